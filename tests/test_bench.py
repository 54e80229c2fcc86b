"""`python -m ddp_amp.bench`: --help, and a tiny CPU run of every section with its JSON and `--check`.

Structure and sanity only (every trial printed, ratios positive and finite); whether a
target is met is the benchmark's business, not the tests'. How `--check` compares is
tested on the tiny run's own result dicts, with figures set on either side of each target.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import subprocess
import sys
from typing import Any

import pytest

from ddp_amp.bench import overhead, transformer
from ddp_amp.bench.__main__ import check
from ddp_amp.bench.targets import check_report, target_fields
from ddp_amp.torch_api import GLOO_CONNECTS_LAZILY, SHARDING, TENSOR_PARALLEL
from tests.multiproc import REPO_ROOT, cli_env

Run = tuple[list[subprocess.CompletedProcess[str]], dict[str, Any]]


def _bench(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ddp_amp.bench", *args], capture_output=True, text=True,
                          timeout=timeout, env=cli_env(), cwd=REPO_ROOT)


def _sane_ratio(ratio: dict[str, Any]) -> None:
    for key in ("median", "q1", "q3", "min", "max"):
        assert math.isfinite(ratio[key]) and ratio[key] > 0, ratio
    assert ratio["min"] <= ratio["q1"] <= ratio["median"] <= ratio["q3"] <= ratio["max"], ratio
    assert ratio["pairs"] >= 2


def test_help_describes_every_section() -> None:
    result = _bench("--help", timeout=60)
    assert result.returncode == 0, result.stderr
    for word in ("--json", "--scale", "--sections", "overhead", "fastpaths", "GradScaler", "peak RSS",
                 "transformer", "MFU"):
        assert word in result.stdout, word


@pytest.mark.parametrize(("bad", "named"), [(("--sections", "recipe,nope"), "nope"),
                                            (("--resume-widths", "wide"), "'wide' for --resume-widths")])
def test_a_bad_value_is_a_one_line_usage_error(bad: tuple[str, str], named: str) -> None:
    result = _bench(*bad, timeout=60)
    assert result.returncode == 2
    assert named in result.stderr and "Traceback" not in result.stderr and len(result.stderr.splitlines()) == 1


# The tiny run's sections in two processes at once, about equal halves: most sections leave one
# of the two cores idle (one process, or ranks waiting on each other). The first half holds the
# sections that state no target, so that its --check names them on one line.
TINY_HALVES = ("recipe,fastpaths,checkpoint,memory,data", "host,overhead,transformer,resume,scale,tp,cp")
TINY_ARGS = ("--device", "cpu", "--scale", "0.004", "--batches", "2", "--epochs", "1",
             "--blocks", "2", "--steps-per-block", "1", "--transformer-precisions", "fp32,fp8",
             "--memory-width", "64", "--memory-layers", "4",
             "--build-width", "64", "--build-layers", "4", "--build-llama-width", "64",
             "--build-llama-layers", "1", "--build-runs", "1",
             "--activation-width", "32", "--activation-layers", "2", "--activation-tokens", "16",
             "--scale-ranks", "16", "--scale-silence", "2", "--resume-ranks", "4,16", "--resume-widths", "256",
             "--resume-repeats", "1",
             "--data-copies", "1", "--data-trials", "1",
             "--tp-width", "64", "--tp-layers", "1", "--tp-vocab", "512", "--tp-tokens", "16",
             "--cp-width", "64", "--cp-layers", "1", "--cp-tokens", "1024", "--cp-budget-mib", "20",
             "--cp-longest", "1024")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """A tiny CPU run of every section, with --check and --json, for the tests below: each half
    of the sections one process, and their reports' sections together in one report."""
    folder = tmp_path_factory.mktemp("bench")
    outs = [folder / f"bench-{half}.json" for half in range(len(TINY_HALVES))]
    procs = [subprocess.Popen([sys.executable, "-m", "ddp_amp.bench", *TINY_ARGS, "--sections", sections,
                               "--check", "--json", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=cli_env(), cwd=REPO_ROOT)
             for sections, out in zip(TINY_HALVES, outs)]
    results = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=400)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    for result in results:
        assert result.returncode in (0, 1) and "Traceback" not in result.stderr, result.stderr[-3000:]
    first, *others = [json.loads(out.read_text()) for out in outs]
    for other in others:
        assert {key: value for key, value in other.items() if key not in ("sections", "command", "date")} == {
            key: value for key, value in first.items() if key not in ("sections", "command", "date")}
        first["sections"].update(other["sections"])
    return results, first


