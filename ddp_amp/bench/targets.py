"""The benchmark's stated targets, and `--check`: each one met, missed, or not for this run.

A figure held to a target carries these fields, wherever it sits in a section's result (a
row of `rows`, a named part such as the overhead section's `recipe_model`, or an entry of a
row's or a section's `target_checks`):

- `target`: the number the figure is held to;
- `meets_target`: True or False where the target applies to this run; None where it does
  not (a GPU's target in a run on a CPU), with `target_note` saying why;
- `figure` (what is measured, "trainer / hand"), `measured` (its value) and `compare`
  ("at most" or "at least"), which the check prints where they are there.

`target_fields` makes them, with the one comparison. `check_report` finds every dict that
has `target` and `meets_target` in a report, so a new row that carries them is checked
without a change here.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

AT_MOST, AT_LEAST = "at most", "at least"
# Keys that hold rows or checks rather than name a part of a section.
_CONTAINERS = {"rows", "trials", "target_checks"}


def target_fields(figure: str, measured: float | None, target: float, compare: str = AT_MOST,
                  not_here: str = "") -> dict[str, Any]:
    """The fields of one stated target; `not_here` says why it does not apply to this run.

    A figure that was not measured (None or NaN: a failed row) misses its target.
    """
    fields: dict[str, Any] = {"figure": figure, "measured": measured, "target": target, "compare": compare,
                              "target_note": not_here}
    if not_here:
        fields["meets_target"] = None
    elif measured is None or math.isnan(measured):
        fields.update(meets_target=False, target_note="not measured")
    else:
        fields["meets_target"] = measured <= target if compare == AT_MOST else measured >= target
    return fields


def checks_cell(row: dict[str, Any]) -> str:
    """A table cell of a row's target checks: 'figure 0.44 <= 0.6: met; ...' (empty without any)."""
    return "; ".join(f"{check['figure']} {check['measured']:.3g} <= {check['target']:g}: "
                     f"{ {True: 'met', False: 'MISSED', None: 'n/a'}[check['meets_target']]}"
                     for check in row.get("target_checks", []))


def verdict_text(fields: dict[str, Any]) -> str:
    """'target at most 1.05: MISSED', with the note where there is one."""
    verdict = {True: "met", False: "MISSED", None: "not applicable here"}[fields["meets_target"]]
    return f"{_target(fields)}: {verdict}{_note(fields)}"


def _target(fields: dict[str, Any]) -> str:
    return f"target {fields.get('compare', 'of')} {fields['target']:g}"


def _note(fields: dict[str, Any]) -> str:
    return f" ({fields['target_note']})" if fields.get("target_note") else ""


@dataclass(frozen=True)
class Outcome:
    """One stated target of a run: where it is, and its fields (`meets_target` and the rest)."""

    where: str
    fields: dict[str, Any]

    @property
    def met(self) -> bool | None:
        """True: met; False: missed; None: not applicable to this run."""
        return self.fields["meets_target"]

    def line(self) -> str:
        """'MISSED  host fp16, no group: trainer / hand 1.07, target at most 1.05'."""
        status = {True: "met", False: "MISSED", None: "n/a"}[self.met]
        measured = self.fields.get("measured")
        value = f" {measured:.3g}" if isinstance(measured, (int, float)) and not isinstance(measured, bool) else ""
        figure = self.fields.get("figure", "figure")
        return f"{status:<7} {self.where}: {figure}{value}, {_target(self.fields)}{_note(self.fields)}"


def check_report(report: dict[str, Any]) -> tuple[list[Outcome], list[str]]:
    """Every stated target in `report`'s sections, and the names of sections that state none."""
    outcomes: list[Outcome] = []
    without: list[str] = []
    for name, section in report["sections"].items():
        found = list(_targets(section, [name]))
        outcomes += found
        if not found:
            without.append(name)
    return outcomes, without


def check_text(report: dict[str, Any]) -> str:
    """The check as lines: each target met, missed or not applicable, then sections without any."""
    outcomes, without = check_report(report)
    lines = [f"Targets (--check) on {report.get('device', 'this device')}:"]
    lines += ["  " + outcome.line() for outcome in outcomes]
    if without:
        lines.append(f"  no targets stated: {', '.join(without)}")
    return "\n".join(lines)


def _targets(value: Any, where: list[str]) -> Iterator[Outcome]:
    if isinstance(value, dict):
        here = where + [_identity(value)]
        if "target" in value and "meets_target" in value:
            yield Outcome(" ".join(part for part in here if part), value)
        for key, child in value.items():
            if isinstance(child, (dict, list)):
                yield from _targets(child, here + ([] if key in _CONTAINERS else [key.replace("_", " ")]))
    elif isinstance(value, list):
        for item in value:
            yield from _targets(item, where)


def _identity(row: dict[str, Any]) -> str:
    """What tells a row from its siblings: 'fp16 compiled', 'fp32, group of 1 (DDP)'."""
    parts = [str(row[key]) for key in ("name", "loop", "precision", "variant") if isinstance(row.get(key), str)]
    if isinstance(row.get("ranks"), int) and "ddp" not in row:
        parts.append(f"on {row['ranks']} rank(s)")
    if isinstance(row.get("compiled"), bool):
        parts.append("compiled" if row["compiled"] else "eager")
    text = " ".join(parts)
    if isinstance(row.get("ddp"), bool):
        group = f"group of {row.get('ranks', '?')} (DDP)" if row["ddp"] else "no group"
        text = f"{text}, {group}" if text else group
    return text
