"""The watch at start-up and at scale: ranks that reach their loop far apart are not named,
nor is a rank whose helper starts slowly or stops beating; a rank that never arrives is one
line; the store client the helper speaks is torch's protocol. The figures at 64 to 16,384
ranks: `python -m ddp_amp.bench --sections scale`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ddp_amp import Liveness, Session
from ddp_amp.distributed.open_files import STORE_FDS_PER_RANK
from ddp_amp.distributed.store_wire import WireClient
from ddp_amp.distributed.spawn import run_ranks
from tests.multiproc import REPO_ROOT, cli_env, free_port

# The sessions' watches judge silence at LIMITS (8 polls, ample on a loaded machine: the
# beats come from each rank's own helper process); the sessions start up to three silence
# limits apart, as 30 s is at the default 10 s: a silence clock that started before a rank's
# first beat would name the late ranks. Their poll is not the group's: each session starts
# a new helper. Two of those do not beat: rank 0's starts slowly (its interpreter sleeps
# three silence limits first, as one on a loaded shared file system may) and rank 1 stops
# its helper (SIGSTOP) as its session starts: a rank named on evidence about its helper
# would fail this test too.
LIMITS = Liveness(poll_s=0.25, silence_s=2.0)
SPREAD_S = 3 * LIMITS.silence_s


def _store_connections(port: int) -> int:
    """The connections this process accepted on its store's `port` that are still open."""
    sockets = {os.readlink(f"/proc/self/fd/{fd}")[8:-1] for fd in os.listdir("/proc/self/fd")
               if os.path.exists(f"/proc/self/fd/{fd}") and os.readlink(f"/proc/self/fd/{fd}").startswith("socket:[")}
    count = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            fields = row.split()
            if fields[9] in sockets and fields[3] == "01" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                count += 1
    return count


def _late_loop(ctx: object, world_size: int, slow_python: str) -> tuple[int, float, bool, int]:
    """A user's loop whose data takes a different time to load on each rank, after the group
    formed: the Sessions start up to SPREAD_S apart, then train a few steps together. Rank 0,
    the store's host, returns the most connections its store held while its session ran (0
    elsewhere)."""
    from ddp_amp.distributed import DistContext

    assert isinstance(ctx, DistContext)
    time.sleep(SPREAD_S * ctx.rank / (world_size - 1))
    if ctx.rank == 0:
        sys.executable = slow_python  # the interpreter of the helper its session starts
    most = [0]
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.wait(0.05):
            most[0] = max(most[0], _store_connections(ctx.env.master_port))

    sampler = threading.Thread(target=sample, daemon=True)
    if ctx.rank == 0:
        sampler.start()
    with Session("fp32", "cpu", liveness=LIMITS) as session:
        watch = session._watch  # the test's own look: this rank beats, and ranks 0 and 1 judge
        watched = watch is not None and watch.heart is not None and watch.judge == (ctx.rank in (0, 1))
        if ctx.rank == 1 and watch is not None and watch.heart is not None:
            os.kill(watch.heart.proc.pid, signal.SIGSTOP)
        torch.manual_seed(0)
        model = session.setup(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(5):
            loss = model(torch.randn(6, 4)).pow(2).mean()
            session.backward(loss)
            session.step(optimizer)
            optimizer.zero_grad(set_to_none=True)
    sampling.set()
    return ctx.rank, float(loss), watched, most[0]


def test_eight_ranks_whose_sessions_start_three_silences_apart_complete_and_none_is_named(tmp_path: Path) -> None:
    slow_python = tmp_path / "slow_python"
    slow_python.write_text(f"#!/bin/sh\nsleep {SPREAD_S}\nexec {sys.executable} \"$@\"\n")
    slow_python.chmod(0o755)
    results = run_ranks(_late_loop, 8, 8, str(slow_python), timeout=300)
    assert [rank for rank, _, _, _ in results] == list(range(8))  # every rank finished; none was ended
    assert all(watched for _, _, watched, _ in results)  # and each was watched all along
    # What the store's host held at most: torch's client and the helper of each rank, the
    # two judges, keepers standing in for helpers that start slowly or stopped: within the 3
    # a rank that open_files.py counts on, plus the judges.
    held = results[0][3]
    assert 8 < held <= STORE_FDS_PER_RANK * 8 + 2, held
    print(f"the store's host held at most {held} connections for 8 ranks")


def test_a_rank_that_never_arrives_is_one_line_on_every_rank(tmp_path: Path) -> None:
    """Ranks 0 and 1 of three, started by hand: rank 0 (the store's host) gives up after
    --dist-timeout with one line, and rank 1, whose store goes with it, prints nothing (no
    c10d warning, no C++ stack trace)."""
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-m", "ddp_amp.train", "--task", "mlp", "--device", "cpu",
                               "--max-steps", "1", "--dist-timeout", "2", "--run-dir", str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO_ROOT,
                              env=cli_env(RANK=str(rank), WORLD_SIZE="3", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="3",
                                          MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
             for rank in range(2)]
    outputs = [proc.communicate(timeout=120)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [2, 2], outputs
    assert outputs[0].startswith("ddp_amp: error: --dist-timeout='2': expected every rank at the rendezvous within "
                                 "it (2 of 3 ranks joined") and outputs[0].count("\n") == 1, outputs[0]
    assert outputs[1] == "", outputs[1]


def test_where_rank_0_hosts_the_store_and_never_arrives_every_rank_there_prints_the_one_line() -> None:
    """Ranks 1 and 2 of three, started by hand (env://, as under srun): rank 0, which would
    host the store, never starts. Each rank that is there says so in one line (no rank 0 is
    there to say it for them) and exits 2."""
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-m", "ddp_amp.train", "--task", "mlp", "--device", "cpu",
                               "--max-steps", "1", "--dist-timeout", "2"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO_ROOT,
                              env=cli_env(RANK=str(rank), WORLD_SIZE="3", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="3",
                                          MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
             for rank in (1, 2)]
    outputs = [proc.communicate(timeout=120)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [2, 2], outputs
    for rank, output in zip((1, 2), outputs):
        assert output.count("\n") == 1 and output.startswith(
            f"ddp_amp: error: --dist-timeout='2': expected every rank at the rendezvous within it (rank {rank} could "
            f"not reach the store at 127.0.0.1:{port}: "), output
        assert "the store's host (rank 0) did not start" in output, output


def test_the_wire_client_speaks_torchs_store_protocol() -> None:
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    prefixed = dist.PrefixStore("p", server)
    prefixed.set("a", "from torch")
    client = WireClient("127.0.0.1", server.port, "p")
    client.set("b", b"from the wire")
    assert prefixed.get("b") == b"from the wire"
    assert client.multi_get(["a", "missing"]) == [b"from torch", b""]  # a missing key never waits
    assert client.compare_set("c", b"", b"") == b"" and prefixed.check(["c"])
    assert client.compare_set("c", b"", b"set") == b"set" and client.compare_set("c", b"", b"again") == b"set"
    assert client.add("n", 3) == 3 and prefixed.add("n", 1) == 4
    client.close()
