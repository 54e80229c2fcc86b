"""The layers of ddp_amp hold: lower never imports higher, and no module imports its way back.

The contract lives in pyproject.toml (`[tool.importlinter]`); `lint-imports` checks it.
These tests run it on the real tree, show that it fails when an upward import is added on
purpose (on a copy), and look for import cycles between any two modules.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import grimp

from tests.multiproc import REPO_ROOT, cli_env

LINT = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
        "sys.exit(lint_imports_command())"]


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(LINT, cwd=root, capture_output=True, text=True, timeout=120,
                          env=cli_env(PYTHONPATH=str(root)))


def test_layers_contract_is_kept() -> None:
    result = _lint(REPO_ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "ddp_amp layers KEPT" in result.stdout
    assert "0 broken" in result.stdout


def test_an_upward_import_breaks_the_contract(tmp_path: Path) -> None:
    shutil.copytree(REPO_ROOT / "ddp_amp", tmp_path / "ddp_amp", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO_ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    scaler = tmp_path / "ddp_amp" / "amp" / "scaler.py"
    scaler.write_text(scaler.read_text() + "\nfrom ddp_amp.trainer import Trainer  # upward, on purpose\n")
    result = _lint(tmp_path)
    assert result.returncode != 0
    assert "ddp_amp layers BROKEN" in result.stdout, result.stdout[-3000:]
    assert "ddp_amp.amp.scaler -> ddp_amp.trainer" in result.stdout


def test_a_trainer_import_past_the_session_breaks_its_contract(tmp_path: Path) -> None:
    shutil.copytree(REPO_ROOT / "ddp_amp", tmp_path / "ddp_amp", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO_ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    best = tmp_path / "ddp_amp" / "trainer" / "best.py"
    best.write_text(best.read_text() + "\nfrom ddp_amp.checkpoint import read_best  # past the session, on purpose\n")
    loop = tmp_path / "ddp_amp" / "trainer" / "loop.py"
    loop.write_text(loop.read_text()
                    + "\nfrom ddp_amp.distributed import all_reduce_  # past the session, on purpose\n")
    result = _lint(tmp_path)
    assert result.returncode != 0
    assert "the Trainer reaches the layers below the session only through it BROKEN" in result.stdout, \
        result.stdout[-3000:]
    assert "ddp_amp.trainer.best -> ddp_amp.checkpoint" in result.stdout
    assert "ddp_amp.trainer.loop -> ddp_amp.distributed" in result.stdout


def test_the_trainer_names_no_package_below_the_session() -> None:
    """Read as text, so that an import only type checkers see counts too."""
    below = re.compile(r"^\s*(from|import) ddp_amp\.(amp|distributed|checkpoint|parallel|env)\b", re.MULTILINE)
    found = [f"{path.name}: {match.group(0).strip()}"
             for path in sorted((REPO_ROOT / "ddp_amp" / "trainer").glob("*.py"))
             for match in below.finditer(path.read_text())]
    assert found == []


# The Hugging Face boundary: the packages that read and write its conventions are imported
# in ddp_amp/hf/ only. The benchmarks are left out: they build their subjects (a tokenizer, a
# Llama) as a user's script would.
HF_PACKAGES = re.compile(r"^\s*(from|import) (transformers|safetensors|tokenizers|huggingface_hub)\b", re.MULTILINE)


def _hf_imports_outside_hf(root: Path) -> list[str]:
    """Read as text, so that an import only type checkers see counts too."""
    return [f"{path.relative_to(root)}: {match.group(0).strip()}"
            for path in sorted((root / "ddp_amp").rglob("*.py"))
            if path.relative_to(root).parts[1] not in ("hf", "bench")
            for match in HF_PACKAGES.finditer(path.read_text())]


def test_only_the_hf_package_imports_hugging_face_packages(tmp_path: Path) -> None:
    assert _hf_imports_outside_hf(REPO_ROOT) == []
    (tmp_path / "ddp_amp" / "data").mkdir(parents=True)
    (tmp_path / "ddp_amp" / "data" / "reader.py").write_text("def f():\n    from transformers import AutoConfig\n")
    assert _hf_imports_outside_hf(tmp_path) == ["ddp_amp/data/reader.py: from transformers"]


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan, iterative)."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph.modules):
        if start in order:
            continue
        work = [(start, iter(sorted(graph.find_modules_directly_imported_by(start))))]
        order[start] = low[start] = len(order)
        stack.append(start)
        on_stack.add(start)
        while work:
            module, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in order:
                    order[child] = low[child] = len(order)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[module] = min(low[module], order[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[module])
            if low[module] == order[module]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == module:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def test_no_import_cycles() -> None:
    assert _cycles(grimp.build_graph("ddp_amp")) == []


def test_the_cycle_finder_finds_a_cycle(tmp_path: Path) -> None:
    package = tmp_path / "cyclic"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from cyclic import b\n")
    (package / "b.py").write_text("from cyclic import c\n")
    (package / "c.py").write_text("import cyclic.a\n")
    sys.path.insert(0, str(tmp_path))
    try:
        assert _cycles(grimp.build_graph("cyclic")) == [["cyclic.a", "cyclic.b", "cyclic.c"]]
    finally:
        sys.path.remove(str(tmp_path))


# Folder names that common tools skip by default: pytest's `norecursedirs`, the standard Python
# `.gitignore` (`dist/`, `build/`, `*.egg-info/`), and ruff's and black's default excludes.
SKIPPED_BY_TOOLS = ("*.egg", "*.egg-info", ".*", "_darcs", "build", "CVS", "dist", "node_modules", "venv",
                    "{arch}", "__pypackages__", "_build", "buck-out", "site-packages")


def test_no_package_folder_is_one_that_tools_skip() -> None:
    import fnmatch

    folders = [path for path in (REPO_ROOT / "ddp_amp").rglob("*") if path.is_dir() and path.name != "__pycache__"]
    skipped = [str(path.relative_to(REPO_ROOT)) for path in folders
               if any(fnmatch.fnmatch(path.name, pattern) for pattern in SKIPPED_BY_TOOLS)]
    assert folders and skipped == []
    assert (REPO_ROOT / "ddp_amp" / "distributed" / "__init__.py").is_file()


def test_the_configuration_imports_no_service_and_no_layer_below_sees_it() -> None:
    """TrainConfig is composed of the components' own options (each component's `options`
    module, which declares and checks them) and nothing else of theirs; the layers under the
    Trainer get their own options, never the whole configuration."""
    graph = grimp.build_graph("ddp_amp")
    imported = {module for module in graph.find_modules_directly_imported_by("ddp_amp.config")}
    services = {module for module in imported if not module.endswith(".options")}
    assert services <= {"ddp_amp.errors", "ddp_amp.option_values"}, imported
    assert {"ddp_amp.amp.options", "ddp_amp.parallel.options", "ddp_amp.checkpoint.options"} <= imported, imported
    below = ("ddp_amp.session", "ddp_amp.checkpoint", "ddp_amp.guards", "ddp_amp.metrics", "ddp_amp.amp",
             "ddp_amp.distributed", "ddp_amp.env", "ddp_amp.parallel", "ddp_amp.data")
    importers = graph.find_modules_that_directly_import("ddp_amp.config")
    assert not [module for module in importers if module.startswith(below)], importers
