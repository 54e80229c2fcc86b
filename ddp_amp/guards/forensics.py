"""Overflow forensics: after fp16 steps were skipped, which rank's gradients went non-finite, and where.

What "local" means here. Under DDP each rank's gradients are all-reduced during backward,
and one rank's inf becomes everyone's (inf + x = inf). The scaler's found-inf flags are
computed after that reduction, so every rank sees the same non-finite values and the flag
cannot say where they came from. A rank's own gradient is visible in one place: as
autograd accumulates it into `.grad`, before DDP's own hook copies it into a bucket to
reduce. `OverflowProbe` checks it there, with a post-accumulate-grad hook per parameter.

After every hook the user registered. A parameter's post-accumulate-grad hooks run in the
order they were registered, all before DDP's hook (DDP's sits on the gradient's accumulator
node, whose own hooks run after the accumulation and the tensor's hooks). Registered when
the probe arms and left there, the check would run before any user hook registered after
that (one registered on every step, say) and miss the NaN such a hook writes. So each armed
parameter also gets a gradient hook, which autograd runs as the gradient arrives, before
accumulating it: it moves the check to the end of the parameter's post-accumulate-grad
hooks, the order autograd reads just after. The check then sees `.grad` after every user
hook registered before this parameter's gradient arrived, whenever that was.
Limits: a post-accumulate-grad hook registered in the middle of a backward, after this
parameter's gradient arrived (by another hook), runs after the check in that backward;
and hooks put on the accumulator node itself rather than on the tensor run after all the
tensor's hooks, so after the check: a NaN they write is skipped but not named.

Cost. Nothing while disarmed: no hook at all, and DDP keeps its built-in C++ all-reduce
(a Python comm hook costs several times the built-in one's host time: docs/facts.md, "Host
time on the hot path").
The watch arms the probe when it first sees skipped steps (at a check step), and disarms
it after `ARMED_FOR` steps with no new skip. While armed, each parameter's gradient gets one sum
and a flag per step (and the move of its check: two Python hook calls per parameter and
backward); the flags are read only when an overflow is reported.

So the first skips a run sees are reported without a rank (nothing checked their local
gradients yet); skips while armed name the ranks and parameters exactly. Without a
process group the gradients are local anyway: the watch scans `.grad` at the check step
when that step was skipped (`scan_grads`), which names them at once.

Sharded (`--shard`), no hook sees a rank's own gradient: autograd accumulates into the
gathered parameter, and what lands in the shard's `.grad` is already the reduce-scatter's
sum over ranks. So the probe never arms; the watch scans each rank's gradient shards at a
check step that was skipped, which names the parameters but not the rank whose data made
the inf.
"""

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ddp_amp.distributed import all_gather_objects, local_part
from ddp_amp.torch_api import DTensor

ARMED_FOR = 200  # steps the probe stays armed after the last check that saw new skips


def _nonfinite(tensor: torch.Tensor) -> torch.Tensor:
    """0-d bool tensor: does `tensor` hold any inf/NaN (no host sync)."""
    return torch.isfinite(tensor).logical_not().any()


def _moves_last(check: RemovableHandle) -> Callable[[torch.Tensor], None]:
    """A gradient hook that moves the post-accumulate-grad hook `check` after all others of its tensor.

    Autograd calls a tensor's gradient hooks before it accumulates the gradient, and its
    post-accumulate-grad hooks after, in the order of their dict at that time: moved to the
    end there, `check` runs after every hook registered so far, its own registration time
    notwithstanding.
    """
    def move(grad: torch.Tensor) -> None:
        hooks = check.hooks_dict_ref()
        if hooks is not None and check.id in hooks:
            hooks[check.id] = hooks.pop(check.id)
    return move


def _sum_nonfinite(tensor: torch.Tensor) -> torch.Tensor:
    """0-d bool tensor, cheap: is the sum of `tensor` inf/NaN (no host sync).

    Any inf/NaN element makes the sum non-finite. One reduction pass with no temporary,
    where `isfinite(t).any()` writes a bool tensor as large as `t` and reads it again: on a
    CPU many times cheaper (docs/facts.md, "A sum finds inf/NaN"). It can also fire for
    finite values whose sum exceeds fp32's range; the exact check confirms before a name is
    reported.
    """
    return torch.isfinite(tensor.float().sum()).logical_not()


