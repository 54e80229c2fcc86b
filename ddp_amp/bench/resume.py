"""What a resume reads and hashes on each rank, and rank 0's share of a save and a resume at scale.

    python -m ddp_amp.bench --sections resume --check

For 1, 2 and 4 real gloo ranks and two model sizes, a `Session` shards a stack of Linear
layers (FSDP2) with AdamW state, saves it as a real checkpoint on disk, and then finds it
again as a resume does (`Session.latest`: rank 0 checks that the files are there, each rank
hashes the files it reads, all agree), timed on every rank, with a fresh checkpointer so
nothing is remembered from the save. Each rank reports the bytes it hashed, beside its own
shards, RNG file and record plus the replicated files (what it reads) and the whole
checkpoint (what rank 0 alone hashed before, while the others waited). Target, checked by
`--check`: no rank hashes more than its own files plus the replicated files (ratio at most 1).

Then the connections of the saves' own process group (`--async-checkpoint`'s, gloo beside
training's collectives) on the largest number of real ranks: each rank's TCP connections
other than the store's, before a background save of a small replicated model and after its
outcome. The group connects a pair of ranks when a collective first joins them, and the
reports' exchange is an all-reduce, a ring: target, two peers a rank at most, at any N (a
group that connected every pair as it formed, with a gather to rank 0, held N-1 a rank).

Then rank 0's time and file operations at save and at resume with 64 to 16,384 emulated
ranks' files on local disk, flat in N (rank_zero.py).
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddp_amp.bench import rank_zero
from ddp_amp.bench.table import grid
from ddp_amp.bench.targets import target_fields
from ddp_amp.checkpoint.verify import check_own_files, verify_checkpoint
from ddp_amp.distributed import DistContext
from ddp_amp.distributed.spawn import run_ranks
from ddp_amp.parallel import ShardOptions
from ddp_amp.session import Session
from ddp_amp.torch_api import GLOO_CONNECTS_LAZILY

RANKS = (1, 2, 4)
PEERS_TARGET = 2  # a ring's neighbours
_ESTABLISHED = "01"
WIDTHS = (256, 1024)  # 4 layers: 0.26M and 4.2M parameters; with AdamW's moments, 3 and 50 MB
LAYERS = 4
# A rank's own files: its shards, its RNG file and per-rank values, its record.
_OWN = re.compile(r"^(?:sharded/__(\d+)_\d+\.distcp|(?:rng|per_rank)/rank-(\d+)\.pt|ranks/rank-(\d+)\.json)$")


def _reads(listed: dict[str, Any], rank: int) -> tuple[int, int]:
    """(bytes of this rank's own shards, RNG file and record plus the replicated files, bytes
    of all), counted from the checkpoint's full listing apart from the rule verify.py applies."""
    own = total = 0
    for name, record in listed.items():
        size, owned = int(record["size"]), _OWN.match(name)
        total += size
        if owned is None or int(next(value for value in owned.groups() if value is not None)) == rank:
            own += size
    return own, total


def _rank(ctx: DistContext, root: str, width: int) -> dict[str, Any]:
    """Save a sharded checkpoint, then find it again as a resume does, timed (collective)."""
    with Session("fp32", "cpu", backend="gloo", environ=os.environ, shard=ShardOptions()) as session:
        torch.manual_seed(0)
        model = session.setup(nn.Sequential(*[nn.Linear(width, width) for _ in range(LAYERS)]))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        session.backward(model(torch.randn(4, width)).square().mean())
        session.step(optimizer)
        path = Path(root) / "step-00000001"
        session.save(path, {"model": model, "optimizer": optimizer})
        session.all_reduce(torch.zeros(1))  # every rank starts the clock together
        started = time.perf_counter()
        found = session.latest(root)  # a checkpoint just written counts as unverified
        seconds = time.perf_counter() - started
        own = check_own_files(path, ctx.rank, ctx.world_size)  # what that check hashed here
    listed = verify_checkpoint(path)["files"]  # every file, each rank's too
    reads, total = _reads(listed, ctx.rank)
    return {"rank": ctx.rank, "found": found == path, "verify_s": seconds, "bytes_hashed": own.bytes_hashed,
            "files_hashed": own.files, "reads_bytes": reads, "checkpoint_bytes": total, "files": len(listed)}


def _peer_connections(store_port: int) -> int:
    """This process's established TCP connections other than to or from the group's store
    (on `store_port`): its process groups' connections between ranks."""
    fds = Path("/proc/self/fd")
    sockets = set()
    for fd in fds.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed since the listing
            continue
        if target.startswith("socket:["):
            sockets.add(target[8:-1])
    count = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            fields = row.split()
            ports = {int(fields[1].rsplit(":", 1)[1], 16), int(fields[2].rsplit(":", 1)[1], 16)}
            if fields[9] in sockets and fields[3] == _ESTABLISHED and store_port not in ports:
                count += 1
    return count


