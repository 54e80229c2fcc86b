#!/usr/bin/env python3
"""A throw-away Slurm cluster on this host, for the tests and for trying the templates.

    sudo python3 slurm/local_cluster.py start [--nodes 2]   # install if missing, start, wait idle
    eval "$(python3 slurm/local_cluster.py env)"            # export SLURM_CONF for sbatch/srun
    sbatch -n 2 slurm/one_node.sbatch --device cpu --max-steps 50
    sudo python3 slurm/local_cluster.py stop                # stop the daemons by their PIDs

Needs root and Debian's `slurmctld slurmd slurm-client munge` (installed with apt-get when
missing). Everything it writes lives in one private directory (`--dir`, default
/tmp/ddp_amp-slurm): slurm.conf, state, spool, logs, the munge socket and the PID files.
`--nodes N` emulates N nodes on this host: one slurmd per node with its own name, port and
/etc/hosts entry (removed again on stop). The first node is this host (`hostname -s`).

Stdlib only, so it runs with any python3 (no torch needed). Why Python and not a shell
script: the daemons run under a small child-subreaper process (prctl), which a shell cannot
become; when PID 1 reaps orphans slowly, proctrack/pgid otherwise adds ~3 s to every job.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
DEFAULT_DIR = Path(os.environ.get("DDP_AMP_SLURM_DIR", "/tmp/ddp_amp-slurm"))
CTLD_PORT = 6817
SLURMD_PORT = 6818
HOSTS_MARK = "# ddp_amp local_cluster"
PR_SET_CHILD_SUBREAPER = 36


def node_names(count: int) -> list[str]:
    """This host first (slurmd without -N knows itself by `hostname -s`), then emulated nodes."""
    host = socket.gethostname().split(".")[0]
    return [host] + [f"{host}-n{i}" for i in range(1, count)]


def slurm_conf(directory: Path, nodes: list[str], cpus: int) -> str:
    """The whole config: no cgroups, no accounting, fast scheduling and requeue."""
    lines = [
        "ClusterName=ddpamp",
        f"SlurmctldHost={nodes[0]}(127.0.0.1)",
        f"SlurmctldPort={CTLD_PORT}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        # A requeued job waits cred_expire + 1 s (default 120) before it may start again.
        f"AuthInfo=socket={directory}/munge/munge.socket,cred_expire=5",
        f"StateSaveLocation={directory}/state",
        f"SlurmdSpoolDir={directory}/spool/%n",
        f"SlurmctldPidFile={directory}/run/slurmctld.pid",
        f"SlurmdPidFile={directory}/run/slurmd-%n.pid",
        f"SlurmctldLogFile={directory}/log/slurmctld.log",
        f"SlurmdLogFile={directory}/log/slurmd-%n.log",
        "ProctrackType=proctrack/pgid",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "MpiDefault=none",
        "MailProg=/bin/true",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        # The scheduler otherwise runs every 60 s: a requeued job would wait that long.
        "SchedulerType=sched/backfill",
        "SchedulerParameters=sched_interval=1,bf_interval=1",
        "ReturnToService=2",
        # Declared CPUs may exceed this host's cores (emulated nodes share them).
        "SlurmdParameters=config_overrides",
        "SlurmdTimeout=60",
        "KillWait=10",
    ]
    for index, name in enumerate(nodes):
        lines.append(f"NodeName={name} NodeHostname={name} NodeAddr=127.0.0.1 "
                     f"Port={SLURMD_PORT + index} CPUs={cpus} State=UNKNOWN")
    lines.append(f"PartitionName=debug Nodes={','.join(nodes)} Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def install_packages() -> None:
    if all(shutil.which(b) for b in ("slurmctld", "slurmd", "sbatch", "munged")):
        return
    if not shutil.which("apt-get"):
        sys.exit("local_cluster: Slurm is not installed and apt-get is missing: install "
                 + " ".join(PACKAGES) + " by hand")
    print("local_cluster: installing " + " ".join(PACKAGES), flush=True)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    if subprocess.run(["apt-get", "install", "-y", "-q", *PACKAGES], env=env,
                      stdout=subprocess.DEVNULL).returncode:
        subprocess.run(["apt-get", "update", "-q"], env=env, stdout=subprocess.DEVNULL, check=True)
        subprocess.run(["apt-get", "install", "-y", "-q", *PACKAGES], env=env,
                       stdout=subprocess.DEVNULL, check=True)


def _resolves(name: str) -> bool:
    try:
        socket.gethostbyname(name)
    except OSError:
        return False
    return True


def _hosts_entries(nodes: list[str], add: bool) -> None:
    """Emulated nodes (and this host, if it does not resolve) map to loopback: jobs use
    the first node's name as their master address."""
    hosts = Path("/etc/hosts")
    kept = [line for line in hosts.read_text().splitlines() if not line.endswith(HOSTS_MARK)]
    if add:
        names = nodes[1:] + ([] if _resolves(nodes[0]) else nodes[:1])
        kept += [f"127.0.0.1 {name} {HOSTS_MARK}" for name in names]
    # Rewrite in place: /etc/hosts is often a bind mount, which a rename would break.
    with open(hosts, "w", encoding="utf-8") as handle:
        handle.write("\n".join(kept) + "\n")


def _prepare(directory: Path, nodes: list[str], cpus: int) -> None:
    for sub in ("state", "run", "log", *(f"spool/{n}" for n in nodes)):
        (directory / sub).mkdir(parents=True, exist_ok=True)
    if not Path("/etc/munge/munge.key").exists():  # normally made by the package's postinst
        subprocess.run(["mungekey", "--create"], user="munge", group="munge", check=True)
    munge_dir = directory / "munge"
    munge_dir.mkdir(exist_ok=True)
    # munged wants its socket directory owned by munge and traversable by every client.
    munge_dir.chmod(0o755)
    shutil.chown(munge_dir, "munge", "munge")
    (directory / "slurm.conf").write_text(slurm_conf(directory, nodes, cpus))
    (directory / "nodes").write_text("\n".join(nodes) + "\n")


