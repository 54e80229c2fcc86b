"""The liveness watch at 64 to 16,384 ranks: the real judges against one real TCPStore.

The store's server runs in a process of its own (its CPU time is the store thread's: the
process does nothing else). Two real `PeerWatch` judges (ranks 0 and 1, each with its real
heartbeat helper) run here; every other rank is emulated by a few threads that send, per
rank and poll, exactly what a rank's helper sends: one `set` of its beat and one
`multi_get` of the verdict's two keys, pipelined over a handful of connections. After a
warm-up longer than the silence limit (a live rank named then is a false name), the last
rank stops beating, as a rank on another machine killed with SIGKILL does, and the time to
the judges' line is its detection time.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ddp_amp.bench.targets import target_fields
from ddp_amp.distributed import watch
from ddp_amp.distributed.liveness import POLL_S, SILENCE_S, remember_prefix
from ddp_amp.distributed.store_wire import WireClient
from ddp_amp.env import DistEnv

RANKS = (64, 512, 4096, 16384)
PREFIX = "ddp_amp/attempt_0"
WARM_AFTER_SILENCE_S = 5.0  # the warm-up outlasts the silence limit: a live rank named by then is a false name
DETECT_LIMIT_S = 30.0
STORE_SHARE_TARGET = 0.10  # of one core, at 4,096 ranks
CONNECTIONS = 8
_SERVER = ("import sys, time, datetime, torch.distributed as d\n"
           "s = d.TCPStore('127.0.0.1', 0, 1, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)\n"
           "print(s.port, flush=True)\n"
           "sys.stdin.read()\n")


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100.0  # utime + stime, clock ticks of 1/100 s


class Emulated(threading.Thread):
    """Ranks `ranks` beating every POLL_S over one connection, until `stop`; `dead` stops
    beating from `kill_at` on."""

    def __init__(self, port: int, ranks: list[int], dead: int, kill_at: float, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.client = WireClient("127.0.0.1", port, PREFIX, timeout_s=60)
        self.ranks, self.dead, self.kill_at, self.stop = ranks, dead, kill_at, stop
        self.requests = 0

    def run(self) -> None:
        count = 0
        verdict = self.client.multi_get_request([watch.FAILURE_KEY, "ddp_amp/host_done"])
        while not self.stop.is_set():
            began = time.monotonic()
            beating = [r for r in self.ranks if r != self.dead or began < self.kill_at]
            self.client.send(b"".join(self.client.set_request(f"ddp_amp/beat/{r}", f"{count} - r {r} - -".encode())
                                      + verdict for r in beating))
            try:
                self.client.read_values(2 * len(beating))
            except OSError:  # the size's run ended and its server with it
                return
            self.requests += 2 * len(beating)
            count += 1
            self.stop.wait(max(0.0, POLL_S - (time.monotonic() - began)))


def _one(ranks: int, silence_s: float) -> dict[str, Any]:
    server = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    lines: list[str] = []
    named = threading.Event()
    try:
        port = int(server.stdout.readline())  # type: ignore[union-attr]  # a pipe
        import torch.distributed as dist  # the judges' own store clients, as in a job
        from datetime import timedelta
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
        started = time.monotonic()
        kill_at = started + silence_s + WARM_AFTER_SILENCE_S
        stop = threading.Event()
        others = list(range(2, ranks))
        emulated = [Emulated(port, others[i::CONNECTIONS], dead, kill_at, stop) for i in range(CONNECTIONS)]
        for thread in emulated:
            thread.start()
        judges = [watch.PeerWatch(prefixed, DistEnv(rank=r, world_size=ranks), silence_s=silence_s).start()
                  for r in (0, 1)]
        time.sleep(2.0)  # past the start: the steady state is measured
        cpu0, t0, req0 = _cpu_s(server.pid), time.monotonic(), sum(t.requests for t in emulated)
        named.wait(max(0.0, kill_at - time.monotonic()))
        cpu1, t1, req1 = _cpu_s(server.pid), time.monotonic(), sum(t.requests for t in emulated)
        early = named.is_set()
        named.wait(DETECT_LIMIT_S + 30)
        detected = time.monotonic() - kill_at if named.is_set() and not early else None
        stop.set()
        released.set()  # a judge's thread waiting in `caught` goes on, sees it is stopped, and ends
        for judge in judges:
            judge.stop(done=False)  # joined, and its helper ended
        judge_requests = 2 * -(-ranks // 100) / POLL_S  # two judges, batches of 100 beats per poll
        false_names = sorted(_named(lines) - {dead})
        share = (cpu1 - cpu0) / (t1 - t0)
        return {"ranks": ranks, "store_cpu_share": share, "requests_per_s": (req1 - req0) / (t1 - t0) + judge_requests,
                "detection_s": detected, "false_names": len(false_names), "line": lines[0] if lines else "",
                "target_checks": [
                    target_fields("live ranks named", len(false_names), 0),
                    target_fields("detection s", detected, DETECT_LIMIT_S),
                    target_fields("store thread, share of a core", share, STORE_SHARE_TARGET,
                                  not_here="" if ranks == 4096 else "the target is for 4,096 ranks")]}
    finally:
        server.kill()
        server.wait()


def _named(lines: list[str]) -> set[int]:
    found: set[int] = set()
    for line in lines:
        match = re.match(r"ddp_amp: ranks? ([\d, -]+) went silent", line)
        for span in (match.group(1).split(", ") if match else []):
            low, _, high = span.partition("-")
            found.update(range(int(low), int(high or low) + 1))
    return found


def run(ranks: tuple[int, ...] = RANKS, silence_s: float = SILENCE_S) -> dict[str, Any]:
    """Each size in turn; about twice the silence limit and a few seconds each."""
    saved = watch._say, watch._exit
    try:
        return {"rows": [_one(n, silence_s) for n in ranks], "poll_s": POLL_S, "silence_s": silence_s}
    finally:
        watch._say, watch._exit = saved


def scale_table(section: dict[str, Any]) -> str:
    head = f"liveness at scale (poll {section['poll_s']} s, silence {section['silence_s']} s)"
    rows = [f"{'ranks':>7} {'store CPU':>10} {'requests/s':>11} {'detected':>9} {'false names':>12}"]
    for row in section["rows"]:
        detected = "never" if row["detection_s"] is None else f"{row['detection_s']:.1f} s"
        rows.append(f"{row['ranks']:>7} {row['store_cpu_share']:>9.1%} {row['requests_per_s']:>11.0f} "
                    f"{detected:>9} {row['false_names']:>12}")
    return "\n".join([head, *rows])
