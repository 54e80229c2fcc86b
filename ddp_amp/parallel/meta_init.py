"""Building a model to shard without ever holding it whole: `build_sharded(factory, slot)`.

Under `--shard` each rank keeps 1/S of every parameter (`Shard(0)`: the rows
`torch.chunk(full, S)[index]`). Building the model first in full fp32 on every rank, as a
plain `factory()` does, needs the whole model's bytes on each rank before sharding starts:
8 ranks of a 70B model would need 280 GB of host memory each. Here the factory runs with
every parameter replaced, as it is registered, by a `_Slice`: a tensor that reports the
full shape, dtype and a CPU device (so init code that checks `is_meta` still runs) but
stores only this rank's rows. Writes into it are carried out on those rows:

- the parameter whose init code is running is the build's current one: in-place ops on it
  act on its full values, so init code may read them (truncated normal, a padding row
  zeroed) while it runs; once the next parameter's init starts, it keeps its rows only;
- `uniform_`, `normal_`, `fill_` and `zero_` compute the rows alone, drawing random ones
  piece by piece (`row_draws`): the random stream is consumed exactly as by an unsharded
  build, so the result equals `factory()`'s under the same seed, slice for slice, and no
  parameter is ever held in full for them. Init code that then reads the full values gets
  them made again from the generator state the fill started from;
- other random fills (`bernoulli_`, ...) draw the full tensor (one parameter, never the
  model) and keep the rows;
- element-wise in-place ops with scalar arguments (`mul_`, `clamp_`, `erfinv_`, ...) on a
  parameter no longer current act on its rows alone;
- `copy_` from a real tensor of the full shape copies its rows (orthogonal and other inits
  that compute a full value first);
- `clone` and aliases of the whole parameter (`detach`, `view` to its own shape) are
  `_Slice`s too (`copy.deepcopy` of a layer, `nn.TransformerEncoder`'s clones).

Anything else that writes into a parameter (a write into one row or column, an in-place op
with a tensor argument) cannot be reproduced on a slice and is refused in one line naming
the parameter and the op; reads of values (a parameter's `sum()`) give shape-only meta
tensors, so a value derived from one can only reach a parameter through a refused write.
Buffers are built for real (they are small, and computed, like rotary frequencies).

After the build the parameters are meta tensors (`fully_shard` shards those without
memory) and the slices wait, keyed by the parameter's name, for `materialize` to copy them
into the shards once the model is sharded. Rows and full tensors live in memory mappings of
their own (`host_pages`), so what is freed goes back to the system at once: a rank's peak
is what it holds, about 1.1 x its share of a 1B Llama (docs/benchmarks.md).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ddp_amp.errors import UsageError
from ddp_amp.parallel.host_pages import mapped_copy, mapped_empty, mapped_zeros
from ddp_amp.parallel.init_skip import PlanDiverged, skip_plan
from ddp_amp.parallel.row_draws import FILLS, pieces_exact
from ddp_amp.parallel.shard_rows import BuildValues, ShardSlot, SlotBuild
from ddp_amp.torch_api import DTensor, disabled_torch_function_impl, make_wrapper_subclass, tree_map

log = logging.getLogger(__name__)

# In-place ops that overwrite every element without reading it: they may start on a parameter
# whose other ranks' rows are gone.
_OVERWRITES = {"uniform_", "normal_", "bernoulli_", "exponential_", "cauchy_", "log_normal_", "geometric_",
               "random_", "fill_", "zero_"}
# Element-wise in-place ops: each element's new value depends on that element (and scalars) only,
# so a rank's rows suffice.
_ELEMENTWISE = {"fill_", "zero_", "mul_", "div_", "add_", "sub_", "clamp_", "clamp_min_", "clamp_max_",
                "erfinv_", "neg_", "abs_", "sqrt_", "exp_", "log_", "tanh_", "sigmoid_", "pow_", "reciprocal_",
                "sign_", "floor_", "ceil_", "round_", "trunc_", "fmod_", "remainder_"}
# Ops that make a new tensor from another's shape and dtype only (init code's scratch tensors).
_LIKE = {"new_empty", "new_zeros", "new_ones", "new_full", "new_empty_strided", "empty_like", "zeros_like",
         "ones_like", "full_like", "rand_like", "randn_like", "randint_like"}
# Ops whose result is the tensor itself when its shape is unchanged (same storage).
_ALIASES = {"detach", "alias", "view", "_unsafe_view", "view_as", "reshape", "expand", "lift_fresh"}


class _Slice(torch.Tensor):
    """A parameter during the build: the full tensor's metadata (CPU, not meta, so init code
    that skips meta tensors still runs), values in a `BuildValues`."""

    held: BuildValues

    @staticmethod
    def __new__(cls, shape: torch.Size, dtype: torch.dtype, values: BuildValues) -> _Slice:
        made = make_wrapper_subclass(cls, shape, dtype=dtype, device=torch.device("cpu"))
        made.held = values
        return made

    def __repr__(self) -> str:  # type: ignore[override]  # no values to print
        return f"_Slice({self.held.label}, shape={tuple(self.shape)})"

    __torch_function__ = disabled_torch_function_impl  # type: ignore[assignment]  # dispatch level only

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple[Any, ...] = (),  # type: ignore[override]
                           kwargs: dict[str, Any] | None = None) -> Any:  # (torch's own subclasses' signature)
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        target = args[0] if args and isinstance(args[0], _Slice) else None
        if target is not None and name.endswith("_"):
            return target._write(func, name, args, kwargs)
        if func._schema.is_mutable and isinstance(kwargs.get("out"), _Slice):
            raise _cannot(kwargs["out"].held.label, f"{func} writes into it through out=")
        if target is not None and name == "clone" and not target.held.part:
            return _Slice(target.shape, target.dtype, target.held.copied())
        if target is not None and name in _ALIASES and _result_shape(func, args, kwargs) == target.shape:
            return _Slice(target.shape, target.dtype, target.held)
        if target is not None and not _in_full(target) and _returns_alias(func):
            shape = _result_shape(func, args, kwargs)
            return _Slice(shape, target.dtype, BuildValues(target.held.build, target.held.rows, target.held.label,
                                                           part=True, skipped=target.held.skipped,
                                                           slot=target.held.slot))
        if name in _LIKE:
            return func(*tree_map(_shape_only, args), **tree_map(_shape_only, kwargs))
        if all(_in_full(a) for a in _flat(args, kwargs)):
            # Reads of the tensor being initialised: computed for real, on its full values.
            return func(*tree_map(_full, args), **tree_map(_full, kwargs))
        # Reads of values no longer held in full: shapes only. A value computed so can reach
        # a parameter only through a write, which refuses a meta source.
        return func(*tree_map(_as_meta, args), **tree_map(_as_meta, kwargs))

    def _write(self, func: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Slice:
        values = self.held
        if values.skipped:
            return self  # the load that follows overwrites it
        if values.part:
            raise _cannot(values.label, f"{func} writes into a part of it (a row, a column) after other "
                          "parameters were initialised")
        rest = _flat(args[1:], kwargs)
        if name == "copy_":
            source = args[1]
            if not (isinstance(source, torch.Tensor) and source.shape == self.shape and _in_full(source)
                    and not source.is_meta):
                raise _cannot(values.label, "copy_ from a value computed from other parameters, or of another "
                              f"shape ({tuple(getattr(source, 'shape', ()))})")
            values.start_full(self.shape, self.dtype).copy_(_full(source))
            return self
        if _fills_rows_alone(func, name, self.dtype, rest):
            values.fill_rows(func, args[1:], kwargs, self.shape, self.dtype)
            return self
        if name in _OVERWRITES and all(_in_full(a) for a in rest):
            func(values.start_full(self.shape, self.dtype), *tree_map(_full, args[1:]), **tree_map(_full, kwargs))
            return self
        if _in_full(self) and all(_in_full(a) for a in rest):
            func(_full(self), *tree_map(_full, args[1:]), **tree_map(_full, kwargs))
            return self
        if name in _ELEMENTWISE and not any(isinstance(a, torch.Tensor) and (a.dim() or a.is_meta) for a in rest):
            func(values.rows, *tree_map(_full, args[1:]), **tree_map(_full, kwargs))
            return self
        raise _cannot(values.label, f"{func} reads values of it that this rank no longer holds in full "
                      "(initialise each parameter in one go)")


def _flat(args: Any, kwargs: Any = None) -> list[Any]:
    found: list[Any] = []
    tree_map(found.append, (args, kwargs))
    return found


def _fills_rows_alone(func: Any, name: str, dtype: torch.dtype, rest: list[Any]) -> bool:
    """Whether the write overwrites every element with values that need no other tensor: a
    constant, or a random fill whose pieces are drawn as the whole is (row_draws.py)."""
    if any(isinstance(a, _Slice) or (isinstance(a, torch.Tensor) and (a.dim() or a.is_meta)) for a in rest):
        return False
    return name in ("fill_", "zero_") or (name in FILLS and pieces_exact(func, dtype))


def _in_full(value: Any) -> bool:
    """Whether `value` has real values here: not a `_Slice`, or the one whose init code is
    running (held in full, or a fill it can make again)."""
    return not isinstance(value, _Slice) or value.held.full is not None or value.held.fill is not None


def _full(value: Any) -> Any:
    if isinstance(value, _Slice):
        return value.held.full_values(value.shape, value.dtype)
    return value


def _shape_only(value: Any) -> Any:
    """A `_Slice` as a real tensor of its shape and dtype that holds one element (not a copy)."""
    if isinstance(value, _Slice):
        return torch.empty((), dtype=value.dtype).expand(value.shape)
    return value


def _returns_alias(func: Any) -> bool:
    """Whether `func` returns a view of its input (a row, a transpose)."""
    returns = func._schema.returns
    return bool(returns) and returns[0].alias_info is not None


def _result_shape(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Size:
    return func(*tree_map(_as_meta, args), **tree_map(_as_meta, kwargs)).shape


def _as_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and not value.is_meta:
        return torch.empty(value.shape, dtype=value.dtype, device="meta")
    if isinstance(value, torch.device) and value.type == "cpu":
        return torch.device("meta")
    return value


def _cannot(label: str, why: str) -> UsageError:
    return UsageError("model init on the meta device", label, "an init each shard can replay (random fills, "
                      "element-wise ops, copies of whole tensors)", f"{why}; initialise it with torch.nn.init on the "
                      "whole parameter, or load weights with --init-weights, or drop --shard")


# The shards' rows of the models built here, until `materialize`: model -> {parameter name: rows}.
_PENDING: weakref.WeakKeyDictionary[nn.Module, dict[str, torch.Tensor]] = weakref.WeakKeyDictionary()


def build_sharded(factory: Callable[[], nn.Module], slot: ShardSlot,
                  overwritten: Collection[str] = frozenset(), slots: Sequence[ShardSlot] | None = None,
                  named: Mapping[str, ShardSlot] | None = None) -> nn.Module:
    """`factory()` with this rank's rows of each parameter only; see the module's docstring.
    `overwritten`: names of parameters the caller fills right after (pretrained weights):
    their init is not drawn, where the build can tell which they are (init_skip.py).
    `slots`: a slot per registration, in order (a split model's parameters, each cut along
    its own dimension), `slot` for any past them; `named`: the slot of each name in the
    model, for parameters held whole while building (a registration no name keeps, as a
    layer that `nn.TransformerEncoder` copies: the copies are cut once the model is built).

    The returned model's parameters are on the meta device until `materialize`, after sharding."""
    plan = skip_plan(factory, overwritten) if overwritten else None
    if plan is not None:
        stream = torch.get_rng_state()
        try:
            return _build(factory, SlotBuild(slot, plan, slots), frozenset(overwritten), named)
        except (PlanDiverged, UsageError) as error:
            log.warning("every parameter's init is drawn after all: leaving those --init-weights fills "
                        "uninitialised did not hold (%s)", error)
            torch.set_rng_state(stream)
    return _build(factory, SlotBuild(slot, slots=slots), frozenset(), named)


