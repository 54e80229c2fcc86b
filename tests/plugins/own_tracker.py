"""Trackers of a user's own for `--tracker package.module:function`: one that keeps what it is
given in a JSON file beside the run, and ones that fail to start or to log."""

from __future__ import annotations

import json
from pathlib import Path

from ddp_amp.metrics.trackers import TrackedRun


class JsonTracker:
    """Appends each log call to `<run-dir>/own_tracker.jsonl`; its run id survives a resume."""

    def start(self, run: TrackedRun) -> dict[str, str]:
        self.path = run.run_dir / "own_tracker.jsonl"
        self.run_id = run.saved.get("run_id", f"own-{run.name}")
        with self.path.open("a") as out:
            out.write(json.dumps({"start": run.start_step, "run_id": self.run_id, "lr": run.config.get("lr")}) + "\n")
        return {"run_id": self.run_id}

    def log(self, values: dict[str, float], step: int) -> None:
        with self.path.open("a") as out:
            out.write(json.dumps({"step": step, **values}) + "\n")

    def finish(self) -> None:
        with self.path.open("a") as out:
            out.write(json.dumps({"finished": self.run_id}) + "\n")


class NoStart(JsonTracker):
    def start(self, run: TrackedRun) -> dict[str, str]:
        raise ConnectionError("no route to the tracking server\nsecond line")


class BreaksLater(JsonTracker):
    def log(self, values: dict[str, float], step: int) -> None:
        raise OSError("disk full")


def json_tracker() -> JsonTracker:
    return JsonTracker()


def no_start() -> NoStart:
    return NoStart()


def breaks_later() -> BreaksLater:
    return BreaksLater()


def read(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "own_tracker.jsonl").read_text().splitlines()]
