"""Shared fixtures: every test starts and ends with a clean environment and no process group."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch.distributed as dist


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


# The real local Slurm cluster (slurm/local_cluster.py), started once per session on demand.
from tests.slurm_cluster import slurm_cluster  # noqa: E402,F401