def build_whole(factory: Callable[[], nn.Module], overwritten: Collection[str] = frozenset()) -> nn.Module:
    """`factory()`, drawing no init for the `overwritten` parameters where the build can tell
    which they are: built as the one slot that holds every row, whose rows then become the
    parameters. Init code a slot cannot replay gets a plain `factory()` instead."""
    if not overwritten or skip_plan(factory, overwritten) is None:
        return factory()
    stream = torch.get_rng_state()
    try:
        model = build_sharded(factory, ShardSlot(1, 0), overwritten)
    except UsageError:
        torch.set_rng_state(stream)
        return factory()
    rows = _PENDING.pop(model)
    made: dict[int, nn.Parameter] = {}  # a tied weight is one parameter under each of its names
    for module_name, module in model.named_modules(remove_duplicate=False):
        for name, param in list(module._parameters.items()):
            if param is not None and id(param) not in made:
                whole = rows[f"{module_name}.{name}" if module_name else name].clone()  # out of its mapping
                made[id(param)] = nn.Parameter(whole, requires_grad=param.requires_grad)
            if param is not None:
                module._parameters[name] = made[id(param)]
    return model


def _build(factory: Callable[[], nn.Module], build: SlotBuild, overwritten: frozenset[str],
           named: Mapping[str, ShardSlot] | None = None) -> nn.Module:
    handle = nn.modules.module.register_module_parameter_registration_hook(
        lambda module, name, param: _as_slice(build, module, name, param))  # type: ignore[arg-type]  # a hook may return the parameter to register instead
    try:
        model = factory()
    except RuntimeError as error:
        if "meta" not in str(error):
            raise
        # An init that needs values this rank no longer holds (a parameter's .item(), say).
        raise _cannot("the model", "its init reads a value of a parameter no longer held in full ("
                      f"{str(error).splitlines()[0]})") from None
    finally:
        handle.remove()
    build.finish()
    if not isinstance(model, nn.Module):
        raise UsageError("Task.build_model", type(model).__name__, "a function returning a torch.nn.Module",
                         "return the model from build_model")
    _PENDING[model] = _to_meta(model, overwritten, named or {})
    return model


