"""`--precision fp8`: bf16 autocast plus float8 matmuls in the linear layers, through torchao.

torchao's `Float8Linear` (the optional extra `ddp_amp[fp8]`) replaces each `nn.Linear` and
keeps its weight and bias as the very same fp32 Parameters; the three matmuls of a layer's
forward and backward cast their operands to float8 with dynamic per-tensor scales. The rest
of the model runs under bf16 autocast, so bf16's exponent range holds and no loss scaling is
needed. The state dict keeps the plain layer's names and dtypes: a checkpoint loads into the
unconverted model. Hardware float8 matmuls need compute capability 8.9 or newer (Ada,
Hopper); torchao's emulation runs the same casts through ordinary matmuls on any device,
which is how the CPU tests exercise this path.
"""

from __future__ import annotations

import importlib.util
import logging

import torch
from torch import nn

MIN_CAPABILITY = (8, 9)
# float8 matmuls (torch._scaled_mm) need both dimensions of a weight divisible by 16.
ALIGNMENT = 16


def fp8_unavailable(device: torch.device, emulate: bool) -> str | None:
    """Why fp8 training cannot run on `device`, as a hint for the user; None where it can."""
    if importlib.util.find_spec("torchao") is None:
        return "torchao is not installed: pip install 'ddp_amp[fp8]'"
    if emulate:
        return None
    if device.type != "cuda":
        return (f"the {device.type} has no float8 matmul units; fp8 needs a CUDA GPU of compute "
                "capability 8.9+ (Ada, Hopper), or --fp8-emulate to test the path slowly")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < MIN_CAPABILITY:
        return (f"this GPU is compute capability {major}.{minor}; float8 matmuls need 8.9+ (Ada, "
                "Hopper): use --precision bf16")
    return None


def _convertible(module: nn.Module, _name: str) -> bool:
    return (isinstance(module, nn.Linear) and module.in_features % ALIGNMENT == 0
            and module.out_features % ALIGNMENT == 0)


def convert_linears(model: nn.Module, emulate: bool = False) -> nn.Module:
    """Swap `model`'s aligned `nn.Linear` layers for torchao's `Float8Linear`, in place.

    Returns the model (a new object only where `model` itself is a Linear). Layers whose
    dimensions are not multiples of 16 stay as they are, in bf16.
    """
    _import_torchao_quietly()
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    return convert_to_float8_training(model, module_filter_fn=_convertible,
                                      config=Float8LinearConfig(emulate=emulate))


def _import_torchao_quietly() -> None:
    """Import torchao without its warnings about kernel libraries this path does not use.

    torchao tries to load its own CUDA kernel libraries at import and logs a warning for
    each one that does not match the installed torch (every one, on a CPU build); float8
    training needs none of them (it uses torch's float8 matmul and torch.compile).
    """
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        import torchao.float8  # noqa: F401  # imported only to see that it loads
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)

