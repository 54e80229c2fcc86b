"""The .safetensors reader that reads and never maps: every dtype, slices along any dimension,
scalars and empty tensors equal what safetensors' own reader gives; a damaged file is refused
from its header with why."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ddp_amp.hf.safetensors_file import NotSafetensors, read_header, read_slice

TENSORS = {
    "f32": torch.randn(6, 5, 4), "bf16": torch.randn(7, 3).bfloat16(), "f16": torch.randn(4).half(),
    "i64": torch.arange(12).reshape(3, 4), "bool": torch.rand(5, 2) > 0.5, "u8": torch.arange(9, dtype=torch.uint8),
    "f8": torch.randn(4, 4).to(torch.float8_e4m3fn), "scalar": torch.tensor(3.5), "empty": torch.zeros(0, 3),
}


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def test_slices_and_dtypes_equal_safetensors_own_reader(tmp_path: Path) -> None:
    path = tmp_path / "all.safetensors"
    save_file(TENSORS, str(path))
    header = read_header(path)
    regions = {"f32": (slice(1, 4), slice(2, 5), slice(0, 4)), "bf16": (slice(2, 7), slice(1, 2)),
               "i64": (slice(0, 3), slice(1, 3)), "bool": (slice(4, 5), slice(0, 2)), "f16": (slice(3, 3),)}
    fd = os.open(path, os.O_RDONLY)
    try:
        with safe_open(str(path), framework="pt") as opened:
            for name, tensor in TENSORS.items():
                assert header[name].shape == tuple(tensor.shape) and header[name].dtype == tensor.dtype
                whole = read_slice(fd, header[name])
                assert whole.dtype == tensor.dtype and whole.shape == tensor.shape, name
                assert torch.equal(_bytes(whole), _bytes(opened.get_tensor(name))), name  # float8 has no equal()
                if name in regions:
                    part = read_slice(fd, header[name], regions[name])
                    assert torch.equal(part, opened.get_slice(name)[regions[name]]), name
    finally:
        os.close(fd)


def test_a_damaged_file_is_refused_from_its_header_with_why(tmp_path: Path) -> None:
    path = tmp_path / "whole.safetensors"
    save_file({"w": torch.randn(64, 64)}, str(path))
    data = path.read_bytes()
    cases = {"truncated": (data[:-100], "truncated"), "tiny": (data[:5], "shorter than a safetensors header"),
             "pickle": (b"PK\x03\x04" + data[4:], "PyTorch pickle"), "garbled": (data[:8] + b"x" * 50 + data[58:],
                                                                               "not JSON")}
    for name, (content, reason) in cases.items():
        bad = tmp_path / f"{name}.safetensors"
        bad.write_bytes(content)
        with pytest.raises(NotSafetensors, match=reason):
            read_header(bad)
