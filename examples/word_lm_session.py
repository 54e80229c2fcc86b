"""The word-level LSTM language model of `examples/word_lm.py`, trained by a hand-written loop
on `ddp_amp.Session` instead of the `--task` plugin.

    python examples/word_lm_session.py --run-dir runs/word_lm_session
    torchrun --standalone --nproc_per_node=2 examples/word_lm_session.py --device cpu --batch-size 20

The same model, data layout, step, SGD, clipping, plateau schedule (LR / 4 when the
validation loss does not improve), best checkpoint and test pass as the plugin; everything
but the loop is imported from `word_lm.py`. With the same settings (`--batch-size` here is
the plugin's `--batch-size`, model and data options are the plugin's `--task-opt KEY=VALUE`
as `--KEY VALUE`) it takes the same steps: tests/test_example_word_lm.py compares the two.

Rank 0 writes `<run-dir>/losses.jsonl`: one `{"step", "loss", "lr"}` per step (the loss
averaged over ranks; the LR after that step's evaluation, as the CLI's `metrics.jsonl`
logs it), one `{"step", "eval_nll"}` per evaluation and a final `{"summary": {...}}`. The
best weights are kept in `<run-dir>/best`, the final state in `<run-dir>/last` (`Session.save`
checkpoints).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset
# examples/ is on sys.path when this file runs as a script (python or torchrun).
from word_lm import (DEFAULT_CLIP, DEFAULT_LR, DEFAULTS, CarriedHidden, ChunkGrid, Corpus, build_model, chunk_loss,
                     chunk_nll, load_corpus, make_optimizer, make_plateau_schedule, read_options)

from ddp_amp import Session


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=20, help="text streams, over all ranks (default: 20)")
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--eval-every", type=int, default=50, help="0: evaluate only at the end")
    parser.add_argument("--lr", type=float, default=DEFAULT_LR)
    parser.add_argument("--clip", type=float, default=DEFAULT_CLIP, help="gradient norm clip")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--run-dir", type=Path, default=Path("runs/word_lm_session"))
    for key, default in DEFAULTS.items():  # the plugin's task options
        parser.add_argument(f"--{key}", type=type(default), default=default)
    return parser.parse_args()


def rank_share(data: Dataset, rows: int, session: Session, generator: torch.Generator | None = None) -> DataLoader:
    """This rank's items r, r + N, r + 2N, ... in batches of `rows`: chunk i of its own streams in
    batch i (see ChunkGrid), as the trainer deals out training streams and held-out data."""
    return DataLoader(data, batch_size=rows, sampler=range(session.rank, len(data), session.world_size),
                      generator=generator)


def passes(loader: DataLoader) -> Iterator[Any]:
    """Batches, pass after pass (each pass starts the streams over: chunk 0 resets the state)."""
    while True:
        yield from loader


def mean_over_ranks(value: torch.Tensor, session: Session) -> float:
    """A scalar averaged over ranks, as the CLI logs its loss (collective)."""
    total = value.detach().clone().float()
    if session.world_size > 1:
        dist.all_reduce(total)
    return total.item() / session.world_size


@torch.no_grad()
def evaluate(model: nn.Module, grid: ChunkGrid, rows: int, session: Session) -> float:
    """Mean NLL per word over `grid`, each chunk scored once over all ranks (collective)."""
    forward = session.local_module(model)  # no DDP collectives in the forward
    scoring = CarriedHidden()  # chunk 0 comes first: it starts from zeros
    total = torch.zeros(2, dtype=torch.float64, device=session.device)  # NLL sum, word count
    model.eval()
    try:
        # A generator of its own: the loader's seed draw must not move the training RNG.
        for batch in rank_share(grid, rows, session, torch.Generator()):
            nll, count = chunk_nll(forward, session.to_device(batch), scoring)
            total = total + torch.stack([nll.double(), torch.tensor(float(count), dtype=torch.float64,
                                                                     device=session.device)])
    finally:
        model.train()
    if session.world_size > 1:
        dist.all_reduce(total)
    nll_sum, words = total.tolist()
    return nll_sum / max(words, 1.0)


class BestWeights:
    """The original's `if val_loss < best_val_loss: save`: a checkpoint of the best weights."""

    def __init__(self, directory: Path) -> None:
        self.directory, self.value, self.step = directory, math.inf, 0

    def offer(self, value: float, step: int, model: nn.Module, session: Session) -> None:
        """Keep the weights if `value` is strictly lower than the best so far (collective)."""
        if value < self.value:
            session.save(self.directory, {"model": model, "step": step, "eval_nll": value})
            self.value, self.step = value, step


class JsonLines:
    """Records appended to a JSON-lines file, on rank 0 only."""

    def __init__(self, path: Path, session: Session) -> None:
        self.handle: TextIO | None = path.open("w", encoding="utf-8") if session.is_main else None

    def write(self, record: dict[str, Any]) -> None:
        if self.handle is not None:
            self.handle.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()


