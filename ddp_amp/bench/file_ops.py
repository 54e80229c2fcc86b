"""Counting one thread's file-system calls, for the benchmark (and tests) only.

While a `FileOps` is entered, the functions of `os`, `io` and `builtins` through which
Python code reaches the file system (ddp_amp's own calls, and pathlib's, shutil's,
torch.save's and torch.load's, which call the same functions) are replaced by wrappers that
count each call made from the thread that entered it, by kind, and the directory entries
each listing returns; other threads (retention's deletion, DCP's writers) go uncounted,
unless `all_threads` asks for every thread's calls (a test of what a process touches).
Reads and writes through an open file are not counted: an open is, once. C code that does
not go through these functions is not seen (DCP's shards are written through Python file
objects, so their opens are). Nothing of ddp_amp is changed: the counted code runs as it
does for users.
"""

from __future__ import annotations

import builtins
import io
import os
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from types import ModuleType, TracebackType
from typing import Any

# kind -> the (module, function name) pairs counted as that kind
KINDS: dict[str, tuple[tuple[ModuleType, str], ...]] = {
    "open": ((builtins, "open"), (io, "open"), (os, "open")),
    "stat": ((os, "stat"), (os, "lstat")),
    "list": ((os, "listdir"), (os, "scandir")),
    "mkdir": ((os, "mkdir"),),
    "rename": ((os, "rename"), (os, "replace")),
    "remove": ((os, "unlink"), (os, "remove"), (os, "rmdir")),
    "fsync": ((os, "fsync"),),
}


def _mode(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """An open's mode as `seen` keeps it: open()'s ("r" where none is given), or os.open's
    flags as "flags=N"; "" for the other calls."""
    if name == "open" and len(args) > 1 and isinstance(args[1], int):
        return f"flags={args[1]}"
    if name == "open":
        return str(args[1] if len(args) > 1 else kwargs.get("mode", "r"))
    return ""


class _CountedListing:
    """An `os.scandir` iterator that counts the entries it yields."""

    def __init__(self, inner: Any, count: Callable[[int], None]) -> None:
        self._inner, self._count = inner, count

    def __iter__(self) -> Iterator[Any]:
        for entry in self._inner:
            self._count(1)
            yield entry

    def __enter__(self) -> _CountedListing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._inner.close()


class FileOps:
    """Counts the file-system calls of the thread that enters it (see the module's docstring).

    `paths`: also keep (kind, path, mode) of every counted call that names a path in `seen`;
    `all_threads`: count the calls of every thread, not only the one that enters it.
    """

    def __init__(self, paths: bool = False, all_threads: bool = False) -> None:
        self.calls: Counter[str] = Counter()
        self.entries = 0  # directory entries returned by listings
        self.seen: list[tuple[str, str, str]] = []
        self._paths = paths
        self._all_threads = all_threads
        self._lock = threading.Lock()  # counted from several threads where all_threads
        self._thread = threading.get_ident()
        self._saved: list[tuple[ModuleType, str, Any]] = []

    @property
    def total(self) -> int:
        return sum(self.calls.values())

    def _counting(self, kind: str, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if not self._all_threads and threading.get_ident() != self._thread:
                return original(*args, **kwargs)
            with self._lock:
                self.calls[kind] += 1
                if self._paths and args and isinstance(args[0], (str, os.PathLike)):
                    self.seen.append((kind, os.fspath(args[0]), _mode(name, args, kwargs)))
            result = original(*args, **kwargs)
            if name == "listdir":
                self._add_entries(len(result))
            elif name == "scandir":
                return _CountedListing(result, self._add_entries)
            return result
        return counted

    def _add_entries(self, count: int) -> None:
        with self._lock:
            self.entries += count

    def __enter__(self) -> FileOps:
        self._thread = threading.get_ident()
        for kind, places in KINDS.items():
            for module, name in places:
                original = getattr(module, name)
                self._saved.append((module, name, original))
                setattr(module, name, self._counting(kind, name, original))
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        self._saved.clear()
