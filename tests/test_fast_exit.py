"""`fast_exit.exit_process`: the exit code and atexit handlers as `sys.exit`, the heap frozen first."""

from __future__ import annotations

import subprocess
import sys

from tests.multiproc import REPO_ROOT, cli_env

_SCRIPT = """
import atexit, gc
import torch
from ddp_amp.fast_exit import exit_process
atexit.register(lambda: print("atexit ran, frozen objects:", gc.get_freeze_count(), flush=True))
exit_process(3)
"""


def test_the_exit_code_and_atexit_handlers_are_kept_and_the_heap_is_frozen_before_them() -> None:
    result = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=120,
                            env=cli_env(), cwd=REPO_ROOT)
    assert result.returncode == 3, result.stderr
    frozen = int(result.stdout.rsplit(":", 1)[1])
    assert frozen > 100_000, result.stdout  # torch's objects, out of the last collections' way


def test_every_command_line_entry_point_exits_through_it() -> None:
    for module in ("train", "export", "doctor", "report", "torchrun", "bench/__main__"):
        text = (REPO_ROOT / "ddp_amp" / f"{module}.py").read_text()
        main_block = text.rsplit('if __name__ == "__main__":', 1)[1]
        assert "exit_process(main(" in main_block, module
