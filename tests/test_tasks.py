"""The task contract: built-in names, the plugin loader, and errors that name what was expected."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from ddp_amp.config import TrainConfig
from ddp_amp.errors import UsageError
from ddp_amp.tasks import BUILTIN_TASKS, Task, load_task, task_label
from tests.multiproc import run_train

PLUGIN_HEADER = """
import torch
from torch import nn
from torch.utils.data import TensorDataset
from ddp_amp import Task

def data():
    return TensorDataset(torch.randn(8, 2), torch.randn(8, 1))

def good(config):
    return Task(model=nn.Linear(2, 1), train_data=data(), loss_fn=nn.functional.mse_loss)
"""

# function body -> words the error must contain
BAD_PLUGINS = {
    "return {'model': nn.Linear(2, 1)}": "a function returning ddp_amp.Task, got dict",
    "return Task(model='linear', train_data=data(), loss_fn=nn.functional.mse_loss)":
        "Task.model to be a torch.nn.Module, got str",
    "return Task(model=nn.Linear(2, 1), train_data=(x for x in []), loss_fn=nn.functional.mse_loss)":
        "Task.train_data to be a map-style Dataset",
    "return Task(model=nn.Linear(2, 1), train_data=data(), loss_fn='mse')":
        "Task.loss_fn to be callable",
    "return Task(model=nn.Linear(2, 1), train_data=TensorDataset(torch.zeros(0, 2)), loss_fn=nn.functional.mse_loss)":
        "a non-empty Task.train_data",
    "return Task(model=nn.Linear(2, 1), train_data=data(), loss_fn=nn.functional.mse_loss, metric=lambda o, t: {})":
        "Task.eval_data with Task.metric (or eval_fn)",
    "return Task(model=nn.Linear(2, 1), train_data=data(), eval_data=data(), loss_fn=nn.functional.mse_loss, metric=1)":
        "Task.metric to be callable or None, got int",
    "return Task(model=nn.Linear(2, 1), train_data=data(), loss_fn=nn.functional.mse_loss, default_lr='fast')":
        "Task.default_lr to be a number >= 0, got 'fast'",
    ("return Task(model=nn.Linear(2, 1), train_data=data(), loss_fn=nn.functional.mse_loss, "
     "default_clip_grad_norm=-1.0)"):
        "Task.default_clip_grad_norm to be a number >= 0",
}


@pytest.fixture()
def plugin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder on sys.path holding `myplugin.py` with a good task and one bad one per case."""
    body = PLUGIN_HEADER + "".join(f"\ndef bad{i}(config):\n    {line}\n" for i, line in enumerate(BAD_PLUGINS))
    (tmp_path / "myplugin.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("myplugin", None)


def test_every_builtin_name_loads_a_task() -> None:
    assert {"mlp", "lm", "digits"} <= set(BUILTIN_TASKS)
    # Task options belong to their task; a small lm corpus keeps this fast.
    for name, options in (("lm", ("tokens=3000",)), ("digits", ())):
        task = load_task(name, TrainConfig(task=name, task_opt=options))
        assert isinstance(task, Task) and task.name == name and task.metric is not None


def test_a_good_plugin_loads_and_is_named_after_its_function(plugin_dir: Path) -> None:
    task = load_task("myplugin:good", TrainConfig())
    assert task.name == "good" and len(task.train_data) == 8  # type: ignore[arg-type]
    # The conventional factory name says nothing, so such a plugin is named after its module.
    assert task_label("examples.plugin_task:make_task") == "plugin_task"


@pytest.mark.parametrize("index", range(len(BAD_PLUGINS)))
def test_a_plugin_returning_the_wrong_thing_says_what_was_expected(plugin_dir: Path, index: int) -> None:
    expected = list(BAD_PLUGINS.values())[index]
    with pytest.raises(UsageError, match="expected") as error:
        load_task(f"myplugin:bad{index}", TrainConfig())
    assert expected in str(error.value)
    assert f"myplugin:bad{index}" in str(error.value)  # names the --task value too


@pytest.mark.parametrize(("spec", "expected"), [
    ("nosuchtask", "a built-in task (causal_lm, digits, lm, mlp) or 'package.module:function'"),
    ("no_such_module_xyz:make_task", "an importable module 'no_such_module_xyz'"),
    ("myplugin:missing", "a function 'missing' in module 'myplugin'"),
])
def test_a_bad_task_spec_says_what_was_expected(plugin_dir: Path, spec: str, expected: str) -> None:
    with pytest.raises(UsageError) as error:
        load_task(spec, TrainConfig())
    assert expected in str(error.value)


def test_cli_reports_a_bad_plugin_in_one_line_with_exit_2(plugin_dir: Path) -> None:
    result = run_train(["--task", "myplugin:bad0", "--run-dir", str(plugin_dir / "run")],
                       env=None, cwd=plugin_dir)  # cwd is importable under `python -m`
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "a function returning ddp_amp.Task, got dict" in lines[0], lines
