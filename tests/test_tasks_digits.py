"""`digits`: scikit-learn's bundled images, a fixed held-out split, and a clear error without the extra."""

from __future__ import annotations

import sys

import pytest
import torch

from ddp_amp.config import TrainConfig
from ddp_amp.errors import UsageError
from ddp_amp.tasks import load_task
from ddp_amp.tasks.digits import accuracy

pytest.importorskip("sklearn", reason="the digits task needs the [sklearn] extra (in [test])")


def test_split_is_disjoint_fixed_and_independent_of_the_seed() -> None:
    first = load_task("digits", TrainConfig(seed=0))
    second = load_task("digits", TrainConfig(seed=5))
    train_x, _ = first.train_data.tensors  # type: ignore[attr-defined]
    eval_x, eval_y = first.eval_data.tensors  # type: ignore[attr-defined]
    assert len(train_x) + len(eval_x) == 1797 and len(eval_x) == 539
    assert torch.equal(eval_x, second.eval_data.tensors[0])  # type: ignore[attr-defined]
    assert set(eval_y.tolist()) == set(range(10)) and float(train_x.max()) == 1.0
    train_rows = {tuple(row.tolist()) for row in train_x}
    leaked = sum(tuple(row.tolist()) in train_rows for row in eval_x)
    assert leaked < 5  # a few digits are pixel-identical duplicates in the data set itself


def test_accuracy_counts_correct_predictions() -> None:
    output = torch.tensor([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]])
    total, count = accuracy(output, torch.tensor([1, 1, 1]))["accuracy"]
    assert (int(total), count) == (2, 3)


def test_without_scikit_learn_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in sys.modules if n == "sklearn" or n.startswith("sklearn.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "sklearn", None)  # what `import sklearn` sees when it is absent
    with pytest.raises(UsageError) as error:
        load_task("digits", TrainConfig())
    assert "scikit-learn installed" in str(error.value) and "pip install 'ddp_amp[sklearn]'" in str(error.value)
