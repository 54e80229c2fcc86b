"""examples/word_lm.py (PyTorch's word-level LSTM language model as a `--task` plugin) and
examples/word_lm_session.py (the same training as a hand-written loop on `ddp_amp.Session`)
take the same steps:

(a) on one rank, in fp32, the plugin's per-step losses through the real CLI are bitwise the
    Session loop's, across a plateau LR drop;
(b) on two gloo ranks under torchrun with the same global batch, both give the one-rank
    losses up to float rounding (and each other's bitwise): each rank carries its own text
    streams, so the ranks together read exactly what one rank reads;
(c) the plugin stopped mid-run and resumed goes on bitwise as the uninterrupted run, through
    more LR drops and a new pass over the text, and ends with the same hidden state and weights;
(d) `--keep-best eval_nll` keeps the best checkpoint past retention (and across the resume),
    and the test split is scored with its weights.

Each configuration runs once (a module fixture); the runs are tiny (a 16-wide LSTM, 3000
words, 30 steps) and dropout is off: on two ranks each rank draws its own dropout masks, so
no two-rank run could match a one-rank run with it on.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from ddp_amp import TrainConfig
from ddp_amp.data.iterable_stream import RankShard
from ddp_amp.trainer import build_trainer, session_for
from examples.word_lm import DEFAULT_LR, CarriedHidden, ChunkGrid, ChunkStream
from tests.multiproc import REPO_ROOT, cli_env, run_train
from tests.test_host_reads import HostReadCounter

# Big enough to cross a pass over the training text (18 chunks per stream) and to see the
# validation loss rise (an LR drop) before it improves again (a best checkpoint mid-run).
MODEL = {"emsize": 16, "nhid": 16, "nlayers": 1, "bptt": 8, "tokens": 3000, "vocab": 200, "dropout": 0}
BATCH, STEPS, EVAL_EVERY, STOP_AT = 16, 30, 3, 12  # STOP_AT: an evaluation step, mid-pass, past an LR drop
COMMON = ["--batch-size", str(BATCH), "--eval-every", str(EVAL_EVERY), "--precision", "fp32", "--device", "cpu"]
PASS_STEPS = 18  # chunks per stream: (3000 * 0.8 training words / 16 streams - 1) // 8 words per chunk
# On two ranks each rank averages its 8 rows and DDP averages the two ranks' gradients; one
# rank averages all 16 rows at once. The same sums in another order: float32 rounding differs
# by an ulp or two per step (up to 4e-7 relative, seen) and could grow through the training
# dynamics. 1e-5 leaves room for that, and is far below what reading other text would change:
# the loss moves by 1e-2 and more from one step to the next.
RANKS_RTOL = 1e-5


@dataclass
class Run:
    """One finished run: its directory, what it printed, and its JSON-lines records."""

    directory: Path
    stdout: str
    records: list[dict[str, Any]]

    def losses(self) -> dict[int, float]:
        return {r["step"]: r["loss"] for r in self.records if "loss" in r and "step" in r}

    def lrs(self) -> dict[int, float]:
        return {r["step"]: r["lr"] for r in self.records if "lr" in r and "step" in r}

    def evals(self) -> dict[int, float]:
        return {r["step"]: r["eval_nll"] for r in self.records if "eval_nll" in r and "step" in r}

    def summary(self) -> dict[str, Any]:
        return next(r["summary"] for r in self.records if "summary" in r)


def _finished(result: subprocess.CompletedProcess[str], directory: Path, log_name: str) -> Run:
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    lines = (directory / log_name).read_text().splitlines()
    return Run(directory, result.stdout, [json.loads(line) for line in lines])


def run_plugin(directory: Path, steps: int, nproc: int = 0) -> Run:
    options = [arg for key, value in MODEL.items() for arg in ("--task-opt", f"{key}={value}")]
    result = run_train(["--task", "examples.word_lm:make_task", *options, *COMMON, "--max-steps", str(steps),
                        "--log-every", "1", "--keep-best", "eval_nll", "--keep-last", "1",
                        "--run-dir", str(directory)], nproc=nproc)
    return _finished(result, directory, "metrics.jsonl")


def run_session_loop(directory: Path, nproc: int = 0) -> Run:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={nproc}"] if nproc else [sys.executable]
    options = [arg for key, value in MODEL.items() for arg in (f"--{key}", str(value))]
    command = [*launcher, str(REPO_ROOT / "examples" / "word_lm_session.py"), *options, *COMMON,
               "--max-steps", str(STEPS), "--run-dir", str(directory)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=180, env=cli_env(), cwd=REPO_ROOT)
    return _finished(result, directory, "losses.jsonl")


@dataclass
class Runs:
    session: Run  # the Session loop, one rank, straight through
    first_half: Run  # the plugin, one rank, stopped at STOP_AT ...
    hidden_at_stop: Any  # ... the hidden state its checkpoint carried (retention deletes it later) ...
    resumed: Run  # ... and run on to STEPS in the same directory
    plugin_2: Run  # two ranks
    session_2: Run  # two ranks


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """Every configuration, once, two at a time (each run is mostly interpreter start-up).

    No straight plugin run to STEPS: the straight Session loop is the reference. The plugin
    matches it bitwise up to the stop ((a)), so where the resumed plugin matches it after the
    stop, it matches the plugin's own uninterrupted run ((c)).
    """
    root = tmp_path_factory.mktemp("word_lm")

    def stopped_then_resumed() -> tuple[Run, Any, Run]:
        first_half = run_plugin(root / "plugin", STOP_AT)
        hidden = _ckpt(first_half, STOP_AT, "per_rank/rank-00000.pt")["task_state"]  # the one rank's own
        return first_half, hidden, run_plugin(root / "plugin", STEPS)

    with ThreadPoolExecutor(max_workers=2) as lanes:  # submitted longest first
        halves = lanes.submit(stopped_then_resumed)
        plugin_2 = lanes.submit(run_plugin, root / "plugin-2", STEPS, 2)
        session_2 = lanes.submit(run_session_loop, root / "session-2", 2)
        session = lanes.submit(run_session_loop, root / "session")
        return Runs(session.result(), *halves.result(), plugin_2.result(), session_2.result())


def _ckpt(run: Run, step: int, name: str) -> Any:
    return torch.load(run.directory / "checkpoints" / f"step-{step:08d}" / name, weights_only=True)


def lr_drops(lrs: dict[int, float]) -> list[int]:
    """The steps whose LR differs from the step before's."""
    return [step for step in sorted(lrs) if step - 1 in lrs and lrs[step] != lrs[step - 1]]


