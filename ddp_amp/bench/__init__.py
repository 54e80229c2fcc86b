"""`python -m ddp_amp.bench`: measured AMP speed-up, launcher overhead and fast-path figures.

Modules: `recipe` (the AMP recipe's network, data and hand-written loop), `amp_recipe`
(fp32 / fp16 / bf16 trials), `overhead` (hand loop vs Trainer, interleaved), `fastpaths`
(one paired ratio per fast path), `host` (the micro model's host time per step), `gpt` and
`transformer` (a GPT-2-shaped decoder: tokens/s, MFU, Trainer vs hand loop), `stats`
(interleaving, paired ratios), `table` (text output), `__main__` (the command line); and
`checkpoint_stall` (how long a save blocks training, synchronous and in the background);
`scale` (the liveness watch at 64 to 16,384 ranks) with `beaters` (the emulated ranks'
connections to its store).
Fresh processes and ranks come from `ddp_amp.distributed.spawn`.
"""
