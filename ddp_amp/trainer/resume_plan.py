"""What a launch starts from: a fresh run or a checkpoint, decided before anything is written.

`plan_resume` resolves `--resume auto|none|PATH` against the run directory and compares the
checkpoint's saved configuration with this launch's, field by field, by the classes in
`ddp_amp.config` (must match / applied with a notice / precision / free). A refusal is a
`ConfigDrift` error listing every differing field; nothing is loaded or written before it.
`--resume none` in a directory that holds checkpoints is refused too, unless
`--archive-checkpoints` moves them aside (one atomic rename) so that no later resume of the
new run can pick them up. Rank 0 decides; every rank gets the plan or the error.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddp_amp.config import TrainConfig, flag_of, same_setting
from ddp_amp.durable import fsync_dir
from ddp_amp.errors import UsageError
from ddp_amp.session import Checkpointer, Session
from ddp_amp.trainer.resume import DATA_IDENTITY


class ConfigDrift(UsageError):
    """A resume refused because settings that must match differ; one line per field."""

    def __init__(self, checkpoint: str, differences: list[str], fields: list[str]) -> None:
        super().__init__("--resume", checkpoint, "the settings this run was saved with",
                         "resume with the saved values, start a new run (--run-dir / --run-name), or "
                         f"accept the change knowingly with --allow-change {','.join(fields)}")
        self.differences, self.fields = differences, fields
        self.args = ("\n  ".join([str(self.args[0]), *differences]),)

    def __reduce__(self) -> tuple[type[ConfigDrift], tuple[str, list[str], list[str]]]:  # type: ignore[override]  # pickled with its own arguments
        return type(self), (str(self.value), self.differences, self.fields)


@dataclass(frozen=True)
class ResumePlan:
    """Where this launch starts: a checkpoint (and its step) or a fresh run, and what changed."""

    checkpoint: Path | None
    step: int = 0
    notices: tuple[str, ...] = ()

    def describe(self) -> str:
        return f"resume from {self.checkpoint} at step {self.step}" if self.checkpoint else "fresh run"


def compare_settings(saved: Mapping[str, Any], config: TrainConfig) -> tuple[list[str], list[str], list[str]]:
    """(refused lines, their field names, notice lines) for resuming `saved` under `config`."""
    allowed = set(config.allow_change)
    now = config.to_dict()
    refused, names, noticed = [], [], []
    for field in dataclasses.fields(TrainConfig):
        kind = field.metadata["resume"]
        if kind in ("free", "precision") or field.name not in saved:
            continue
        old, new = saved[field.name], now[field.name]
        if same_setting(field.name, old, new):
            continue
        line = f"{flag_of(field.name)}: saved {old!r}, now {new!r}"
        if kind == "match" and field.name not in allowed:
            refused.append(line)
            names.append(field.name)
        else:
            noticed.append(f"{line}: the new value applies")
    return refused, names, noticed


def _warn(message: str) -> None:
    print(f"[ddp_amp] warning: {message}", file=sys.stderr, flush=True)


def _archive(root: Path) -> str:
    archived = root.with_name(f"checkpoints-archived-{time.strftime('%Y%m%d-%H%M%S')}")
    os.rename(root, archived)  # one rename: the old checkpoints are all here or all there
    fsync_dir(root.parent)
    return f"--archive-checkpoints: moved the earlier checkpoints to {archived}"


def _data_drift(meta: Any, config: TrainConfig, data_identity: str) -> list[str]:
    """The refusal line where the checkpoint's training data is not this launch's (same
    paths, other content: the task's data identity differs), unless --allow-change data."""
    saved = meta.extra.get(DATA_IDENTITY)
    if not saved or not data_identity or saved == data_identity or "data" in config.allow_change:
        return []
    return [f"--data: its content changed since the checkpoint (tokenized data {saved}, now {data_identity})"]


def _decide(config: TrainConfig, run_dir: Path, chosen: Path | None, data_identity: str) -> ResumePlan:
    root = Checkpointer.root_of(run_dir)
    if config.resume == "none":
        existing = Checkpointer.steps(root)
        if not existing:
            return ResumePlan(None)
        if not config.archive_checkpoints:
            raise UsageError("--resume", "none", "a run directory without checkpoints, for a fresh run",
                             f"{run_dir} holds {len(existing)} checkpoint(s), newest {existing[-1][1].name}; "
                             "resume them (--resume auto), start elsewhere (--run-dir / --run-name), or add "
                             "--archive-checkpoints to move them aside")
        return ResumePlan(None, notices=(_archive(root),))
    path = chosen
    if path is None:
        return ResumePlan(None)
    meta = Checkpointer.read_meta(path)
    refused, names, noticed = compare_settings(meta.config or {}, config)
    drift = _data_drift(meta, config, data_identity)
    if drift and not refused:  # the data alone: one line, as any other single refusal
        raise UsageError("--data", " ".join(config.data), f"the data {path.name} trained on",
                         f"{drift[0].removeprefix('--data: ')}; resume on that data, start a new run (--run-dir / "
                         "--run-name), or accept the change knowingly with --allow-change data")
    if drift and "data" not in names:
        refused, names = refused + drift, names + ["data"]
    if refused:
        raise ConfigDrift(str(path), refused, names)
    return ResumePlan(path, meta.step or 0, tuple(noticed))


def plan_resume(config: TrainConfig, run_dir: Path, session: Session, data_identity: str = "") -> ResumePlan:
    """Decide where this launch starts (collective: rank 0 decides, every rank learns it);
    `data_identity` is the task's (Task.data_identity), compared with the checkpoint's.

    Reads only, except `--archive-checkpoints`' rename; call it under the run's lock for
    `auto` and `none` (they look at the run directory), before the lock for a PATH.
    """
    # Found and checked by every rank, each the files it reads; then rank 0 decides with it.
    chosen = None if config.resume == "none" else \
        session.checkpointer.choose(config.resume, Checkpointer.root_of(run_dir), _warn)
    return session.on_rank_zero(lambda: _decide(config, run_dir, chosen, data_identity))
