"""A job whose launcher died stops, and a silent rank is named: real torchrun, real workers.

- torchrun SIGKILLed: its workers stop within seconds with one line, the run lock goes
  with them, and a rerun resumes from the checkpoint that line names;
- a rank SIGKILLed (the OOM killer's way), or hung in its own code: the job's output has
  one line naming it and every rank's last step, instead of gloo's words.
"""

from __future__ import annotations

import os
import random
import re
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from ddp_amp.checkpoint import verify_checkpoint
from ddp_amp.checkpoint.discovery import checkpoint_root, list_step_dirs
from ddp_amp.distributed import PeerWatch, Progress
from ddp_amp.distributed.liveness import SILENCE_S, PeerTracker
from ddp_amp.distributed.naming import rank_list, silent_line
from ddp_amp.distributed.store_keys import failure_value, parse_failure
from tests.multiproc import REPO_ROOT, child_pids, cli_env, free_port, is_running, run_ranks, run_train
from tests.resume_harness import TASK

MLP = ["--task", "mlp", "--device", "cpu", "--batch-size", "8", "--eval-every", "0", "--task-opt", "hidden=16",
       "--task-opt", "samples=256", "--log-every", "1000"]
CKPT = ["--task", TASK, "--batch-size", "8", "--device", "cpu", "--log-every", "1000", "--max-steps", "100000"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


class Output:
    """A process's merged output, read as it comes, each line with the time it arrived."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._reader.start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:  # ends when every writer (torchrun and its workers) closed it
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def wait_closed(self, timeout: float) -> None:
        self._reader.join(timeout)
        assert not self._reader.is_alive(), "the output stayed open: a worker still runs"

    def first(self, pattern: str, timeout: float = 120) -> tuple[float, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [(at, line) for at, line in list(self.lines) if re.search(pattern, line)]
            if found:
                return found[0]
            time.sleep(0.05)
        raise AssertionError(f"never saw {pattern!r}:\n" + self.text()[-3000:])

    def ours(self) -> list[str]:
        return [line for _, line in self.lines if line.startswith("ddp_amp: ")]

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


def _start(command: list[str], open_files: tuple[int, int] | None = None) -> tuple[subprocess.Popen[str], Output]:
    """`command`'s process and its output; `open_files`: its soft and hard RLIMIT_NOFILE."""
    limits = (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, open_files)) if open_files else None
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=cli_env(),
                            cwd=REPO_ROOT, preexec_fn=limits)
    return proc, Output(proc)


