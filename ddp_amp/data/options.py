"""The data options of a run: the global batch, its accumulation micro-steps, loader workers,
and the text sources a task that reads them (causal_lm) trains and evaluates on."""

from __future__ import annotations

from dataclasses import dataclass

from ddp_amp.errors import UsageError
from ddp_amp.option_values import ComponentOptions, check_fields, option


@dataclass(frozen=True)
class DataOptions(ComponentOptions):
    """The batch geometry of one optimizer step, and each rank's loader."""

    batch_size: int = option(64, "global batch size per optimizer step, summed over ranks and "
                             "accumulation micro-steps; must divide by world size x --grad-accum",
                             resume="match", limits=(1, 2**31))
    grad_accum: int = option(1, "micro-steps accumulated per optimizer step (DDP syncs only on the last)",
                             resume="match", limits=(1, 2**31))
    num_workers: int = option(0, "DataLoader worker processes per rank", limits=(0, 256))
    data: tuple[str, ...] = option((), "training text for --task causal_lm: a file, glob or datasets save_to_disk "
                                   "folder (.jsonl, .json, .parquet, .txt, also .gz/.bz2/.xz/.zst), optionally "
                                   "PATH:WEIGHT to use its windows WEIGHT times per epoch; repeatable", resume="match")
    eval_data: tuple[str, ...] = option((), "held-out text for --task causal_lm, in --data's forms; repeatable "
                                        "(without it, --task-opt test_size holds out part of --data)")
    data_cache: str = option("", "folder of tokenized text (reused by every run on the same files and "
                             "tokenizer; every rank must see it); default $DDP_AMP_DATA_CACHE, else "
                             "~/.cache/ddp_amp/data", resume="free")

    def micro_batch_size(self, world_size: int, ranks: str = "world size") -> int:
        """Per-rank batch of one micro-step over `world_size` data-parallel ranks (`ranks`: what
        the refusal calls them); raises if the global batch does not divide."""
        parts = world_size * self.grad_accum
        if self.batch_size % parts:
            raise UsageError("--batch-size", self.batch_size,
                             f"a multiple of {ranks} x --grad-accum = {world_size} x "
                             f"{self.grad_accum} = {parts}",
                             f"try --batch-size {max(parts, self.batch_size // parts * parts)}")
        return self.batch_size // parts

    def check(self) -> None:
        """Choices and ranges."""
        check_fields(self, DataOptions)