def test_each_rank_continues_its_own_streams_and_ranks_together_read_what_one_reads() -> None:
    streams, bptt, chunks = 4, 3, 5
    ids = torch.arange(streams * (chunks * bptt + 1))  # every word unique: it says where it came from
    stream = ChunkStream(ChunkGrid(ids, streams, bptt))

    def micro_batches(rank: int, ranks: int) -> list[torch.Tensor]:
        items = [item["tokens"] for item in RankShard(stream, rank, ranks)]
        rows = streams // ranks
        return [torch.stack(items[i:i + rows]) for i in range(0, len(items), rows)]

    one_rank = micro_batches(0, 1)
    two_ranks = [micro_batches(rank, 2) for rank in (0, 1)]
    per_stream = len(ids) // streams
    for rank, batches in enumerate(two_ranks):
        for row in range(streams // 2):  # row j of rank r reads stream r + 2j, chunk after chunk
            text = torch.cat([batch[row] for batch in batches])
            start = (rank + 2 * row) * per_stream
            assert torch.equal(text, ids[start:start + chunks * bptt]), (rank, row)
    for i, whole in enumerate(one_rank):  # at every step the two ranks' rows are the one rank's
        together = torch.cat([two_ranks[0][i], two_ranks[1][i]])
        assert sorted(map(tuple, together.tolist())) == sorted(map(tuple, whole.tolist()))


def test_rows_whose_stream_starts_over_start_from_zeros() -> None:
    hidden = CarriedHidden()
    assert hidden.start_for(torch.tensor([0, 1])) is None  # the very first chunk: the LSTM's zeros
    state = torch.tensor([[[1.0, 2.0], [float("nan"), 3.0]]])  # (layers, rows, width)
    hidden.keep((state, -state))
    h, c = hidden.start_for(torch.tensor([3, 0]))  # row 0 reads on, row 1 starts a new pass
    assert torch.equal(h[0, 0], state[0, 0]) and torch.equal(c[0, 0], -state[0, 0])
    assert not h[0, 1].any() and not c[0, 1].any()  # zeros, even where the state was NaN


def test_steady_state_steps_read_nothing_on_the_host() -> None:
    """Which rows start over is chosen on the device: the Trainer's steps with this task read
    no tensor on the host (one process, in this one)."""
    config = TrainConfig(task="examples.word_lm:make_task", precision="fp32", device="cpu", batch_size=BATCH,
                         task_opt=tuple(f"{key}={value}" for key, value in MODEL.items()), max_steps=100)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the CLI runs get it (OMP_NUM_THREADS=1): tiny steps, a shared CPU
    try:
        trainer = build_trainer(session_for(config).start(), config)
        trainer.watch.finite.read_at_once = False  # count the finite guard's GPU branch (test_host_reads)
        for _ in range(3):  # lazy starts: the first pass's loader, the hidden state, optimizer state
            trainer.train_step()
        counter = HostReadCounter()
        with counter:
            for _ in range(8):  # within the first pass (PASS_STEPS): a new pass's loader reads its seed
                trainer.train_step()
    finally:
        torch.set_num_threads(threads)
    assert not counter.reads, counter.reads


def test_plugin_and_session_loop_take_bitwise_the_same_steps(runs: Runs) -> None:
    plugin, session = runs.first_half, runs.session
    losses = plugin.losses()
    assert sorted(losses) == list(range(1, STOP_AT + 1))
    assert losses == {step: loss for step, loss in session.losses().items() if step <= STOP_AT}  # bit for bit
    lrs = plugin.lrs()
    assert lrs == {step: lr for step, lr in session.lrs().items() if step <= STOP_AT}
    assert plugin.evals() == {step: nll for step, nll in session.evals().items() if step <= STOP_AT}
    # The plateau schedule acted: the LR fell by 4, at an evaluation, before the stop.
    drops = lr_drops(lrs)
    assert lrs[1] == DEFAULT_LR and drops and lrs[drops[0]] == DEFAULT_LR / 4, lrs
    assert all(step % EVAL_EVERY == 0 for step in drops), drops


def test_two_ranks_give_the_one_rank_losses_up_to_rounding(runs: Runs) -> None:
    one, plugin_2, session_2 = runs.session, runs.plugin_2, runs.session_2
    assert plugin_2.summary()["world_size"] == 2 and session_2.summary()["world_size"] == 2
    assert plugin_2.losses() == session_2.losses()  # the same DDP all-reduce in both: bitwise
    assert plugin_2.lrs() == one.lrs()  # the same plateau decisions
    losses_1, losses_2 = one.losses(), plugin_2.losses()
    assert sorted(losses_2) == sorted(losses_1)
    for step, loss in losses_1.items():
        assert losses_2[step] == pytest.approx(loss, rel=RANKS_RTOL, abs=0), step
    for step, nll in one.evals().items():
        assert plugin_2.evals()[step] == pytest.approx(nll, rel=RANKS_RTOL, abs=0), step


def test_a_stopped_and_resumed_run_goes_on_bitwise_hidden_state_included(runs: Runs) -> None:
    resumed, session = runs.resumed, runs.session
    assert f"resumed from {resumed.directory / 'checkpoints' / f'step-{STOP_AT:08d}'}" in resumed.stdout
    # The carried (h, c) went through the checkpoint: mid-pass at the stop, so not zeros.
    saved = runs.hidden_at_stop
    assert all(part.abs().sum() > 0 for part in saved["value"])
    # Every step before and after the stop is the uninterrupted loop's (metrics.jsonl keeps
    # the first run's steps), through more LR drops and into a second pass over the text.
    assert sorted(resumed.losses()) == list(range(1, STEPS + 1))
    assert resumed.losses() == session.losses() and resumed.lrs() == session.lrs()
    assert any(step > STOP_AT for step in lr_drops(resumed.lrs())), resumed.lrs()
    epochs = {r["step"]: r["epoch"] for r in resumed.records if "epoch" in r and "step" in r}
    assert epochs[PASS_STEPS] == 0 and epochs[PASS_STEPS + 1] == 1, epochs
    # And it ends in the same state: the carried hidden state and the weights, bit for bit.
    twin = torch.load(session.directory / "last" / "state.pt", weights_only=True)
    twin_weights = torch.load(session.directory / "last" / "model.pt", weights_only=True)
    hidden = _ckpt(resumed, STEPS, "per_rank/rank-00000.pt")["task_state"]["value"]
    assert all(torch.equal(mine, its) for mine, its in zip(hidden, twin["hidden"]["value"], strict=True))
    weights = _ckpt(resumed, STEPS, "model.pt")
    assert weights.keys() == twin_weights.keys()
    assert all(torch.equal(weights[name], twin_weights[name]) for name in weights)


def test_keep_best_keeps_the_best_checkpoint_and_the_test_pass_uses_it(runs: Runs) -> None:
    plugin, session = runs.resumed, runs.session
    summary = plugin.summary()
    scored = {step: nll for step, nll in plugin.evals().items() if step > 0}
    best_step = min(scored, key=scored.__getitem__)
    assert 0 < best_step < STEPS  # not the final weights: the test pass must load the kept ones
    assert (summary["best_step"], summary["best_value"]) == (best_step, scored[best_step])
    kept = sorted(path.name for path in (plugin.directory / "checkpoints").glob("step-*"))
    assert kept == [f"step-{best_step:08d}", f"step-{STEPS:08d}"]  # --keep-last 1 spared the best
    assert json.loads((plugin.directory / "checkpoints" / "best.json").read_text())["step"] == best_step
    assert summary["test_weights_from_step"] == best_step
    assert math.isfinite(summary["test_nll"]) and summary["test_ppl"] == pytest.approx(math.exp(summary["test_nll"]))
    # The Session loop kept its own best by the same rule and scored the test split the same.
    twin = session.summary()
    assert (twin["best_step"], twin["test_nll"]) == (best_step, summary["test_nll"])
