"""The process options of a run: which device each rank uses, its group's backend, and how
long a collective may wait for a peer."""

from __future__ import annotations

from dataclasses import dataclass

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

    def check(self) -> None:
        """Choices and ranges."""
        check_fields(self, DistOptions)
