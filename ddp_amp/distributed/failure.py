"""An error on one rank ends every rank within seconds, and its message is printed once.

A rank that fails alone (its task code raised, it ran out of memory) leaves its peers
blocked in their next collective: gloo notices a vanished peer, NCCL waits until its
timeout (`--dist-timeout`, 600 s by default). So:
- the failing rank publishes its message in the group's store (`publish_failure`) before
  it exits, and prints it, unless another rank's failure was published first (ranks that
  fail together print one line);
- every rank's heartbeat helper waits in the store for news (heartbeat.py), and its
  `watch.PeerWatch`, a thread that hears it twice a second, ends this process at once
  (exit 1) without a message of its own once another rank's failure is there, even while
  it is blocked in a collective;
- a rank that finds a peer silent (gone, or hung: liveness.py) claims the failure with
  `claim_failure`: of several ranks that find it at once, one prints the line;
- a rank whose own call failed because a peer vanished reads the store before printing
  (`published_failure`): a failure published by another rank was already shown.
The store is the per-attempt one, so a torchrun restart starts with no failure recorded.
"""

from __future__ import annotations

import json
import sys
import traceback
from types import TracebackType
from typing import Any

import torch.distributed as dist

from ddp_amp.distributed.store_keys import FAILURE_KEY, announce, failure_value

EXIT_PEER_FAILED = 1


def publish_failure(store: dist.Store | None, rank: int, message: str) -> bool:
    """Record this rank's failure for its peers unless another rank's is there already (ranks
    that fail at once, over the same bad input say, race here: one wins). True where this
    rank's is the job's failure, or nobody can be told (no store, or it is gone): then this
    rank prints it. Never raises."""
    if store is None:
        return True
    try:
        return claim_failure(store, rank, message)
    except Exception:  # noqa: BLE001 - a dead store: the peers learn from the broken group
        return True


def claim_failure(store: dist.Store, rank: int, message: str) -> bool:
    """Publish `message` as the job's failure unless one is there already, and wake every
    rank's helper with the news (store_keys.py); True where this call published it (raises
    where the store cannot be reached)."""
    value = failure_value(rank, message)  # bounded: every rank's helper reads it
    claimed = bytes(store.compare_set(FAILURE_KEY, "", value.decode())) == value
    if claimed:
        announce(store)
    return claimed


def published_failure(store: dist.Store | None) -> dict[str, Any] | None:
    """The failure a rank published, or None (also where the store cannot be reached)."""
    if store is None:
        return None
    try:
        if store.check([FAILURE_KEY]) and (raw := store.get(FAILURE_KEY)):
            return json.loads(raw)
    except Exception:  # noqa: BLE001 - a dead store tells nothing
        return None
    return None


def announce_failure(error: BaseException, store: dist.Store | None, rank: int) -> None:
    """Print this rank's error with its traceback, then publish it for the peers.

    Printed first, because a launcher may stop this process as soon as a peer ends; and
    not again if the exception reaches the top of the program (the interpreter's last
    handler skips it). Without a store (no peers) nothing is needed: Python prints it.
    """
    if store is None:
        return
    print(f"[ddp_amp rank {rank}] this rank failed; its peers are being stopped:", file=sys.stderr)
    traceback.print_exception(error, file=sys.stderr)
    sys.stderr.flush()
    previous = sys.excepthook

    def skip_this_one(kind: type[BaseException], value: BaseException, trace: TracebackType | None) -> None:
        if value is not error:
            previous(kind, value, trace)

    sys.excepthook = skip_this_one
    publish_failure(store, rank, f"rank {rank}: {type(error).__name__}: {error}")
