"""`python -m ddp_amp.doctor`: what the launch environment resolved to, and what is wrong with it.

    python -m ddp_amp.doctor                                  # this shell: launcher, device, precision, shard
    srun --ntasks-per-node=4 python -m ddp_amp.doctor --probe # every task, plus a timed all-reduce
    torchrun --nproc-per-node=2 -m ddp_amp.doctor --probe

It reuses the library's own resolution (`detect_env`, `resolve_device`, `resolve_backend`,
`resolve_precision`), so it reports exactly what `ddp_amp.train` would do, and flags the
classic mistakes: SLURM variables without `srun`, a MASTER_ADDR that does not resolve, a
port already in use, tasks per node that do not match the GPUs. `--probe` joins the process
group and times all-reduces: latency of a 1-element tensor and bandwidth of a large one.
Exit code 0 when nothing is an error, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ddp_amp.config import TrainConfig
from ddp_amp.distributed import (DistContext, all_gather_objects, all_reduce_, init_distributed,
                          resolve_backend, resolve_device, shutdown_distributed)
from ddp_amp.env import DistEnv, detect_env, launched_by_srun, launched_by_torchrun
from ddp_amp.errors import UsageError
from ddp_amp.amp import resolve_precision
from ddp_amp.amp.float8 import fp8_unavailable
from ddp_amp.fast_exit import exit_process

Finding = tuple[str, str]  # (level: ok | warn | error, message)


def check_srun(environ: Mapping[str, str]) -> list[Finding]:
    """SLURM job variables but no srun step: the batch shell runs one process, not the job."""
    if "SLURM_JOB_ID" not in environ or launched_by_torchrun(environ) or launched_by_srun(environ):
        return []
    tasks = environ.get("SLURM_NTASKS", "1")
    level = "error" if tasks not in ("", "1") else "warn"
    return [(level, f"inside SLURM job {environ['SLURM_JOB_ID']} ({tasks} task(s)) but not started "
             "by srun: this runs ONE process; start it with `srun python -m ddp_amp.train` "
             "(or one torchrun per node)")]


def check_master_addr(env: DistEnv) -> list[Finding]:
    try:
        addresses = sorted({str(info[4][0]) for info in socket.getaddrinfo(env.master_addr, env.master_port)})
    except socket.gaierror as error:
        return [("error", f"MASTER_ADDR {env.master_addr!r} does not resolve ({error.strerror}); "
                 "use a host name every node can resolve, e.g. the first of `scontrol show hostnames`")]
    return [("ok", f"MASTER_ADDR {env.master_addr} resolves to {', '.join(addresses)}")]


def _is_this_host(address: str) -> bool:
    try:
        target = {info[4][0] for info in socket.getaddrinfo(address, None)}
        local = {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)}
    except socket.gaierror:
        return False
    return bool(target & (local | {"127.0.0.1", "::1"}))


def check_port(env: DistEnv) -> list[Finding]:
    """The store port must be free on the master host before rank 0 opens it."""
    if env.rank != 0 or env.agent_hosts_store or not _is_this_host(env.master_addr):
        return []  # torchrun's agent already holds it, or the store lives elsewhere
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", env.master_port))
        except OSError as error:
            return [("error", f"MASTER_PORT {env.master_port} is in use on this host ({error.strerror}); "
                     "another job or a stale process holds it: pick another port")]
    return [("ok", f"MASTER_PORT {env.master_port} is free")]


def check_gpus(env: DistEnv, environ: Mapping[str, str], gpu_count: int) -> list[Finding]:
    """One process per GPU: tasks (or torchrun workers) per node should equal the GPUs."""
    if gpu_count == 0 or env.launcher == "single":
        return []
    per_node = env.local_world_size
    flag = "--ntasks-per-node" if env.launcher == "slurm" else "--nproc-per-node"
    if "CUDA_VISIBLE_DEVICES" in environ and gpu_count == 1 and per_node > 1:
        return [("ok", "each process sees one GPU (CUDA_VISIBLE_DEVICES is set per task)")]
    if per_node > gpu_count:
        return [("error", f"{per_node} processes on this node but {gpu_count} GPU(s): local rank "
                 f"{env.local_rank} has no GPU of its own; set {flag}={gpu_count}")]
    if per_node < gpu_count:
        return [("warn", f"{per_node} process(es) on this node but {gpu_count} GPUs: "
                 f"{gpu_count - per_node} stay idle; set {flag}={gpu_count}")]
    return [("ok", f"{per_node} processes for {gpu_count} GPUs on this node")]


def signal_meanings(config: TrainConfig) -> str:
    """What each handled signal makes ddp_amp.train do, with its defaults."""
    requeue, stop = config.preempt_signal, config.stop_signal

    def names(signums: Iterable[signal.Signals]) -> str:
        return ",".join(s.name.removeprefix("SIG") for s in signums) or "none"

    return (f"{names(requeue)}: checkpoint + requeue, exit 75 (--preempt-signal); "
            f"{names(stop)}: checkpoint + stop, no requeue, exit 128+N (--stop-signal)")


def shard_support(world_size: int) -> str:
    """What `--shard` would do in this launch (FSDP2 ships with torch; background sharded
    saves also need gloo, the CPU backend)."""
    if world_size == 1:
        spread = "one process: --shard runs, with nothing to shard over"
    else:
        spread = (f"each of {world_size} ranks holds 1/{world_size} of the parameters, gradients and optimizer "
                  "state (FSDP2)")
    gloo = "" if dist.is_gloo_available() else "; --async-checkpoint with it needs gloo, missing from this torch"
    return f"available: {spread}{gloo}"


def diagnose(environ: Mapping[str, str], device: str = "auto", backend: str = "auto"
             ) -> tuple[DistEnv | None, dict[str, Any], list[Finding]]:
    """Resolve the environment as `ddp_amp.train` would; (env, facts, findings). Pure of side effects."""
    findings: list[Finding] = check_srun(environ)
    try:
        env = detect_env(environ)
    except UsageError as error:
        return None, {}, findings + [("error", f"launch environment: {error}")]
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    facts: dict[str, Any] = {
        "launcher": env.launcher, "rank": env.rank, "local_rank": env.local_rank,
        "world_size": env.world_size, "local_world_size": env.local_world_size,
        "node_rank": env.node_rank, "master": f"{env.master_addr}:{env.master_port}",
        "restart_count": env.restart_count, "host": socket.gethostname(), "gpus_visible": gpus,
        "signals": signal_meanings(TrainConfig()),
    }
    try:
        chosen = resolve_device(device, env, backend)
        facts["device"] = str(chosen)
        facts["backend"] = resolve_backend(backend, chosen) if env.is_distributed else "none (one process)"  # type: ignore[arg-type]  # CLI str, checked
        auto = resolve_precision("auto", chosen)
        facts["precision_auto"] = f"{auto.name} ({auto.reason})"
        why_no_fp8 = fp8_unavailable(chosen, emulate=False)
        facts["precision_fp8"] = "available" if why_no_fp8 is None else f"not available: {why_no_fp8}"
    except UsageError as error:
        findings.append(("error", f"device/backend: {error}"))
    facts["shard"] = shard_support(env.world_size)
    if env.is_distributed:
        findings += check_master_addr(env) + check_port(env)
    elif environ.get("MASTER_PORT", "").isdigit():  # a port picked for a launch still to come
        findings += check_port(DistEnv(master_addr=environ.get("MASTER_ADDR") or "127.0.0.1",
                                       master_port=int(environ["MASTER_PORT"])))
    findings += check_gpus(env, environ, gpus)
    return env, facts, findings


def probe(ctx: DistContext, megabytes: float = 16.0, iters: int = 20) -> dict[str, float]:
    """Median latency (1 element) and bandwidth (`megabytes`) of all-reduce (collective)."""
    def timed(tensor: torch.Tensor, repeat: int) -> float:
        times = []
        for _ in range(repeat + 2):  # the first two warm up connections and buffers
            if ctx.device.type == "cuda":
                torch.cuda.synchronize(ctx.device)
            start = time.perf_counter()
            all_reduce_(tensor)
            if ctx.device.type == "cuda":
                torch.cuda.synchronize(ctx.device)
            times.append(time.perf_counter() - start)
        return statistics.median(times[2:])

    latency = timed(torch.ones(1, device=ctx.device), iters)
    size = max(int(megabytes * 2**20) // 4, 1)
    seconds = timed(torch.ones(size, device=ctx.device), max(iters // 4, 3))
    n = ctx.world_size
    algbw = size * 4 / seconds / 1e9
    # Bus bandwidth: what each link carried in a ring all-reduce, comparable across n.
    return {"latency_us": latency * 1e6, "size_mb": size * 4 / 2**20, "time_ms": seconds * 1e3,
            "algbw_gb_s": algbw, "busbw_gb_s": algbw * 2 * (n - 1) / n}


def format_report(facts: dict[str, Any], findings: list[Finding]) -> str:
    lines = [f"  {key:<17} {value}" for key, value in facts.items()]
    lines += [f"  [{level}] {message}" for level, message in findings]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddp_amp.doctor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--probe", action="store_true", help="join the group and time all-reduces")
    parser.add_argument("--probe-mb", type=float, default=16.0, help="bandwidth tensor size in MiB")
    parser.add_argument("--iters", type=int, default=20, help="timed all-reduces for the latency")
    parser.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    parser.add_argument("--backend", default="auto", choices=("auto", "nccl", "gloo"))
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for peers")
    args = parser.parse_args(argv)
    env, facts, findings = diagnose(os.environ, args.device, args.backend)
    errors = any(level == "error" for level, _ in findings)
    if not (args.probe and env is not None and env.is_distributed and not errors):
        tag = f" rank {env.rank}" if env is not None and env.is_distributed else ""
        print(f"ddp_amp doctor{tag}:\n{format_report(facts, findings)}", flush=True)
        if args.probe and env is not None and not env.is_distributed:
            print("  probe: one process, nothing to all-reduce")
        return 1 if errors else 0
    ctx = init_distributed(env, args.device, args.backend, args.timeout)
    try:
        reports = all_gather_objects(format_report(facts, findings))
        result = probe(ctx, args.probe_mb, args.iters)
    finally:
        shutdown_distributed()
    if env.rank == 0:  # one readable report for the whole job, in rank order
        for rank, report in enumerate(reports):
            print(f"ddp_amp doctor rank {rank}:\n{report}")
        print(f"probe: all-reduce over {ctx.world_size} ranks ({ctx.backend}): latency "
              f"{result['latency_us']:.0f} us; {result['size_mb']:.0f} MiB in {result['time_ms']:.1f} ms = "
              f"{result['algbw_gb_s']:.2f} GB/s algbw, {result['busbw_gb_s']:.2f} GB/s busbw", flush=True)
    return 0


if __name__ == "__main__":
    exit_process(main())
