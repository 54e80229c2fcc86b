"""`Session.preemption`: a loop of one's own stops on a preemption signal as the Trainer does:
every rank at the same step, with a checkpoint, a line and a record, exit code 75; and the
checkpoint resumes bitwise, again and again; the record says how long from the signal to the
commit whichever rank got it; and the handlers come with a `with` block or start()/close()."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ddp_amp import Session, UsageError
from tests.multiproc import REPO_ROOT, cli_env
from tests.resume_harness import assert_bitwise_equal

SCRIPT = str(REPO_ROOT / "tests/scripts/session_preempt_loop.py")
LAST = 10


def _loop(run_dir: Path, hold_at: int = 0) -> subprocess.CompletedProcess[str]:
    """The loop on 2 ranks under torchrun; where `hold_at`, USR1 to rank 1 alone while it waits."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", SCRIPT,
               str(run_dir), str(LAST), str(hold_at)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env())
    try:
        if hold_at:
            holding = run_dir / f"holding-{hold_at}"
            deadline = time.monotonic() + 240
            while not (holding.exists() and holding.read_text()):
                assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
                time.sleep(0.05)
            os.kill(int(holding.read_text()), signal.SIGUSR1)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def _stops(result: subprocess.CompletedProcess[str]) -> dict[int, tuple[int, int]]:
    """Each rank's (stop step, exit code), from its line."""
    found = re.findall(r"rank (\d) stops at step (\d+) with exit code (\d+)", result.stdout)
    return {int(rank): (int(step), int(code)) for rank, step, code in found}


def _final(run_dir: Path) -> dict[str, object]:
    """The final checkpoint's model, optimizer and step (the model has dropout: a resume that
    lost a rank's RNG streams would show in its weights)."""
    final = run_dir / "final"
    return {name: torch.load(final / name, weights_only=False) for name in ("model.pt", "state.pt")}


def test_a_signal_to_one_rank_stops_every_rank_at_one_step_and_the_loop_resumes_bitwise(tmp_path: Path) -> None:
    straight = _loop(tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr[-3000:]

    preempted = tmp_path / "preempted"
    for hold_at in (4, 7):  # preempted, resumed, preempted again after the resume, resumed to the end
        result = _loop(preempted, hold_at)
        assert result.returncode != 0, result.stdout + result.stderr[-3000:]  # torchrun: a worker exited 75
        stops = _stops(result)
        assert stops == {0: (hold_at, 75), 1: (hold_at, 75)}, result.stdout + result.stderr[-3000:]
        lines = [line for line in result.stdout.splitlines() if "stopped at step" in line]
        assert len(lines) == 1 and f"stopped at step {hold_at} after SIGUSR1" in lines[0], result.stdout
        assert "not a SLURM job" in lines[0]
        assert (preempted / "checkpoints" / f"step-{hold_at:08d}").is_dir()
    records = [json.loads(line) for line in (preempted / "metrics.jsonl").read_text().splitlines()]
    assert [(r["event"], r["step"], r["action"]) for r in records] == [("preempted", 4, "requeue"),
                                                                      ("preempted", 7, "requeue")]
    # The signal reached rank 1 alone; rank 0 writes the record and knows when it came.
    assert all(isinstance(r["signal_to_commit_s"], float) and r["signal_to_commit_s"] >= 0 for r in records), records
    finished = _loop(preempted)
    assert finished.returncode == 0, finished.stderr[-3000:]

    assert_bitwise_equal(_final(tmp_path / "straight"), _final(preempted))


def test_preemption_options_are_checked_in_one_line() -> None:
    with Session("fp32", "cpu", environ={}) as session:
        with pytest.raises(UsageError, match="stop_signals"):
            session.preemption("USR1,TERM", "TERM")
        with pytest.raises(UsageError, match="check_every_s"):
            session.preemption(check_every_s=0)
        with pytest.raises(UsageError, match="signals"):
            session.preemption("KILL")


def test_the_start_and_close_form_installs_and_gives_back_the_handlers(tmp_path: Path) -> None:
    with Session("fp32", "cpu", environ={}) as session:
        preemption = session.preemption(run_dir=tmp_path).start()  # the loop stays at this level
        assert signal.getsignal(signal.SIGUSR1) != signal.SIG_DFL
        os.kill(os.getpid(), signal.SIGUSR1)
        assert preemption.should_stop(1)
        record = preemption.stop(1, lambda: session.save(tmp_path / "step-00000001", {"step": 1}))
        preemption.close()
        preemption.close()  # idempotent, as Session.close is
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
    assert record["exit_code"] == 75 and record["signal_to_commit_s"] >= 0


def test_a_world_of_one_stops_at_the_step_its_signal_came_before(tmp_path: Path) -> None:
    with Session("fp32", "cpu", environ={}) as session, \
            session.preemption(run_dir=tmp_path, start_step=3) as preemption:
        assert not preemption.should_stop(4)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert preemption.should_stop(5)
        record = preemption.stop(5, lambda: session.save(tmp_path / "step-00000005", {"step": 5}))
        assert session.ctx.progress.step == 5 and session.ctx.progress.checkpoint == str(tmp_path / "step-00000005")
    assert record["exit_code"] == 75 and record["checkpoint"] == str(tmp_path / "step-00000005")
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL  # the handler is given back