def test_tiny_cpu_run_prints_every_figure_and_writes_json(tiny_run: Run) -> None:
    results, report = tiny_run
    text = "".join(result.stdout for result in results)
    for trial in ("fp32", "fp16", "bf16"):
        assert f"\n{trial} " in text, trial
    assert "trainer / hand-written recipe:" in text and "IQR" in text
    assert "Agreed overflow decision" in text and "agreed / unagreed" in text and "pinned non-blocking H2D copy" in text

    assert report["device"] == "cpu" and report["torch"] == __import__("torch").__version__
    assert report["date"] and report["device_name"]
    recipe = report["sections"]["recipe"]
    assert [t["precision"] for t in recipe["trials"]] == ["fp32", "fp16", "bf16"]
    for trial in recipe["trials"]:
        assert trial["total_s"] > 0 and trial["peak_mem_mb"] > 0 and trial["speedup_vs_fp32"] > 0
        assert math.isfinite(trial["final_loss"])
    host = report["sections"]["host"]
    assert [(r["loop"], r["precision"], r.get("ddp", r.get("variant"))) for r in host["rows"]] == [
        (loop, p, ddp) for ddp in (False, True) for p in ("fp32", "bf16", "fp16") for loop in ("trainer", "session")
    ] + ([("session", p, "sharded over 2 ranks") for p in ("fp32", "bf16")] if SHARDING.available() else [])
    for row in host["rows"]:
        _sane_ratio(row["over_hand"])
        assert row["meets_target"] == (row["over_hand"]["median"] <= row["target"])
    assert "Host time per step" in text
    overhead = report["sections"]["overhead"]
    for model in ("recipe_model", "tiny_model"):
        _sane_ratio(overhead[model]["trainer_over_hand"])
        # every fp16 step of the Trainer with a peer agreed on its skip decision
        assert overhead[model]["agreements"] >= 2
    _sane_ratio(overhead["agreement_cost"]["agreed_over_unagreed"])
    assert overhead["agreement_cost"]["agreements"] >= 2
    rows = {row["name"]: row for row in report["sections"]["fastpaths"]["rows"]}
    assert "skipped" in rows["pinned non-blocking H2D copy"]
    measured = [row for row in rows.values() if "ratio" in row]
    assert len(measured) >= 5
    for row in measured:
        _sane_ratio(row["ratio"])
    transformer = report["sections"]["transformer"]
    rows = {row["precision"]: row for row in transformer["rows"]}
    assert set(rows) == {"fp32", "fp8"}
    # No float8 matmuls on a CPU, and no torchao for torch 2.4: either way the row says why.
    why = "compute capability 8.9" if importlib.util.find_spec("torchao") else "torchao is not installed"
    assert why in rows["fp8"]["skipped"], rows["fp8"]
    for name in ("fp32",):
        row = rows[name]
        _sane_ratio(row["trainer_over_hand"])
        assert row["tokens_per_s"] > 0 and row["flops_per_step"] > 0 and row["tflops"] > 0
        assert row["mfu"] is None  # no known peak on a CPU: no guessed MFU
    # 6 x parameters x tokens is the usual estimate of a step's matmul FLOPs; the count
    # leaves out embedding lookups and adds attention, so it lands near the estimate.
    estimate = 6 * transformer["parameters"] * transformer["shape"]["batch"] * transformer["shape"]["sequence"]
    assert 0.5 * estimate < rows["fp32"]["flops_per_step"] < 2 * estimate
    assert "Transformer: GPT-2-shaped decoder" in text and "fp8: not run" in text
    # Each rank's peak while built sharded, the stack's and a transformers Llama's: shares of a
    # few KiB or MiB are shown but not held to the target.
    if SHARDING.available():  # else not run (test_check_lists_every_target... checks the reason)
        build = report["sections"]["memory"]["build"]
        llama_row, *split_rows = build["llama"]["rows"]  # and, where torch splits, one built split 2 x sharded 2
        assert len(split_rows) == int(TENSOR_PARALLEL.available())
        assert all(len(row["of_share_per_rank"]) == 4 for row in [llama_row, *split_rows])
        assert "transformers LlamaForCausalLM" in text
        sharded = [row for row in [*build["rows"], llama_row, *split_rows] if "target" in row]
        assert len(sharded) == 4 + len(split_rows)
        assert all(row["meets_target"] is None and "too small" in row["target_note"] for row in sharded)
    # What a rank holds of a small Llama split over 2 and 4 ranks, and sharded over as many: the
    # parameters fall about as 1/N either way; the targets apply from a width of 1024.
    if TENSOR_PARALLEL.available():
        rows = report["sections"]["tp"]["rows"]
        assert [(row["layout"], row["ranks"]) for row in rows] == [
            ("one rank", 1), ("sharded", 2), ("split", 2), ("sharded", 4), ("split", 4)]
        for row in rows[1:]:
            assert 0.9 / row["ranks"] < row["parameters_ratio"] < 1.3 / row["ranks"], row
        assert all(check["meets_target"] is None for row in rows for check in row.get("target_checks", []))
        assert "Tensor parallel: per rank, a Llama of width 64" in text
        # One window split over 1, 2 and 4 ranks: the activations fall with N, the keys and values
        # gathered are reported, and the longer windows fit the same budget; the target needs 4,096 tokens.
        rows = report["sections"]["cp"]["rows"]
        assert [row["ranks"] for row in rows] == [1, 2, 4]
        assert rows[0]["activations"] > rows[1]["activations"] > rows[2]["activations"], rows
        assert rows[0]["gathered"] == 0 and rows[1]["gathered"] > 0 and rows[2]["flops_per_gathered_byte"] > 0
        assert rows[0]["longest_within_budget"] <= rows[1]["longest_within_budget"] <= rows[2]["longest_within_budget"]
        assert rows[2]["longest_within_budget"] > rows[0]["longest_within_budget"], rows
        assert all(check["meets_target"] is None for row in rows for check in row.get("target_checks", []))
        assert "Context parallel: per rank, one window of 1024 tokens" in text
    # The real judges against one real store, 16 ranks each with its own connection, one
    # stopping: named, and no other; the rate achieved is reported beside the one asked.
    (scale_row,) = report["sections"]["scale"]["rows"]
    assert scale_row["ranks"] == 16 and scale_row["false_names"] == 0 and scale_row["detection_s"] is not None
    assert scale_row["line"].startswith("ddp_amp: rank 15 went silent"), scale_row
    assert 0 <= scale_row["store_cpu_share"] < 1 and 0 <= scale_row["judge_cpu_share"] < 1
    assert scale_row["beats_per_s_asked"] == 14 / 0.5 and scale_row["beats_per_s"] > 0
    # The store's descriptors: one a connection of the 14 emulated helpers, the 2 judges' and
    # their helpers', the bench's own client.
    assert 14 <= scale_row["store_fds"] <= 14 + 2 + 2 + 1, scale_row
    data = report["sections"]["data"]
    ours, theirs = data["tokenize"]["rows"]
    assert ours["contender"] == "ddp_amp" and theirs["contender"] == "datasets.map"
    assert ours["documents"] == theirs["documents"] > 0
    assert ours["tokens"] == theirs["tokens"] + ours["documents"]  # the same tokens, and an EOS per document
    assert 0 < data["loader"]["draw_s"] < data["loader"]["step_s"]
    assert [row["windows"] for row in data["memory"]["rows"]] == [1_000, 1_000_000_000]
    assert "data: a rank opening a cache entry" in text
    # Rank 0's share of a save and a resume at 4 and 16 emulated ranks: the same file operations.
    if SHARDING.available():
        verified = report["sections"]["resume"]["rows"]
        assert [(row["width"], row["ranks"]) for row in verified] == [(256, 1), (256, 2), (256, 4)]
        assert all(row["found"] and row["meets_target"] for row in verified), verified
        small, large = report["sections"]["resume"]["rank_zero"]["rows"]
        assert (small["ranks"], large["ranks"]) == (4, 16) and small["save_ops"] == large["save_ops"] > 0
        assert small["resume_ops"] == large["resume_ops"] > 0 and "rank 0's share at N emulated ranks" in text
        # What the reports' exchange carries does not grow with N, and no target is a time the
        # machine's load decides: rank 0's targets are counts.
        assert small["exchanged_bytes"] == large["exchanged_bytes"] == 1_028
        checks = report["sections"]["resume"]["rank_zero"]["target_checks"]
        assert len(checks) == 6 and not [check for check in checks if "time" in check["figure"]], checks
        # The saves' own gloo group on 4 real ranks: each rank connects to its ring's two
        # neighbours over a background save, not to every other rank (3 each before).
        group = report["sections"]["resume"]["saves_group"]
        assert group["ranks"] == 4 and group["saved"], group
        if GLOO_CONNECTS_LAZILY:
            assert group["opened"] == [2, 2, 2, 2] and group["meets_target"], group


