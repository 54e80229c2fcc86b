"""`--async-checkpoint`: a background save holds the state of its own step, a writer killed
mid-write costs only that checkpoint, and a failed background write ends the job on every
rank as a failed synchronous save does.

In-process trainers (tests/resume_harness.py) where they suffice; a subprocess for the kill;
two gloo ranks of the CLI's `main` for the failure, in a group formed from torchrun's
variables (`run_ranks`), so each rank's own exit code is seen: under torchrun the agent
SIGTERMs the slower rank once the first one exits.
"""

from __future__ import annotations

import io
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ddp_amp.checkpoint import background, safe_load, verify_checkpoint
from ddp_amp.distributed import DistContext, init_distributed
from ddp_amp.env import DistEnv
from ddp_amp.tasks import load_task
from ddp_amp.train import main
from tests.multiproc import REPO_ROOT, kill_when, run_ranks, slow_writes_env
from tests.resume_harness import TASK, assert_bitwise_equal, build_trainer, config, snapshot

CLI = ["--task", TASK, "--batch-size", "8", "--device", "cpu", "--precision", "fp32", "--log-every", "1000",
       "--async-checkpoint"]


@pytest.fixture
def ctx() -> DistContext:
    return init_distributed(DistEnv(), device="cpu")


def test_background_save_holds_its_step_and_resumes_bitwise(ctx: DistContext, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    straight = build_trainer(config(max_steps=8), ctx, None)
    at_save: dict[str, Any] = {}
    while straight.step < 8:
        straight.train_step()
        if straight.step == 3:
            at_save = snapshot(straight)
    expected = snapshot(straight)
    del straight

    run = build_trainer(config(max_steps=5, ckpt_every=3, async_checkpoint=True), ctx, tmp_path)
    # Hold step 3's writer until steps 4 and 5 have updated the weights and the AdamW
    # moments in place: a copy taken late, or no copy, would write their values instead.
    commit = background.commit_outcome
    seen: list[tuple[int, Path | None]] = []

    def late_writer(*args: Any) -> Any:
        deadline = time.monotonic() + 20
        while run.step < 5 and time.monotonic() < deadline:
            time.sleep(0.005)
        seen.append((run.step, run.checkpoints.last))
        return commit(*args)

    monkeypatch.setattr(background, "commit_outcome", late_writer)
    run.fit()
    saved = tmp_path / "step-00000003"
    assert seen == [(5, None)]  # written after two more steps, and not claimed before its commit
    assert run.checkpoints.last == tmp_path / "step-00000005"
    lines = run.run_log.lines  # type: ignore[attr-defined]
    started = next(i for i, line in enumerate(lines) if line.startswith(
        "checkpoint step-00000003 started in the background (stall "))
    learned = next(i for i, line in enumerate(lines) if line.startswith(f"saved checkpoint {saved} ("))
    assert started < learned and "in the background)" in lines[learned], lines

    verify_checkpoint(saved)
    assert_bitwise_equal(at_save["model"], safe_load(saved / "model.pt"), "model.pt")
    assert_bitwise_equal(at_save["optimizer"], safe_load(saved / "state.pt")["optimizer"], "state.pt")
    resumed = build_trainer(config(max_steps=8), ctx, None)
    resumed.load_checkpoint(saved)
    while resumed.step < 8:
        resumed.train_step()
    assert_bitwise_equal(expected, snapshot(resumed))


def test_writer_killed_in_the_background_keeps_previous_checkpoint(ctx: DistContext, tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    log = tmp_path / "stdout.txt"
    # The crash tests' slow writes (tests/slow_writes), so the kill lands inside step 4's write.
    env = slow_writes_env(0.3, PYTHONUNBUFFERED="1")
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "ddp_amp.train", *CLI, "--max-steps", "6", "--ckpt-every", "2",
                                 "--run-dir", str(tmp_path)], env=env, cwd=REPO_ROOT, stdout=out,
                                stderr=subprocess.STDOUT)
        kill_when(proc, lambda: any(root.glob(".tmp-step-00000004-*/model.pt")), "the step-4 write")
    assert "checkpoint step-00000004 started in the background" in log.read_text()
    assert not (root / "step-00000004").exists()
    verify_checkpoint(root / "step-00000002")  # the previous one is whole

    resumed = build_trainer(config(max_steps=6, ckpt_every=2, async_checkpoint=True), ctx, root)
    assert resumed.resume("auto") == root / "step-00000002" and resumed.step == 2
    resumed.fit()
    resumed.session.close()  # as a run's end does: what retention let go (the killed write's) is gone after it
    assert sorted(p.name for p in root.iterdir()) == ["step-00000002", "step-00000004", "step-00000006"]
    verify_checkpoint(root / "step-00000004")


