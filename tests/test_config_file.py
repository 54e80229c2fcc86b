"""`--config run.toml` and `--print-config`: a TOML file of options, flags over it, and back.

Most tests call `parse_config` in-process (no training); two run the real CLI: one prints
the resolved config, one is refused for an unknown key without creating anything.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from ddp_amp.config import TrainConfig
from ddp_amp.command_line import config_toml, parse_command_line
from ddp_amp.config_file import dumps
from ddp_amp.errors import UsageError
from ddp_amp.train import main
from ddp_amp.trainer.resume_plan import compare_settings
from tests.multiproc import cli_env

try:  # --config reads TOML with the standard library's tomllib (Python 3.11+), else tomli
    import tomllib
except ModuleNotFoundError:
    tomllib = pytest.importorskip("tomli")


def _write(tmp_path: Path, text: str, name: str = "run.toml") -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def _error(argv: list[str]) -> str:
    with pytest.raises(UsageError) as caught:
        _ = parse_command_line(argv).config
    message = str(caught.value)
    assert "\n" not in message, message
    return message


def test_file_values_apply_and_the_rest_keep_their_defaults(tmp_path: Path) -> None:
    path = _write(tmp_path, 'task = "mlp"\nmax_steps = 7\nlr = 1e-3\ncompile = true\n'
                            'task_opt = ["hidden=32", "layers=2"]\n')
    config = parse_command_line(["--config", path]).config
    assert (config.task, config.max_steps, config.lr, config.compile) == ("mlp", 7, 1e-3, True)
    assert config.task_opt == ("hidden=32", "layers=2")
    assert config.batch_size == TrainConfig().batch_size


def test_a_dash_in_a_key_means_an_underscore_but_not_both_spellings(tmp_path: Path) -> None:
    assert parse_command_line(["--config", _write(tmp_path, "max-steps = 9\n")]).config.max_steps == 9
    message = _error(["--config", _write(tmp_path, "max_steps = 9\nmax-steps = 8\n", "both.toml")])
    assert "both.toml: max-steps=8" in message and "set twice" in message


def test_flags_override_the_file_wherever_they_stand(tmp_path: Path) -> None:
    path = _write(tmp_path, 'max_steps = 7\nprecision = "bf16"\ntask_opt = ["hidden=32", "layers=2"]\n')
    config = parse_command_line(["--max-steps", "11", "--config", path, "--task-opt", "hidden=64"]).config
    assert config.max_steps == 11 and config.precision == "bf16"
    assert config.task_opt == ("hidden=64",)  # the flag replaces the file's list, not adds to it


def test_print_config_round_trips_to_an_equal_config(tmp_path: Path) -> None:
    argv = ["--task", "mlp", "--task-opt", "hidden=32", "--task-opt", 'note=a "quoted" C:\\path\twith tab',
            "--lr", "1e-3", "--loss-scale-min", "0", "--preempt-check-s", "1e-06", "--compile",
            "--run-dir", 'runs/it\'s "x" \\ y', "--seed", str(2**63 - 1), "--print-config"]
    original = parse_command_line(argv).config
    assert original != TrainConfig() and len(original.task_opt) == 2
    text = config_toml(original)
    # Every option of the run; none about this one launch (a file of them would start a new run).
    launch = {"run_dir", "run_name", "resume", "archive_checkpoints", "allow_change", "debug"}
    assert set(tomllib.loads(text)) == {f.name for f in dataclasses.fields(TrainConfig)} - launch
    assert parse_command_line(["--config", _write(tmp_path, text)]).config == dataclasses.replace(original, run_dir="")


def test_a_flag_turns_off_what_the_file_turns_on(tmp_path: Path) -> None:
    path = _write(tmp_path, "compile = true\nstatic_graph = true\n")
    assert parse_command_line(["--config", path]).config.compile
    config = parse_command_line(["--config", path, "--no-compile"]).config
    assert not config.compile and config.static_graph  # only what the flag names changes


def test_the_emitter_writes_what_tomllib_reads_back() -> None:
    floats = [0.0, 1e-3, 1e-06, 0.1, 1e16, 5e-324, 65536.0, 1.7976931348623157e308]
    texts = ["", "".join(map(chr, range(0x80))), "é 中 😀", 'end\\"']
    values = {**{f"f{i}": value for i, value in enumerate(floats)}, **{f"s{i}": text for i, text in enumerate(texts)},
              "list": ("a", 'b"\\'), "empty": (), "yes": True, "no": False, "int": -(2**63), "odd key": 1}
    back = tomllib.loads(dumps(values, header=["a comment"]))
    assert back == {key: list(value) if isinstance(value, tuple) else value for key, value in values.items()}
    assert all(type(back[key]) is type(value) for key, value in values.items() if not isinstance(value, tuple))


def test_an_unknown_key_names_the_file_and_the_nearest_option(tmp_path: Path) -> None:
    path = _write(tmp_path, "batchsize = 64\n")
    message = _error(["--config", path])
    assert message.startswith(f"{path}: batchsize=64") and "did you mean batch_size?" in message


@pytest.mark.parametrize(("line", "shown", "expected"), [
    ('max_steps = "10"', "max_steps='10'", "an integer"),
    ("max_steps = 10.5", "max_steps=10.5", "an integer"),
    ("max_steps = true", "max_steps=True", "an integer"),
    ('lr = "1e-3"', "lr='1e-3'", "a number"),
    ("debug = 1", "debug=1", "a boolean"),
    ('task_opt = "hidden=32"', "task_opt='hidden=32'", "a list of strings"),
    ("task_opt = [1, 2]", "task_opt=[1, 2]", "a list of strings"),
    ("precision = 16", "precision=16", "a string"),
])
def test_a_value_of_the_wrong_type_names_key_value_and_type(line: str, shown: str, expected: str,
                                                            tmp_path: Path) -> None:
    path = _write(tmp_path, line + "\n")
    message = _error(["--config", path])
    assert message.startswith(f"{path}: {shown}: expected {expected}"), message


def test_an_integer_is_accepted_for_a_float_option(tmp_path: Path) -> None:
    config = parse_command_line(["--config", _write(tmp_path, "lr = 1\n")]).config
    assert config.lr == 1.0 and type(config.lr) is float


def test_a_bad_value_from_the_file_is_blamed_on_the_file_unless_a_flag_replaces_it(tmp_path: Path) -> None:
    path = _write(tmp_path, 'precision = "fp4"\n')
    assert _error(["--config", path]).startswith(f"{path}: precision='fp4': expected one of auto")
    assert parse_command_line(["--config", path, "--precision", "fp32"]).config.precision == "fp32"


@pytest.mark.parametrize(("text", "expected"), [
    ("max_steps = \n", "expected a valid TOML file"),
    (None, "expected a readable TOML file"),
])
def test_a_missing_or_invalid_file_is_one_line_with_its_path(text: str | None, expected: str,
                                                             tmp_path: Path) -> None:
    path = _write(tmp_path, text) if text is not None else str(tmp_path / "missing.toml")
    message = _error(["--config", path])
    assert message.startswith(f"--config={path!r}: {expected}"), message


def test_the_file_path_is_not_part_of_the_config_so_a_resume_from_flags_matches(tmp_path: Path) -> None:
    from_file = parse_command_line(["--config", _write(tmp_path, 'seed = 3\ntask_opt = ["hidden=32"]\n')]).config
    from_flags = parse_command_line(["--seed", "3", "--task-opt", "hidden=32"]).config
    assert from_file == from_flags and from_file != TrainConfig()
    assert compare_settings(from_file.to_dict(), from_flags) == ([], [], [])


def test_debug_true_in_the_file_shows_tracebacks(tmp_path: Path) -> None:
    path = _write(tmp_path, 'debug = true\ntask = "no_such_module:make"\n')
    with pytest.raises(UsageError, match="no_such_module"):  # raised, where it would print one line
        main(["--config", path, "--run-dir", str(tmp_path / "run")])


PRINT_ARGV = ["--config", "run.toml", "--task-opt", "hidden=32"]
CliRuns = dict[str, tuple[Path, subprocess.CompletedProcess[str]]]  # name -> (its directory, result)


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory: pytest.TempPathFactory) -> CliRuns:
    """Both CLI runs, started together: each spends seconds importing torch, so side by side
    they cost the file one import's time, not two."""
    good = tmp_path_factory.mktemp("print")
    _write(good, 'task = "mlp"\nlr = 1e-3\n')
    unknown = tmp_path_factory.mktemp("unknown")
    _write(unknown, 'task = "mlp"\nmax_stpes = 3\n')
    started = {"print": (good, _start([*PRINT_ARGV, "--print-config"], good)),
               "unknown": (unknown, _start(["--config", "run.toml", "--run-dir", "run"], unknown))}
    try:
        return {name: (cwd, _finish(proc)) for name, (cwd, proc) in started.items()}
    finally:  # a no-op for those that exited; one that hung must not outlive the tests
        for _, proc in started.values():
            proc.kill()


