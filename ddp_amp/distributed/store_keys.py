"""What the liveness watch keeps in the group's store: its keys, a beat's form, and how news
of the job's verdict reaches every rank at once.

Keys, under the attempt's prefix:
- `BEAT_KEY<rank>`: the rank's heartbeat, `"<tag> <step> <state>"`: the tag changes at
  every beat ("0": the rank's own first beat; "<g>:<n>": its helper's; "k<n>": the rank
  standing in for a helper that does not beat), the step is its last finished one ("-":
  none yet), the state one of STATES;
- `FAILURE_KEY`: the job's failure, a JSON object `{"rank", "message"}`, and where a judge
  named ranks `"named"` (the first NAMED_RANKS of them: their helpers end them, so a
  launcher reports them as the root cause), `"count"` (how many it named) and `"since"`
  (when the evidence began, seconds since the epoch); the first to claim it (compare_set)
  is the job's. Every helper reads it, so it is bounded: the message is cut at
  MESSAGE_CHARS, the ranks at NAMED_RANKS (under 2 KB at any world size);
- `HOST_DONE_KEY`: "1" once the rank hosting the store finished its run (its store going
  away is then no failure);
- `NEWS_KEY`: how many events (a failure, the host done) were announced; `NEWS_KEY/<n>`:
  there once the n-th was.

Each helper keeps one WAIT on `NEWS_KEY/<seen + 1>` (store_wire.py): the store answers it
when the next event is announced, so a failure reaches every rank at once and the verdict
costs the store nothing while there is none. (Polled, it cost two requests per rank and
poll: most of the store's load at scale.) An event is written first, then announced.
Standard library only: the helper imports it.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

BEAT_KEY = "ddp_amp/beat/"
FAILURE_KEY = "ddp_amp/failure"
HOST_DONE_KEY = "ddp_amp/host_done"
NEWS_KEY = "ddp_amp/news"

# A beat's state. TIMED_OUT: its last collective timed out; FAILED: its last collective failed
# as a peer's connection ended; GONE: its process ended without saying DONE (its helper saw it).
RUNNING, FAILED, TIMED_OUT, DONE, GONE = "r", "f", "t", "d", "x"
STATES = (RUNNING, FAILED, TIMED_OUT, DONE, GONE)
NAMED_RANKS = 4  # ranks a failure names for their helpers to end; the rest end on the news
MESSAGE_CHARS = 1000  # of a failure's message kept in the store (its rank prints it whole)


class _Store(Protocol):
    """What an announcement needs of a store: torch's (a PrefixStore) or a WireClient."""

    def add(self, key: str, amount: int, /) -> int: ...

    def set(self, key: str, value: Any, /) -> None: ...


def news_slot(count: int) -> str:
    """The key that exists once the `count`-th event was announced."""
    return f"{NEWS_KEY}/{count}"


def announce(store: _Store) -> None:
    """Wake every helper's WAIT: call after writing the event itself."""
    store.set(news_slot(store.add(NEWS_KEY, 1)), b"")


def beat(tag: str, step: str, state: str) -> bytes:
    return f"{tag} {step} {state}".encode()


def failure_value(rank: int, message: str, named: list[int] | None = None, since: float | None = None) -> bytes:
    """The FAILURE_KEY value for `rank`'s failure, or for the ranks a judge `named`: bounded
    (MESSAGE_CHARS of the message, NAMED_RANKS of the ranks and how many there were)."""
    if len(message) > MESSAGE_CHARS:
        message = message[:MESSAGE_CHARS - 3] + "..."
    record: dict[str, Any] = {"rank": rank, "message": message}
    if named:
        record.update(named=sorted(named)[:NAMED_RANKS], count=len(set(named)), since=since)
    return json.dumps(record).encode()


def parse_failure(value: bytes) -> dict[str, Any]:
    """A FAILURE_KEY value as a dict ({} where it is empty or not ours)."""
    try:
        record = json.loads(value)
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}
