"""A transformers model's configuration and architecture: read from a model directory, recorded
by a run, written out by `export --hf`.

A model directory (`save_pretrained`'s) holds `config.json`; its `model_type` picks the
class, and `architectures` names it. `model_config` reads it offline for the `causal_lm`
task, checked against the window length, and `build_causal_lm` builds that architecture,
freshly initialised (on the meta device too, where the caller builds there).

A run whose model carries a transformers config (`model.config`) records it in its run
directory, in `HF_CONFIG` (`hf_config_record`, written when the run starts), with the class
`from_pretrained` rebuilds (the user's, not FSDP's sharded subclass `FSDP<class>`) and,
under `TIED`, which names are another's weight: a sharded checkpoint holds such a weight
under each name, as separate tensors, so that is how an export knows to write it once.
`export --hf` reads the record back (`run_hf_config`), or takes `--hf-config`'s instead
(`export_config`), and writes it as the model directory's `config.json`, without `TIED`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from ddp_amp.errors import UsageError
from ddp_amp.torch_api import FSDPModule

if TYPE_CHECKING:
    from transformers import PretrainedConfig

HF_CONFIG = "hf_config.json"  # in a run directory: the transformers config of its model
TIED = "ddp_amp_tied_weights"  # in HF_CONFIG, not written out: {name: the earlier name it shares a weight with}


def read_model_directory(directory: str, expected: str, load: Callable[[], Any]) -> Any:
    """`load()`, or a one-line UsageError naming the model directory where it cannot read it."""
    try:
        return load()
    except (OSError, ValueError) as error:
        raise UsageError("--task-opt model", directory, expected,
                         f"{type(error).__name__}: {str(error).splitlines()[0][:160]}") from None


def require_transformers(option: str, value: str) -> None:
    """A one-line UsageError, naming the option that needs it, where transformers is not installed."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise UsageError(option, value, "the transformers package installed", "pip install 'ddp_amp[text]'") from None


def model_config(directory: str, seq: int) -> PretrainedConfig:
    """The model directory's config, checked against the window length; read offline."""
    from transformers import AutoConfig

    if not Path(directory).is_dir():
        raise UsageError("--task-opt model", directory, "a Hugging Face model directory on this machine",
                         "save_pretrained() (or download) it first; nothing is fetched from the hub")
    config = read_model_directory(directory, "a model directory with a readable config.json",
                                  lambda: AutoConfig.from_pretrained(directory, local_files_only=True))
    longest = getattr(config, "max_position_embeddings", None)
    if longest is not None and seq > longest:
        raise UsageError("--task-opt max_length", seq, f"at most the model's max_position_embeddings ({longest})",
                         f"e.g. --task-opt max_length={longest}")
    config.use_cache = False  # no generation here: a key/value cache would only cost memory
    return config


def build_causal_lm(config: PretrainedConfig) -> nn.Module:
    """A causal LM of `config`'s architecture, freshly initialised, attending with torch's SDPA."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def hf_config_record(model: nn.Module) -> dict[str, Any] | None:
    """What a run records in `HF_CONFIG` for a transformers model (one with `config.to_json_string`),
    else None: the config, the class `from_pretrained` rebuilds (the model's own, not the
    `FSDP<class>` subclass sharding made of it) and the tied names."""
    hf_config: Any = getattr(model, "config", None)
    if not hasattr(hf_config, "to_json_string"):
        return None
    recorded: dict[str, Any] = json.loads(hf_config.to_json_string())
    recorded["architectures"] = [next(cls.__name__ for cls in type(model).__mro__ if not issubclass(cls, FSDPModule))]
    first: dict[int, str] = {}
    tied: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            tied[name] = first[id(param)]
        else:
            first[id(param)] = name
    if tied:
        recorded[TIED] = tied
    return recorded


def run_hf_config(checkpoint: Path) -> dict[str, Any] | None:
    """The transformers config recorded by the run that wrote `checkpoint` (its run directory
    is two levels up: RUN/checkpoints/step-N), or None."""
    for folder in (checkpoint.parent.parent, checkpoint.parent, checkpoint):
        path = folder / HF_CONFIG
        if path.is_file():
            loaded = json.loads(path.read_text())
            return loaded if isinstance(loaded, dict) else None
    return None


def export_config(checkpoint: Path, given: Path | None, recorded: dict[str, Any]) -> dict[str, Any]:
    """The transformers config to write: `--hf-config`'s (a config.json or a directory with one),
    else the one the run recorded."""
    if given is not None:
        path = given / "config.json" if given.is_dir() else given
        try:
            loaded = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise UsageError("--hf-config", str(given), "a transformers config.json, or a directory with one",
                             f"{type(error).__name__}: {error}"[:200]) from None
        if isinstance(loaded, dict):
            return loaded
    if not recorded:
        raise UsageError("--hf", str(checkpoint), f"a run whose model is a transformers model (its {HF_CONFIG})",
                         "this run recorded no transformers config; name one with --hf-config DIR_OR_CONFIG_JSON")
    return dict(recorded)


def unsharded_architectures(config: dict[str, Any]) -> list[str]:
    """The classes `config` names, less the `FSDP` prefix: runs from before the record named the
    model's own class recorded FSDP's sharded subclass of it."""
    return [name.removeprefix("FSDP") for name in config.get("architectures", [])]
