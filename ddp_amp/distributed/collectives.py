"""Collectives for plain Python values, and the two ways ranks agree on an outcome.

Every function here is collective: call it on every rank, in the same order. Each is a
no-op (or a local call) for a world of one, so callers never branch on the world size.

- `on_rank_zero(work)`: rank 0 does the work (a file write, a `scontrol` call, choosing a
  checkpoint), and every rank returns its result or raises its error. No rank goes on
  believing something happened that did not, and no rank waits on a peer that failed.
- `on_every_rank(work)`: every rank does its own part (reading a checkpoint, checking it
  fits); if any rank fails, every rank raises the lowest failing rank's error, before any
  rank acts on a half-agreed state.
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def has_peers() -> bool:
    """True where a process group of more than one rank exists."""
    return dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_(tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce over the default group; a no-op for a world of one (collective)."""
    if has_peers():
        dist.all_reduce(tensor, op=op)
    return tensor


def broadcast_object(obj: T, src: int = 0) -> T:
    """Send rank `src`'s picklable object to every rank (collective); of the type of `obj`."""
    if not has_peers():
        return obj
    holder: list[Any] = [obj]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]


def all_gather_objects(obj: T) -> list[T]:
    """Every rank's picklable object, in rank order (collective); each of the type of `obj`."""
    if not has_peers():
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def agreed_origin(error: BaseException) -> int | None:
    """The rank an agreed error came from (every rank raised it together), or None."""
    return getattr(error, "ddp_amp_origin_rank", None)


def mark_agreed(error: BaseException, origin: int) -> BaseException:
    """Mark `error` as raised on every rank together, first on rank `origin`; returns it."""
    with contextlib.suppress(AttributeError):  # an exception type without a __dict__
        error.ddp_amp_origin_rank = origin  # type: ignore[attr-defined]  # an attribute of ours, set at run time
    return error


def _portable(error: BaseException) -> BaseException:
    """`error` itself if it survives pickling, else a RuntimeError that carries its text."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any pickling failure: send the text instead
        return RuntimeError(f"{type(error).__name__}: {error}")


def _outcome_bytes(work: Callable[[], Any]) -> tuple[bytes, BaseException | None]:
    """Run `work`; its pickled ("ok", result) or ("error", error), and the local error."""
    try:
        result = work()
    except Exception as error:  # noqa: BLE001 - any failure is every rank's to see
        return pickle.dumps(("error", _portable(error))), error
    try:
        return pickle.dumps(("ok", result)), None
    except Exception as error:  # noqa: BLE001 - a result the others cannot receive
        failure = RuntimeError(f"rank 0's result could not be sent to the other ranks: {error}")
        return pickle.dumps(("error", failure)), failure


def on_rank_zero(work: Callable[[], T]) -> T:
    """Run `work()` on rank 0 only; every rank returns its result or raises its error (collective).

    The result must be picklable (it is broadcast). Rank 0 re-raises its own exception
    object, with its traceback; the others raise a copy of it.
    """
    if not has_peers():
        return work()
    payload, local_error = _outcome_bytes(work) if dist.get_rank() == 0 else (b"", None)
    received = broadcast_object(payload)
    if local_error is not None:
        raise mark_agreed(local_error, 0)
    status, value = pickle.loads(received)
    if status == "error":
        raise mark_agreed(value, 0)
    return value


def on_every_rank(work: Callable[[], T]) -> T:
    """Run `work()` on every rank; if any rank fails, all raise the lowest failing rank's error.

    Collective: one all-gather of the outcomes. A rank's own failure is raised as it is;
    a rank that succeeded raises a copy of the first failure instead of returning.
    """
    local_error: BaseException | None = None
    try:
        result = work()
    except Exception as error:  # noqa: BLE001 - reported to every rank below
        local_error = error
    if local_error is not None:  # `result` is unset
        if not has_peers():
            raise local_error
        all_gather_objects(_portable(local_error))
        raise mark_agreed(local_error, dist.get_rank())
    no_failure: BaseException | None = None
    if not has_peers():
        return result
    failures = [(rank, f) for rank, f in enumerate(all_gather_objects(no_failure)) if f is not None]
    if failures:
        origin, first = failures[0]
        raise mark_agreed(first, origin)
    return result
