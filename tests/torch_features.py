"""Skip marks for tests of a feature that needs a newer torch than the running one.

A test of `--shard` (or of selective recompute) cannot run where torch lacks what the
feature uses: ddp_amp refuses the feature there in one line, and tests/test_torch_api.py
checks that refusal. Such a test carries `needs(SHARDING)` and is skipped with the reason
naming the torch it needs.
"""

from __future__ import annotations

import pytest
import torch

from ddp_amp.torch_api import SELECTIVE_RECOMPUTE, SHARDING, Feature

__all__ = ["needs", "needs_selective", "needs_sharding"]


def needs(feature: Feature) -> pytest.MarkDecorator:
    """Skip where the running torch is older than `feature` needs, saying which torch it needs."""
    return pytest.mark.skipif(not feature.available(), reason=f"{feature.name} needs torch >= "
                              f"{feature.needs[0]}.{feature.needs[1]}; this is torch {torch.__version__}")


needs_sharding = needs(SHARDING)
needs_selective = needs(SELECTIVE_RECOMPUTE)
