"""This process's parent as it was when ddp_amp was first imported.

A worker started by torchrun's agent watches that agent: once it is gone the worker stops
(distributed/launcher.py). The check compares the parent now with the parent at start, and
"at start" must be taken before torch's import: an agent killed during those seconds leaves
the worker reparented (to init or a subreaper) before any later look at its parent, which
would then take the new parent for the launcher and train on, orphaned. Where torchrun's
agent also hosts the store, its loss shows up at the store too; torch 2.4's agent does not
host it, and there the parent is the only sign. Standard library only; the package imports
it first.
"""

from __future__ import annotations

import os

PARENT_AT_START = os.getppid()
