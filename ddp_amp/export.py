"""Export a checkpoint's model weights to safetensors: `python -m ddp_amp.export SOURCE --to FILE`.

    python -m ddp_amp.export runs/x --to model.safetensors           # newest complete checkpoint
    python -m ddp_amp.export runs/x --best --to best.safetensors     # the --keep-best one
    python -m ddp_amp.export runs/x/checkpoints/step-00000400 --to model.safetensors
    python -m ddp_amp.export runs/x --to hf-model/ --hf        # a Hugging Face model directory

SOURCE is a run directory (the checkpoint `--resume auto` would pick: the newest whose
manifest verifies), its `checkpoints/` folder (or any folder of `step-N` checkpoints a
`Session.save` loop wrote), or one checkpoint directory (verified here). What is written is
one module's file of the checkpoint's layout (`model.pt`, or `--module NAME`'s), the user's
module's state dict, so

    model.load_state_dict(safetensors.torch.load_file("model.safetensors"), strict=True)

fills a plain `nn.Module` of the task. Tensors that share storage (tied weights) are written
once per name, so every name the module expects is in the file; non-tensor entries
(`_extra_state`) cannot be stored in safetensors and are left out, with a note. The
metadata holds the step, the run's precision, the task and the ddp_amp version. The file
appears whole or not at all (temporary file, fsync, rename); an existing one is replaced
only with `--force`. Needs safetensors: `pip install 'ddp_amp[export]'`.
With `--hf` the output is a directory `transformers`' `from_pretrained` loads: the run's
transformers config (recorded at its start in `hf_config.json`, or `--hf-config`) as
`config.json`, and the weights as safetensors files of at most `--max-shard-size` with their
index, a tied weight once (ddp_amp/hf/weights_out.py).
Exit codes: 0 done, 2 bad input, a refused checkpoint or safetensors missing (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ddp_amp.checkpoint import (IncompleteCheckpoint, Meta, checkpoint_root, complete_copy, list_step_dirs,
                                module_file, read_best, read_checkpoint, read_meta, resolve_resume, sharded_tensors,
                                verify_checkpoint)
from ddp_amp.errors import UsageError
from ddp_amp.fast_exit import exit_process
from ddp_amp.hf import (ExportedTensors, check_hf_output, export_config, parse_size, require_safetensors,
                        run_hf_config, run_hf_files, storable_tensors, tied_once, unsharded_architectures,
                        write_hf_directory, write_safetensors)
from ddp_amp.version import __version__

SOURCE = "RUN_DIR_OR_CHECKPOINT"
RUN_CONFIG = "config.json"  # every run directory gets one at its start


# -- which checkpoint ------------------------------------------------------------------


def _refused(path: Path, reason: IncompleteCheckpoint | str) -> UsageError:
    return UsageError(SOURCE, str(path), "a committed checkpoint whose files match its manifest.json",
                      f"{reason}; export another step-N, or the run directory to take its newest "
                      "complete checkpoint")


def _verified(path: Path) -> Path:
    """`path` once its manifest checks out (sizes and sha256), else a UsageError naming why."""
    try:
        verify_checkpoint(path)
    except IncompleteCheckpoint as reason:
        raise _refused(path, reason) from None
    return path


def _checkpoints_folder(source: Path) -> Path | None:
    """The folder of `step-N` directories that `source` stands for, if it is a run or that folder."""
    if checkpoint_root(source).is_dir():
        return checkpoint_root(source)
    if list_step_dirs(source):
        return source
    return None


def _best_checkpoint(root: Path, warn: Callable[[str], None]) -> Path:
    """The checkpoint `--keep-best` recorded under `root`, verified."""
    record = read_best(root)
    if record is None:
        raise UsageError("--best", str(root), "a run trained with --keep-best (checkpoints/best.json)",
                         "drop --best to export the newest checkpoint")
    found = complete_copy(record.directory(root), warn)  # a crash mid-re-save may have set it aside
    if found is None:
        raise UsageError("--best", str(record.directory(root)),
                         f"the best checkpoint ({record.metric}={record.value:g} at step {record.step}), "
                         "complete", "it is missing or failed its manifest check (see the warning); "
                         "export the run without --best, or another step-N")
    return found


def locate_checkpoint(source: Path, best: bool, warn: Callable[[str], None]) -> Path:
    """The verified checkpoint directory that `source` (and `--best`) names; UsageError if none."""
    if not source.exists():
        raise UsageError(SOURCE, str(source), "an existing run directory or checkpoint directory",
                         "pass a training run's --run-dir, or one of its checkpoints/step-N")
    if source.is_file():
        raise UsageError(SOURCE, str(source), "a directory, not a file",
                         "pass the step-N directory that holds it, or the run directory")
    root = _checkpoints_folder(source)
    if root is None and (source / RUN_CONFIG).is_file():
        raise UsageError(SOURCE, str(source), "a run with a complete checkpoint",
                         "this run has no checkpoints/ yet: it stopped before its first save")
    if root is None:  # not a run: it must be one checkpoint
        if best:
            raise UsageError("--best", str(source), "a run directory (its checkpoints/best.json names "
                             "the best checkpoint)", "drop --best to export this checkpoint")
        return _verified(source)
    if best:
        return _best_checkpoint(root, warn)
    chosen = resolve_resume("auto", root, warn)  # the very choice a resume makes
    if chosen is None:
        raise UsageError(SOURCE, str(source), "a run with a complete checkpoint",
                         f"no step-N under {root} passed its manifest check (see the warnings)")
    return chosen


# -- what goes into the file -----------------------------------------------------------


def export_metadata(meta: Meta, step: int, exported: ExportedTensors) -> dict[str, str]:
    """safetensors metadata (string -> string): where the weights came from."""
    config: Mapping[str, Any] = meta.config or {}
    metadata = {
        "format": "pt",  # what Hugging Face loaders look for in a PyTorch safetensors file
        "step": str(step),
        "precision": str(meta.precision or "unknown"),
        "task": str(config.get("task", "unknown")),
        "ddp_amp_version": __version__,
        "checkpoint_ddp_amp_version": str(meta.ddp_amp_version or "unknown"),
    }
    if exported.shared:
        metadata["shared_tensors"] = json.dumps(exported.shared, sort_keys=True)
    if exported.skipped:
        metadata["skipped_entries"] = json.dumps(exported.skipped)
    return metadata


def chosen_module(path: Path, meta: Meta, module: str | None) -> str:
    """Which module of checkpoint `path` to export: `module`, else its only one (or `model`)."""
    saved = list(meta.modules) if meta.modules is not None else ["model"]  # before meta.json listed them
    if module is None and ("model" in saved or len(saved) == 1):
        module = "model" if "model" in saved else saved[0]
    present = module in meta.sharded or (module is not None and (path / module_file(module)).is_file())
    if module is None or module not in saved or not present:
        hint = (f"name one with --module ({', '.join(saved)})" if saved else
                "it holds no module: a Session.save of a model (state {'model': model}) writes one")
        raise UsageError("--module" if module else SOURCE, module or str(path),
                         "a module the checkpoint holds", hint)
    return module


def read_model_state(path: Path, module: str | None = None) -> tuple[dict[str, Any], Meta, int]:
    """(a module's state dict, meta.json, step) of verified checkpoint `path`; a sharded module's
    shards are put together here, in this process."""
    try:
        meta = read_meta(path, what=SOURCE)
        key = chosen_module(path, meta, module)
        if key in meta.sharded:
            state: Any = sharded_tensors(path, key)
        else:
            state = read_checkpoint(path, [module_file(key)], what=SOURCE).files[module_file(key)]
    except (OSError, RuntimeError, KeyError, ValueError, TypeError) as error:
        raise UsageError(SOURCE, str(path), "a readable ddp_amp checkpoint",
                         f"{type(error).__name__}: {error}"[:300]) from None
    if not isinstance(state, Mapping) or not all(isinstance(name, str) for name in state):
        raise UsageError(SOURCE, str(path / module_file(key)), "a state dict (names -> tensors)",
                         f"it holds a {type(state).__name__}; was it written by ddp_amp?")
    return dict(state), meta, _step_of(path, meta)


def _step_of(path: Path, meta: Meta) -> int:
    """The optimizer step the checkpoint was taken at: meta.json's, else the manifest's."""
    step: Any = meta.step
    if step is None:
        step = verify_checkpoint(path, check_hashes=False).get("step", 0)  # sizes only: hashed already
    try:
        return int(step)
    except (TypeError, ValueError):
        raise UsageError(SOURCE, str(path), "a checkpoint whose meta.json holds an integer step",
                         f"it holds {step!r}; was it written by ddp_amp?") from None


# -- the output ------------------------------------------------------------------------


def check_output(path: Path, force: bool) -> None:
    """Refuse a directory, and an existing file unless `force`: nothing of the user's is lost."""
    if path.is_dir():
        raise UsageError("--to", str(path), "a file path, not a directory",
                         f"name the file, e.g. --to {path / 'model.safetensors'}")
    if path.exists() and not force:
        raise UsageError("--to", str(path), "a path with no file yet",
                         "pass --force to replace it, or choose another --to")


# -- the command -----------------------------------------------------------------------


def _note(message: str) -> None:
    print(f"ddp_amp: {message}", file=sys.stderr, flush=True)


def _size(count: int) -> str:
    return f"{count / 2**20:.1f} MiB" if count >= 2**20 else f"{count / 2**10:.1f} KiB"


def _describe_changes(exported: ExportedTensors) -> None:
    if exported.shared:
        pairs = ", ".join(f"{name} = {owner}" for name, owner in exported.shared.items())
        _note(f"note: tensors sharing storage written as separate copies ({pairs}); "
              "loading fills each name with the same values")
    if exported.skipped:
        _note(f"note: left out {len(exported.skipped)} non-tensor entr{'y' if len(exported.skipped) == 1 else 'ies'} "
              f"({', '.join(exported.skipped)}): safetensors stores tensors only; a module that "
              "defines get_extra_state needs strict=False or that state from elsewhere")


def export_hf(source: Path, output: Path, *, best: bool = False, force: bool = False, module: str | None = None,
              max_shard_size: str = "5GB", hf_config: Path | None = None) -> Path:
    """Write the checkpoint `source` names as a Hugging Face model directory `output`; returns that checkpoint."""
    backend = require_safetensors()
    max_bytes = parse_size(max_shard_size)
    check_hf_output(output, force)  # before reading gigabytes only to be refused
    checkpoint = locate_checkpoint(source, best, lambda message: _note(f"warning: {message}"))
    recorded = run_hf_config(checkpoint) or {}
    config = export_config(checkpoint, hf_config, recorded)
    state, meta, step = read_model_state(checkpoint, module)
    if chosen_module(checkpoint, meta, module) in meta.sharded and hf_config is None:
        config["architectures"] = unsharded_architectures(config)
    tensors = tied_once(storable_tensors(state), recorded)
    files = write_hf_directory(output, tensors, config, max_bytes, backend, force, run_hf_files(checkpoint))
    print(f"ddp_amp: exported step {step} of {checkpoint} ({len(tensors)} tensors in {len(files)} "
          f"file{'s' if len(files) > 1 else ''}) as a Hugging Face model directory {output}", flush=True)
    return checkpoint


def export(source: Path, output: Path, *, best: bool = False, force: bool = False,
           module: str | None = None) -> Path:
    """Write the weights of the checkpoint `source` names to `output`; returns that checkpoint."""
    backend = require_safetensors()  # before reading gigabytes only to fail
    check_output(output, force)
    checkpoint = locate_checkpoint(source, best, lambda message: _note(f"warning: {message}"))
    state, meta, step = read_model_state(checkpoint, module)
    exported = storable_tensors(state)
    _describe_changes(exported)
    size = write_safetensors(output, exported, export_metadata(meta, step, exported), backend)
    print(f"ddp_amp: exported step {step} of {checkpoint} ({len(exported.tensors)} tensors, "
          f"{_size(size)}) to {output}", flush=True)
    return checkpoint


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddp_amp.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("source", metavar=SOURCE, type=Path,
                        help="a run directory (its newest complete checkpoint) or one checkpoints/step-N")
    parser.add_argument("--to", required=True, type=Path, metavar="FILE",
                        help="the .safetensors file to write (with --hf: the model directory)")
    parser.add_argument("--hf", action="store_true",
                        help="write a Hugging Face model directory (config.json, safetensors files and their "
                        "index) that transformers' from_pretrained loads, for a run of a transformers model")
    parser.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                        help="with --hf: the largest weights file (default: %(default)s)")
    parser.add_argument("--hf-config", type=Path, default=None, metavar="PATH",
                        help="with --hf: the config.json to write (or a directory with one), instead of the "
                        "one the run recorded")
    parser.add_argument("--best", action="store_true",
                        help="export the checkpoint --keep-best kept (checkpoints/best.json) instead")
    parser.add_argument("--force", action="store_true", help="replace FILE if it exists")
    parser.add_argument("--module", default=None, metavar="NAME",
                        help="which module of the checkpoint, by its key in the saved state (default: "
                        "'model', or its only one)")
    args = parser.parse_args(argv)
    try:
        if args.hf:
            export_hf(args.source, args.to, best=args.best, force=args.force, module=args.module,
                      max_shard_size=args.max_shard_size, hf_config=args.hf_config)
        else:
            export(args.source, args.to, best=args.best, force=args.force, module=args.module)
    except UsageError as error:
        print(f"ddp_amp: error: {error}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    exit_process(main())