def test_check_lists_every_target_and_exits_1_exactly_when_one_is_missed(tiny_run: Run) -> None:
    results, report = tiny_run
    host = report["sections"]["host"]["rows"]
    missed = [row for row in host if row["over_hand"]["median"] > row["target"]]
    for result, sections in zip(results, TINY_HALVES):  # each process's exit: its own sections' targets
        own = {"device": report["device"],
               "sections": {name: report["sections"][name] for name in sections.split(",")}}
        any_missed = [outcome for outcome in check_report(own)[0] if outcome.met is False]
        assert result.returncode == (1 if any_missed else 0), result.stderr[-3000:]
    blocks = [result.stdout[result.stdout.index("Targets (--check) on cpu:"):] for result in results]
    text = "".join(blocks)
    lines = [line for block in blocks for line in block.splitlines()[1:]]
    # compared on any device; the sharded rows where torch shards
    assert len([line for line in lines if " host " in line]) == len(host) == (14 if SHARDING.available() else 12)
    assert all(line.lstrip().startswith(("met ", "MISSED ")) for line in lines if " host " in line)
    for where in ("overhead recipe model", "overhead tiny model", "transformer fp32 eager",
                  "transformer: compiled bf16 MFU"):  # a GPU's targets: not applicable on a CPU, and said so
        line = next(line for line in lines if where in line)
        assert line.lstrip().startswith("n/a ") and "this run is on cpu" in line, line
    assert "no targets stated: recipe, fastpaths, checkpoint" in text
    sharded = [line for line in lines if line.lstrip().startswith("met ") and " memory sharded" in line]
    if SHARDING.available():
        assert len(sharded) == 6
    else:  # the sections that shard are not run, and the run says why
        assert not sharded and "memory: not run: sharding (FSDP2) needs torch >= 2.7" in results[0].stdout
        assert report["sections"]["resume"] == {"skipped": report["sections"]["memory"]["skipped"]}
    assert ("targets missed: host" in results[1].stderr) == bool(missed)


