"""`meta.json`: what a checkpoint says about itself, as one typed record, read and written here.

A resume checks it before it loads any tensor: who saved it and with how many ranks, the
versions, the precision and the scaler's skipped-step count, which files hold modules and
which hold per-rank values, which entries are DCP shards; the Trainer adds the step, its
batch geometry, the optimizer class and the run's configuration. Keys a caller adds of its
own (`Session.save(meta=...)`) are kept in `extra`, written beside the others.

Every field may be missing from a checkpoint written by older code, so each one is optional
here and its reader says what a missing value means (`None`: not recorded).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddp_amp.errors import UsageError

META_FILE = "meta.json"


@dataclass(frozen=True)
class Meta:
    """The contents of one checkpoint's meta.json."""

    saved_by: str | None = None  # "ddp_amp" (a Session.save) or "ddp_amp.Trainer"
    world_size: int | None = None  # ranks that saved it
    ddp_amp_version: str | None = None
    torch_version: str | None = None
    precision: str | None = None  # the Precision's name, e.g. "fp16"
    loss_scaling: bool | None = None  # whether the scaler was enabled
    scaler_skipped_total: int | None = None  # optimizer steps the scaler skipped, all told
    # Keys saved as a module file of their own (model.pt), and keys saved per rank; None:
    # written before meta.json listed them (then the Trainer's model, and data and task_state).
    modules: tuple[str, ...] | None = None
    per_rank: tuple[str, ...] | None = None
    sharded: tuple[str, ...] = ()  # keys saved as DCP shards under sharded/
    # The Trainer's: where a resume starts and what it checks before loading.
    step: int | None = None
    micro_batch_size: int | None = None
    # The data-parallel ranks the data position is a position over; None: written where every
    # rank was data parallel (then it is world_size).
    dp_size: int | None = None
    batches_per_epoch: int | None = None
    optimizer_class: str | None = None  # "AdamW", or "SGD+Adam" for several
    config: dict[str, Any] | None = None  # the run's TrainConfig, as a dict
    extra: dict[str, Any] = field(default_factory=dict)  # the caller's own keys

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Meta:
        """A record from meta.json's object (or a caller's mapping): known keys become fields,
        typed; the rest go to `extra`."""
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        values: dict[str, Any] = {key: raw[key] for key in known if key in raw and raw[key] is not None}
        for key in ("world_size", "scaler_skipped_total", "step", "micro_batch_size", "dp_size",
                    "batches_per_epoch"):
            if key in values:
                try:
                    values[key] = int(values[key])
                except (TypeError, ValueError):
                    raise ValueError(f"{key} is {values[key]!r}, not an integer") from None
        for key in ("modules", "per_rank", "sharded"):
            if key in values:
                values[key] = tuple(str(item) for item in values[key])
        if "loss_scaling" in values:
            values["loss_scaling"] = bool(values["loss_scaling"])
        if "config" in values and not isinstance(values["config"], dict):
            values.pop("config")  # not a configuration this code wrote
        extra = {key: value for key, value in raw.items() if key not in known and key != "extra"}
        return cls(**values, extra=extra)

    def to_dict(self) -> dict[str, Any]:
        """meta.json's object: every recorded field and `extra`. A field at its default stays
        out, so a record laid over another (`merged`) never blanks what that one holds."""
        out: dict[str, Any] = dict(self.extra)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "extra" or value is None or value == f.default:
                continue
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    def merged(self, more: Mapping[str, Any]) -> Meta:
        """This record with the keys of `more` laid over it (a caller's description)."""
        return Meta.from_dict({**self.to_dict(), **more})

    def encode(self) -> bytes:
        """The bytes of meta.json."""
        return (json.dumps(self.to_dict(), indent=2, sort_keys=True, default=str) + "\n").encode()


def read_meta(path: Path, what: str = "--resume") -> Meta:
    """Checkpoint `path`'s meta.json; UsageError where it cannot be read (no collectives)."""
    try:
        raw = json.loads((path / META_FILE).read_text())
        if not isinstance(raw, dict):
            raise TypeError("not a JSON object")
        return Meta.from_dict(raw)
    except (OSError, ValueError, TypeError) as error:
        raise UsageError(what, str(path), f"a checkpoint directory with a readable {META_FILE}",
                         f"it could not be read ({error}); every rank must see it (shared "
                         "filesystem)") from None
