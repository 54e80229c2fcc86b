"""Layer 1, pure: which launcher started this process and where it sits in the job.

Reads an environment mapping and returns a `DistEnv`; never writes `os.environ`, never
imports torch.distributed. Every other layer may import it.
"""

from ddp_amp.env.detect import (DistEnv, Launcher, detect_env, expand_nodelist, launched_by_srun,
                                launched_by_torchrun)

__all__ = ["DistEnv", "Launcher", "detect_env", "expand_nodelist", "launched_by_srun",
           "launched_by_torchrun"]
