"""ruff and mypy pass on the tree, as configured in pyproject.toml (`[tool.ruff]`, `[tool.mypy]`).

Each runs as a subprocess of this interpreter (`python -m ruff`, `python -m mypy`), from the
repo root, so that the settings and the installed versions are the ones the suite was given.
Both keep their caches in the repo root (.ruff_cache, .mypy_cache, ignored by git): a second
run checks only what changed. Both are in the `test` extra: missing, they fail here.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from ddp_amp.torch_api import TORCH_RELEASE
from tests.multiproc import REPO_ROOT, cli_env

LINTED = ["ddp_amp", "tests", "examples"]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=600, env=cli_env())


def test_ruff_finds_nothing() -> None:
    result = _run("ruff", "check", "--output-format", "concise", *LINTED)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


# mypy reads the installed torch's type stubs: the tree is typed against the torch CI runs.
# An older torch's stubs lack names ddp_amp takes only where that torch has them (torch_api.py).
@pytest.mark.skipif(TORCH_RELEASE != (2, 13), reason=f"the tree is typed against torch 2.13, not {torch.__version__}")
def test_mypy_finds_nothing() -> None:
    result = _run("mypy")  # the files and the options: pyproject.toml's [tool.mypy]
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