def test_a_missed_target_fails_the_check_also_in_a_row_added_later(tiny_run: Run,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    report = {"device": "cpu", "sections": {"host": copy.deepcopy(tiny_run[1]["sections"]["host"])}}
    rows = report["sections"]["host"]["rows"]
    for row in rows:
        row.update(target_fields("trainer / hand", 0.95 * row["target"], row["target"]))
    assert check(report) == 0
    fp16 = next(index for index, row in enumerate(rows) if (row["loop"], row["precision"]) == ("trainer", "fp16"))
    rows[fp16].update(target_fields("trainer / hand", 1.06 * rows[fp16]["target"], rows[fp16]["target"]))
    assert check(report) == 1
    out = capsys.readouterr()
    assert "MISSED  host trainer fp16, no group: trainer / hand 1.11, target at most 1.05" in out.out
    assert out.err.strip().endswith("targets missed: host trainer fp16, no group")

    rows[fp16].update(target_fields("trainer / hand", rows[fp16]["target"], rows[fp16]["target"]))  # on the line
    rows.append({"loop": "session", "precision": "bf16", "ddp": False, "target": 1.05, "meets_target": False})
    assert check(report) == 1  # a row of a new kind, with only a target and its verdict
    assert capsys.readouterr().err.strip().endswith("targets missed: host session bf16, no group")


def test_gpu_targets_are_compared_on_a_gpu_and_not_applicable_on_a_cpu(tiny_run: Run,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    sections = {name: copy.deepcopy(tiny_run[1]["sections"][name]) for name in ("overhead", "transformer")}
    report = {"device": "cuda", "sections": sections}
    bench_overhead, bench_transformer = sections["overhead"], sections["transformer"]
    rows = bench_transformer["rows"]
    fp32 = next(row for row in rows if row["precision"] == "fp32")
    fp32["trainer_over_hand"]["median"] = 1.0
    bf16 = dict(copy.deepcopy(fp32), precision="bf16", compiled=True, mfu=0.55)
    rows.append(bf16)
    bench_overhead["recipe_model"]["trainer_over_hand"]["median"] = 1.01
    bench_overhead["tiny_model"]["trainer_over_hand"]["median"] = 1.04

    def checked(device: str) -> tuple[int, str]:
        overhead.add_targets(bench_overhead, device)
        transformer.add_targets(bench_transformer, device)
        code = check(report)
        return code, capsys.readouterr().out

    code, text = checked("cuda")
    assert code == 0 and text.count("met ") == 5, text  # 2 overhead models, 2 transformer rows, the MFU
    assert "n/a     transformer fp8" in text  # a precision this GPU could not run: says so, does not fail
    bf16["mfu"] = 0.3
    code, text = checked("cuda")
    assert code == 1 and "MISSED  transformer: compiled bf16 MFU 0.3, target at least 0.5" in text, text
    bf16["mfu"] = 0.55
    bench_overhead["recipe_model"]["trainer_over_hand"]["median"] = 1.03
    code, text = checked("cuda")
    assert code == 1 and "MISSED  overhead recipe model" in text, text
    rows.append({"precision": "fp16", "compiled": False, "failed": "RuntimeError: out of memory"})
    bench_overhead["recipe_model"]["trainer_over_hand"]["median"] = 1.01
    code, text = checked("cuda")
    assert code == 1 and "MISSED  transformer fp16 eager: trainer / hand, target at most 1.02 (not measured)" in text

    code, text = checked("cpu")  # the same figures on a CPU: none of these targets applies
    assert code == 0 and "MISSED" not in text and "met " not in text, text
