"""Which parameters a sharded build leaves uninitialised: those a load overwrites next.

`--init-weights` fills parameters from pretrained files right after the build, so drawing
their random init first is wasted work: for a 1B Llama on 4 ranks it was most of the time
to the first step. `meta_init.build_sharded` is told the names the load fills
(`overwritten`), but a parameter is registered inside its module's constructor, before
anything knows its name in the model. So the factory first runs on the meta device (no
memory, no random numbers drawn: `meta_model`), recording each parameter in the order it is
registered; the names each ends up with in the model say which registrations to leave
uninitialised (`SkipPlan`): those the load fills, and those the model does not keep (a
head's own weight before it is tied to the embedding).

The real build registers the same parameters in the same order. Where it does not (a
shape differs at some registration), or a kept parameter's values came from one left
uninitialised while the load does not fill it, the plan does not hold (`PlanDiverged`):
the build is done again, drawing everything, so a parameter the load leaves alone is
always initialised as its init code says. A skipped draw does not advance the random
stream, so the parameters that are drawn get other values than in a build that draws all.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
from torch import nn


class PlanDiverged(Exception):
    """The build did not register the parameters the meta build did: draw everything instead."""


@dataclass(frozen=True)
class SkipPlan:
    """Per registration, in order: the parameter's shape, and whether its init is skipped."""

    shapes: tuple[torch.Size, ...]
    skipped: tuple[bool, ...]

    def skips(self, index: int, shape: torch.Size) -> bool:
        """Whether registration `index` (of a parameter of `shape`) is left uninitialised."""
        if index >= len(self.shapes) or self.shapes[index] != shape:
            raise PlanDiverged(f"registration {index}: {tuple(shape)}")
        return self.skipped[index]


def meta_model(factory: Callable[[], nn.Module], registered: list[nn.Parameter] | None = None,
               owners: list[nn.Module] | None = None) -> nn.Module | None:
    """`factory()` built on the meta device (names and shapes, no values, the random stream
    untouched), appending each parameter registered to `registered` (and the module it was
    registered on to `owners`); None where the factory cannot build there (init code that
    needs values)."""
    handle = None

    def record(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and registered is not None:
            registered.append(param)
            if owners is not None:
                owners.append(module)

    if registered is not None:
        handle = nn.modules.module.register_module_parameter_registration_hook(record)
    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            model = factory()
    except Exception:  # noqa: BLE001 - any failure means the same: no names before the real build
        return None
    finally:
        if handle is not None:
            handle.remove()
    return model if isinstance(model, nn.Module) else None


def skip_plan(factory: Callable[[], nn.Module], overwritten: Collection[str]) -> SkipPlan | None:
    """The registrations of `factory`'s parameters to leave uninitialised (see the module's
    docstring); None where none would be or the factory cannot build on the meta device."""
    registered: list[nn.Parameter] = []
    model = meta_model(factory, registered)
    if model is None:
        return None
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    wanted = set(overwritten)
    skipped = tuple(not names.get(id(param)) or any(name in wanted for name in names[id(param)])
                    for param in registered)
    if not any(skipped):
        return None
    return SkipPlan(tuple(param.shape for param in registered), skipped)
