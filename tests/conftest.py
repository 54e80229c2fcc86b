"""Shared fixtures: every test starts and ends with a clean environment and no process group."""

from __future__ import annotations

import compileall
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist


def pytest_sessionstart(session: pytest.Session) -> None:
    """Compile the repository's modules to bytecode once, for the hundreds of processes the
    tests start. An editable install leaves them as sources, and where PYTHONDONTWRITEBYTECODE
    is set (these machines set it) every new interpreter compiles them again: 0.15 s of CPU each
    (docs/facts.md, "A new interpreter spends seconds importing torch")."""
    root = Path(__file__).resolve().parent.parent
    for package in ("ddp_amp", "tests"):
        compileall.compile_dir(root / package, quiet=1)


@pytest.fixture(autouse=True)
def restore_environment() -> Iterator[None]:
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def no_leftover_process_group() -> Iterator[None]:
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is visible (torch.cuda.is_available() is false)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Under `pytest -n N` (xdist's default `--dist load`, or `loadfile`), workers take whole
    files (tests/file_scheduling.py); the other `--dist` modes are left to xdist."""
    if config.getvalue("dist") not in ("load", "loadfile"):
        return None
    from tests.file_scheduling import FileScheduling

    return FileScheduling(config, log)


# The real local Slurm cluster (slurm/local_cluster.py), started once per session on demand.
from tests.slurm_cluster import slurm_cluster  # noqa: E402,F401
