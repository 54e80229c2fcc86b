"""The Hugging Face boundary: what reads or writes transformers' conventions, in one package.

- `tp_plan`: a transformers model's own tensor-parallel plan (`_tp_plan`, from its config's
  `base_model_tp_plan`), in ddp_amp's styles, with sequence parallel on its blocks' norms.

Imports `errors` from ddp_amp, nothing else; transformers only where a model is one.
"""

from ddp_amp.hf.tp_plan import ModelPlan, model_tensor_parallel_plan

__all__ = ["ModelPlan", "model_tensor_parallel_plan"]
