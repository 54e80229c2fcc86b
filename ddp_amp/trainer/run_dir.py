"""Which directory a run lives in, and rank 0's lock on it while the run lives.

Identity, in order: `--run-dir`; `--run-name` (runs/<name>); the launcher's id for this run
(`DistEnv.run_id`: the SLURM job id, or torchrun's rendezvous id where it names this run),
as runs/<task>-<id>; else a new name. Restarts of one job find the same directory: SLURM
keeps the job id over requeues, torchrun the rendezvous id over restarts, and a new name
under torchrun is made from the torchrun agent (the workers' parent: its pid and start
time), which outlives the workers it restarts. Unrelated launches never share a name.

The lock is a kernel file lock (`flock`) on `<run dir>/.lock`, taken by rank 0 for the whole
run: the kernel drops it when the process ends, however it ends, so a `kill -9` leaves no
stale lock and the job's restart gets it. The file holds who has it (host, pid, job id,
start time) for the message a second job gets. On NFS, Linux maps flock to a POSIX lock
that the server arbitrates, so the lock holds across nodes there too.

Where the filesystem has no flock (Lustre mounted without `-o flock` answers ENOSYS), the
lock is an exclusive lock file instead (`lock_file.OwnerFileLock`: created with O_EXCL,
naming its holder, taken over only when that holder provably no longer runs, removed on
release), with a one-line notice that this fallback is in use.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

import psutil

from ddp_amp.config import TrainConfig
from ddp_amp.errors import UsageError
from ddp_amp.session import DistEnv, Session
from ddp_amp.tasks import task_label
from ddp_amp.trainer.lock_file import UNSUPPORTED, OwnerFileLock

RUNS_ROOT = Path("runs")
LOCK_FILE = ".lock"


def _new_name(env: DistEnv) -> str:
    """A name no other launch gets: time and pid of the process that outlives restarts."""
    owner = psutil.Process(os.getppid()) if env.launcher == "torchrun" else psutil.Process()
    started = time.strftime("%Y%m%d-%H%M%S", time.localtime(owner.create_time()))
    return f"{started}-{owner.pid}"


def run_directory(config: TrainConfig, session: Session) -> Path:
    """This run's directory (collective: rank 0 names it, every rank gets the same path)."""
    if config.run_dir:
        return Path(config.run_dir)
    if config.run_name:
        return RUNS_ROOT / config.run_name
    name = session.env.run_id or session.on_rank_zero(lambda: _new_name(session.env))
    return RUNS_ROOT / f"{task_label(config.task)}-{name}"


def _holder(env: DistEnv) -> dict[str, object]:
    job = os.environ.get("SLURM_JOB_ID") or env.run_id or ""
    return {"host": socket.gethostname(), "pid": os.getpid(), "job": job,
            "started": time.strftime("%Y-%m-%d %H:%M:%S")}


def _describe(holder_text: str) -> str:
    try:
        holder = json.loads(holder_text)
        job = f", job {holder['job']}" if holder.get("job") else ""
        return f"host {holder['host']}, pid {holder['pid']}{job}, since {holder['started']}"
    except (ValueError, KeyError, TypeError):
        return "a process that has not written its name yet"


def _notice(message: str) -> None:
    # Rank 0 only, before the run log exists: straight to stderr, one line.
    print(f"[ddp_amp] notice: {message}", file=sys.stderr, flush=True)


class RunLock:
    """Rank 0's hold on a run directory; `acquire` on rank 0, `release` when the run ends."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self._fd: int | None = None
        self._owner_file: OwnerFileLock | None = None

    def acquire(self, env: DistEnv) -> None:
        """Take the lock (creating the directory) or raise UsageError naming its holder."""
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            raise UsageError("--run-dir", str(self.run_dir), "a writable directory for the run",
                             f"{error.strerror or error} ({error.filename or self.run_dir}); pick another "
                             "--run-dir or fix its permissions") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 4096).decode(errors="replace")
            os.close(fd)
            raise UsageError("--run-dir", str(self.run_dir), "a run directory no other job is using",
                             f"it is in use by {_describe(holder)}; wait for that job to end or stop "
                             "it, or give this run its own --run-dir / --run-name") from None
        except OSError as error:
            os.close(fd)
            if error.errno not in UNSUPPORTED:
                raise
            self._take_owner_file(env, error)
            return
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(_holder(env)) + "\n").encode(), 0)
        os.fsync(fd)
        self._fd = fd

    def _take_owner_file(self, env: DistEnv, error: OSError) -> None:
        lock = OwnerFileLock(self.run_dir)
        lock.acquire(_holder(env), _notice)
        _notice(f"the filesystem of {self.run_dir} does not support flock ({os.strerror(error.errno or 0)}): "
                f"the run lock is the lock file {lock.path}, removed when the run ends")
        self._owner_file = lock

    def release(self) -> None:
        if self._owner_file is not None:
            self._owner_file.release()
            self._owner_file = None
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def lock_run_directory(run_dir: Path, session: Session) -> RunLock:
    """Rank 0 takes the lock; every rank raises if it is held elsewhere (collective)."""
    lock = RunLock(run_dir)
    session.on_rank_zero(lambda: lock.acquire(session.env))
    return lock