def _lowered_soft_limit() -> tuple[int, int]:
    """This process's hard open-file limit with a soft one below it."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return min(1024, hard // 2), hard


def _wait_gone(pids: list[int], deadline: float, output: Output | None = None) -> None:
    while any(is_running(pid) for pid in pids):
        assert time.monotonic() < deadline, (f"workers {pids} still ran 30 s after torchrun was killed: "
                                             + " ".join(Path(f"/proc/{pid}/stat").read_text() for pid in pids
                                                        if is_running(pid)) + (output.text()[-3000:] if output else ""))
        time.sleep(0.05)


def test_workers_of_a_killed_torchrun_stop_within_seconds_and_a_rerun_resumes(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [*MLP, "--max-steps", "100000", "--ckpt-every", "50", "--run-dir", str(run_dir)]
    torchrun, output = _start([*TORCHRUN, "--max-restarts=3", "-m", "ddp_amp.train", *args])
    try:
        output.first(r"saved checkpoint .*step-00000100")
        workers = child_pids(torchrun.pid)
        assert len(workers) == 2, workers
        torchrun.kill()
        killed = time.monotonic()
        torchrun.wait(10)
        _wait_gone(workers, killed + 30, output)
        stopped_after = time.monotonic() - killed
        output.wait_closed(10)
    finally:
        torchrun.kill()
    ours = output.ours()
    assert len(ours) == 1, output.text()[-3000:]
    line = ours[0]
    assert line.startswith(f"ddp_amp: rank 0: the launcher (torchrun, pid {torchrun.pid}) is gone; stopping at step ")
    stopped_at = int(re.search(r"stopping at step (\d+)", line)[1])  # type: ignore[index]
    named = Path(re.search(r"; checkpoint (\S+) is committed \(--resume auto continues from the newest\)$",
                           line)[1])  # type: ignore[index]
    verify_checkpoint(named)
    # The newest whole one (a write the kill cut short is ignored): the named one, or the one
    # after it where the kill came between its commit and the trainer learning of it.
    step, newest = list_step_dirs(checkpoint_root(run_dir))[-1]
    assert 100 <= step <= stopped_at and newest in (named, named.parent / f"step-{step:08d}"), (line, newest)
    assert int(named.name.split("-")[1]) >= step - 50, (line, newest)
    # No storm of store warnings: a store call under way as the launcher died may log one.
    assert output.text().count("[c10d]") <= 4, output.text()[-3000:]
    # The lock went with rank 0's process: the rerun takes the directory and resumes there.
    rerun = run_train([*args[:args.index("--max-steps")], "--max-steps", str(step + 10), "--ckpt-every", "50",
                       "--run-dir", str(run_dir), "--resume", "auto"], nproc=2)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"start: resume from {newest}" in rerun.stdout, rerun.stdout
    print(f"workers stopped {stopped_after:.2f} s after torchrun was killed")


def test_workers_of_a_torchrun_killed_while_they_start_stop_too(tmp_path: Path) -> None:
    """Killed before its workers reach the store: their connect would retry for --dist-timeout."""
    torchrun, output = _start([*TORCHRUN, "-m", "ddp_amp.train", *MLP, "--max-steps", "100000", "--run-dir",
                               str(tmp_path)])
    try:
        deadline = time.monotonic() + 30
        while len(workers := child_pids(torchrun.pid)) < 2:
            assert time.monotonic() < deadline, "torchrun started no workers"
            time.sleep(0.05)
        torchrun.kill()
        killed = time.monotonic()
        output.wait_closed(30)
        stopped_after = time.monotonic() - killed
    finally:
        torchrun.kill()
    # Their output closes as they exit, a moment before they are gone.
    _wait_gone(workers, killed + 30)
    # Killed while the workers import torch, as a rule; else the watch saw it, as above.
    assert len(output.ours()) == 1 and re.search(r"the launcher is gone|the launcher \(torchrun, pid \d+\) is gone",
                                                 output.ours()[0]), output.text()[-3000:]
    print(f"workers stopped {stopped_after:.2f} s after torchrun was killed: {output.ours()[0][:60]}")


def test_a_rank_killed_with_sigkill_is_named_in_one_line(tmp_path: Path) -> None:
    proc, output = _start([*TORCHRUN, "-m", "ddp_amp.train", *CKPT, "--run-dir", str(tmp_path), "--task-opt",
                           "kill_at=200", "--task-opt", "kill_rank=1"])
    started, _ = output.first(" start: fresh run")
    named, line = output.first("^ddp_amp: ")
    assert proc.wait(60) != 0
    output.wait_closed(10)
    assert output.ours() == [line], output.text()[-3000:]
    heard = re.fullmatch(r"ddp_amp: rank 1 went silent \(last heard at (step \d+|no step yet)\): its process ended "
                         r"or stopped without an error of its own \(killed, e\.g\. by the OOM killer or kill -9, "
                         r"or its node was lost\); the other ranks reached step 200", line)
    assert heard is not None, line
    assert heard[1] == "no step yet" or int(heard[1].split()[1]) <= 200
    assert "GLHF" not in output.text() and "Connection closed" not in output.text(), output.text()[-3000:]
    # Its helper sees its process end (GONE): named at once, not after SILENCE_S of no heartbeat.
    assert named - started < SILENCE_S, named - started
    # torchrun's summary names the killed rank as the root cause, not the survivor that ended.
    root_cause = output.text().split("Root Cause (first observed failure):")[1]
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)\s*exitcode\s*: -9", root_cause), root_cause
    print(f"named {named - started:.2f} s after the start line")


STOPPED_SILENCE_S = 4.0  # the stopped rank's test: 8 polls, as short as a loaded machine allows


def _root_cause(output: Output) -> str:
    """torchrun's "Root Cause" section of the job's output."""
    return output.text().split("Root Cause (first observed failure):")[1]


def test_a_rank_that_stops_answering_is_named_once_its_heartbeat_is_silent(tmp_path: Path) -> None:
    """SIGSTOP: the process is there, its heartbeat is not; as a rank on a lost node looks.
    Its own helper ends it once it is named, and torchrun reports it as the root cause
    (not the judge that ended first)."""
    open_files = _lowered_soft_limit()
    proc, output = _start([*TORCHRUN, "-m", "ddp_amp.train", *CKPT, "--run-dir", str(tmp_path), "--task-opt",
                           "stop_at=20", "--task-opt", "kill_rank=1", "--dist-timeout", "120",
                           "--peer-silence", str(STOPPED_SILENCE_S)], open_files)
    try:
        started, _ = output.first(" start: fresh run")
        # Started with a soft open-file limit under the hard one: torchrun's agent (the
        # store's host) and each worker run at the hard one.
        soft = {pid: resource.prlimit(pid, resource.RLIMIT_NOFILE)[0] for pid in [proc.pid, *child_pids(proc.pid)]}
        named, line = output.first("^ddp_amp: ")
        code = proc.wait(60)
    finally:
        for pid in child_pids(proc.pid):  # only where the test failed: the stopped rank
            os.kill(pid, signal.SIGKILL)
    assert code != 0
    output.wait_closed(10)
    assert output.ours() == [line], output.text()[-3000:]
    assert len(soft) == 3 and set(soft.values()) == {open_files[1]}, (open_files, soft)
    assert line.startswith("ddp_amp: rank 1 went silent (last heard at ") and "the other ranks reached step 20" in line
    # Its last heartbeat may come a poll (0.5 s) before the start line; silent from step 20 on.
    assert STOPPED_SILENCE_S - 1 < named - started < STOPPED_SILENCE_S + 10, named - started
    root_cause = _root_cause(output)
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)", root_cause) and "rank 1 went silent" in root_cause, root_cause
    print(f"named {named - started:.2f} s after the start line (silence {STOPPED_SILENCE_S} s)")


def test_a_rank_hung_in_its_own_code_is_named_within_the_dist_timeout(tmp_path: Path) -> None:
    timeout = 5
    proc, output = _start([*TORCHRUN, "-m", "ddp_amp.train", *CKPT, "--run-dir", str(tmp_path), "--task-opt",
                           "hang_at=20", "--task-opt", "kill_rank=1", "--dist-timeout", str(timeout)])
    started, _ = output.first(" start: fresh run")
    named, line = output.first("^ddp_amp: ")
    assert proc.wait(60) != 0
    output.wait_closed(10)
    assert output.ours() == [line], output.text()[-3000:]
    assert line == ("ddp_amp: rank 1 made no progress since step 20: alive, but never joined the collective that "
                    "timed out (--dist-timeout) on the others (a hang in its own code or I/O: data loading, a file "
                    "system, a deadlock); the other ranks reached step 20")
    assert "Timed out waiting" not in output.text(), output.text()[-3000:]
    # 20 steps take well under a second; then gloo's timeout, and the others get 2 s to say theirs.
    assert named - started < timeout + 5, named - started
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)", _root_cause(output)), _root_cause(output)
    print(f"named {named - started:.2f} s after the start line (--dist-timeout {timeout})")


def _finish_apart(ctx: object, rank_delay: float) -> float:
    """Rank 1 ends its watch and returns at once; rank 0 goes on longer than the silence."""
    from ddp_amp.distributed import DistContext

    assert isinstance(ctx, DistContext)
    watch = PeerWatch(ctx.store, ctx.env, Progress(), interval_s=0.1, silence_s=0.5).start()
    time.sleep(0.5)
    if ctx.rank == 0:
        time.sleep(rank_delay)  # rank 1's process has ended by now: a killed one would be named
    watch.stop()
    return time.monotonic()


def test_a_rank_that_finished_is_not_silent_for_the_others_still_finishing() -> None:
    ends = run_ranks(_finish_apart, 2, 2.0)
    assert ends[0] - ends[1] > 1.5  # rank 0 outlived rank 1 and was not stopped


def test_a_session_never_closed_does_not_make_a_rank_that_finished_first_look_silent(tmp_path: Path) -> None:
    """The watch of a session never closed says DONE as its process ends without an error."""
    proc, output = _start([*TORCHRUN, str(REPO_ROOT / "tests/plugins/unclosed_session.py"), str(tmp_path), "finish"])
    assert proc.wait(120) == 0, output.text()[-3000:]
    output.wait_closed(10)
    assert "rank 0 finished" in output.text() and not output.ours(), output.text()[-3000:]


def test_a_rank_that_ended_with_an_uncaught_exception_is_named_even_without_a_session_block(tmp_path: Path) -> None:
    """The same script, rank 1 failing outside any session block, started by hand (env://):
    no launcher stops rank 0 for it, and its watch says no DONE, so rank 0 stops, naming it."""
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(REPO_ROOT / "tests/plugins/unclosed_session.py"), str(tmp_path),
                               "raise"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO_ROOT,
                              env=cli_env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                                          MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
             for rank in range(2)]
    outputs = [proc.communicate(timeout=120)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [1, 1], outputs
    assert "rank 1 failed in the script's own code" in outputs[1], outputs[1]
    assert "rank 0 finished" not in outputs[0], outputs[0]
    ours = [line for line in outputs[0].splitlines() if line.startswith("ddp_amp: ")]
    assert [line.split(" (")[0] for line in ours] == ["ddp_amp: rank 1 went silent"], outputs[0]


def test_the_line_lists_ranks_and_steps_compactly() -> None:
    assert rank_list([7, 0, 1, 2, 5]) == "ranks 0-2, 5, 7"
    steps = {0: 12, 1: 12, 2: 12, 3: 11, 4: None, 5: 12}
    line = silent_line([3, 4], [], steps)
    assert line.startswith("ddp_amp: ranks 3-4 went silent (last heard at steps 11 (rank 3), none yet (rank 4)): "
                           "their processes ended")
    assert line.endswith("; the other ranks reached step 12")


def test_the_line_and_the_failure_every_helper_reads_stay_small_at_16384_ranks() -> None:
    """466 live ranks named among 16,384 at scattered places, at many steps: the line names
    a few ranks and how many more, and the failure record in the store a few and the count."""
    world = 16_384
    draw = random.Random(0)
    gone = sorted(draw.sample(range(2, world), 466))
    steps: dict[int, int | None] = {rank: draw.choice([None, 4179, 4180, 4181, 4000 + rank % 97])
                                    for rank in range(world)}
    line = silent_line(gone, [], steps, [world - 1])
    assert len(line) < 1_000, len(line)
    assert line.startswith(f"ddp_amp: ranks {gone[0]}, {gone[1]}, {gone[2]}, {gone[3]} and 462 more went silent")
    value = failure_value(0, line, gone, 0.0)
    record = parse_failure(value)
    assert len(value) < 2_000 and record["named"] == gone[:4] and record["count"] == 466, len(value)
    assert len(failure_value(1, "x" * 200_000)) < 1_100  # a rank's own error, however long its text


def test_the_tracker_judges_on_the_beats_alone() -> None:
    """A judge's view of four ranks, at times it is given: GONE is named at once, DONE never,
    an unchanged beat after the silence limit, and a rank with no beat only once a
    collective timed out (it never arrived)."""
    tracker = PeerTracker(0, 4, silence_s=10.0)
    tracker.update([b"1:1 5 r", b"1:1 5 r", b"1:1 5 r", b""], now=0.0)
    tracker.update([b"1:2 6 r", b"1:2 5 x", b"1:1 5 r", b""], now=1.0)
    assert tracker.gone(1.0) == [1] and tracker.never_arrived(1.0, settle_s=2.0) == []  # 3: no beat yet, not judged
    tracker.update([b"1:3 7 r", b"1:2 5 x", b"1:2 6 d", b""], now=11.5)
    tracker.update([b"1:4 7 t"], now=12.0, ranks=[0])  # the judge's own collective timed out
    assert tracker.never_arrived(13.0, settle_s=2.0) == [] and tracker.never_arrived(14.0, settle_s=2.0) == [3]
    assert tracker.gone(30.0) == [1]  # 2 said DONE: its silence is no failure (0 is the judge itself)
    steps = {rank: tracker.step(rank) for rank in range(4)}
    assert steps == {0: 7, 1: 5, 2: 6, 3: None}
    assert silent_line([1], [], steps, [3]) == (
        "ddp_amp: rank 1 went silent (last heard at step 5): its process ended or stopped without an error of its "
        "own (killed, e.g. by the OOM killer or kill -9, or its node was lost); rank 3 never arrived: no heartbeat "
        "since the group formed (its process did not start, or ended before it joined: see its own output); the "
        "other ranks reached steps 7 (rank 0), 6 (rank 2)")


def test_a_rank_holding_the_gil_past_the_silence_limit_is_not_named(tmp_path: Path) -> None:
    """Rank 1 spends three silence limits in one C call that keeps the GIL: every thread of
    its process pauses, its heartbeat helper (a process of its own) beats on, and the run
    finishes with no rank named. The store takes 8 beats a second at most here, so the 2
    ranks' beats widen from 0.2 s to 0.25 s, and rank 0 says so once."""
    done = run_train([*CKPT[:-2], "--max-steps", "10", "--run-dir", str(tmp_path), "--task-opt", "gil_at=5",
                      "--task-opt", "gil_s=6", "--task-opt", "kill_rank=1", "--peer-poll", "0.2",
                      "--peer-silence", "2", "--peer-beats-per-s", "8"], nproc=2, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    notices = [line for line in output.splitlines() if line.startswith("[ddp_amp] at 2 ranks")]
    assert notices == ["[ddp_amp] at 2 ranks each rank beats every 0.25 s (not --peer-poll 0.2 s): the store "
                       "receives at most --peer-beats-per-s 8 beats a second; a rank whose process ended is named "
                       "within 0.45 s, a stopped or lost one in 1.75-2.5 s (raise --peer-beats-per-s for faster "
                       "detection at that much more load on the store: docs/watching.md)"], output[-3000:]
    assert "went silent" not in output and "made no progress" not in output, output[-3000:]
    summary = re.search(r"summary: .*steps_taken=10 .*wall_s=([\d.]+)", output)
    assert summary and float(summary.group(1)) >= 6, output[-3000:]  # the 6 s with the GIL held are in it


def test_a_rank_hung_with_the_gil_held_ends_when_the_store_host_leaves_first(tmp_path: Path) -> None:
    """No launcher to end what is left (a plain `srun` without --kill-on-bad-exit, or
    hand-made env:// ranks): rank 1 hangs in one C call that keeps the GIL, so none of its
    threads can run. Rank 0, which hosts the store, names it and exits; rank 1's heartbeat
    helper ends rank 1 (SIGKILL), so the job does not wait for its time limit."""
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = cli_env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, "-m", "ddp_amp.train", *CKPT, "--run-dir", str(tmp_path),
                                       "--task-opt", "gil_at=5", "--task-opt", "kill_rank=1", "--dist-timeout", "5"],
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                      cwd=REPO_ROOT))
    outputs = [Output(proc) for proc in procs]
    try:
        codes = [proc.wait(180) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    assert codes[1] == -signal.SIGKILL, outputs[1].text()[-3000:]
    assert codes[0] != 0
    assert outputs[0].ours() == ["ddp_amp: rank 1 made no progress since step 5: alive, but never joined the "
                                 "collective that timed out (--dist-timeout) on the others (a hang in its own code "
                                 "or I/O: data loading, a file system, a deadlock); the other ranks reached step 5"], \
        outputs[0].text()[-3000:]


def test_a_store_host_whose_open_file_limit_is_too_low_for_the_ranks_is_refused_in_one_line(tmp_path: Path) -> None:
    """torchrun's agent hosts the store with a hard limit of 200 open files, under the 262
    that 2 ranks need (3 a rank plus 256): every rank stops before its group forms, one line."""
    done = subprocess.run([*TORCHRUN, "-m", "ddp_amp.train", *MLP, "--max-steps", "1", "--run-dir", str(tmp_path)],
                          capture_output=True, text=True, env=cli_env(), cwd=REPO_ROOT, timeout=120,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (200, 200)))
    ours = [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("ddp_amp: ")]
    assert done.returncode != 0 and ours == [
        "ddp_amp: error: open files of the store's host=200: expected at least 262 for 2 ranks (torchrun's agent at "
        "localhost: 3 per rank, for torch's store client and the failure watch's heartbeat helper and stand-in, plus "
        "256) (hint: raise the hard limit where the job starts (ulimit -Hn, nofile in /etc/security/limits.conf, "
        "LimitNOFILE= of a systemd unit, srun --propagate=NOFILE); ddp_amp raises the soft limit to it)"], done.stderr
    assert "exitcode  : 2" in done.stderr and not any(tmp_path.iterdir())


def test_a_silence_limit_shorter_than_four_polls_is_refused_in_one_line(tmp_path: Path) -> None:
    done = run_train([*MLP, "--max-steps", "1", "--run-dir", str(tmp_path), "--peer-poll", "1",
                      "--peer-silence", "2"])
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--peer-silence=2.0: expected at least 4 polls (4 s at --peer-poll 1)" in lines[0] \
        and "lower --peer-poll" in lines[0], done.stderr
    assert not any(tmp_path.iterdir())  # refused before anything was written
