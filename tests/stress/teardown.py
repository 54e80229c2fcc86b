"""Count unclean exits of 2-rank gloo DDP jobs under torchrun: ddp_amp.train vs a naive script.

    python -m tests.stress.teardown --runs 50

Not part of the pytest suite (it takes minutes); it is the evidence behind
ddp_amp.distributed.shutdown_distributed's ordering. An unclean exit is a non-zero torchrun exit
or 'terminate called' on stderr.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile

from tests.multiproc import REPO_ROOT, cli_env

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def unclean(command: list[str]) -> bool:
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=120,
                                env=cli_env(), cwd=REPO_ROOT)
    except subprocess.TimeoutExpired:  # a hang at teardown counts as unclean
        print(f"hung: {command[-1]}", flush=True)
        return True
    if result.returncode != 0 or "terminate called" in result.stderr:
        print(f"unclean (exit {result.returncode}): {result.stderr.strip().splitlines()[-1:]}", flush=True)
        return True
    return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50)
    args = parser.parse_args()
    counts = {"ddp_amp.train": 0, "naive script": 0}
    with tempfile.TemporaryDirectory() as run_dir:
        for i in range(args.runs):
            counts["ddp_amp.train"] += unclean(TORCHRUN + ["-m", "ddp_amp.train", "--task", "mlp",
                                                           "--task-opt", "hidden=256", "--precision", "fp16",
                                                           "--max-steps", "20", "--log-every", "100",
                                                           "--run-dir", f"{run_dir}/{i}"])
            counts["naive script"] += unclean(TORCHRUN + ["tests/stress/naive_teardown.py"])
            print(f"after {i + 1} runs each: unclean exits {counts}", flush=True)


if __name__ == "__main__":
    main()
