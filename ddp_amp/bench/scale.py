"""The liveness watch at 64 to 16,384 ranks, loading the store the way real ranks do.

One real TCPStore server (libuv, torch's default) runs in a process of its own: its CPU time
is the store's. Two real `PeerWatch` judges (ranks 0 and 1, each with its real heartbeat
helper) run here. Every other rank is emulated with a connection of its own, as its helper
holds one, carrying what that helper sends (beaters.py): at connect, the handshake, a read of
the verdict and a WAIT for news; then one `set` of its beat every beat period, each rank at
its own phase. BEATER_PROCESSES processes hold those connections, thousands each: a 2-core
machine cannot run a helper process per rank, but each connection carries one rank's load at
its real rate. The rate achieved is printed beside the one asked, and a row where they differ
by more than 5% misses its target: its figures would not be the real load's.

After a warm-up longer than the silence limit (a live rank named by then is a false name),
the last rank stops beating, as a rank whose node was lost, and the time to the judges' line
is its detection time. The store's CPU, the rate achieved and each judge thread's CPU are
measured over the warm-up's steady part, and the store process's open descriptors then,
less those it had before any rank connected: one a rank here (its helper's connection; a
real rank adds torch's own client, and its keeper's while it stands in: open_files.py).

The store listens on 127.0.0.1 over IPv4: its server looks up the name of every client that
connects, and an IPv6-mapped address goes to DNS (on this machine, 5 s stalls every ~50
connections); 127.0.0.1 is answered from /etc/hosts. The steady state measured is the same.
"""

from __future__ import annotations

import itertools
import re
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ddp_amp.bench.targets import AT_MOST, target_fields
from ddp_amp.distributed import watch
from ddp_amp.distributed.liveness import BEATS_PER_S, SILENCE_S, Liveness, remember_prefix
from ddp_amp.env import DistEnv

RANKS = (64, 512, 4096, 16384)
PREFIX = "ddp_amp/attempt_0"
BEATER_PROCESSES = 4
STEADY_AFTER_S = 2.0  # after the judges start: the measured part begins
WARM_AFTER_SILENCE_S = 5.0  # the warm-up outlasts the silence limit: a live rank named by then is a false name
DETECT_LIMIT_S = 30.0
STORE_SHARE_TARGET = 0.10  # of one core
JUDGE_SHARE_TARGET = 0.02  # of one core, on each judge rank
RATE_TOLERANCE = 0.05
BEATERS = Path(__file__).with_name("beaters.py")
# The store on an IPv4 listener of the bench's own. torch 2.4's libuv server takes no
# listener (NotImplementedError): there it listens on its own (dual-stack: each client's
# name lookup may stall; docs/facts.md), as it does in users' jobs on that torch.
_SERVER = ("import socket, sys, datetime, torch.distributed as d\n"
           "listener = socket.socket(); listener.bind(('127.0.0.1', 0)); listener.listen(4096)\n"
           "options = dict(timeout=datetime.timedelta(seconds=60), wait_for_workers=False)\n"
           "try:\n"
           "    s = d.TCPStore('127.0.0.1', listener.getsockname()[1], 1, True, master_listen_fd=listener.fileno(),"
           " **options)\n"
           "    listener.detach()\n"
           "except NotImplementedError:\n"
           "    listener.close(); s = d.TCPStore('127.0.0.1', 0, 1, True, **options)\n"
           "print(s.port, flush=True)\n"
           "sys.stdin.read()\n")


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100.0  # utime + stime, clock ticks of 1/100 s


