"""Reading a sharded checkpoint without running pickled code.

DCP keeps its map of the shards (`sharded/.metadata`) as a plain pickle, and its own reader
loads it with `pickle.load`: a checkpoint from elsewhere could run code the moment it is
resumed or exported. `SafeShardReader` reads that map with an unpickler that rebuilds only
the classes such a map is made of (DCP's metadata dataclasses, `torch.Size`, dtypes,
layouts, paths); anything else is refused, unexecuted, in one line. The shards' tensors are
raw bytes, and the non-tensor entries DCP pickles beside them (an optimizer's param_groups)
go through `torch.load(weights_only=True)` in DCP itself.
"""

from __future__ import annotations

import pathlib
import pickle
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata

from ddp_amp.errors import UsageError
from ddp_amp.torch_api import DCP_PICKLED_GLOBALS, dcp_metadata_path

# (module, name) pairs a DCP map is made of, as written by torch 2.13 (every global its
# pickles were seen to name, for replicated and sharded models and optimizers alike).
_ALLOWED: dict[tuple[str, str], Any] = {
    **{(dcp_metadata.__name__, cls.__name__): cls for cls in (
        dcp_metadata.Metadata, dcp_metadata.TensorStorageMetadata, dcp_metadata.ChunkStorageMetadata,
        dcp_metadata.BytesStorageMetadata, dcp_metadata.TensorProperties, dcp_metadata.MetadataIndex,
        dcp_metadata.StorageMeta)},
    **DCP_PICKLED_GLOBALS,
    ("torch", "Size"): torch.Size,
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib", "WindowsPath"): pathlib.WindowsPath,
}


class _MapUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get((module, name))
        if found is None and module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            found = getattr(torch, name)
        if found is None:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's map")
        return found


class SafeShardReader(dcp.FileSystemReader):
    """DCP's file reader, whose map of the shards is read with the restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        path = dcp_metadata_path(self, kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            try:
                metadata = _MapUnpickler(stream).load()
            except (pickle.UnpicklingError, AttributeError, TypeError) as error:
                raise UsageError("checkpoint file", str(path), "DCP's map of the shards (metadata only)",
                                 f"it holds other pickled objects or code, refused unexecuted "
                                 f"({str(error).splitlines()[0][:200]}); only resume from checkpoints you "
                                 "trust, saved by ddp_amp") from None
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise UsageError("checkpoint file", str(path), "DCP's map of the shards",
                             f"it holds a {type(metadata).__name__}; the checkpoint is not one ddp_amp wrote")
        if metadata.storage_meta is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
