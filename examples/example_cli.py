"""The command line the examples share: `--precision`, `--device`, `--facts FILE`.

Each example's `train(session)` returns what its rank observed; `run_example` gathers that
from every rank and, on rank 0, prints a summary and writes it all to `--facts` (the tests
read that file to check the example's property).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from ddp_amp import Session


def run_example(description: str, train: Callable[..., dict[str, Any]],
                summary: Callable[[dict[str, Any]], object],
                scaler_options: dict[str, float] | None = None,
                add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
                train_args: Callable[[argparse.Namespace], tuple[Any, ...]] = lambda args: ()) -> None:
    """Parse the shared options, run `train(session, *train_args(args))`, report on rank 0."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--precision", default="fp16")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--facts", help="write what every rank observed to this JSON file")
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args()
    with Session(args.precision, args.device, scaler_options=scaler_options) as session:
        facts = session.all_gather_objects(train(session, *train_args(args)))
        if session.is_main:
            print(summary(facts[0]))
            if args.facts:
                with open(args.facts, "w", encoding="utf-8") as handle:
                    json.dump({"world_size": session.world_size, "ranks": facts}, handle)
