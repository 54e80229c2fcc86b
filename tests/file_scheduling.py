"""How pytest-xdist's workers share the suite: whole files, so a file's module fixtures (runs that
several of its tests read) start once, on one worker.

The files whose tests use the local Slurm cluster form one unit: its daemons listen on fixed
ports in one directory, so only one worker may start it (tests/slurm_cluster.py).
"""

from __future__ import annotations

from functools import cache

from xdist.scheduler import LoadScopeScheduling

from tests.multiproc import REPO_ROOT

SLURM_UNIT = "the files using the slurm_cluster fixture"


@cache
def uses_slurm_cluster(path: str) -> bool:
    """Whether the test file at `path` (relative to the repository) asks for the cluster. The
    controller sees only test ids, not fixtures, hence the file's text."""
    return "slurm_cluster" in (REPO_ROOT / path).read_text()


class FileScheduling(LoadScopeScheduling):
    """xdist's `loadscope` with files as the scopes and the Slurm files as one."""

    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        return SLURM_UNIT if uses_slurm_cluster(path) else path
