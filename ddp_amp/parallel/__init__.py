"""How a model is spread over the ranks: replicated (DDP) or sharded (FSDP2), and the fast
paths around it (activation checkpointing, compile, reduced-precision gradient traffic).

- `options`: `ParallelOptions`, the run's choices among them.
"""
