"""Config files for `--config PATH`: read a flat TOML table of options, write one back.

Reading checks what TOML alone can check, against a spec of option names and value kinds
that the caller derives from its own fields: every key is a known option (a dash in a key
means an underscore, so `batch-size` and `batch_size` are the same key), every value has
the option's TOML type. Ranges, choices and cross-option rules are the caller's, applied
to file values and flags alike. Writing covers exactly the value kinds options have:
strings, integers, floats, booleans and lists of strings. Errors are one-line
`UsageError`s that name the file. The reader is the standard library's `tomllib` from
Python 3.11 on, and `tomli` (the same parser, a dependency there) on Python 3.10.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any

from ddp_amp.errors import UsageError

# The value kinds an option can have, and how an error message names each one.
KIND_NAMES: dict[type, str] = {
    bool: "a boolean (true or false)",
    int: "an integer",
    float: "a number",
    str: "a string (in quotes)",
    tuple: "a list of strings",
}


def read_options(path: str, kinds: Mapping[str, type | tuple[type, ...]]) -> dict[str, Any]:
    """The options set in the TOML file `path`, by name, as values of `kinds[name]`.

    Raises UsageError for a missing or unreadable file, invalid TOML, an unknown key (with
    the nearest known name), a key given in both spellings, or a value of the wrong type.
    """
    table = _load(path)
    options: dict[str, Any] = {}
    for key, value in table.items():
        name = option_name(key)
        if name not in kinds:
            raise UsageError(f"{path}: {key}", value, "a key naming an option of --help",
                             _nearest_hint(name, kinds))
        if name in options:
            raise UsageError(f"{path}: {key}", value, "each option set once",
                             f"{name} is set twice: {name.replace('_', '-')} and {name} are the same key")
        options[name] = _typed(f"{path}: {key}", value, kinds[name])
    return options


def option_name(key: str) -> str:
    """The option a file key sets: its dashes read as underscores (`batch-size` -> `batch_size`)."""
    return key.replace("-", "_")


def _toml_reader(path: str) -> ModuleType:
    """The standard library's `tomllib` (Python 3.11+), else `tomli`: the same parser, as
    published before Python took it in, and a dependency of ddp_amp on Python 3.10."""
    try:
        import tomllib
        return tomllib
    except ModuleNotFoundError:
        pass
    try:
        import tomli
        return tomli
    except ModuleNotFoundError:
        raise UsageError("--config", path, "Python 3.11 or newer, or the tomli package (a TOML reader)",
                         "pip install tomli, or pass the options as flags instead") from None


def _load(path: str) -> dict[str, Any]:
    toml = _toml_reader(path)
    try:
        with open(path, "rb") as file:
            return toml.load(file)
    except OSError as error:
        raise UsageError("--config", path, "a readable TOML file", error.strerror or str(error)) from None
    except UnicodeDecodeError:
        raise UsageError("--config", path, "a TOML file in UTF-8", "re-save it as UTF-8") from None
    except toml.TOMLDecodeError as error:
        raise UsageError("--config", path, "a valid TOML file", str(error)) from None


def _nearest_hint(name: str, kinds: Mapping[str, Any]) -> str:
    close = difflib.get_close_matches(name, list(kinds), n=1)
    return f"did you mean {close[0]}?" if close else "keys are option names without --, e.g. max_steps"


def _typed(where: str, value: Any, kind: type | tuple[type, ...]) -> Any:
    """`value` as the option's kind, or a UsageError. TOML types are kept strict (`"10"` is
    not an integer, `1` is not `true`); the one widening is an integer for a float option,
    as `lr = 1` is how people write 1.0. A switch that grew choices takes either kind."""
    if isinstance(kind, tuple):
        for one in kind:
            if (one is bool) == isinstance(value, bool) and isinstance(value, one):
                return value
        raise UsageError(where, value, " or ".join(KIND_NAMES[one] for one in kind),
                         f"this value is {_toml_type(value)} in TOML")
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if (kind is bool and isinstance(value, bool)) or (kind is str and isinstance(value, str)):
        return value
    if kind is int and is_number and isinstance(value, int):
        return value
    if kind is float and is_number:
        return float(value)
    if kind is tuple and isinstance(value, list) and all(isinstance(item, str) for item in value):
        return tuple(value)
    raise UsageError(where, value, KIND_NAMES[kind], f"this value is {_toml_type(value)} in TOML")


def _toml_type(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, list):
        return "a list" + ("" if all(isinstance(item, str) for item in value) else " not only of strings")
    names = {int: "an integer", float: "a float", str: "a string", dict: "a table"}
    return names.get(type(value), f"a {type(value).__name__}")


# ---- writing ----------------------------------------------------------------------------

BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")
# Characters a TOML basic string must escape: the quote, the backslash, and the control
# characters (tab may stay literal, but escaping it keeps every value on one visible line).
_SHORT_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def dumps(options: Mapping[str, Any], header: Sequence[str] = ()) -> str:
    """`options` as a flat TOML table, one `key = value` line each, after `header` comments."""
    lines = [f"# {line}" if line else "#" for line in header]
    lines += [f"{_key(key)} = {_value(key, value)}" for key, value in options.items()]
    return "\n".join(lines) + "\n"


def _key(key: str) -> str:
    return key if BARE_KEY.match(key) else _string(key, key)


def _value(key: str, value: Any) -> str:
    if isinstance(value, bool):  # before int: a bool is an int to Python
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return _float(value)
    if isinstance(value, str):
        return _string(key, value)
    if isinstance(value, (list, tuple)) and all(isinstance(item, str) for item in value):
        return "[" + ", ".join(_string(key, item) for item in value) + "]"
    raise TypeError(f"{key}: no TOML form for {type(value).__name__} {value!r}")


def _float(value: float) -> str:
    # repr is the shortest text that reads back as the same float, and always has a '.' or
    # an exponent, as a TOML float needs ('0.0', '0.001', '1e-06', '1e+16'); TOML spells
    # the non-finite ones inf and nan.
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return repr(value)


def _string(key: str, text: str) -> str:
    return '"' + "".join(_char(key, text, char) for char in text) + '"'


def _char(key: str, text: str, char: str) -> str:
    if char in _SHORT_ESCAPES:
        return _SHORT_ESCAPES[char]
    code = ord(char)
    if code < 0x20 or code == 0x7F:
        return f"\\u{code:04X}"
    if 0xD800 <= code <= 0xDFFF:  # a byte of a non-UTF-8 file name (surrogateescape)
        raise UsageError(key, text, "text TOML can hold (valid Unicode)", "pass this option as a flag instead")
    return char