def _as_slice(build: SlotBuild, module: nn.Module, name: str, param: nn.Parameter | None) -> nn.Parameter | None:
    """The parameter-registration hook: a new parameter becomes a `_Slice` of this rank's rows."""
    if param is None:
        return None
    index, build.registered = build.registered, build.registered + 1
    skipped = build.plan is not None and build.plan.skips(index, param.shape)
    if isinstance(param, _Slice):
        return None  # one already sliced (a tied weight registered again)
    slot = build.slot_for(index)
    shape = slot.rows(torch.empty(param.shape, device="meta")).shape
    if skipped:  # none needed: the load fills them
        rows = mapped_zeros(shape, param.dtype)
    elif param.is_meta:  # made on the meta device by the model itself: no values yet, as a plain build
        rows = mapped_empty(shape, param.dtype)
    else:
        rows = mapped_copy(slot.rows(param.detach().to("cpu")))
    values = BuildValues(build, rows, f"{type(module).__name__}.{name}", skipped=skipped, slot=slot)
    return nn.Parameter(_Slice(param.shape, param.dtype, values), requires_grad=param.requires_grad)


def _to_meta(model: nn.Module, overwritten: frozenset[str], named: Mapping[str, ShardSlot]) -> dict[str, torch.Tensor]:
    """Swap every `_Slice` parameter for a meta one (the same object under each of its names);
    return the rows by parameter name, a whole one cut by its name's slot in `named`. One left
    uninitialised must be `overwritten`."""
    rows: dict[str, torch.Tensor] = {}
    swapped: dict[int, nn.Parameter] = {}
    uncovered: dict[int, str] = {}  # parameters left uninitialised, by identity
    loaded: set[int] = set()  # those of them the load fills
    for module_name, module in model.named_modules(remove_duplicate=False):
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if not isinstance(param, _Slice):
                raise _cannot(f"{type(module).__name__}.{name}", "it was set without registering it "
                              "(module._parameters written directly)")
            if id(param) not in swapped:
                swapped[id(param)] = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"),
                                                  requires_grad=param.requires_grad)
            module._parameters[name] = swapped[id(param)]
            full_name = f"{module_name}.{name}" if module_name else name
            if param.held.skipped:
                uncovered.setdefault(id(param), full_name)
                loaded.update({id(param)} if full_name in overwritten else set())
            rows[full_name] = param.held.rows
            slot = named.get(full_name)
            if slot is not None and rows[full_name].shape == param.shape != slot.rows(torch.empty(
                    param.shape, device="meta")).shape:  # held whole while building: cut now
                rows[full_name] = mapped_copy(slot.rows(rows[full_name]))
        for name, buffer in module._buffers.items():
            if buffer is not None and (buffer.is_meta or isinstance(buffer, _Slice)):
                raise _cannot(f"{type(module).__name__}.{name}", "this buffer was computed from a parameter's "
                              "values, which are not known while building")
    for identity, name in uncovered.items():
        if identity not in loaded:  # under none of its names (a tied weight has several)
            raise PlanDiverged(f"{name} was left uninitialised, and is not loaded")
    return rows


