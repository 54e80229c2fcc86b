"""`python -m ddp_amp.bench`: the AMP speed-up, the launcher's overhead and the fast paths.

    python -m ddp_amp.bench                         # all sections; recipe sizes on a GPU
    python -m ddp_amp.bench --sections recipe       # only the AMP recipe trials
    python -m ddp_amp.bench --sections host --check # Trainer and Session host time; exit 1 off target
    python -m ddp_amp.bench --check                 # every stated target: met, missed or n/a here
    python -m ddp_amp.bench --sections transformer  # GPT-2 small: tokens/s, memory, MFU (GPU)
    python -m ddp_amp.bench --sections checkpoint --scale 1  # async vs sync save stall, 101M params
    python -m ddp_amp.bench --sections resume --check  # bytes each rank hashes; rank 0 flat in N
    python -m ddp_amp.bench --sections scale --check   # the liveness watch at 64-16,384 ranks
    python -m ddp_amp.bench --sections data --check    # tokenizing, the loader, memory at 1e9 windows
    python -m ddp_amp.bench --json bench.json       # also write the figures as JSON
    python -m ddp_amp.bench --help                  # every option

On a CPU the sizes default to 1/16 of the recipe (--scale) so the sections stay short;
low precision on a CPU without bf16/fp16 units is many times slower than fp32, and
the table shows that as measured. Exit codes: 0 done, 2 bad input, 1 a failed section (or,
with --check, a target missed).

Targets (targets.py): host, Trainer / hand in every row, on any device; overhead and
transformer, a GPU's (not applicable on a CPU, and `--check` says so); resume, no rank
hashes more than it reads, the saves' own group connects each rank to two peers at most,
and rank 0's file operations at save, at resume and for retention's deletion are flat from
64 to 16,384 emulated ranks (its time is reported, not held to a target: the machine's load
decides it); recipe, fastpaths and checkpoint report figures without targets.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any, NoReturn

import torch

from ddp_amp.bench import (activation_memory, amp_recipe, build_memory, checkpoint_stall, context_parallel, data,
                           fastpaths, host, memory, overhead, rank_zero, resume, scale, table, tensor_parallel,
                           transformer)
from ddp_amp.bench.targets import check_report, check_text
from ddp_amp.fast_exit import exit_process
from ddp_amp.torch_api import SHARDING, TENSOR_PARALLEL

SECTIONS = ("recipe", "host", "overhead", "fastpaths", "transformer", "checkpoint", "memory", "resume", "scale",
            "data", "tp", "cp")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m ddp_amp.bench", allow_abbrev=False,
        description="Benchmark ddp_amp: (recipe) the PyTorch AMP recipe's fp32 vs autocast fp16 + "
        "GradScaler vs autocast bf16 trials, each in a fresh process: total time, time per step, peak "
        "memory (CUDA max_memory_allocated, CPU peak RSS), speed-up over fp32, TFLOP/s and MFU on known "
        "GPUs; (host) the host time per step of the Trainer and of a Session loop against the "
        "hand-written AMP loop on a micro "
        "model (2 x Linear(16,16), batch 8) whose compute is negligible, fp32/bf16/fp16, without and with "
        "a process group of one, one thread, interleaved, against the target ratio; (overhead) the "
        "hand-written recipe loop vs ddp_amp's Trainer, interleaved in blocks, as "
        "the median of paired per-step ratios with its spread, on the recipe model and on a tiny model "
        "(2 x Linear(256,256), batch 64) where Python overhead dominates, plus the cost of the agreed "
        "overflow decision; (fastpaths) fused/foreach optimizer, set_to_none, gradient_as_bucket_view, "
        "static graph, grad-comm dtype, torch.compile, pinned non-blocking copies (CUDA); (transformer) a "
        "GPT-2-small-shaped decoder (124M parameters, 8 x 1024 tokens; a 2-layer miniature on CPU), hand "
        "loop vs Trainer, fp32/bf16/fp16/fp8, eager and compiled: tokens/s, peak memory, TFLOP/s and MFU "
        "from torch's FLOP counter; (checkpoint) the loop's stall of a --async-checkpoint save (the host copy "
        "and one broadcast; the writes run in the background) against a synchronous save, as paired saves of one "
        "trainer on an mlp of 8 layers of width 4096 x --scale (101M parameters and AdamW state at scale 1); "
        "(resume) each rank's verification time and bytes hashed when a sharded checkpoint is found again, "
        "on 1, 2 and 4 gloo ranks, against its own files plus the replicated files; the connections each rank "
        "opens for the --async-checkpoint group over a background save on 4 ranks; then rank 0's time and "
        "file operations at save, at resume and for retention with --resume-ranks emulated ranks' files on local "
        "disk; (scale) "
        "the liveness watch at 64 to 16,384 ranks against one real store, every rank with its own connection "
        "at its real beat rate: the store's and the judges' CPU, the beat rate achieved against the one asked, "
        "the detection time of a lost rank and the live ranks named; (data) tokenizing JSON lines per core "
        "against datasets.map, the causal_lm loader's draw against its step, a rank's memory with 1e9 windows; (tp) "
        "the parameters and activations a rank holds of a transformers Llama (Llama 3.2 1B's shape) split over "
        "1, 2 and 4 ranks (tensor, sequence and loss parallel) against sharded over as many; (cp) the "
        "activations a rank holds of one long window of a small Llama split over 1, 2 and 4 ranks (context "
        "parallel), the keys and values gathered against the attention's FLOPs, and the longest window within "
        "a memory budget at each degree. "
        "Defaults depend on the device: recipe sizes on CUDA, 1/16 of them and short runs on CPU.")
    parser.add_argument("--scale-ranks", default=",".join(map(str, scale.RANKS)),
                        help="the scale section's world sizes, comma-separated (default: %(default)s)")
    parser.add_argument("--scale-silence", type=float, default=scale.SILENCE_S,
                        help="the scale section's silence limit in seconds, as --peer-silence sets it for a run "
                        "(at least four beat periods: 16 s at 16,384 ranks); "
                        "each size takes about twice this (default: %(default)s)")
    parser.add_argument("--scale-beats-per-s", type=float, default=scale.BEATS_PER_S,
                        help="the scale section's store budget of beats a second, as --peer-beats-per-s sets it "
                        "for a run: higher, shorter beats and faster detection at large world sizes, for more "
                        "store load (default: %(default)s)")
    parser.add_argument("--resume-ranks", default=",".join(map(str, rank_zero.RANKS)),
                        help="the resume section's emulated world sizes for rank 0's share, comma-separated; the "
                        "first and the last are compared (default: %(default)s)")
    parser.add_argument("--resume-widths", default=",".join(map(str, resume.WIDTHS)),
                        help="the resume section's model widths for each rank's verification, comma-separated "
                        "(default: %(default)s)")
    parser.add_argument("--resume-repeats", type=int, default=rank_zero.REPEATS,
                        help="the resume section's saves per emulated world size, each with "
                        f"{rank_zero.RESUME_REPEATS} resumes (default: %(default)s)")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated sections to run, from {', '.join(SECTIONS)} (default: all)")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="where to run: auto (cuda if available), cuda or cpu (default: auto)")
    parser.add_argument("--scale", type=float, default=None,
                        help="multiply the recipe's width 4096 and batch 512, and the checkpoint section's "
                        "width 4096, by this (default: 1 on CUDA, 0.0625 on CPU)")
    parser.add_argument("--batches", type=int, default=50, help="recipe: batches per epoch (default: 50)")
    parser.add_argument("--epochs", type=int, default=3, help="recipe: epochs (default: 3)")
    parser.add_argument("--trials", default=",".join(amp_recipe.TRIALS),
                        help="recipe: comma-separated precisions to try (default: fp32,fp16,bf16)")
    parser.add_argument("--ranks", type=int, default=None,
                        help="overhead/fastpaths: processes (default: 2 gloo ranks on CPU, one per GPU on CUDA)")
    parser.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto",
                        help="overhead/fastpaths: process-group backend as in ddp_amp.train; naming one "
                        "forms a group even for one rank, so one GPU measures the DDP path (default: auto)")
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp16",
                        help="overhead: precision of both contenders (default: fp16, the case with a scaler)")
    parser.add_argument("--fastpaths-precision", choices=("fp32", "bf16", "fp16"), default=None,
                        help="fastpaths: precision (default: fp16 on CUDA, fp32 on CPU where low precision is slow)")
    parser.add_argument("--blocks", type=int, default=None,
                        help="overhead/fastpaths: interleaved blocks per contender (default: 20 on CUDA, 8 on "
                        "CPU); checkpoint: paired saves (default: 10 on CUDA, 5 on CPU)")
    parser.add_argument("--steps-per-block", type=int, default=None,
                        help="overhead/fastpaths: steps per block (default: 10 on CUDA, 4 on CPU)")
    parser.add_argument("--with-compile", action=argparse.BooleanOptionalAction, default=None,
                        help="fastpaths, transformer: include torch.compile (default: on CUDA only; "
                        "compiling takes minutes on a CPU)")
    parser.add_argument("--transformer-precisions", default=",".join(transformer.PRECISIONS),
                        help="transformer: comma-separated precisions (default: fp32,bf16,fp16,fp8; fp8 "
                        "rows say why where the device has no float8 matmuls)")
    parser.add_argument("--transformer-batch", type=int, default=None,
                        help="transformer: sequences per step (default: 8 of 1024 tokens on CUDA, 4 of 64 on CPU)")
    parser.add_argument("--memory-width", type=int, default=memory.WIDTH,
                        help=f"memory: width of the Linear stack (default: {memory.WIDTH}; with "
                        f"--memory-layers {memory.LAYERS}, about 50M parameters)")
    parser.add_argument("--memory-layers", type=int, default=memory.LAYERS,
                        help=f"memory: Linear layers in the stack (default: {memory.LAYERS})")
    parser.add_argument("--build-width", type=int, default=build_memory.WIDTH,
                        help=f"memory, peak while built and sharded: width of its Linear stack (default: "
                        f"{build_memory.WIDTH}; with --build-layers {build_memory.LAYERS}, about 510M parameters)")
    parser.add_argument("--activation-width", type=int, default=activation_memory.WIDTH,
                        help="memory, kept for backward per --activation-checkpointing mode: the lm model's width "
                        "(default: %(default)s)")
    parser.add_argument("--activation-layers", type=int, default=activation_memory.LAYERS,
                        help="memory, kept for backward: the lm model's layers (default: %(default)s)")
    parser.add_argument("--activation-tokens", type=int, default=activation_memory.TOKENS,
                        help="memory, kept for backward: tokens per sequence (default: %(default)s)")
    parser.add_argument("--build-layers", type=int, default=build_memory.LAYERS,
                        help=f"memory, peak while built and sharded: Linear layers (default: {build_memory.LAYERS})")
    parser.add_argument("--data-copies", type=int, default=data.COPIES,
                        help="data: copies of the reference docs in the tokenizing corpus (default: %(default)s, "
                        "about 6 MB)")
    parser.add_argument("--data-trials", type=int, default=data.TRIALS,
                        help="data: fresh processes per tokenizing contender, in turn (default: %(default)s)")
    parser.add_argument("--build-llama-width", type=int, default=build_memory.LLAMA_WIDTH,
                        help="memory, peak while built and sharded: hidden size of the transformers Llama built "
                        f"on {build_memory.LLAMA_RANKS} ranks (default: %(default)s; with --build-llama-layers "
                        f"{build_memory.LLAMA_LAYERS}, 1.04B parameters)")
    parser.add_argument("--build-llama-layers", type=int, default=build_memory.LLAMA_LAYERS,
                        help="memory, peak while built and sharded: the Llama's layers (default: %(default)s; 0: no "
                        "Llama)")
    parser.add_argument("--build-runs", type=int, default=build_memory.RUNS,
                        help="memory, peak while built and sharded: how many times the Llama is built, each in "
                        "fresh processes (default: %(default)s)")
    parser.add_argument("--tp-width", type=int, default=tensor_parallel.LlamaShape.width,
                        help="tp: the Llama's hidden size, at Llama 3.2 1B's proportions (default: %(default)s, "
                        "1.24B parameters with the other defaults)")
    parser.add_argument("--tp-layers", type=int, default=tensor_parallel.LlamaShape.layers,
                        help="tp: the Llama's layers (default: %(default)s)")
    parser.add_argument("--tp-vocab", type=int, default=tensor_parallel.LlamaShape.vocab,
                        help="tp: the Llama's vocabulary (default: %(default)s)")
    parser.add_argument("--cp-tokens", type=int, default=context_parallel.WindowShape.tokens,
                        help="cp: tokens of the one window measured (default: %(default)s)")
    parser.add_argument("--cp-width", type=int, default=context_parallel.WindowShape.width,
                        help="cp: the Llama's hidden size, heads of 32 (default: %(default)s)")
    parser.add_argument("--cp-layers", type=int, default=context_parallel.WindowShape.layers,
                        help="cp: the Llama's layers (default: %(default)s)")
    parser.add_argument("--cp-budget-mib", type=int, default=context_parallel.WindowShape.budget_mib,
                        help="cp: the activations per rank the longest window must fit (default: %(default)s)")
    parser.add_argument("--cp-longest", type=int, default=context_parallel.WindowShape.longest_tried,
                        help="cp: the longest window tried for the budget (default: %(default)s)")
    parser.add_argument("--tp-tokens", type=int, default=tensor_parallel.LlamaShape.tokens,
                        help="tp: tokens of the one sequence measured (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per process (default: all cores for recipe trials, cores/ranks for ranks)")
    parser.add_argument("--check", action="store_true",
                        help="print every stated target of the sections run, met, missed or not applicable "
                        "on this device (host: any device; overhead, transformer: a GPU), and exit 1 if "
                        "one is missed (default: report only)")
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="also write every figure, with device, torch version and date, as JSON to PATH")
    return parser


def _fail(message: str) -> NoReturn:
    """Bad input: one line on stderr, exit code 2 (as `python -m ddp_amp.train`)."""
    print(f"ddp_amp.bench: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Fill device-dependent defaults; exit 2 with one line on bad input."""
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if args.device == "cuda" and not torch.cuda.is_available():
        _fail("--device cuda, but no CUDA GPU is visible; use --device cpu")
    args.device = "cuda" if cuda else "cpu"
    args.scale = args.scale if args.scale is not None else (1.0 if cuda else 0.0625)
    args.ranks = args.ranks or (max(torch.cuda.device_count(), 1) if cuda else 2)
    args.fastpaths_precision = args.fastpaths_precision or ("fp16" if cuda else "fp32")
    # The host section's micro steps are the shortest (docs/benchmarks.md): it keeps its own
    # counts unless told otherwise.
    args.host_blocks = args.blocks or host.BLOCKS
    args.host_steps = args.steps_per_block or host.STEPS_PER_BLOCK
    # Transformer steps are the longest (docs/benchmarks.md): fewer, shorter blocks for the
    # same confidence.
    args.transformer_blocks = args.blocks or (10 if cuda else 4)
    args.transformer_steps = args.steps_per_block or (4 if cuda else 2)
    args.checkpoint_pairs = args.blocks or (10 if cuda else 5)
    args.blocks = args.blocks or (20 if cuda else 8)
    args.steps_per_block = args.steps_per_block or (10 if cuda else 4)
    args.with_compile = cuda if args.with_compile is None else args.with_compile
    cores = os.cpu_count() or 1
    args.rank_threads = args.threads or (0 if cuda else max(1, cores // args.ranks))
    args.trial_threads = args.threads or 0
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    try:
        args.resume_ranks = tuple(int(n) for n in args.resume_ranks.split(","))
    except ValueError:
        _fail(f"bad value {args.resume_ranks!r} for --resume-ranks; expected world sizes such as 64,4096,16384")
    try:
        args.resume_widths = tuple(int(n) for n in args.resume_widths.split(","))
    except ValueError:
        _fail(f"bad value {args.resume_widths!r} for --resume-widths; expected model widths such as 256,1024")
    args.trials = tuple(t.strip() for t in args.trials.split(",") if t.strip())
    args.transformer_precisions = tuple(t.strip() for t in args.transformer_precisions.split(",") if t.strip())
    bad = ([s for s in args.sections if s not in SECTIONS] + [t for t in args.trials if t not in amp_recipe.TRIALS]
           + [t for t in args.transformer_precisions if t not in transformer.PRECISIONS])
    counts = (args.batches, args.epochs, args.ranks, args.blocks, args.steps_per_block, args.transformer_batch or 1,
              args.resume_repeats, min(args.resume_ranks) - 1, min(args.resume_widths), args.data_copies,
              args.data_trials)
    if bad or args.scale <= 0 or min(counts) < 1:
        _fail(f"bad value {bad[0] if bad else 'among the numbers'}; "
              f"sections {', '.join(SECTIONS)}, trials {', '.join(amp_recipe.TRIALS)}, transformer "
              f"precisions {', '.join(transformer.PRECISIONS)}, "
              "--scale > 0, counts >= 1, --resume-ranks >= 2 (see --help)")
    return args


def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    return f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores"


# The sections that shard a model (FSDP2, DCP checkpoints), and why a torch too old for it runs none of them.
SHARDED_SECTIONS = ("memory", "resume")
_CANNOT_SHARD = (f"{SHARDING.name} needs torch >= {SHARDING.needs[0]}.{SHARDING.needs[1]}; "
                 f"this is torch {torch.__version__}")


def unsharded_sections(asked: list[str]) -> list[str]:
    """The sections of `asked` that shard, where this torch cannot: each is reported as not run."""
    return [] if SHARDING.available() else [name for name in asked if name in SHARDED_SECTIONS]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the chosen sections, printing each table as soon as it is done."""
    report: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": args.device, "device_name": _device_name(args.device), "torch": torch.__version__,
        "command": "python -m ddp_amp.bench " + " ".join(sys.argv[1:]), "sections": {}}
    print(f"ddp_amp.bench {report['date']} on {report['device_name']}, torch {report['torch']}", flush=True)
    if "recipe" in args.sections:
        section = amp_recipe.run(args.device, args.scale, args.batches, args.epochs, args.trials,
                                 threads=args.trial_threads)
        report["sections"]["recipe"] = section
        print("\n" + table.recipe_table(section), flush=True)
    if "host" in args.sections:
        section = host.run(args.device, args.host_blocks, args.host_steps)
        report["sections"]["host"] = section
        print("\n" + table.host_table(section), flush=True)
    if "overhead" in args.sections:
        section = overhead.run(args.device, args.ranks, args.scale, args.precision, args.blocks,
                               args.steps_per_block, threads=args.rank_threads, backend=args.backend)
        report["sections"]["overhead"] = section
        print("\n" + table.overhead_table(section), flush=True)
    if "fastpaths" in args.sections:
        section = fastpaths.run(args.device, args.ranks, args.scale, args.fastpaths_precision, args.blocks,
                                args.steps_per_block, args.with_compile, threads=args.rank_threads,
                                backend=args.backend)
        report["sections"]["fastpaths"] = section
        print("\n" + table.fastpaths_table(section), flush=True)
    if "transformer" in args.sections:
        section = transformer.run(args.device, args.with_compile, args.transformer_blocks, args.transformer_steps,
                                  args.transformer_precisions, backend=args.backend, batch=args.transformer_batch)
        report["sections"]["transformer"] = section
        print("\n" + table.transformer_table(section), flush=True)
    if "checkpoint" in args.sections:
        section = checkpoint_stall.run(args.device, args.scale, args.checkpoint_pairs, threads=args.trial_threads)
        report["sections"]["checkpoint"] = section
        print("\n" + checkpoint_stall.async_table(section), flush=True)
    for name in unsharded_sections(args.sections):
        report["sections"][name] = {"skipped": _CANNOT_SHARD}
        print(f"\n{name}: not run: {_CANNOT_SHARD}", flush=True)
    if "memory" in args.sections and SHARDING.available():
        section = memory.run(args.device, args.memory_width, args.memory_layers)
        report["sections"]["memory"] = section
        print("\n" + memory.memory_table(section), flush=True)
        section["build"] = build_memory.run(args.device, args.build_width, args.build_layers,
                                            llama_width=args.build_llama_width,
                                            llama_layers=args.build_llama_layers, runs=args.build_runs)
        print("\n" + build_memory.build_table(section["build"]), flush=True)
        section["activations"] = activation_memory.run(args.activation_width, args.activation_layers,
                                                       args.activation_tokens)
        print("\n" + activation_memory.activation_table(section["activations"]), flush=True)
    if "resume" in args.sections and SHARDING.available():
        section = resume.run(widths=args.resume_widths, emulated=args.resume_ranks, repeats=args.resume_repeats)
        report["sections"]["resume"] = section
        print("\n" + resume.resume_table(section), flush=True)
    if "tp" in args.sections:
        if TENSOR_PARALLEL.available():
            section = tensor_parallel.run(tensor_parallel.LlamaShape.of(args.tp_width, args.tp_layers,
                                                                         args.tp_vocab, args.tp_tokens))
        else:
            section = {"skipped": f"{TENSOR_PARALLEL.name} needs torch >= {TENSOR_PARALLEL.needs[0]}."
                                  f"{TENSOR_PARALLEL.needs[1]}; this is torch {torch.__version__}"}
        report["sections"]["tp"] = section
        print("\n" + tensor_parallel.tp_table(section), flush=True)
    if "cp" in args.sections:
        if TENSOR_PARALLEL.available():
            width = args.cp_width
            section = context_parallel.run(context_parallel.WindowShape(
                width=width, layers=args.cp_layers, heads=max(2, width // 32), kv_heads=max(1, width // 128),
                tokens=args.cp_tokens,
                budget_mib=args.cp_budget_mib, longest_tried=args.cp_longest))
        else:
            section = {"skipped": f"{TENSOR_PARALLEL.name} needs torch >= {TENSOR_PARALLEL.needs[0]}."
                                  f"{TENSOR_PARALLEL.needs[1]}; this is torch {torch.__version__}"}
        report["sections"]["cp"] = section
        print("\n" + context_parallel.cp_table(section), flush=True)
    if "scale" in args.sections:
        section = scale.run(tuple(int(n) for n in args.scale_ranks.split(",")), args.scale_silence,
                            args.scale_beats_per_s)
        report["sections"]["scale"] = section
        print("\n" + scale.scale_table(section), flush=True)
    if "data" in args.sections:
        section = data.run(args.data_copies, args.data_trials)
        report["sections"]["data"] = section
        print("\n" + data.data_table(section), flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    args = _defaults(build_parser().parse_args(argv))
    report = run(args)
    if args.json:
        path = Path(args.json)
        scratch = path.with_name(path.name + ".tmp")
        scratch.write_text(json.dumps(report, indent=2) + "\n")
        os.replace(scratch, path)  # a failed run never leaves half a file
        print(f"\nwrote {path}")
    return check(report) if args.check else 0


def check(report: dict[str, Any]) -> int:
    """Print every stated target of `report` and how it fared; 1 if any was missed, else 0."""
    print("\n" + check_text(report), flush=True)
    missed = [outcome.where for outcome in check_report(report)[0] if outcome.met is False]
    if missed:
        print(f"ddp_amp.bench: targets missed: {'; '.join(missed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    exit_process(main())
