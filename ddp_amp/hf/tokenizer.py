"""A model directory's tokenizer: its files, the tokenizer read from them, and the copies a run
keeps for `export --hf`.

The files (`tokenizer_files`) are those `save_pretrained` writes for a tokenizer, whichever
the family uses (a fast tokenizer's `tokenizer.json`, a sentencepiece model, a BPE vocabulary
and merges, the chat template); the tokenized data's cache is keyed by their hash, and a run
copies them into its run directory (`HF_FILES`) so that `export --hf` writes them beside the
weights (`run_hf_files`). `load_tokenizer` reads the directory's own fast tokenizer offline;
`saved_call_settings` names the per-call settings a `tokenizer.json` kept from a call before
it was saved (truncation, padding), which the data's encoder switches off, as `tokenizer(text)`
does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ddp_amp.errors import UsageError
from ddp_amp.hf.config import read_model_directory

# What a tokenizer is made of, in a model directory: hashed into the key, copied on export.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt")
HF_FILES = "hf_files"  # in a run directory: files written beside the weights (the tokenizer's)


def tokenizer_files(folder: Path) -> list[Path]:
    return [folder / name for name in TOKENIZER_FILES if (folder / name).is_file()]


def load_tokenizer(directory: str) -> Any:
    """The directory's own fast tokenizer, offline."""
    if not tokenizer_files(Path(directory)):
        raise UsageError("--task-opt model", directory, "a model directory with its tokenizer (tokenizer.json)",
                         "save the tokenizer beside the model: tokenizer.save_pretrained(DIR)")
    from transformers import AutoTokenizer
    tokenizer = read_model_directory(directory, "a tokenizer transformers reads",
                                     lambda: AutoTokenizer.from_pretrained(directory, local_files_only=True))
    if not hasattr(tokenizer, "backend_tokenizer"):
        raise UsageError("--task-opt model", directory, "a fast tokenizer (tokenizer.json)",
                         "convert it once: AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)")
    return tokenizer


def saved_call_settings(tokenizer_dir: Path) -> list[str]:
    """The per-call settings (truncation, padding) saved in the tokenizer's tokenizer.json."""
    try:
        saved = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    except (OSError, ValueError):
        return []
    return [name for name in ("truncation", "padding") if isinstance(saved, dict) and saved.get(name)]


def run_hf_files(checkpoint: Path) -> dict[str, bytes]:
    """The files (a tokenizer's) the run that wrote `checkpoint` keeps for its export, by name."""
    folder = checkpoint.parent.parent / HF_FILES
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir()) if path.is_file()} \
        if folder.is_dir() else {}