class Beaters:
    """The processes that emulate ranks 2..N-1, and what they sent."""

    def __init__(self, port: int, ranks: int, beat_s: float) -> None:
        bounds = [2 + (ranks - 2) * i // BEATER_PROCESSES for i in range(BEATER_PROCESSES + 1)]
        spans = [(first, end) for first, end in itertools.pairwise(bounds) if end > first]
        self.procs = [subprocess.Popen([sys.executable, "-E", "-s", str(BEATERS), "127.0.0.1", str(port), PREFIX,
                                        str(first), str(end), str(beat_s)], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True)
                      for first, end in spans]
        self.owner = {rank: proc for (first, end), proc in zip(spans, self.procs) for rank in range(first, end)}
        for proc in self.procs:
            if proc.stdout is None or proc.stdout.readline().strip() != "ready":
                raise RuntimeError("an emulating process failed to connect its ranks to the store")

    def _ask(self, proc: subprocess.Popen[str], line: str) -> None:
        proc.stdin.write(line + "\n")  # type: ignore[union-attr]  # a pipe
        proc.stdin.flush()  # type: ignore[union-attr]  # a pipe

    def sent(self) -> int:
        for proc in self.procs:
            self._ask(proc, "count")
        total = 0
        for proc in self.procs:
            total += int(proc.stdout.readline())  # type: ignore[union-attr]  # a pipe
        return total

    def stop(self, rank: int) -> None:
        self._ask(self.owner[rank], f"stop {rank}")

    def end(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


def _one(ranks: int, silence_s: float, beats_per_s: float) -> dict[str, Any]:
    limits = Liveness(silence_s=silence_s, beats_per_s=beats_per_s)
    beat_s, silence = limits.beat_s(ranks), limits.silence_for(ranks)
    server = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    lines: list[str] = []
    named = threading.Event()
    beaters: Beaters | None = None
    try:
        port = int(server.stdout.readline())  # type: ignore[union-attr]  # a pipe
        fds_before = _fds(server.pid)
        beaters = Beaters(port, ranks, beat_s)
        store = dist.TCPStore("127.0.0.1", port, 1, False, timeout=timedelta(seconds=60), wait_for_workers=False)
        prefixed = dist.PrefixStore(PREFIX, store)
        remember_prefix(prefixed, PREFIX)
        # The judges' line and their exit, caught: this process goes on to the next size.
        watch._say = lines.append  # type: ignore[assignment]  # a bench hook on the module's printer
        released = threading.Event()

        def caught() -> None:  # returns only once the size is over (os._exit never does)
            named.set()
            released.wait()

        watch._exit = caught
        dead = ranks - 1
        judges = [watch.PeerWatch(prefixed, DistEnv(rank=r, world_size=ranks), silence_s=silence_s,
                                  beats_per_s=beats_per_s).start()
                  for r in (0, 1)]
        started = time.monotonic()
        kill_at = started + silence + WARM_AFTER_SILENCE_S
        time.sleep(STEADY_AFTER_S)
        cpu0, t0, sent0 = _cpu_s(server.pid), time.monotonic(), beaters.sent()
        judged0 = [judge.judge_cpu_s for judge in judges]
        named.wait(max(0.0, kill_at - time.monotonic()))
        cpu1, t1, sent1 = _cpu_s(server.pid), time.monotonic(), beaters.sent()
        judged1 = [judge.judge_cpu_s for judge in judges]
        fds = _fds(server.pid) - fds_before
        early = named.is_set()
        beaters.stop(dead)
        stopped = time.monotonic()
        named.wait(DETECT_LIMIT_S + 30)
        detected = time.monotonic() - stopped if named.is_set() and not early else None
        released.set()  # a judge's thread waiting in `caught` goes on, sees it is stopped, and ends
        for judge in judges:
            judge.stop(done=False)  # joined, and its helper ended
        share = (cpu1 - cpu0) / (t1 - t0)
        judge_share = max(b - a for a, b in zip(judged0, judged1)) / (t1 - t0)
        asked = (ranks - 2) / beat_s
        achieved = (sent1 - sent0) / (t1 - t0)
        false_names = sorted(_named(lines) - {dead})
        return {"ranks": ranks, "beat_s": beat_s, "silence_s": silence, "beats_per_s_asked": asked,
                "beats_per_s": achieved, "store_cpu_share": share, "judge_cpu_share": judge_share,
                "detection_s": detected, "false_names": len(false_names), "line": lines[0] if lines else "",
                "store_fds": fds,
                "target_checks": [
                    target_fields("live ranks named", len(false_names), 0),
                    target_fields("detection s", detected, DETECT_LIMIT_S),
                    target_fields("store thread, share of a core", share, STORE_SHARE_TARGET),
                    target_fields("judge thread, share of a core", judge_share, JUDGE_SHARE_TARGET),
                    target_fields("beats/s achieved / asked, off by", abs(achieved / asked - 1), RATE_TOLERANCE,
                                  AT_MOST)]}
    finally:
        if beaters is not None:
            beaters.end()
        server.kill()
        server.wait()


def _fds(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


def _named(lines: list[str]) -> set[int]:
    found: set[int] = set()
    for line in lines:
        match = re.match(r"ddp_amp: ranks? ([\d, -]+) went silent", line)
        for span in (match.group(1).split(", ") if match else []):
            low, _, high = span.partition("-")
            found.update(range(int(low), int(high or low) + 1))
    return found


def run(ranks: tuple[int, ...] = RANKS, silence_s: float = SILENCE_S,
        beats_per_s: float = BEATS_PER_S) -> dict[str, Any]:
    """Each size in turn; about twice the silence limit (at least four beat periods) each,
    and the time its ranks take to connect. `beats_per_s`: the store's budget of beats a
    second (`--peer-beats-per-s`)."""
    saved = watch._say, watch._exit
    try:
        return {"rows": [_one(n, silence_s, beats_per_s) for n in ranks], "silence_s": silence_s,
                "beats_per_s": beats_per_s,
                "beater_processes": BEATER_PROCESSES, "host": socket.gethostname()}
    finally:
        watch._say, watch._exit = saved


def scale_table(section: dict[str, Any]) -> str:
    head = (f"liveness at scale (--peer-silence {section['silence_s']} s, --peer-beats-per-s "
            f"{section['beats_per_s']:,.0f}; ranks 2..N-1 emulated with a connection each, over "
            f"{section['beater_processes']} processes)")
    rows = [f"{'ranks':>7} {'beat':>6} {'silence':>8} {'beats/s asked':>14} {'achieved':>9} {'store CPU':>10} "
            f"{'judge CPU':>10} {'detected':>9} {'false names':>12} {'store fds':>10}"]
    for row in section["rows"]:
        detected = "never" if row["detection_s"] is None else f"{row['detection_s']:.1f} s"
        rows.append(f"{row['ranks']:>7} {row['beat_s']:>5.2f}s {row['silence_s']:>7.1f}s "
                    f"{row['beats_per_s_asked']:>14.0f} {row['beats_per_s']:>9.0f} {row['store_cpu_share']:>9.1%} "
                    f"{row['judge_cpu_share']:>9.2%} {detected:>9} {row['false_names']:>12} {row['store_fds']:>10,}")
    return "\n".join([head, *rows])
