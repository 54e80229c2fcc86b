"""The options a user sees are frozen: every flag of `python -m ddp_amp.train` (its spellings,
default, type, choices and help) and every key and value of the default `config.json`,
`--print-config` file and config-file key kinds, compared with the fixture taken before the
options moved into their components. The comparison is by name: the options' order follows
the components that own them.

Regenerate the fixture only for a deliberate change of the command line:
    python tests/test_flags_frozen.py > tests/fixtures/flags.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ddp_amp.command_line import build_parser, config_toml, option_kinds
from ddp_amp.config import TrainConfig, match_fields

FIXTURE = Path(__file__).parent / "fixtures" / "flags.json"


def _jsonable(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def snapshot() -> dict[str, Any]:
    """What the fixture records, from the code as it is now."""
    flags: dict[str, Any] = {}
    for action in build_parser()._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        # A switch that grew choices has its --no- form as a second action of the same dest.
        flags[action.dest if action.dest not in flags else action.option_strings[0]] = {
            "option_strings": list(action.option_strings), "action": type(action).__name__,
            "default": _jsonable(action.default), "type": getattr(action.type, "__name__", None),
            "choices": _jsonable(action.choices), "metavar": action.metavar, "help": action.help,
        }
    toml_lines = config_toml(TrainConfig()).splitlines()
    return {
        "flags": flags,
        "config_json": {key: _jsonable(value) for key, value in TrainConfig().to_dict().items()},
        "print_config_header": [line for line in toml_lines if line.startswith("#")],
        "print_config": dict(line.split(" = ", 1) for line in toml_lines if not line.startswith("#")),
        "file_kinds": {name: kind.__name__ if isinstance(kind, type) else " or ".join(one.__name__ for one in kind)
                       for name, kind in option_kinds().items()},
        "must_match_on_resume": sorted(match_fields()),
    }


def test_flags_and_defaults_are_the_frozen_ones() -> None:
    frozen = json.loads(FIXTURE.read_text())
    now = json.loads(json.dumps(snapshot()))
    assert sorted(now["flags"]) == sorted(frozen["flags"])
    for name, flag in frozen["flags"].items():
        assert now["flags"][name] == flag, name
    assert now["config_json"] == frozen["config_json"]
    assert now["print_config_header"] == frozen["print_config_header"]
    assert now["print_config"] == frozen["print_config"]
    assert now["file_kinds"] == frozen["file_kinds"]
    assert now["must_match_on_resume"] == frozen["must_match_on_resume"]


if __name__ == "__main__":
    print(json.dumps(snapshot(), indent=1))