@dataclass
class Training:
    """What one rank's loop works on."""

    session: Session
    model: nn.Module  # as set up: DDP(AutocastModule(WordLSTM)), or the AutocastModule alone
    optimizer: torch.optim.Optimizer
    plateau: torch.optim.lr_scheduler.ReduceLROnPlateau
    hidden: CarriedHidden  # carried from step to step
    corpus: Corpus
    rows: int  # this rank's rows (text streams) per batch
    best: BestWeights
    log: JsonLines

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def evaluate(self, grid: ChunkGrid) -> float:
        return evaluate(self.model, grid, self.rows, self.session)


def start_training(session: Session, args: argparse.Namespace) -> Training:
    if args.batch_size % session.world_size:
        raise SystemExit(f"word_lm_session: --batch-size {args.batch_size} must be a multiple of the "
                         f"{session.world_size} ranks (each rank reads its own streams)")
    options = read_options({key: str(getattr(args, key)) for key in DEFAULTS})  # the plugin's checks
    corpus = load_corpus(options, streams=args.batch_size)
    # The trainer's seeding: the same initial weights on every rank, then each rank its own RNG.
    torch.manual_seed(args.seed)
    user_model = build_model(options, corpus.vocab_size)
    torch.manual_seed(args.seed + session.rank)
    model = session.setup(user_model)
    optimizer = make_optimizer(model.parameters(), args.lr)
    args.run_dir.mkdir(parents=True, exist_ok=True)
    return Training(session, model, optimizer, make_plateau_schedule(optimizer), CarriedHidden(), corpus,
                    args.batch_size // session.world_size, BestWeights(args.run_dir / "best"),
                    JsonLines(args.run_dir / "losses.jsonl", session))


def train_step(run: Training, batch: Any, clip: float) -> torch.Tensor:
    """Forward, backward and update on one batch of chunks; the loss (on the device)."""
    session = run.session
    with session.autocast():
        loss = chunk_loss(run.model, session.to_device(batch), run.hidden)
    session.backward(loss)
    session.step(run.optimizer, clip_grad_norm=clip)
    run.optimizer.zero_grad(set_to_none=True)
    return loss


def after_evaluation(run: Training, step: int, eval_nll: float) -> None:
    """The original's end of an epoch: LR / 4 unless the validation loss improved; keep the best."""
    run.log.write({"step": step, "eval_nll": eval_nll})
    if step == 0:  # before the first step: where learning starts, nothing to schedule or keep
        return
    run.plateau.step(eval_nll)
    run.best.offer(eval_nll, step, run.model, run.session)


def train_loop(run: Training, args: argparse.Namespace) -> float:
    """`--max-steps` steps, evaluating every `--eval-every`; the last validation NLL."""
    eval_nll, eval_step = math.nan, -1
    if args.eval_every:
        eval_nll, eval_step = run.evaluate(run.corpus.valid), 0
        after_evaluation(run, 0, eval_nll)
    # No generator of its own here: each pass's loader draws its seed from the global RNG, as
    # the CLI's stream loader does, so dropout draws the same numbers in both.
    batches = passes(rank_share(run.corpus.train, run.rows, run.session))
    for step in range(1, args.max_steps + 1):
        # Read every step, for the per-step log; a long run would read it every N steps.
        record = {"step": step, "loss": mean_over_ranks(train_step(run, next(batches), args.clip), run.session)}
        if args.eval_every and step % args.eval_every == 0:
            eval_nll, eval_step = run.evaluate(run.corpus.valid), step
            after_evaluation(run, step, eval_nll)
            if run.session.is_main:
                print(f"step {step} loss {record['loss']:.4f} eval_nll {eval_nll:.4f} lr {run.lr:.4g}", flush=True)
        run.log.write({**record, "lr": run.lr})  # the LR after this step's evaluation, as the CLI logs it
    if eval_step != args.max_steps:  # the final evaluation, as the CLI's
        eval_nll = run.evaluate(run.corpus.valid)
        run.best.offer(eval_nll, args.max_steps, run.model, run.session)
    return eval_nll


def finish(run: Training, args: argparse.Namespace, eval_nll: float) -> dict[str, Any]:
    """Save the final state, score the test split with the best weights; the summary."""
    session = run.session
    # The final state, as the CLI's last checkpoint (rank 0's carried hidden state).
    session.save(args.run_dir / "last", {"model": run.model, "optimizer": run.optimizer, "plateau": run.plateau,
                                         "hidden": run.hidden, "step": args.max_steps})
    tested = args.max_steps
    if run.best.step and run.best.step != args.max_steps:
        session.load(run.best.directory, {"model": run.model}, restore_rng=False)
        tested = run.best.step
    summary = {"steps": args.max_steps, "world_size": session.world_size, "eval_nll": eval_nll,
               "best_step": run.best.step, "best_value": run.best.value,
               "test_nll": run.evaluate(run.corpus.test), "test_weights_from_step": tested}
    run.log.write({"summary": summary})
    return summary


def train(session: Session, args: argparse.Namespace) -> dict[str, Any]:
    run = start_training(session, args)
    try:
        return finish(run, args, train_loop(run, args))
    finally:
        run.log.close()


def main() -> None:
    args = parse_args()
    with Session(args.precision, args.device) as session:
        summary = train(session, args)
        if session.is_main:
            print("summary: " + " ".join(f"{key}={value:.6g}" if isinstance(value, float) else f"{key}={value}"
                                         for key, value in summary.items()), flush=True)


if __name__ == "__main__":
    main()
