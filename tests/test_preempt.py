"""Preemption: a signal on any rank stops every rank at the same step, in normal control flow."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ddp_amp.config import TrainConfig
from ddp_amp.distributed import DistContext
from ddp_amp.errors import UsageError
from ddp_amp.metrics import QuietRunLog
from ddp_amp.guards import EXIT_PREEMPTED, PreemptionWatch, requeue_slurm_job
from ddp_amp.option_values import parse_signals
from ddp_amp.guards.preemption import _run_deaf_to_term
from ddp_amp.checkpoint.discovery import SCRATCH_PREFIX
from ddp_amp.tasks import load_task
from ddp_amp.trainer import Trainer, seed_everything, session_for
from ddp_amp.train import main
from tests.multiproc import REPO_ROOT, cli_env, run_ranks, slow_writes_env
from tests.slurm_cluster import Cluster

SMALL_MLP = ("in_size=16", "hidden=32", "out_size=4", "samples=512")


def test_parse_signals_accepts_names_and_none() -> None:
    assert parse_signals("USR1,sigterm,SIGUSR1", "--preempt-signal") == (signal.SIGUSR1, signal.SIGTERM)
    assert parse_signals("none", "--preempt-signal") == ()
    with pytest.raises(UsageError, match="--preempt-signal"):
        parse_signals("USR1,KILL", "--preempt-signal")


def test_cli_rejects_an_unknown_signal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--preempt-signal", "STOP", "--device", "cpu", "--run-dir", str(tmp_path)]) == 2
    assert "--preempt-signal" in capsys.readouterr().err


class _SignalledTrainer(Trainer):
    """Rank `victim` sends itself a real signal after step `at`; nothing else differs."""

    victim, at, signum = 1, 3, signal.SIGUSR1

    def train_step(self) -> torch.Tensor:
        loss = super().train_step()
        if self.session.rank == self.victim and self.step == self.at:
            os.kill(os.getpid(), self.signum)
        return loss


def _train_until_signalled(ctx: DistContext, checks: list[float]) -> list[dict[str, Any]]:
    records = []
    for check_s in checks:
        config = TrainConfig(task="mlp", device="cpu", task_opt=SMALL_MLP, batch_size=16, max_steps=5000,
                             log_every=10_000, preempt_check_s=check_s, preempt_requeue="never", precision="fp32")
        seed_everything(config.seed)
        task = load_task(config.task, config)
        trainer = _SignalledTrainer(session_for(config).start(), config, task, QuietRunLog(ctx.rank))
        records.append({**trainer.fit(),
                        "handler_restored": signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL})
        trainer = None  # free DDP before the next one (docs/facts.md: teardown)
    return records


def test_any_rank_signal_stops_all_ranks_at_the_same_step() -> None:
    """check_s=1e-9 agrees after every step; 0.05 s agrees on a cadence the ranks compute alike."""
    every_step, cadence = zip(*run_ranks(_train_until_signalled, 2, [1e-9, 0.05]))
    for records in (every_step, cadence):
        assert all(r["preempted"] and r["signal"] == "SIGUSR1" for r in records)
        assert records[0]["step"] == records[1]["step"]
        assert 3 <= records[0]["step"] < 5000
        assert all(r["handler_restored"] for r in records)
    assert every_step[0]["step"] == 3  # signalled in step 3: stops at that step's boundary


def _wait_for_metrics(run_dir: Path, proc: subprocess.Popen[str], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        metrics = run_dir / "metrics.jsonl"
        if metrics.exists() and metrics.read_text().strip():
            return
        time.sleep(0.1)
    raise AssertionError(f"training did not start: {proc.poll()}")


def test_dataloader_workers_survive_the_signal(tmp_path: Path) -> None:
    """USR1 to the whole process group (as SLURM sends it) reaches the workers too: they
    ignore it, and the run stops with the preemption exit code instead of a worker crash."""
    proc = subprocess.Popen([sys.executable, "-m", "ddp_amp.train", "--task", "mlp", "--device", "cpu",
                             "--num-workers", "1",
                             "--max-steps", "100000", "--log-every", "5", "--task-opt", "hidden=16",
                             "--run-dir", str(tmp_path)],
                            env=cli_env(), cwd=REPO_ROOT, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        _wait_for_metrics(tmp_path, proc)
        os.killpg(proc.pid, signal.SIGUSR1)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == EXIT_PREEMPTED, stderr
    assert "stopped at step" in stdout and "after SIGUSR1" in stdout, stdout + stderr
    assert not (tmp_path / "summary.json").exists()  # a stopped run is not a finished run


def test_requeue_reports_why_it_could_not(tmp_path: Path) -> None:
    done, message = requeue_slurm_job({})
    assert not done and "not a SLURM job" in message
    done, message = requeue_slurm_job({"SLURM_JOB_ID": "12", "PATH": str(tmp_path)})
    assert not done and "scontrol" in message  # no scontrol on that PATH


def test_the_requeue_command_outlives_the_term_its_requeue_brings() -> None:
    # SLURM signals every process of a requeued job's step, the `scontrol requeue` child
    # of rank 0 too: the child must finish and report, however soon the TERM lands.
    previous = signal.getsignal(signal.SIGTERM)
    result = _run_deaf_to_term(["sh", "-c", "kill -TERM $$; echo finished"], timeout_s=30)
    assert result.returncode == 0 and result.stdout.strip() == "finished", result
    assert signal.getsignal(signal.SIGTERM) == previous


def test_requeue_refused_by_slurm_is_reported(slurm_cluster: Cluster) -> None:
    os.environ["SLURM_CONF"] = str(slurm_cluster.conf)
    done, message = requeue_slurm_job({"SLURM_JOB_ID": "987654", "PATH": os.environ["PATH"]})
    assert not done and "refused" in message and "987654" in message, message


def test_the_check_cadence_after_a_resume_is_measured_from_the_resumed_step() -> None:
    watch = PreemptionWatch((signal.SIGUSR1,), torch.device("cpu"), check_s=0.05, distributed=True)
    watch.install(step=5000)  # a run resumed at step 5000
    try:
        stopped_at = None
        for step in range(5001, 5400):
            time.sleep(0.002)
            if step == 5010:
                os.kill(os.getpid(), signal.SIGUSR1)
            if watch.should_stop(step):
                stopped_at = step
                break
    finally:
        watch.restore()
    # ~0.05 s between checks at ~2 ms a step: the stop comes within a few dozen steps,
    # not 10,000 steps later as when the cadence was measured from step 0.
    assert stopped_at is not None and stopped_at < 5100, stopped_at
    assert watch.stopped_by == "SIGUSR1" and watch.requeue


def test_term_checkpoints_and_stops_without_requeue(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "ddp_amp.train", "--task", "mlp", "--device", "cpu",
                             "--max-steps", "100000", "--log-every", "5", "--task-opt", "hidden=16",
                             "--eval-every", "0", "--run-dir", str(tmp_path)],
                            env=cli_env(SLURM_JOB_ID="4242", SLURM_RESTART_COUNT="0"), cwd=REPO_ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _wait_for_metrics(tmp_path, proc)
        proc.send_signal(signal.SIGTERM)  # what scancel sends
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    record = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
              if '"preempted"' in line][-1]
    assert record["action"] == "stop" and record["signal"] == "SIGTERM" and not record["requeuing"]
    assert record["checkpoint"] and Path(record["checkpoint"]).is_dir() and record["signal_to_commit_s"] >= 0
    assert "SIGTERM means stop: not requeued" in stdout
    assert [line for line in stdout.splitlines() if "stopped at step" in line] == [stdout.splitlines()[-1]]


def test_term_while_a_preemption_checkpoints_does_not_kill_the_stop(tmp_path: Path) -> None:
    """SLURM follows a requeue or a cancel with TERM. With --stop-signal none nothing else
    handles TERM, yet one that lands while the USR1 stop writes its checkpoint must not end
    the process: the checkpoint commits, the stop line is printed and the exit code is 75."""
    proc = subprocess.Popen([sys.executable, "-m", "ddp_amp.train", "--task", "mlp", "--device", "cpu",
                             "--max-steps", "100000", "--log-every", "5", "--task-opt", "hidden=16",
                             "--eval-every", "0", "--stop-signal", "none", "--run-dir", str(tmp_path)],
                            env=slow_writes_env(0.5), cwd=REPO_ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _wait_for_metrics(tmp_path, proc)
        proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 60
        while not list((tmp_path / "checkpoints").glob(f"{SCRATCH_PREFIX}step-*")):  # the save is under way
            assert time.monotonic() < deadline and proc.poll() is None, "no checkpoint was started"
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_PREEMPTED, (proc.returncode, stderr[-2000:])
    stop = [line for line in stdout.splitlines() if "stopped at step" in line]
    assert len(stop) == 1 and "after SIGUSR1" in stop[0] and "not a SLURM job" in stop[0], stdout
    record = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
              if '"preempted"' in line][-1]
    assert Path(record["checkpoint"]).is_dir() and not record["requeuing"], record


def test_signal_options_cannot_overlap() -> None:
    with pytest.raises(UsageError, match="cannot mean both requeue and stop"):
        TrainConfig(preempt_signal="USR1,TERM", stop_signal="TERM")
    assert (TrainConfig().preempt_signal, TrainConfig().stop_signal) == ((signal.SIGUSR1,), (signal.SIGTERM,))


def test_a_signal_during_start_up_is_kept_for_the_loop_instead_of_killing_the_process() -> None:
    # Before the loop's watch is installed (process group, task, model still being built),
    # USR1's default action would end the process; the early handler keeps it for the loop.
    from ddp_amp.guards import EarlySignals

    previous = signal.getsignal(signal.SIGUSR1)
    try:
        EarlySignals((signal.SIGUSR1,))
        os.kill(os.getpid(), signal.SIGUSR1)
        watch = PreemptionWatch((signal.SIGUSR1,), torch.device("cpu"), check_s=0.05, distributed=False)
        watch.install(step=0)
        assert watch.received == signal.SIGUSR1
        watch.restore()
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_a_warning_that_lands_as_a_finished_run_exits_does_not_kill_it(tmp_path: Path) -> None:
    # Python's shutdown puts its handlers back to the default action (death, for USR1); a
    # SLURM warning landing then turned a finished job's exit code 0 into a kill. What the
    # shutdown leaves must be "ignore" where the process exits (python -m ddp_amp.train), and
    # untouched where the caller goes on.
    script = ("import signal, sys\n"
              "from ddp_amp.train import main\n"
              "args = sys.argv[1:]\n"
              "main([*args, '--run-dir', 'run-a'])\n"
              "print('caller goes on:', signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL)\n"
              "code = main([*args, '--run-dir', 'run-b'], exiting=True)\n"
              "print('process exits:', signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN)\n"
              "sys.exit(code)\n")
    result = subprocess.run([sys.executable, "-c", script, "--task", "mlp", "--device", "cpu", "--max-steps", "2",
                             "--task-opt", "hidden=8", "--task-opt", "samples=64", "--batch-size", "8"],
                            capture_output=True, text=True, env=cli_env(), cwd=tmp_path, timeout=120)
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    assert "caller goes on: True" in result.stdout and "process exits: True" in result.stdout, result.stdout


def test_the_cli_holds_preemption_signals_before_it_imports_torch() -> None:
    # SLURM may send its warning up to a minute early: with a short time limit it can land
    # while torch is still being imported, which takes seconds.
    order = subprocess.run([sys.executable, "-X", "importtime", "-m", "ddp_amp.train", "--help"], capture_output=True,
                           text=True, env=cli_env(), cwd=REPO_ROOT, timeout=120).stderr.splitlines()
    names = [line.rsplit("|", 1)[-1].strip() for line in order if line.startswith("import time:")]
    assert names.index("ddp_amp.startup_signals") < names.index("torch")