def saves_group_connections(ctx: DistContext, root: str) -> dict[str, Any]:
    """The connections this rank opened for the saves' own group, over one background save
    of a small replicated model (collective): training's group is connected already."""
    with Session("fp32", "cpu", backend="gloo", environ=os.environ) as session:
        torch.manual_seed(0)
        model = session.setup(nn.Linear(8, 8))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        before = _peer_connections(ctx.env.master_port)
        session.save(Path(root) / "step-00000001", {"model": model, "optimizer": optimizer}, background=True)
        saved = session.wait_for_save()
        opened = _peer_connections(ctx.env.master_port) - before
    return {"rank": ctx.rank, "opened": opened, "saved": saved is not None}


def _rank_then_saves_group(ctx: DistContext, root: str, width: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """`_rank`, then `saves_group_connections`, in the same processes (collective): one start
    of the ranks for both."""
    return _rank(ctx, root, width), saves_group_connections(ctx, str(Path(root) / "saves-group"))


def _saves_group(world_size: int, results: list[dict[str, Any]]) -> dict[str, Any]:
    opened = [result["opened"] for result in results]
    lazy = "" if GLOO_CONNECTS_LAZILY else "this torch's gloo connects every pair as a group forms"
    return {"ranks": world_size, "opened": opened, "saved": all(result["saved"] for result in results),
            **target_fields("connections a rank opened, most", max(opened), PEERS_TARGET, not_here=lazy)}


def run(ranks: tuple[int, ...] = RANKS, widths: tuple[int, ...] = WIDTHS,
        emulated: tuple[int, ...] = rank_zero.RANKS, repeats: int = rank_zero.REPEATS) -> dict[str, Any]:
    """Every (width, ranks) case: each rank's verification time and bytes hashed; then rank 0's
    share at each of `emulated` world sizes (rank_zero.py)."""
    rows: list[dict[str, Any]] = []
    group: dict[str, Any] = {}
    for width in widths:
        for world_size in ranks:
            with tempfile.TemporaryDirectory() as scratch:
                if not group and world_size == max(ranks):  # the saves' group measured there too
                    both = run_ranks(_rank_then_saves_group, world_size, scratch, width, threads=1)
                    results, group = [first for first, _ in both], _saves_group(world_size, [last for _, last in both])
                else:
                    results = run_ranks(_rank, world_size, scratch, width, threads=1)
            worst = max(result["bytes_hashed"] / max(result["reads_bytes"], 1) for result in results)
            rows.append({
                "width": width, "ranks": world_size, "checkpoint_mb": results[0]["checkpoint_bytes"] / 2**20,
                "files": results[0]["files"], "found": all(result["found"] for result in results),
                "verify_s": [result["verify_s"] for result in results],
                "hashed_mb": [result["bytes_hashed"] / 2**20 for result in results],
                "reads_mb": [result["reads_bytes"] / 2**20 for result in results],
                **target_fields("hashed / (own files + replicated), worst rank", worst, 1.0)})
    return {"rows": rows, "saves_group": group, "rank_zero": rank_zero.run(emulated, repeats)}


def resume_table(section: dict[str, Any]) -> str:
    """The section as a table: a row per (width, ranks), per-rank figures joined by '/'."""
    def each(values: list[float], digits: int) -> str:
        return "/".join(f"{value:.{digits}f}" for value in values)

    lines = [[str(row["width"]), str(row["ranks"]), f"{row['checkpoint_mb']:.1f}", str(row["files"]),
              each(row["verify_s"], 3), each(row["hashed_mb"], 2), each(row["reads_mb"], 2),
              f"{row['measured']:.2f}", "yes" if row["found"] else "NO"] for row in section["rows"]]
    group = section["saves_group"]
    peers = (f"resume: the saves' own group (--async-checkpoint) at {group['ranks']} ranks: connections each rank "
             f"opened over a background save {'/'.join(map(str, group['opened']))} (target at most {PEERS_TARGET}: "
             "a ring's neighbours; a group connecting every pair, N-1)")
    return "resume: verification on each rank (rank 0/1/...)\n" + grid(
        ["width", "ranks", "ckpt MB", "files", "verify s", "hashed MB", "reads MB", "worst ratio", "found"],
        lines) + "\n\n" + peers + "\n\n" + rank_zero.rank_zero_table(section["rank_zero"])
