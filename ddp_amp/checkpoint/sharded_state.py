"""The sharded part of a session's state: what a checkpoint writes with torch.distributed.checkpoint
(each rank its shards), and how it comes back, onto any number of ranks, sharded or not.

A state entry is sharded when it is a sharded model (FSDP2), or an optimizer (or a list of
them) over such a model's parameters. Both are written in DCP's form, keyed by parameter
name (`get_model_state_dict` / `get_optimizer_state_dict` of the user's module, so the
names are the model's own, as in `model.pt`). Loading asks the live objects for the same
form, lets DCP fill it (resharding where the world size differs) and puts it back; that
works for a replicated model too, so a sharded checkpoint resumes without `--shard`. The
other way round, a replicated checkpoint's full state dicts are put into a sharded model
and optimizer here (`restore_full`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from ddp_amp.amp import unwrap_model
from ddp_amp.distributed import is_sharded
from ddp_amp.errors import UsageError
from ddp_amp.checkpoint.layout import keeping_kernels
from ddp_amp.torch_api import DTensor

_FULL = StateDictOptions(full_state_dict=True)


def _optimizers(value: Any) -> list[torch.optim.Optimizer] | None:
    if isinstance(value, torch.optim.Optimizer):
        return [value]
    if isinstance(value, (list, tuple)) and value and all(isinstance(item, torch.optim.Optimizer) for item in value):
        return list(value)
    return None


def _params(optimizers: Sequence[torch.optim.Optimizer]) -> list[torch.Tensor]:
    return [p for optimizer in optimizers for group in optimizer.param_groups for p in group["params"]]


def owner(optimizers: Sequence[torch.optim.Optimizer], state: Mapping[str, Any]) -> nn.Module | None:
    """The user's module among `state`'s models whose parameters these optimizers step."""
    wanted = {id(p) for p in _params(optimizers)}
    for value in state.values():
        if isinstance(value, nn.Module) and wanted <= {id(p) for p in unwrap_model(value).parameters()}:
            return unwrap_model(value)
    return None


def sharded_keys(state: Mapping[str, Any]) -> list[str]:
    """The entries of `state` a checkpoint writes sharded: sharded models and their optimizers."""
    keys = []
    for key, value in state.items():
        optimizers = _optimizers(value)
        if ((isinstance(value, nn.Module) and is_sharded(unwrap_model(value)))
                or (optimizers and any(isinstance(p, DTensor) for p in _params(optimizers)))):
            keys.append(key)
    return sorted(keys)


def dcp_form(state: Mapping[str, Any], keys: Sequence[str]) -> dict[str, Any]:
    """`state`'s entries `keys` in DCP's form, by parameter name: what is saved, and the
    template a load fills (collective for a sharded model)."""
    form: dict[str, Any] = {}
    for key in keys:
        value = state[key]
        optimizers = _optimizers(value)
        if optimizers is None:
            form[key] = get_model_state_dict(unwrap_model(value))
            continue
        model = owner(optimizers, state)
        if model is None:
            raise UsageError("state key", key, "an optimizer saved or loaded beside its model",
                             "put the model it steps into the same state, e.g. {'model': model, 'optimizer': opt}")
        form[key] = get_optimizer_state_dict(model, optimizers)
    return form


def put_back(state: Mapping[str, Any], form: Mapping[str, Any]) -> None:
    """Put a filled `dcp_form` into the live objects of `state` (collective for a sharded model)."""
    for key, loaded in form.items():
        value = state[key]
        optimizers = _optimizers(value)
        if optimizers is None:
            set_model_state_dict(unwrap_model(value), loaded)
        else:
            model = owner(optimizers, state)
            if model is None:  # dcp_form, which made `form`, refuses this first
                raise UsageError("state key", key, "an optimizer saved or loaded beside its model",
                                 "put the model it steps into the same state, e.g. {'model': model, 'optimizer': opt}")
            keeping_kernels(optimizers, partial(set_optimizer_state_dict, model, optimizers, loaded))


def restore_full(state: Mapping[str, Any], key: str, saved: Any) -> None:
    """Put a replicated checkpoint's full state of `key` into a sharded model or optimizer."""
    value = state[key]
    optimizers = _optimizers(value)
    if optimizers is None:
        set_model_state_dict(unwrap_model(value), dict(saved), options=_FULL)
        return
    model = owner(optimizers, state)
    if model is None:
        raise UsageError("state key", key, "an optimizer loaded beside its model",
                         "put the model it steps into the same state, e.g. {'model': model, 'optimizer': opt}")
    saved_list = saved if len(optimizers) > 1 else [saved]
    if not any(isinstance(value, torch.Tensor) and value.dim() for state_dict in saved_list
               for per_param in state_dict["state"].values() for value in per_param.values()):
        # Nothing per parameter to shard (SGD without momentum): torch's own load does it,
        # where the by-name load finds no tensor to learn the device from and refuses.
        for optimizer, state_dict in zip(optimizers, saved_list, strict=True):
            keeping_kernels([optimizer], partial(optimizer.load_state_dict, state_dict))
        return
    keeping_kernels(optimizers, lambda: set_optimizer_state_dict(model, optimizers, _by_name(saved_list, optimizers,
                                                                                              model), options=_FULL))


def _by_name(saved: Sequence[dict[str, Any]], optimizers: Sequence[torch.optim.Optimizer],
             model: nn.Module) -> dict[str, Any]:
    """Optimizer state dicts keyed by parameter index (torch's own form, what a replicated
    run saved) in the by-name form: the i-th index is the live optimizers' i-th parameter."""
    names = {id(p): name for name, p in model.named_parameters()}
    merged: dict[str, Any] = {"state": {}, "param_groups": []}
    for optimizer, state_dict in zip(optimizers, saved, strict=True):
        order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
        merged["state"].update({order[int(index)]: value for index, value in state_dict["state"].items()})
        merged["param_groups"] += [{**group, "params": [order[int(i)] for i in group["params"]]}
                                   for group in state_dict["param_groups"]]
    return merged
