"""Test-only, for a process started with this folder on PYTHONPATH: `flock` fails as it does on
a Lustre mount without `-o flock`.

Python imports `sitecustomize` at start-up from the path. Here it makes every `fcntl.flock`
raise OSError(ENOSYS), what Lustre's client answers when the mount has neither `flock` nor
`localflock`. Nothing of ddp_amp is imported or changed: its run lock meets the filesystem
as it would on such a mount.
"""

import errno
import fcntl
import os


def _no_flock(fd: object, operation: int) -> None:
    raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))


fcntl.flock = _no_flock
