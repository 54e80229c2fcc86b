"""The one error type users see for bad input: value, expectation and hint on one line."""

from __future__ import annotations


def spelled(option: str, value: str) -> str:
    """How its caller sets `option` to `value`: `--precision fp16` for a command-line flag,
    `precision="fp16"` for a keyword of a function or class."""
    return f"{option} {value}" if option.startswith("--") else f'{option}="{value}"'


class OneLineError(Exception):
    """An error whose message names the value, what was expected and a hint, on one line."""

    def __init__(self, what: str, value: object, expected: str, hint: str) -> None:
        self.what = what
        self.value = value
        self.expected = expected
        self.hint = hint
        super().__init__(f"{what}={value!r}: expected {expected} (hint: {hint})")

    def __reduce__(self) -> tuple[type[OneLineError], tuple[str, object, str, str]]:
        # Exceptions pickle their `args` (here the one formatted message), which this
        # __init__ cannot take back; the four fields can. Errors cross ranks pickled.
        return type(self), (self.what, self.value, self.expected, self.hint)


class UsageError(OneLineError):
    """Bad input from the user: a flag, an environment variable, a task, a checkpoint.

    The CLI prints it as one line and exits with code 2; library callers can catch it.
    """


class StoreUnreached(UsageError):
    """This rank never reached its group's store within --dist-timeout: the store's host (rank
    0, or the launcher's agent) never came, so no rank is there to speak for the job. Unlike
    other errors raised on every rank, each rank that raises it prints it."""


class CheckpointError(OneLineError):
    """A checkpoint could not be written (a full disk, a read-only directory); every older
    checkpoint is still in place. Not the user's input: the CLI exits with code 3."""


class TrainingHalted(RuntimeError):
    """A safety check stopped training (loss scale collapsed, loss non-finite, ranks out of sync).

    Raised on every rank together (the checks read agreed or gathered values). Nothing is
    checkpointed from the state that failed the check: callers must not save on this error.
    """
