"""The process options of a run: which device each rank uses, its group's backend, and how
long a collective may wait for a peer, and how often ranks beat and how long one may be silent."""

from __future__ import annotations

from dataclasses import dataclass

from ddp_amp.distributed.liveness import BEATS_PER_S, POLL_S, SILENCE_S, Liveness
from ddp_amp.option_values import TEN_YEARS_S, ComponentOptions, check_fields, option


@dataclass(frozen=True)
class DistOptions(ComponentOptions):
    """Device, backend and collective timeout of every rank."""

    device: str = option("auto", "auto (cuda if available), cuda (GPU of the local rank), or cpu",
                         ("auto", "cuda", "cpu"))
    backend: str = option("auto", "process-group backend: auto (nccl on cuda, gloo on cpu; no group "
                          "for one process), nccl, gloo (needed for several ranks on one GPU); "
                          "naming one forms a group even for one process, so DDP runs", ("auto", "nccl", "gloo"))
    dist_timeout: float = option(600.0, "seconds a collective may wait for a peer before the "
                                 "job fails instead of hanging", limits=(1e-3, TEN_YEARS_S))

    peer_poll: float = option(POLL_S, "seconds between two heartbeats of a rank (one store request each, "
                              "sent by the rank's helper process); above --peer-beats-per-s x --peer-poll ranks "
                              f"({BEATS_PER_S * POLL_S:,.0f} at the defaults) each rank beats every world size / "
                              "--peer-beats-per-s s instead, and rank 0 says so at start", limits=(0.05, 60.0))
    peer_silence: float = option(SILENCE_S, "seconds a rank's heartbeat may stay unchanged before the job "
                                 "names it silent (killed, stopped, its node lost) and ends; at least 4 polls, "
                                 "and at least 4 beats where they are widened (16 s at 16,384 ranks at the "
                                 "defaults, said at start); a rank's clock starts at its first beat, written as it "
                                 "joins the group",
                                 limits=(0.2, 3600.0))
    peer_beats_per_s: float = option(BEATS_PER_S, "heartbeats a second the group's store receives at most, all "
                                     "ranks together: above this many x --peer-poll ranks the beats widen to "
                                     "keep to it, and detection slows with them; raise it for faster detection at "
                                     "large world sizes, at that much more load on the store (4,096 a second cost "
                                     "it 6 to 9 percent of a core at 16,384 ranks: docs/benchmarks.md)",
                                     limits=(1.0, 1e6))

    def check(self) -> None:
        """Choices and ranges."""
        check_fields(self, DistOptions)
        self.liveness().check()

    def liveness(self) -> Liveness:
        """The watch's limits (liveness.py)."""
        return Liveness(self.peer_poll, self.peer_silence, self.peer_beats_per_s)