def _daemon_commands(directory: Path, nodes: list[str]) -> list[tuple[str, list[str], str | None]]:
    conf = str(directory / "slurm.conf")
    munge = directory / "munge"
    commands: list[tuple[str, list[str], str | None]] = [
        ("munged", ["munged", "-F", f"--socket={munge}/munge.socket", f"--pid-file={munge}/munged.pid",
                    f"--log-file={munge}/munged.log", f"--seed-file={munge}/munged.seed"], "munge"),
        ("slurmctld", ["slurmctld", "-D", "-i", "-f", conf], None),
    ]
    for index, name in enumerate(nodes):
        extra = ["-N", name] if index else []
        commands.append((f"slurmd-{name}", ["slurmd", "-D", "-f", conf, *extra], None))
    return commands


def _wait_for(check: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise SystemExit(f"local_cluster: timed out after {timeout:.0f}s waiting for {what}")


def _reaper(directory: Path) -> None:
    """Become a child subreaper, start the daemons as our children and reap every orphan."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    nodes = (directory / "nodes").read_text().split()
    pids: dict[int, str] = {}
    for name, command, user in _daemon_commands(directory, nodes):
        log = open(directory / "log" / f"{name}.out", "ab")
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                user=user, group=user)
        pids[proc.pid] = name
        scratch = directory / "run" / f"{name}.pid.tmp"  # rename: readers never see half a file
        scratch.write_text(f"{proc.pid}\n")
        os.replace(scratch, directory / "run" / f"{name}.pid.own")
        if name == "munged":  # slurm's daemons authenticate through munge at start
            _wait_for(lambda: (directory / "munge" / "munge.socket").exists(), 10, "munged")
    while pids:
        try:
            pid, _ = os.wait()
        except ChildProcessError:
            break
        pids.pop(pid, None)


def _own_pids(directory: Path) -> dict[str, int]:
    return {p.name.removesuffix(".pid.own"): int(p.read_text()) for p in
            sorted((directory / "run").glob("*.pid.own"))} if (directory / "run").exists() else {}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is gone for our purposes.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][0] != "Z"
    except OSError:
        return False


def _node_states(directory: Path) -> list[str]:
    result = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True,
                            env=dict(os.environ, SLURM_CONF=str(directory / "slurm.conf")))
    return result.stdout.split() if result.returncode == 0 else []


def status(directory: Path) -> bool:
    """Print each daemon and node state; True when every daemon runs and every node is idle."""
    pids = _own_pids(directory)
    for name, pid in pids.items():
        print(f"{name}: pid {pid} {'running' if _alive(pid) else 'stopped'}")
    states = _node_states(directory) if pids else []
    print("nodes: " + (" ".join(states) or "none"))
    return bool(pids) and all(_alive(p) for p in pids.values()) and bool(states) and all(
        s in ("idle", "mixed", "allocated") for s in states)


def start(directory: Path, node_count: int, cpus: int) -> None:
    if os.geteuid() != 0:
        sys.exit("local_cluster: must run as root (slurmd runs jobs as any user; munged as munge)")
    if any(_alive(pid) for pid in _own_pids(directory).values()):
        stop(directory)
    install_packages()
    nodes = node_names(node_count)
    _prepare(directory, nodes, cpus)
    for stale in (directory / "run").glob("*.pid.own"):
        stale.unlink()
    _hosts_entries(nodes, add=True)
    subprocess.Popen([sys.executable, os.path.abspath(__file__), "_reaper", "--dir", str(directory)],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     start_new_session=True)
    expected = len(nodes) + 2
    _wait_for(lambda: len(_own_pids(directory)) == expected, 20, "the daemons to start")
    started = time.monotonic()
    _wait_for(lambda: (states := _node_states(directory)) and len(states) == len(nodes)
              and all(s == "idle" for s in states), 60, f"{len(nodes)} node(s) to become idle "
              f"(logs in {directory / 'log'})")
    print(f"local_cluster: {len(nodes)} node(s) idle after {time.monotonic() - started:.1f}s; "
          f"export SLURM_CONF={directory / 'slurm.conf'}")


def stop(directory: Path) -> None:
    """Stop our daemons by their recorded PIDs: slurmds, slurmctld, then munged."""
    pids = _own_pids(directory)
    order = [n for n in pids if n.startswith("slurmd-")] + ["slurmctld", "munged"]
    for name in order:
        pid = pids.get(name)
        if pid and _alive(pid):
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 15
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    for own in (directory / "run").glob("*.pid.own") if (directory / "run").exists() else ():
        own.unlink()
    nodes_file = directory / "nodes"
    if nodes_file.exists() and os.geteuid() == 0:
        _hosts_entries(nodes_file.read_text().split(), add=False)
    print("local_cluster: stopped")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("start", "stop", "status", "env", "_reaper"))
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="private config/state directory")
    parser.add_argument("--nodes", type=int, default=1, help="nodes to emulate on this host")
    parser.add_argument("--cpus", type=int, default=64, help="CPUs declared per node")
    args = parser.parse_args(argv)
    directory = args.dir.resolve()
    if args.command == "start":
        start(directory, args.nodes, args.cpus)
    elif args.command == "stop":
        stop(directory)
    elif args.command == "status":
        return 0 if status(directory) else 1
    elif args.command == "env":
        print(f"export SLURM_CONF={directory / 'slurm.conf'}")
    else:
        _reaper(directory)
    return 0


if __name__ == "__main__":
    sys.exit(main())