def is_built_sharded(model: nn.Module) -> bool:
    """Whether `model` came from `build_sharded` and waits for `materialize`."""
    return model in _PENDING


def materialize(model: nn.Module, device: torch.device, built: nn.Module | None = None) -> None:
    """Give each meta parameter of the sharded `model` storage on `device` and this rank's rows
    (`built`: the module `build_sharded` returned, where `model` is what it became, e.g. float8's).

    Module by module, so that no more than one module's shards are held twice."""
    rows = _PENDING.pop(built if built is not None else model)
    for module_name, module in model.named_modules():
        if not any(p.is_meta for p in module.parameters(recurse=False)):
            continue
        buffers = dict(module._buffers)
        module.to_empty(device=device, recurse=False)
        module._buffers.update(buffers)  # to_empty emptied them too: they were built for real
        for name, param in module.named_parameters(recurse=False):
            local = param.to_local() if isinstance(param, DTensor) else param
            mine = rows.pop(f"{module_name}.{name}" if module_name else name)
            if local.shape != mine.shape:
                raise RuntimeError(f"{module_name}.{name}: the shard holds {tuple(local.shape)}, the build made "
                                   f"{tuple(mine.shape)} (a sharding other than Shard(0) over the slot's ranks)")
            with torch.no_grad():
                local.copy_(mine)
