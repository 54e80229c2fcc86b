"""The benchmark's figures as readable text tables (the JSON holds the same numbers)."""

from __future__ import annotations

import math
from typing import Any

from ddp_amp.bench.targets import verdict_text


def _num(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return f"{value:.{digits}g}"
    return str(value)


def grid(headers: list[str], rows: list[list[Any]]) -> str:
    """Left-aligned columns separated by two spaces, with a rule under the header."""
    cells = [headers] + [[_num(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def ratio_text(ratio: dict[str, float]) -> str:
    """'1.02 [IQR 0.99-1.05, min-max 0.95-1.10, n=20]'."""
    return (f"{ratio['median']:.3f} [IQR {ratio['q1']:.3f}-{ratio['q3']:.3f}, "
            f"min-max {ratio['min']:.3f}-{ratio['max']:.3f}, n={ratio['pairs']}]")


def host_table(section: dict[str, Any]) -> str:
    size = section["size"]
    title = (f"Host time per step: Trainer and Session loop / hand-written AMP loop on {size['layers']} x "
             f"Linear({size['width']},{size['width']}), batch {size['batch']} (compute negligible), 1 thread, "
             f"{section['blocks']} interleaved blocks x {section['steps_per_block']} steps")
    rows = [[row["loop"], row["precision"], row.get("variant") or (f"group of {row['ranks']} (DDP)" if row["ddp"]
                                                                   else "none"),
             row["step_us"]["hand"], row["step_us"][row["loop"]], row["extra_us"],
             ratio_text(row["over_hand"]), row["target"], {True: "yes", False: "NO", None: "n/a"}[row["meets_target"]]]
            for row in section["rows"]]
    return title + "\n" + grid(["loop", "precision", "process group", "hand us", "loop us", "extra us",
                                "loop / hand", "target", "met"], rows)


def recipe_table(section: dict[str, Any]) -> str:
    size = section["size"]
    title = (f"AMP recipe: {size['layers']} x Linear({size['width']},{size['width']}) (+ReLU), batch "
             f"{size['batch']}, {section['batches']} batches x {section['epochs']} epochs, "
             f"scale {section['scale']:g}; memory = {section['memory']}")
    rows = [[t["precision"], t["total_s"], t["step_ms"], t["peak_mem_mb"], t["peak_over_start_mb"],
             t["speedup_vs_fp32"], t["tflops"], t["mfu_vs_bf16_peak"]] if "total_s" in t else
            [t["precision"], "skipped: " + t["skipped"], "", "", "", "", "", ""] for t in section["trials"]]
    return title + "\n" + grid(["trial", "total_s", "step_ms", "peak_mem_mb", "over_start_mb",
                                "speedup_vs_fp32", "TFLOP/s", "MFU_vs_bf16_peak"], rows)


def overhead_table(section: dict[str, Any]) -> str:
    parts = []
    for key, label in (("recipe_model", "recipe model"), ("tiny_model", "tiny model")):
        run = section[key]
        size = run["size"]
        steps = ", ".join(f"{name} {ms:.3g} ms" for name, ms in run["step_ms"].items())
        ddp = " with DDP" if run.get("ddp") else ""
        lines = [f"Overhead, {label} ({size['layers']} x Linear({size['width']},{size['width']}), batch "
                 f"{size['batch']}/rank, {run['precision']}, {run['ranks']} ranks{ddp}, {run['blocks']} blocks x "
                 f"{run['steps_per_block']} steps, interleaved): median step {steps}",
                 f"  trainer / hand-written recipe: {ratio_text(run['trainer_over_hand'])}"
                 + (f" ({verdict_text(run)})" if "target" in run else ""),
                 f"  found-inf all-reduces run by the trainer (one per step with peers): {run['agreements']}"]
        parts.append("\n".join(lines))
    cost = section["agreement_cost"]
    parts.append(f"Agreed overflow decision, tiny model, {cost['compute']}, {cost['ranks']} ranks, "
                 f"{cost['blocks']} blocks x {cost['steps_per_block']} steps: median step "
                 f"without the agreement {cost['step_ms']['unagreed']:.3g} ms, with it "
                 f"{cost['step_ms']['agreed']:.3g} ms\n  agreed / unagreed: "
                 + ratio_text(cost["agreed_over_unagreed"]))
    return "\n".join(parts)


def fastpaths_table(section: dict[str, Any]) -> str:
    size = section["size"]
    title = (f"Fast paths ({size['layers']} x Linear({size['width']},{size['width']}), batch {size['batch']}/rank, "
             f"{section['precision']}, {section['ranks']} ranks): ratio = step time on / off, < 1 is faster")
    rows = []
    for row in section["rows"]:
        if "skipped" in row:
            rows.append([row["name"], "-", "-", "skipped: " + row["skipped"]])
        else:
            rows.append([row["name"], row["off_ms"], row["on_ms"], ratio_text(row["ratio"])])
    return title + "\n" + grid(["fast path", "off_ms", "on_ms", "ratio on/off [spread]"], rows)


def transformer_table(section: dict[str, Any]) -> str:
    shape = section["shape"]
    title = (f"Transformer: GPT-2-shaped decoder, {shape['layers']} layers, width {shape['width']}, "
             f"{shape['heads']} heads, vocab {shape['vocab']}, {section['parameters'] / 1e6:.1f}M parameters, "
             f"batch {shape['batch']} x {shape['sequence']} tokens, fused AdamW; {section['blocks']} interleaved "
             f"blocks x {section['steps_per_block']} steps; MFU against the GPU's dense peak for the precision")
    rows, notes = [], []
    for row in section["rows"]:
        mode = "compiled" if row.get("compiled") else "eager"
        if "skipped" in row:
            notes.append(f"{row['precision']}: not run: {row['skipped']}")
            continue
        if "failed" in row:
            notes.append(f"{row['precision']} {mode}: failed: {row['failed'][:300]}")
            continue
        peaks = row["peak_mem_mb"]
        loss_eager = row.get("loss_eager_over_compiled")
        rows.append([row["precision"], mode, row["step_ms"]["hand"], row["step_ms"]["trainer"],
                     ratio_text(row["trainer_over_hand"]), row["tokens_per_s"], row["tflops"], row["mfu"],
                     peaks.get("hand"), peaks.get("trainer"),
                     f"{loss_eager['median']:.3f}" if loss_eager else "-"])
    text = title + "\n" + grid(["precision", "mode", "hand ms", "trainer ms", "trainer / hand",
                                "tokens/s", "TFLOP/s", "MFU", "hand peak MB", "trainer peak MB",
                                "loss eager / compiled"], rows)
    if "fp8_speedup_over_bf16_compiled" in section:
        notes.append(f"fp8 over bf16, compiled Trainer steps: {section['fp8_speedup_over_bf16_compiled']:.3f}x faster")
    return "\n".join([text, *notes])
