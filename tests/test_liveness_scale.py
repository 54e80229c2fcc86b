"""The watch at start-up and at scale: ranks that reach their loop far apart are not named,
a rank late at the rendezvous is one line, and the store client the helper speaks is torch's
protocol. The figures at 64 to 16,384 ranks: `python -m ddp_amp.bench --sections scale`."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ddp_amp import Liveness, Session
from ddp_amp.distributed import init_distributed
from ddp_amp.distributed.store_wire import WireClient
from ddp_amp.env import DistEnv
from ddp_amp.errors import UsageError
from ddp_amp.distributed.spawn import run_ranks
from tests.multiproc import free_port

# The sessions' watches judge silence at SILENCE (poll 0.5 s: 6 polls, ample on a loaded
# machine: the beats come from each rank's own helper process); the sessions start up to
# three times that apart, as 30 s is at the default 10 s: a silence clock that started
# before a rank's first beat would name the late ranks, and this test would fail.
SILENCE = Liveness(poll_s=0.5, silence_s=3.0)
SPREAD_S = 3 * SILENCE.silence_s


def _late_loop(ctx: object, world_size: int) -> tuple[int, float, bool]:
    """A user's loop whose data takes a different time to load on each rank, after the group
    formed: the Sessions start up to SPREAD_S apart, then train a few steps together."""
    from ddp_amp.distributed import DistContext

    assert isinstance(ctx, DistContext)
    time.sleep(SPREAD_S * ctx.rank / (world_size - 1))
    with Session("fp32", "cpu", liveness=SILENCE) as session:
        watch = session._watch  # the test's own look: this rank beats, and ranks 0 and 1 judge
        watched = watch is not None and watch.heart is not None and watch.judge == (ctx.rank in (0, 1))
        torch.manual_seed(0)
        model = session.setup(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(5):
            loss = model(torch.randn(6, 4)).pow(2).mean()
            session.backward(loss)
            session.step(optimizer)
            optimizer.zero_grad(set_to_none=True)
    return ctx.rank, float(loss), watched


def test_eight_ranks_whose_sessions_start_three_silences_apart_complete_and_none_is_named() -> None:
    results = run_ranks(_late_loop, 8, 8, timeout=300)
    assert [rank for rank, _, _ in results] == list(range(8))  # every rank finished; none was ended
    assert all(watched for _, _, watched in results)  # and each was watched all along


def test_a_rank_late_past_the_timeout_at_the_rendezvous_is_one_line() -> None:
    env = DistEnv(rank=0, world_size=2, local_world_size=2, master_port=free_port(), launcher="torchrun")
    with pytest.raises(UsageError, match=r"--dist-timeout.*1 of 2 ranks joined.*raise --dist-timeout") as raised:
        init_distributed(env, "cpu", "gloo", timeout_s=2.0)
    assert "\n" not in str(raised.value)


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
