"""`Session.save` is collective; called on some ranks only, it says so in one line instead of
waiting out the process group's timeout."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ddp_amp import Session, UsageError
from tests.multiproc import REPO_ROOT, cli_env


def test_a_save_on_rank_zero_alone_ends_the_run_with_one_line_saying_save_is_collective(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             str(REPO_ROOT / "tests/scripts/session_save_on_rank_zero.py"), str(tmp_path)],
                            capture_output=True, text=True, timeout=300, env=cli_env())
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    # rank 0's error, named once (rank 1 is ended by the watch with rank 0's message)
    assert "save='called by 1 of 2 ranks within 5 s'" in output, output[-3000:]
    assert output.count("UsageError: save=") == 1, output[-3000:]
    assert "save is collective: call it on every rank" in output
    assert "Timed out" not in output  # no transport error instead of the cause
    assert not (tmp_path / "step-2").exists()  # nothing written


def test_the_arrival_deadline_must_be_positive() -> None:
    with pytest.raises(UsageError, match="save_arrival_s"):
        Session("fp32", "cpu", environ={}, save_arrival_s=0)
