"""Every rank arrives at a collective call, or the ones that did learn it within seconds.

`save` is collective. Called on rank 0 alone (the `if master_process: save(...)` of many
scripts), its first collective would wait for the whole process-group timeout (600 s by
default) and then end in a transport error that says nothing of the cause. So before its
first collective, each rank counts itself in the group's store, with a deadline of its own,
short and separate from the group's: the last to arrive opens the round and everyone goes
on; a rank still alone at the deadline raises one `UsageError` that says the call is
collective. Nothing goes through the process group meanwhile, so the ranks that did not
call it are not caught in a mismatched collective; they learn the failure from the watch
once the raising rank leaves its session.

The rounds are numbered by one counter per call name in the store, so every call of that
name on every rank counts, in order: the n-th arrival of every rank is the n-th round. A
waiting rank asks the store, with a growing pause between asks, whether its round opened:
one small request per rank per pause, and no timeout warnings from the store's client.
"""

from __future__ import annotations

import time

import torch.distributed as dist

from ddp_amp.errors import UsageError

_FIRST_PAUSE_S, _LONGEST_PAUSE_S = 0.002, 0.25


def all_arrive(store: dist.Store | None, world_size: int, what: str, deadline_s: float) -> None:
    """Return once every rank called this for `what` as often as this rank has (collective,
    through the store only); raise a one-line UsageError if they do not within `deadline_s`."""
    if store is None or world_size <= 1:
        return
    counter = f"ddp_amp/arrivals/{what}"
    arrived = store.add(counter, 1)
    round_ = (arrived - 1) // world_size
    opened = f"{counter}/round-{round_}"
    if arrived % world_size == 0:  # the last of this round
        store.set(opened, "1")
        return
    deadline = time.monotonic() + deadline_s
    pause = _FIRST_PAUSE_S
    while not store.check([opened]):
        if time.monotonic() >= deadline:
            came = min(store.add(counter, 0) - round_ * world_size, world_size)
            raise UsageError(what, f"called by {came} of {world_size} ranks within {deadline_s:g} s",
                             "a call on every rank",
                             f"{what} is collective: call it on every rank (rank 0 writes), "
                             "not under `if session.is_main:`")
        time.sleep(pause)
        pause = min(pause * 2, _LONGEST_PAUSE_S)