class OverflowProbe:
    """Per-rank record of non-finite local gradients while armed, reported collectively."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], rank: int, max_names: int = 5) -> None:
        self.rank = rank
        self.sharded = any(isinstance(p, DTensor) for _, p in named_params)
        self.max_names = max_names
        self._params = named_params
        self._handles: list[RemovableHandle] = []
        self._reset()

    def _reset(self) -> None:
        self._bad_names: list[str] = []
        self._flags: dict[str, torch.Tensor] = {}  # name -> non-finite seen (device, read at report)
        self._checked = False

    @property
    def armed(self) -> bool:
        return bool(self._handles)

    def arm(self) -> None:
        """Check every parameter's local gradient from the next backward on, after the user's hooks."""
        if self.armed:
            return
        for name, param in self._params:
            check = param.register_post_accumulate_grad_hook(
                lambda p, name=name: self._check(name, p))
            self._handles += [check, param.register_hook(_moves_last(check))]

    def disarm(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _check(self, name: str, param: nn.Parameter) -> None:
        self._checked = True
        if param.grad is None:
            return
        bad = _sum_nonfinite(param.grad)
        previous = self._flags.get(name)
        self._flags[name] = bad if previous is None else previous | bad

    def _note(self, pairs: Any) -> None:
        """Exact check of each (name, gradient): remember the first bad names."""
        for name, grad in pairs:
            if (grad is not None and _nonfinite(grad).item() and name not in self._bad_names
                    and len(self._bad_names) < self.max_names):
                self._bad_names.append(name)

    def scan_grads(self) -> None:
        """Check `.grad` of every parameter now: the local gradients where none were reduced
        (one process). Call after a skip is known, before `zero_grad`."""
        self._checked = True
        self._note([(name, None if p.grad is None else local_part(p.grad)) for name, p in self._params])

    def _local_summary(self) -> dict[str, Any]:
        if self._flags:  # one host read of all the flags, at report time only
            flagged = torch.stack(list(self._flags.values())).tolist()
            for name, bad in zip(self._flags, flagged):
                if bad and name not in self._bad_names and len(self._bad_names) < self.max_names:
                    self._bad_names.append(name)
        return {"rank": self.rank, "checked": self._checked, "nonfinite": bool(self._bad_names),
                "params": list(self._bad_names)}

    def report(self, step: int, skipped: int) -> dict[str, Any]:
        """Gather every rank's findings since the last report into one record (collective)."""
        gathered = all_gather_objects(self._local_summary())
        self._reset()
        ranks = [g["rank"] for g in gathered if g["nonfinite"]]
        return {
            "event": "overflow",
            "step": step,
            "skipped": skipped,
            "checked": all(g["checked"] for g in gathered),
            "ranks": ranks,
            "params": {str(g["rank"]): g["params"] for g in gathered if g["nonfinite"]},
            **({"sharded": True} if self.sharded else {}),
        }


def describe(record: dict[str, Any]) -> str:
    """One log line for an overflow record."""
    if record.get("sharded") and record.get("checked", True):
        names = sorted({name for names in record["params"].values() for name in names})
        source = (f"non-finite gradients in {', '.join(names)} (sharded: after the reduction over ranks, so "
                  "which rank's data made them is not known)" if names else
                  "no gradient shard was non-finite at the check step")
    elif record.get("sharded"):
        source = "sharded: gradients are scanned at a check step that skipped, and none of these did"
    elif not record.get("checked", True):
        source = ("local gradients not checked yet: the check arms when skips are first seen and "
                  "names the rank and parameters of the skips after it")
    elif record["ranks"]:
        where = "; ".join(f"rank {r}: {', '.join(record['params'].get(str(r), [])) or '?'}"
                          for r in record["ranks"])
        source = f"non-finite local gradients on rank(s) {record['ranks']} ({where})"
    else:
        source = ("no rank's local gradients were non-finite before the reduction; the overflow "
                  "arose in or after it (or in parameters outside DDP)")
    return (f"step {record['step']}: {record['skipped']} skipped step(s) since the last report; "
            f"{source}")
