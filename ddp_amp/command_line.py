"""The command line of `python -m ddp_amp.train`: an argparse parser built from `TrainConfig`'s
fields (so an option cannot exist without its help text), every parse failure turned into a
one-line `UsageError`, and `--config run.toml` merged under the flags (`config_file` reads
and writes the TOML); `--print-config` shows the result as such a file.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import re
from dataclasses import dataclass
from typing import Any, ClassVar, NoReturn

from ddp_amp.config import TrainConfig, flag_of, text_of
from ddp_amp.config_file import dumps, read_options
from ddp_amp.errors import UsageError


RESUME_HELP = ("On resume every setting is compared with the one the checkpoint was saved with. "
               "Those marked [must match on resume] are refused when they differ (list the ones "
               "you change knowingly in --allow-change); --precision follows the AMP rules (a "
               "fresh or ignored loss scaler, with a notice); every other setting takes its new "
               "value with a notice (--lr rescales the restored optimizer's learning rates).")


class _Parser(argparse.ArgumentParser):
    """argparse that raises a one-line UsageError instead of printing usage and exiting."""

    def error(self, message: str) -> NoReturn:
        if message.startswith("unrecognized arguments: "):
            unknown = message.split(": ", 1)[1].split()[0]
            flags = [a for action in self._actions for a in action.option_strings]
            close = difflib.get_close_matches(unknown.split("=")[0], flags, n=1)
            hint = f"did you mean {close[0]}?" if close else "see --help"
            raise UsageError("option", unknown, "a known option", hint)
        bad_value = re.match(r"argument (\S+?)(?:/\S+)?: invalid (\w+) value: '(.*)'", message)
        if bad_value:
            flag, kind, value = bad_value.groups()
            raise UsageError(flag, value, f"a value of type {kind}", "see --help")
        raise UsageError("arguments", " ".join(self.last_argv), "valid options", message)

    last_argv: ClassVar[list[str]] = []  # the argv being parsed, set by parse_command_line


CONFIG_FILE_HELP = ("Options can also come from a TOML file: --config PATH, whose keys are the "
                    "option names below without -- (max_steps or max-steps); flags given here "
                    "override the file. --print-config prints the resolved options as TOML and exits.")


# The repeatable options (a flag per value, a list in a config file), with the word --help shows.
_REPEATED_METAVAR = {"task_opt": "KEY=VALUE", "data": "SOURCE", "eval_data": "SOURCE"}


def build_parser(prog: str = "python -m ddp_amp.train") -> argparse.ArgumentParser:
    parser = _Parser(prog=prog, description="Train with DDP + automatic mixed precision. "
                     "Launch with python, torchrun or srun; the launcher is detected. " + CONFIG_FILE_HELP,
                     epilog=RESUME_HELP, allow_abbrev=False)
    defaults = TrainConfig()
    for f in dataclasses.fields(TrainConfig):
        flag, help_text = flag_of(f.name), f.metadata["help"]
        if f.metadata["resume"] == "match":
            help_text += " [must match on resume]"
        if f.type in ("bool", bool):  # --compile and --no-compile: a flag can undo a file's true
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
        elif f.metadata["bare"] is not None:  # --flag alone, --flag VALUE, --no-flag
            default = text_of(defaults, f.name)
            parser.add_argument(flag, nargs="?", const=f.metadata["bare"], default=default,
                                help=help_text + f" (default: {default}; {flag} alone: {f.metadata['bare']})",
                                metavar=f.name.upper())
            parser.add_argument("--no-" + flag[2:], dest=f.name, action="store_const", const=default,
                                help=f"{flag} {default}")
        elif str(f.type) == "tuple[str, ...]" and f.metadata["kind"] is None:  # repeatable: --data A --data B
            parser.add_argument(flag, action="append", default=[], metavar=_REPEATED_METAVAR.get(f.name, "VALUE"),
                                help=help_text)
        else:
            kind = {"int": int, "float": float}.get(str(f.type), str)
            default = text_of(defaults, f.name)
            parser.add_argument(flag, type=kind, default=default, help=help_text + f" (default: {default})",
                                metavar=f.name.upper())
    return parser


@dataclass(frozen=True)
class CommandLine:
    """What a command line asks for: the run's config, and the two launch options that are
    not part of it. They stay out of TrainConfig (and so out of config.json and the resume
    comparison): the same values from flags or from a file are the same run."""

    config: TrainConfig
    config_file: str | None = None
    print_config: bool = False


def parse_command_line(argv: list[str]) -> CommandLine:
    """Resolve the options: field defaults, then the `--config` file's values, then flags.

    The three layers are merged as values, a later layer replacing an option whole, and
    the result goes through TrainConfig's own checks, the one path a flag-only launch
    uses, so a value is refused alike from a file or a flag. Merging values, rather than
    turning the file into flags before the command line's or into parser defaults, is
    what keeps "flags override" true for `--task-opt`: its append action would add the
    flags' items to the file's list instead of replacing it.
    A file value is type-checked by `read_options`; its TOML type stands in for argparse's
    conversion of a flag's text.
    """
    _Parser.last_argv = list(argv)
    launch, flags = _launch_parser().parse_known_args(argv)
    from_file = read_options(launch.config, option_kinds()) if launch.config is not None else {}
    given = _given_flags(flags)
    try:
        values = {**from_file, **given}
        for name in _REPEATED_METAVAR:
            values[name] = tuple(values.get(name, ()))
        config = TrainConfig(**values)
    except UsageError as error:
        raise _blame_file(error, launch.config, from_file.keys() - given.keys()) from error
    return CommandLine(config, launch.config, launch.print_config)


def _launch_parser() -> argparse.ArgumentParser:
    # Separate from build_parser, whose options are exactly TrainConfig's fields.
    parser = _Parser(add_help=False, allow_abbrev=False)
    parser.add_argument("--config", default=None)
    parser.add_argument("--print-config", action="store_true")
    return parser


def _given_flags(flags: list[str]) -> dict[str, Any]:
    """Only the options these flags set: every default is suppressed, so an option the
    command line leaves out does not hide the file's value with the field's default."""
    parser = build_parser()
    for action in parser._actions:  # not set_defaults: it would put SUPPRESS in the namespace
        action.default = argparse.SUPPRESS
    return vars(parser.parse_args(flags))


def _blame_file(error: UsageError, path: str | None, file_only: set[str]) -> UsageError:
    """`error` naming the file's key instead of the flag, where the bad value came from the
    file (a user who never typed `--precision` should be told where it was set)."""
    name = error.what.removeprefix("--").replace("-", "_")
    if not error.what.startswith("--") or name not in file_only:
        return error
    return UsageError(f"{path}: {name}", error.value, error.expected, error.hint)


# A field's annotation (a string, under `from __future__ import annotations`) -> the value
# kind its config-file key takes.
_FILE_KINDS: dict[str, type] = {"bool": bool, "int": int, "float": float, "str": str, "tuple[str, ...]": tuple}


def option_kinds() -> dict[str, type | tuple[type, ...]]:
    """Every option a config file may set, by field name, with its value kind (the text a
    flag takes, for options written as text)."""
    return {f.name: (bool, str) if f.metadata["bare"] is not None else
            str if f.metadata["kind"] is not None else _FILE_KINDS[str(f.type)]
            for f in dataclasses.fields(TrainConfig)}


def config_toml(config: TrainConfig) -> str:
    """The run's options of `config` as a TOML file that `--config` reads back.

    The options about one launch (run directory, run name, resume, archive, allowed
    changes, debug) are left out: the file describes a run, and starting from it is a new
    run unless flags say otherwise. Every other option is written, defaults included, so
    the file pins the run whatever the defaults of a later version.
    """
    header = ["ddp_amp run configuration: python -m ddp_amp.train --config THIS_FILE",
              "keys are the options of --help without -- (max_steps is --max-steps); flags override them",
              "the launch options (--run-dir, --run-name, --resume, ...) are not here: give them as flags"]
    return dumps(config.run_options(), header)
