"""Which precision a run uses, and why: `--precision auto|fp32|bf16|fp16|fp8` resolved per device.

A `Precision` is the one object that knows what a precision means. It is the only place in
ddp_amp that enters `torch.autocast` (`Precision.autocast`: the autocast-inside-forward
wrapper, the Trainer's step and `Session.autocast` all go through it), it builds the
matching scaler, and it answers the questions other layers would otherwise ask of its name
(does it scale the loss, what do its matmuls run in, what to try when it diverges). So no
layer branches on dtype: bf16, fp8 and fp32 get a disabled scaler whose calls pass straight
through. fp8 is bf16 autocast plus float8 linear layers (float8.py), which `parallelize`
converts.

A precision is named as the command line names it (`fp16`), or, from a script, as torch
names its dtype (`float16`, `"torch.float16"`, `torch.float16`); refusals name the option
as its caller spelled it: the flag `--precision`, or `Session`'s keyword `precision`.
"""

from __future__ import annotations

import os
import threading
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ddp_amp.errors import UsageError, spelled
from ddp_amp.amp.float8 import fp8_unavailable
from ddp_amp.amp.scaler import AgreedGradScaler, scaler_options_of
from ddp_amp.torch_api import FUSED_TRANSFORMER_IGNORES_CPU_AUTOCAST, cpu_has_native_bf16, set_transformer_fastpath

PRECISION_CHOICES: tuple[str, ...] = ("auto", "fp32", "bf16", "fp16", "fp8")
PrecisionName = Literal["fp32", "bf16", "fp16", "fp8"]
_NAMES: dict[str, PrecisionName] = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16", "fp8": "fp8"}
# torch's names of the dtypes a precision computes in, as a script may spell them.
_TORCH_NAMES = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}

# fp8 autocasts to bf16: only the linear layers' matmuls run in float8.
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}
_NOTHING = nullcontext()  # reusable: nullcontext keeps no state
_THREAD = threading.local()  # this thread's reusable autocast regions (see _Region)


class _Region(torch.autocast):
    """A torch.autocast one thread enters again and again: made once, since its constructor's
    checks cost more host time than entering it does (docs/facts.md, host time). It keeps
    what it restores on exit on itself, so it is never entered twice at once: while it is
    in use, a fresh one is made instead. On a torch whose fused transformer inference path
    breaks under CPU autocast (2.4), a CPU region turns that path off while it is entered
    (process-wide: torch has no per-thread switch for it)."""

    in_use = False

    def __init__(self, device_type: str, dtype: torch.dtype, enabled: bool) -> None:
        super().__init__(device_type, dtype=dtype, enabled=enabled)
        self.fastpath_off = enabled and device_type == "cpu" and FUSED_TRANSFORMER_IGNORES_CPU_AUTOCAST
        self.fastpath_before = True

    def __enter__(self) -> _Region:
        self.in_use = True
        if self.fastpath_off:
            self.fastpath_before = set_transformer_fastpath(False)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> bool:
        self.in_use = False
        try:
            return super().__exit__(*exc)
        finally:
            if self.fastpath_off:
                set_transformer_fastpath(self.fastpath_before)


def _region(device_type: str, dtype: torch.dtype, enabled: bool) -> AbstractContextManager[Any]:
    """This thread's reusable region for (device_type, dtype, enabled), or a fresh one where it is in use."""
    regions: dict[tuple[str, torch.dtype, bool], _Region] | None = getattr(_THREAD, "regions", None)
    if regions is None:
        regions = _THREAD.regions = {}
    key = (device_type, dtype, enabled)
    region = regions.get(key)
    if region is None:
        region = regions[key] = _Region(device_type, dtype=dtype, enabled=enabled)
    elif region.in_use:  # entered again from inside itself (another state in between)
        return torch.autocast(device_type, dtype=dtype, enabled=enabled)
    return region


@dataclass(frozen=True)
class Precision:
    """A resolved precision: the name, the device type it runs on and why it was chosen."""

    name: PrecisionName
    device_type: str
    reason: str = ""
    emulate_fp8: bool = False  # fp8 through ordinary matmuls (any device; slow)

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.name]

    @property
    def autocast_enabled(self) -> bool:
        return self.name != "fp32"

    @property
    def uses_loss_scaling(self) -> bool:
        # bf16 has fp32's exponent range, so its gradients do not underflow: no scaling.
        return self.name == "fp16"

    @property
    def float8_linears(self) -> bool:
        return self.name == "fp8"

    def autocast(self) -> AbstractContextManager[Any]:
        """This precision's autocast for the calling thread (autocast state is thread-local).

        Where the thread already runs in exactly this state (the Trainer enters it around
        forward and loss, and the wrapper's forward inside asks again), or where fp32 runs
        outside any autocast region, a shared no-op context comes back: entering autocast,
        even a disabled one, costs host time on every call (docs/facts.md, host time).
        """
        enabled = self.name != "fp32"
        if torch.is_autocast_enabled(self.device_type):
            if enabled and torch.get_autocast_dtype(self.device_type) == _DTYPES[self.name]:
                return _NOTHING
        elif not enabled:
            return _NOTHING
        return _region(self.device_type, _DTYPES[self.name], enabled)

    def matmul_kind(self, capability: tuple[int, int] | None = None) -> str:
        """What the model's matmuls run in, the key of a device's peak rate: fp8, bf16, fp16,
        or for fp32, tf32 where torch runs fp32 matmuls as TF32: its flag is set
        (`torch.backends.cuda.matmul.allow_tf32`, or `set_float32_matmul_precision("high")`)
        and the GPU has TF32 units (NVIDIA compute capability 8.0 or later, `capability`
        or the current GPU's; on ROCm only with HIPBLASLT_ALLOW_TF32=1 as well)."""
        if self.name != "fp32" or self.device_type != "cuda" or not torch.backends.cuda.matmul.allow_tf32:
            return self.name
        if torch.version.hip is not None:
            return "tf32" if os.environ.get("HIPBLASLT_ALLOW_TF32") == "1" else "fp32"
        return "tf32" if (capability or torch.cuda.get_device_capability()) >= (8, 0) else "fp32"

    @property
    def divergence_advice(self) -> str:
        """What to try when a run in this precision goes non-finite (the guards' hint)."""
        if self.uses_loss_scaling:
            return ("Try --precision bf16 (fp32's exponent range, no loss scaling), a lower --lr, "
                    "or --clip-grad-norm 1.0.")
        return "Try a lower --lr or --clip-grad-norm 1.0."

    def make_scaler(self, **scaler_options: float | int) -> AgreedGradScaler:
        """The run's one scaler: rank-agreeing under fp16, a pass-through otherwise.

        `scaler_options`: any of `AgreedGradScaler`'s init_scale, growth_factor, backoff_factor,
        growth_interval, hysteresis and min_scale."""
        return AgreedGradScaler(self.device_type, enabled=self.uses_loss_scaling,
                                **scaler_options_of(scaler_options))