def _start(args: list[str], cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "ddp_amp.train", *args], cwd=cwd, env=cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen[str]) -> subprocess.CompletedProcess[str]:
    stdout, stderr = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def test_cli_print_config_exits_0_with_toml_that_resolves_to_the_same_config(cli_runs: CliRuns,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    cwd, result = cli_runs["print"]
    assert result.returncode == 0 and result.stderr == "", result.stderr[-2000:]
    printed = tomllib.loads(result.stdout)
    assert printed["lr"] == 1e-3 and printed["task_opt"] == ["hidden=32"]
    monkeypatch.chdir(cwd)  # PRINT_ARGV names run.toml relative to the run's directory
    assert parse_command_line(["--config", _write(cwd, result.stdout, "printed.toml")]).config == \
        parse_command_line(PRINT_ARGV).config
    assert sorted(p.name for p in cwd.iterdir()) == ["printed.toml", "run.toml"]  # no runs/ made


def test_cli_unknown_key_exits_non_zero_with_one_line_and_no_run_directory(cli_runs: CliRuns) -> None:
    cwd, result = cli_runs["unknown"]
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "max_stpes" in result.stderr and "max_steps" in result.stderr
    assert sorted(p.name for p in cwd.iterdir()) == ["run.toml"]  # no run directory
