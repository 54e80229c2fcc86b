"""A loop of one's own on `Session` with `session.preemption`'s start()/close() form (run by
tests under torchrun).

argv[1]: the run directory; argv[2]: the last step; argv[3]: a step at which rank 1 waits for
a preemption signal before it goes on (0: none), having written its pid to `holding-N`.
Resumes from the newest checkpoint under the run directory's `checkpoints/`; at the last
step saves `final/`. Prints `rank R stops at step S with exit code C` when preempted.
"""

from __future__ import annotations

import os
import sys
import time
from functools import partial
from pathlib import Path

import torch
from torch import nn

from ddp_amp import Session
from ddp_amp.checkpoint import step_dir_name

run_dir, last_step, hold_at = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
checkpoints = run_dir / "checkpoints"
run_dir.mkdir(parents=True, exist_ok=True)

with Session("fp32", "cpu") as session:
    torch.manual_seed(0)
    model = session.setup(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": model, "optimizer": optimizer}
    step = 0
    latest = session.latest(checkpoints)
    if latest is not None:
        step = session.load(latest, state)["step"]
    # Every step checks (check_every_s tiny): the stop step is the one the signal came before.
    # The start()/close() form: the loop stays at the level of the session's block.
    preemption = session.preemption(run_dir=run_dir, check_every_s=1e-6, start_step=step).start()
    while step < last_step:
        data = torch.Generator().manual_seed(1000 * step + session.rank)  # the data of this step
        inputs, target = torch.randn(8, 8, generator=data), torch.randn(8, 1, generator=data)
        session.backward((model(inputs) - target).square().mean())
        session.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if step == hold_at and session.rank == 1:
            (run_dir / f"holding-{step}").write_text(str(os.getpid()))
            deadline = time.monotonic() + 120
            while preemption.received is None and time.monotonic() < deadline:
                time.sleep(0.01)
        if preemption.should_stop(step):
            record = preemption.stop(step, partial(session.save, checkpoints / step_dir_name(step),
                                                   {**state, "step": step}))
            print(f"rank {session.rank} stops at step {step} with exit code {record['exit_code']}", flush=True)
            sys.exit(record["exit_code"])
    preemption.close()
    session.save(run_dir / "final", {**state, "step": step})
