"""Test-only, for a process started with this folder on PYTHONPATH: a checkpoint's files are
written slowly, so a test can kill the writer while a checkpoint is half-written.

Python imports `sitecustomize` at start-up from the path. Here it makes `os.fsync` of a file
inside a checkpoint's scratch directory (`.tmp-*`, where the commit protocol writes before
its rename; or whatever path fragment `DDP_AMP_TEST_SLOW_WRITES_IN` names, such as a data
cache's `.building-` folder) sleep `DDP_AMP_TEST_SLOW_WRITES_S` seconds first, and, where
`DDP_AMP_TEST_SLOW_WRITES_UNTIL` names a file, wait until that file exists (a test's gate).
Nothing of ddp_amp is imported or changed: it runs as it does for users, only slower.
"""

import os
import time

_DELAY_S = float(os.environ.get("DDP_AMP_TEST_SLOW_WRITES_S", "0") or 0)
_INSIDE = os.environ.get("DDP_AMP_TEST_SLOW_WRITES_IN", "/.tmp-")
_UNTIL = os.environ.get("DDP_AMP_TEST_SLOW_WRITES_UNTIL", "")

if _DELAY_S > 0 or _UNTIL:
    _fsync = os.fsync

    def _slow_fsync(fd: int) -> None:
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            path = ""
        if _INSIDE in path:
            time.sleep(_DELAY_S)
            while _UNTIL and not os.path.exists(_UNTIL):
                time.sleep(0.02)
        _fsync(fd)

    os.fsync = _slow_fsync
