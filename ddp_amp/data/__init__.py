"""The training data: one resumable stream of micro-batches per rank, sharded by the
device mesh's data-parallel rank and size (`DistContext.dp_rank` / `dp_size`), never the
world rank, so ranks that differ only in a model-parallel dimension read the same batches.

Which stream a task's data becomes (`make_stream`):
- a task's own loader (`make_loader`), sharded by the task (task_loader.py);
- an `IterableDataset`: strided over data-parallel ranks and workers, resumed by replay
  (iterable_stream.py);
- a map-style dataset: a seeded order computed per index (order.py), dealt out per
  micro-step, resumed by position, and mappable onto another number of ranks (batches.py).
The first two keep a position per rank (loader_stream.py); a checkpoint saves every rank's.
All of them keep the `Stream` contract (stream.py). `DataOptions` (options.py) holds the
batch geometry and loader workers a run asks for, and the text sources.

Text (the `causal_lm` task's, text_data.py puts it together), one stage a module:
sources.py (what `--data` names) -> readers.py (rows, a unit of a file at a time) ->
encoding.py (rows to tokens and loss masks, by the model's tokenizer) -> token_cache.py and
unit_writer.py (tokenized once by every rank together into a cache entry) -> token_store.py
(reading an entry without loading it) -> windows.py and packing.py (group_texts windows, or
whole documents packed best-fit decreasing; their plans kept by plan_store.py) -> mixture.py
(sources by weight) -> the map-style stream above, in order.py's order.
"""

from __future__ import annotations

from collections.abc import Callable

from torch.utils.data import Dataset, IterableDataset

from ddp_amp.data.batches import BatchStream, collate
from ddp_amp.data.iterable_stream import RankShard, iterable_stream
from ddp_amp.data.loader_stream import LoaderStream
from ddp_amp.data.stream import Stream
from ddp_amp.data.task_loader import LoaderFactory, LoaderRequest, task_loader_stream
from ddp_amp.distributed import DistContext

__all__ = ["BatchStream", "LoaderFactory", "LoaderRequest", "LoaderStream", "RankShard", "Stream", "collate",
           "iterable_stream", "make_stream", "task_loader_stream"]


def make_stream(train_data: Dataset | None, make_loader: LoaderFactory | None, schedule_on: str, ctx: DistContext,
                micro_batch_size: int, num_workers: int, seed: int, worker_init_fn: Callable[[int], None],
                samples_per_step: int = 0) -> Stream:
    """This rank's stream over a task's training data: its own loader where `make_loader` is
    given (collective: its pass lengths are compared), else `train_data`. `schedule_on` is
    the task's LR cadence; `worker_init_fn` goes to every DataLoader worker; `samples_per_step`
    is the global batch (--batch-size), which a map-style dataset's epochs are whole steps of."""
    if make_loader is not None:
        return task_loader_stream(make_loader, schedule_on, ctx, ctx.device, micro_batch_size, num_workers,
                                  seed, worker_init_fn)
    if isinstance(train_data, IterableDataset):
        return iterable_stream(train_data, micro_batch_size, ctx.dp_rank, ctx.dp_size, ctx.device, num_workers,
                               collate_fn=collate, worker_init_fn=worker_init_fn)
    return BatchStream(train_data, micro_batch_size, ctx.dp_rank, ctx.dp_size, seed, ctx.device,  # type: ignore[arg-type]  # set without make_loader
                       num_workers, worker_init_fn=worker_init_fn, samples_per_step=samples_per_step)
