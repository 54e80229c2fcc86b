"""Rank-0 run log: metrics.jsonl survives a resume, and a 2-rank run shows one progress stream."""

from __future__ import annotations

import io
import json
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

from ddp_amp.config import TrainConfig
from ddp_amp.distributed import DistContext
from ddp_amp.metrics import QuietRunLog, RunLog
from ddp_amp.train import train
from ddp_amp.trainer import session_for
from tests.multiproc import REPO_ROOT, cli_env, run_ranks


def _steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()
            if "step" in json.loads(line) and "event" not in json.loads(line)]


def test_rewind_then_append_has_no_duplicate_or_missing_steps(tmp_path: Path) -> None:
    log = RunLog(tmp_path, stream=io.StringIO())
    for step in range(1, 9):  # the lost attempt logged steps 1..8; a checkpoint exists at 5
        log.metrics({"step": step, "loss": 1.0 / step})
    log.event({"event": "overflow", "step": 7, "ranks": [0]}, "overflow")
    log.close()
    with open(tmp_path / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 9, "lo')  # killed mid-write

    resumed = RunLog(tmp_path, stream=io.StringIO())
    assert resumed.rewind_to(5) == 5  # steps 6, 7, 8, the event at 7 and the torn line
    for step in range(6, 11):
        resumed.metrics({"step": step, "loss": 1.0 / step})
    resumed.summary({"step": 10, "loss": 0.1})
    resumed.close()
    assert _steps(tmp_path / "metrics.jsonl") == list(range(1, 11))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[-1] == {"summary": {"step": 10, "loss": 0.1}}
    assert not any(r.get("event") for r in records)

    again = RunLog(tmp_path, stream=io.StringIO())  # a resume from the end drops only the summary
    assert again.rewind_to(10) == 1
    again.close()
    assert _steps(tmp_path / "metrics.jsonl") == list(range(1, 11))


def test_plain_lines_without_a_terminal_and_quiet_other_ranks(tmp_path: Path, capsys: object) -> None:
    stream = io.StringIO()  # not a TTY: no bar, one line per logged step
    log = RunLog(tmp_path, stream=stream)
    log.start_progress(10)
    for step in (5, 10):
        log.advance(5)
        log.metrics({"step": step, "loss": 0.5, "loss_scale": 1024.0})
    log.close()
    assert stream.getvalue().splitlines() == ["[ddp_amp] step=5 loss=0.5 loss_scale=1024",
                                              "[ddp_amp] step=10 loss=0.5 loss_scale=1024"]
    quiet = QuietRunLog(1)
    quiet.start_progress(10)
    quiet.advance()
    quiet.metrics({"step": 1})
    assert quiet.rewind_to(0) == 0
    assert capsys.readouterr().out == ""  # type: ignore[attr-defined]


class _WatchingConsole(io.StringIO):
    """Rank 0's console: its first write waits up to `wait_s` for the file that rank 1
    touches once it has left the event, and records whether it came."""

    def __init__(self, left: Path, wait_s: float) -> None:
        super().__init__()
        self.left, self.wait_s, self.saw_rank_1_leave = left, wait_s, None

    def write(self, text: str) -> int:
        if self.saw_rank_1_leave is None:
            deadline = time.monotonic() + self.wait_s
            while not self.left.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            self.saw_rank_1_leave = self.left.exists()
        return super().write(text)


def _event_then_leave(ctx: DistContext, run_dir: str, left: str) -> tuple[bool | None, str]:
    record = {"event": "preempted", "step": 3}
    if ctx.rank == 0:
        console = _WatchingConsole(Path(left), wait_s=1.0)
        RunLog(Path(run_dir), stream=console).event(record, "stopped at step 3")
        return console.saw_rank_1_leave, console.getvalue()
    QuietRunLog(ctx.rank).event(record, "stopped at step 3")
    Path(left).touch()  # where a preempted rank exits, and srun --kill-on-bad-exit ends the others
    return None, ""


def test_an_event_line_is_out_before_any_rank_leaves_the_event(tmp_path: Path) -> None:
    (saw_leave, printed), _ = run_ranks(_event_then_leave, 2, str(tmp_path), str(tmp_path / "rank-1-left"))
    assert saw_leave is False and printed == "[ddp_amp] stopped at step 3\n"
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"event": "preempted", "step": 3}


def _run_in_terminal(command: list[str], timeout: float = 120) -> str:
    """Run `command` with stdout and stderr on a pseudo-terminal; return everything it printed."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=follower, stderr=follower,
                            env=cli_env(COLUMNS="120"), cwd=REPO_ROOT, close_fds=True)
    os.close(follower)
    chunks = []
    try:
        while True:
            ready, _, _ = select.select([leader], [], [], timeout)
            if not ready:
                raise TimeoutError(f"no output for {timeout}s")
            try:
                data = os.read(leader, 65536)
            except OSError:  # EIO: every writer closed the terminal
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(leader)
        proc.wait(timeout)
    assert proc.returncode == 0, b"".join(chunks).decode(errors="replace")
    return b"".join(chunks).decode(errors="replace")


def test_two_rank_torchrun_on_a_terminal_shows_one_progress_bar(tmp_path: Path) -> None:
    output = _run_in_terminal([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               "--nproc_per_node=2", "-m", "ddp_amp.train", "--task", "mlp", "--device", "cpu",
                               "--precision", "fp16", "--max-steps", "12", "--log-every", "4",
                               "--batch-size", "16", "--task-opt", "hidden=16",
                               "--task-opt", "samples=256", "--run-dir", str(tmp_path)])
    # What the terminal shows once the run is over, row by row: each row is what follows its
    # last "\r". tqdm redraws the bar in place as often as its clock says (so how many times
    # "12/12" was drawn depends on the machine's load), clears it before a line is written
    # above it, and leaves it on a row of its own only when it closes. One progress stream
    # means exactly one bar left on screen, at the final count, with the AMP numbers.
    rows = [line.rsplit("\r", 1)[-1] for line in output.replace("\r\n", "\n").split("\n")]
    finished = [row for row in rows if row.startswith("train:")]
    assert len(finished) == 1, output
    assert "12/12" in finished[0], finished
    assert "train: 100%" in finished[0] and "scale=" in finished[0] and "skipped=0" in finished[0], finished
    assert "samples/s=" in finished[0]
    assert "step=4 " not in output  # on a terminal the bar replaces the plain lines
    assert output.count("summary:") == 1 and "rank 1" not in output


def test_a_restarted_run_replaces_its_metrics_instead_of_appending_twice(tmp_path: Path) -> None:
    config = TrainConfig(task="mlp", task_opt=("hidden=16", "samples=256"), max_steps=10, log_every=5, batch_size=16,
                         eval_every=5, resume="none", archive_checkpoints=True, device="cpu", precision="fp32",
                         run_dir=str(tmp_path))
    for _ in range(2):  # a rerun that starts again from step 0
        with session_for(config) as session:
            train(config, session)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert _steps(tmp_path / "metrics.jsonl") == [0, 5, 5, 10, 10]  # evals at 0, 5, 10; logs at 5, 10
    assert sum("summary" in r for r in records) == 1
    kinds = [(r.get("step"), "loss" in r, any(k.startswith("eval_") for k in r)) for r in records if "summary" not in r]
    assert len(kinds) == len(set(kinds)) and (0, False, True) in kinds  # the step-0 eval once
    assert all(r["step_time"] > 0 and r["peak_mem_mb"] > 0 for r in records if "loss" in r)