def as_precision_name(name: str) -> PrecisionName:
    """`name` as a resolved precision's name (not "auto"); ValueError for anything else."""
    try:
        return _NAMES[name]
    except KeyError:
        raise ValueError(f"not a precision name: {name!r} (one of {', '.join(_NAMES)})") from None


def _autocast_honours(device_type: str, dtype: torch.dtype) -> bool:
    """Run one tiny matmul under autocast and see whether it came out in `dtype`."""
    try:
        a = torch.ones(2, 2, device=device_type)
        with torch.autocast(device_type, dtype=dtype):
            return torch.mm(a, a).dtype == dtype
    except (RuntimeError, ValueError):
        return False


def _resolve_auto(device: torch.device) -> Precision:
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return Precision("bf16", "cuda", "auto: this GPU has bf16 units")
        return Precision("fp16", "cuda", "auto: this GPU lacks bf16, fp16 with loss scaling")
    if device.type == "cpu" and cpu_has_native_bf16():
        return Precision("bf16", "cpu", "auto: this CPU has native bf16 units (AVX512-BF16/AMX)")
    return Precision("fp32", device.type,
                     "auto: fp32, because this CPU has no native bf16/fp16 units and low "
                     "precision would run many times slower; ask for --precision bf16/fp16 to force it")


def precision_choice(value: str | torch.dtype, name: str = "--precision") -> str:
    """`value` as one of PRECISION_CHOICES: ddp_amp's own names, or torch's for the dtype
    (`float16`, `half`, `bfloat16`, `float32`, `float`, with or without `torch.`, or the
    `torch.dtype` itself); else a one-line UsageError naming option `name`."""
    text = str(value) if isinstance(value, torch.dtype) else value
    if isinstance(text, str):
        bare = text.removeprefix("torch.")
        if text in PRECISION_CHOICES:
            return text
        if bare in _TORCH_NAMES:
            return _TORCH_NAMES[bare]
    raise UsageError(name, value, "one of " + ", ".join(PRECISION_CHOICES) + " (or torch's float32, bfloat16, "
                     "float16)", "fp16 and bf16 are the mixed-precision modes; auto picks per device")


def resolve_precision(choice: str | torch.dtype, device: torch.device, emulate_fp8: bool = False,
                      name: str = "--precision") -> Precision:
    """Turn a precision choice (`precision_choice`'s spellings) into a `Precision` for
    `device`, or raise with a hint; messages call the option `name`.

    `emulate_fp8` lets fp8 run on any device through torchao's emulation (for tests).
    """
    choice = precision_choice(choice, name)
    if choice == "auto":
        return _resolve_auto(device)
    if choice == "fp32":
        return Precision("fp32", device.type, "requested")
    if choice == "fp8":
        return _resolve_fp8(device, emulate_fp8, name)
    dtype = _DTYPES[choice]
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported(
            including_emulation=False):
        raise UsageError(name, choice, "a GPU with bf16 support (Ampere or newer)",
                         f"use {spelled(name, 'fp16')} on this GPU")
    if not _autocast_honours(device.type, dtype):
        raise UsageError(name, choice, f"a device whose autocast supports {choice}",
                         f"{device.type} cannot run {choice} autocast; use {spelled(name, 'fp32')} or auto")
    reason = "requested"
    if device.type == "cpu" and not cpu_has_native_bf16():
        reason = "requested; this CPU has no native low-precision units, expect it to be slow"
    return Precision(as_precision_name(choice), device.type, reason)


def _resolve_fp8(device: torch.device, emulate: bool, name: str) -> Precision:
    why_not = fp8_unavailable(device, emulate)
    if why_not is not None:
        raise UsageError(name, "fp8", "a GPU with float8 matmuls and torchao installed", why_not)
    if not _autocast_honours(device.type, torch.bfloat16):
        raise UsageError(name, "fp8", "a device whose autocast supports bf16",
                         f"{device.type} cannot run bf16 autocast; use {spelled(name, 'fp32')}")
    reason = "requested; emulated float8 matmuls (slow)" if emulate else "requested; float8 matmuls"
    return Precision("fp8", device.type, reason, emulate_fp8=emulate)
