"""The one line that names silent ranks, bounded whatever the world size.

The line is printed once for the job, stored in the group's store as the job's failure and
read from there by every rank's heartbeat helper, and copied into torchrun's error file of
the ranks it names. Listing every rank it concerns made it grow with the world: 15-74 KB at
16,384 ranks for a few hundred scattered silent ranks, read by 16,384 helpers through the
store's one thread. So a line names at most NAMED_SPANS runs of ranks and then how many more,
and gives at most STEP_GROUPS distinct steps: a few hundred bytes at any world size.
"""

from __future__ import annotations

from collections.abc import Iterable

NAMED_SPANS = 4  # runs of consecutive ranks a line names before "and N more"
STEP_GROUPS = 3  # distinct steps a line gives before "older (N ranks)"


def _spans(ordered: list[int]) -> list[tuple[int, int]]:
    spans: list[tuple[int, int]] = []
    for rank in ordered:
        if spans and rank == spans[-1][1] + 1:
            spans[-1] = (spans[-1][0], rank)
        else:
            spans.append((rank, rank))
    return spans


def rank_list(ranks: Iterable[int], limit: int = NAMED_SPANS) -> str:
    """'rank 3', 'ranks 0-2, 5': contiguous ranks as ranges; past `limit` ranges, how many
    ranks more ('ranks 3, 17, 250, 301 and 462 more')."""
    ordered = sorted(set(ranks))
    spans = _spans(ordered)
    text = ", ".join(str(start) if start == end else f"{start}-{end}" for start, end in spans[:limit])
    rest = sum(end - start + 1 for start, end in spans[limit:])
    if rest:
        text += f" and {rest:,} more"
    return ("rank " if len(ordered) == 1 else "ranks ") + text


def steps_of(ranks: Iterable[int], steps: dict[int, int | None]) -> str:
    """'step 12', or 'steps 12 (ranks 0-2), 11 (rank 3)' newest first; 'no step yet' for a
    rank that had finished none; past STEP_GROUPS steps, how many ranks are at older ones."""
    by_step: dict[int, list[int]] = {}
    for rank in ranks:
        step = steps.get(rank)
        by_step.setdefault(-1 if step is None else step, []).append(rank)
    if len(by_step) == 1:
        step = next(iter(by_step))
        return "no step yet" if step < 0 else f"step {step}"
    ordered = sorted(by_step.items(), reverse=True)
    parts = [f"{'none yet' if step < 0 else step} ({rank_list(group)})" for step, group in ordered[:STEP_GROUPS]]
    older = sum(len(group) for _, group in ordered[STEP_GROUPS:])
    if older:
        parts.append(f"older or none yet ({older:,} ranks)")
    return "steps " + ", ".join(parts)


def silent_line(gone: list[int], stalled: list[int], steps: dict[int, int | None],
                absent: list[int] | None = None) -> str:
    """The one line that names the silent ranks, the last step of every rank, and the causes.

    `steps`: every rank's last step as this rank knows it (a peer's as of its last heartbeat);
    `absent`: ranks that never beat (named only once a collective timed out).
    """
    absent = absent or []
    parts = []
    if gone:
        parts.append(f"{rank_list(gone)} went silent (last heard at {steps_of(gone, steps)}): "
                     f"{'its process' if len(gone) == 1 else 'their processes'} ended or stopped without an "
                     "error of its own (killed, e.g. by the OOM killer or kill -9, or its node was lost)")
    if stalled:
        parts.append(f"{rank_list(stalled)} made no progress since {steps_of(stalled, steps)}: alive, but never "
                     "joined the collective that timed out (--dist-timeout) on the others (a hang in its own "
                     "code or I/O: data loading, a file system, a deadlock)")
    if absent:
        parts.append(f"{rank_list(absent)} never arrived: no heartbeat since the group formed (its process did not "
                     "start, or ended before it joined: see its own output)")
    named = {*gone, *stalled, *absent}
    others = [rank for rank in steps if rank not in named]
    if others:
        parts.append(f"the other ranks reached {steps_of(others, steps)}")
    return "ddp_amp: " + "; ".join(parts)
