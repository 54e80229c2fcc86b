"""`--config` files on Python 3.10, where the standard library has no `tomllib`: `tomli` reads them.

`ddp_amp.config_file` imports only the standard library and `ddp_amp.errors` (and the package
root imports its layers lazily), so a Python 3.10 interpreter runs the real module from this
checkout without torch. The tests find one (`python3.10` on PATH, or pyenv's), make a venv
with `tomli` once per session, and skip, saying why, where there is none.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.multiproc import REPO_ROOT

# Reads two files under Python 3.10: prints the options of the first and the error of the second.
READ_BOTH = """
import json, sys
from ddp_amp.config_file import read_options
from ddp_amp.errors import UsageError
kinds = {"max_steps": int, "lr": float, "precision": str, "compile": bool, "task_opt": tuple}
options = read_options(sys.argv[1], kinds)
try:
    read_options(sys.argv[2], kinds)
    error = None
except UsageError as caught:
    error = str(caught)
print(json.dumps({"version": list(sys.version_info[:2]), "torch_imported": "torch" in sys.modules,
                  "tomllib_exists": __import__("importlib.util").util.find_spec("tomllib") is not None,
                  "types": {name: type(value).__name__ for name, value in options.items()},
                  "options": {name: list(value) if isinstance(value, tuple) else value
                              for name, value in options.items()},
                  "error": error}))
"""


def _python310() -> str | None:
    """A Python 3.10 interpreter that runs (a pyenv shim for a version not selected does not)."""
    candidates = [shutil.which("python3.10"),
                  *sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.10*/bin/python3.10")))]
    for candidate in filter(None, candidates):
        try:
            probe = subprocess.run([candidate, "-c", "import sys; print(sys.version_info[:2] == (3, 10))"],
                                   capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if probe.returncode == 0 and probe.stdout.strip() == "True":
            return candidate
    return None


def _env() -> dict[str, str]:
    """This checkout importable, nothing of the test's own interpreter on the path."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTHON")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    return env


@pytest.fixture(scope="session")
def python310() -> str:
    found = _python310()
    if found is None:
        pytest.skip("no Python 3.10 interpreter here (python3.10 on PATH or ~/.pyenv/versions/3.10*)")
    return found


@pytest.fixture(scope="session")
def python310_with_tomli(python310: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A Python 3.10 venv with tomli installed from the package index, made once per session."""
    venv = tmp_path_factory.mktemp("py310-venv")
    subprocess.run([python310, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=120)
    python = str(venv / "bin" / "python")
    install = subprocess.run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "tomli>=1.1"],
                             capture_output=True, text=True, timeout=300, env=_env())
    if install.returncode != 0:
        pytest.skip(f"pip could not install tomli into a Python 3.10 venv: {install.stderr.strip()[-500:]}")
    return python


def _read_both(python: str, tmp_path: Path) -> dict[str, object]:
    good = tmp_path / "run.toml"
    good.write_text('max-steps = 500\nlr = 1\nprecision = "bf16"\ncompile = true\ntask_opt = ["hidden=256"]\n',
                    encoding="utf-8")
    bad = tmp_path / "bad.toml"
    bad.write_text("max_steps = = 3\n", encoding="utf-8")
    result = subprocess.run([python, "-c", READ_BOTH, str(good), str(bad)], capture_output=True, text=True,
                            timeout=60, env=_env(), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def test_python_310_reads_config_files_with_tomli(python310_with_tomli: str, tmp_path: Path) -> None:
    seen = _read_both(python310_with_tomli, tmp_path)
    assert seen["version"] == [3, 10] and seen["tomllib_exists"] is False
    assert seen["torch_imported"] is False  # the config file layer stays light
    assert seen["options"] == {"max_steps": 500, "lr": 1.0, "precision": "bf16", "compile": True,
                               "task_opt": ["hidden=256"]}
    assert seen["types"] == {"max_steps": "int", "lr": "float", "precision": "str", "compile": "bool",
                             "task_opt": "tuple"}
    error = str(seen["error"])
    assert "\n" not in error and "bad.toml" in error and "expected a valid TOML file" in error, error


def test_python_310_without_tomli_is_a_one_line_error_with_a_hint(python310: str, tmp_path: Path) -> None:
    probe = subprocess.run([python310, "-c", "import tomli"], capture_output=True, timeout=30, env=_env())
    if probe.returncode == 0:
        pytest.skip(f"{python310} has tomli installed: no interpreter without it to try")
    path = tmp_path / "run.toml"
    path.write_text("max_steps = 5\n", encoding="utf-8")
    script = ("import sys\nfrom ddp_amp.config_file import read_options\nfrom ddp_amp.errors import UsageError\n"
              "try:\n    read_options(sys.argv[1], {'max_steps': int})\n"
              "except UsageError as error:\n    print(error)\n")
    result = subprocess.run([python310, "-c", script, str(path)], capture_output=True, text=True, timeout=60,
                            env=_env())
    assert result.returncode == 0, result.stderr[-3000:]
    line = result.stdout.strip()
    assert "\n" not in line and str(path) in line and "tomli" in line and "pip install tomli" in line, line


def test_this_interpreter_reads_with_the_standard_library_from_python_311() -> None:
    if sys.version_info < (3, 11):
        pytest.skip("Python 3.10: the tests above cover tomli")
    from ddp_amp.config_file import _toml_reader

    assert _toml_reader("unused.toml").__name__ == "tomllib"