def _limited_file_size(limit: int) -> None:
    # A full disk as an unprivileged (or root) test can make one: writes past `limit` bytes
    # fail with EFBIG, midway through torch.save, as ENOSPC would.
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def _cli_rank(ctx: DistContext, argv: list[str], limit: int) -> int:
    """One rank of `python -m ddp_amp.train` in the group run_ranks formed (as torchrun's
    variables describe it), with rank 0's files limited in size; the rank's exit code."""
    if ctx.rank == 0:
        _limited_file_size(limit)
    return main(argv)


def test_failed_background_write_stops_every_rank_like_a_failed_save(tmp_path: Path,
                                                                     capfd: pytest.CaptureFixture[str]) -> None:
    # model.pt fits under the limit, state.pt (AdamW's two moments besides) does not.
    task = load_task(TASK, config(task_opt=("hidden=2048",)))
    buffer = io.BytesIO()
    torch.save(task.model.state_dict(), buffer)
    argv = [*CLI, "--task-opt", "hidden=2048", "--max-steps", "4", "--ckpt-every", "2", "--run-dir", str(tmp_path)]
    codes = run_ranks(_cli_rank, 2, argv, buffer.tell() * 3 // 2, timeout=120)
    assert codes == [3, 3]  # both ranks learned the failure and stopped with a failed write's code
    out, err = capfd.readouterr()
    errors = [line for line in err.splitlines() if line.startswith("ddp_amp: ")]
    assert len(errors) == 1, err[-3000:]
    assert errors[0].startswith("ddp_amp: checkpoint failed: checkpoint=") and "step-00000002" in errors[0]
    assert "File too large" in errors[0] and "no earlier checkpoint exists" in errors[0], errors[0]
    # Started in the background; its failure learned when the next save waited for it.
    assert "checkpoint step-00000002 started in the background" in out, out[-3000:]
    assert "checkpoint at step 2 failed" in out, out[-3000:]
    assert list((tmp_path / "checkpoints").iterdir()) == []  # nothing committed, no scratch left


@pytest.mark.cuda
def test_on_a_gpu_the_host_copy_goes_through_pinned_buffers_reused_across_saves() -> None:
    from ddp_amp.checkpoint.staging import HostStaging

    staging = HostStaging()
    weight = torch.randn(64, 64, device="cuda")
    state = {"model": {"weight": weight, "tied": weight}, "step": 3}
    first = staging.copy(state)
    assert first["model"]["weight"].device.type == "cpu" and first["model"]["weight"].is_pinned()
    assert torch.equal(first["model"]["weight"], weight.cpu()) and first["model"]["tied"] is first["model"]["weight"]
    weight.add_(1.0)  # the next step changes the live tensor: the copy must not follow it...
    assert not torch.equal(first["model"]["weight"], weight.cpu())
    second = staging.copy(state)  # ...until the next save, which reuses the same pinned memory
    assert second["model"]["weight"].data_ptr() == first["model"]["weight"].data_ptr()
    assert torch.equal(second["model"]["weight"], weight.cpu()) and second["step"] == 3
