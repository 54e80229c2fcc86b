"""The run lock where the filesystem has no `flock`: an exclusive lock file with its holder's name.

Lustre mounted without `-o flock` (and some FUSE and older NFS setups) answers `flock` with
ENOSYS, EOPNOTSUPP or ENOLCK. There the lock is `<run dir>/.lock.owner`, created with
O_CREAT|O_EXCL (atomic on every POSIX filesystem, Lustre and NFSv3+ included: of two jobs
one creates it, the other finds it) and holding the holder's identity: host, boot id, pid,
the pid's start time and the job id. It is removed on release.

Nothing drops it when its holder dies, so a later job judges whether the holder is gone,
and takes the file over only when that is proven: on this host, under the boot it was
written in, a pid that no longer runs or now belongs to another process (a different start
time) cannot hold it. A holder on another host cannot be seen from here, however long ago
it wrote: that job is refused with a line saying which file to remove once no job of that
host uses the directory. A takeover renames the stale file aside and checks that it moved
the very file it judged, so two jobs taking over at once cannot both win.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
from collections.abc import Callable
from pathlib import Path

import psutil

from ddp_amp.errors import UsageError

OWNER_FILE = ".lock.owner"
# What `flock` answers where the filesystem does not do it (ENOTSUP is EOPNOTSUPP on Linux).
UNSUPPORTED = frozenset({errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOLCK})


def _boot_id() -> str:
    """This boot's id (Linux): pids and start times are only comparable within one boot."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def process_start(pid: int) -> str | None:
    """When process `pid` started, exactly (clock ticks since boot on Linux); None where no
    process `pid` runs (a zombie has ended: it holds nothing)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
        return None if fields[0] in "ZX" else f"ticks:{fields[19]}"
    except (OSError, IndexError):
        pass
    try:  # no /proc (macOS): psutil's start time, to the hundredth of a second
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return None
        return f"time:{process.create_time():.2f}"
    except psutil.Error:
        return None


def identity(holder: dict[str, object]) -> dict[str, object]:
    """`holder` (host, pid, job, started) with what proves whether it still runs."""
    return {**holder, "boot": _boot_id(), "start": process_start(os.getpid())}


def describe(holder: dict[str, object]) -> str:
    job = f", job {holder['job']}" if holder.get("job") else ""
    return f"host {holder.get('host')}, pid {holder.get('pid')}{job}, since {holder.get('started')}"


def gone_because(holder: dict[str, object]) -> str | None:
    """Why the lock's holder provably no longer runs, or None where it may still run."""
    if holder.get("host") != socket.gethostname():
        return None  # another host's processes cannot be seen from here
    boot = _boot_id()
    if boot and holder.get("boot") and holder["boot"] != boot:
        return "this host has rebooted since it was written"
    pid = holder.get("pid")
    if not isinstance(pid, int):
        return None
    start = process_start(pid)
    if start is None:
        return f"its pid {pid} no longer runs"
    if holder.get("start") and start != holder["start"]:
        return f"its pid {pid} is now another, newer process"
    return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


def _parse(text: str) -> dict[str, object] | None:
    try:
        holder = json.loads(text)
    except ValueError:
        return None
    return holder if isinstance(holder, dict) and "host" in holder and "pid" in holder else None


class OwnerFileLock:
    """The exclusive lock file of a run directory; `acquire`, then `release` when the run ends."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.path = run_dir / OWNER_FILE
        self._text: str | None = None

    def acquire(self, holder: dict[str, object], notice: Callable[[str], None]) -> None:
        """Create the lock file holding `holder`, taking over a provably stale one (with a
        line through `notice`), or raise UsageError naming its holder."""
        text = json.dumps(identity(holder)) + "\n"
        for _ in range(3):  # a takeover lost to another job, or a holder releasing meanwhile
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                found = _read(self.path)
                if found is None:
                    continue  # released between our create and our read: try again
                stale = _parse(found)
                reason = gone_because(stale) if stale is not None else None
                if stale is None or reason is None:
                    raise self._refusal(stale) from None
                if self._take_over(found):
                    notice(f"took over the stale run lock {self.path} of {describe(stale)}: {reason}")
                continue
            try:
                os.write(fd, text.encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            self._text = text
            return
        raise self._refusal(_parse(_read(self.path) or ""))

    def _take_over(self, judged: str) -> bool:
        """Move the stale file aside; True where the file moved is the one judged stale."""
        aside = self.path.with_name(f"{OWNER_FILE}.stale-{socket.gethostname()}-{os.getpid()}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False
        moved = _read(aside)
        if moved != judged:  # another job took it over first: put its live lock back
            with contextlib.suppress(FileExistsError):  # a third job created one meanwhile
                os.link(aside, self.path)
        aside.unlink(missing_ok=True)
        return moved == judged

    def _refusal(self, holder: dict[str, object] | None) -> UsageError:
        expected = "a run directory no other job is using"
        if holder is None:
            return UsageError("--run-dir", str(self.run_dir), expected,
                              f"its lock file {self.path} names no holder (a job writing it, or one that "
                              "died while it did); if no job uses the directory, remove that file")
        if holder.get("host") != socket.gethostname():
            return UsageError("--run-dir", str(self.run_dir), expected,
                              f"it is in use by {describe(holder)} per {self.path} (this filesystem has no "
                              "flock, and a holder on another host cannot be checked from here); once no job "
                              f"on {holder.get('host')} uses it, remove it (rm {self.path}), or give this run "
                              "its own --run-dir / --run-name")
        return UsageError("--run-dir", str(self.run_dir), expected,
                          f"it is in use by {describe(holder)}; wait for that job to end or stop it, or give "
                          "this run its own --run-dir / --run-name")

    def release(self) -> None:
        """Remove the lock file, where it is still this holder's."""
        if self._text is not None and _read(self.path) == self._text:
            self.path.unlink(missing_ok=True)
        self._text = None
