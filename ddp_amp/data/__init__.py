"""The training data of a run: how each rank's batches are cut from the global batch.

- `options`: `DataOptions`, the batch geometry and loader workers.
"""
