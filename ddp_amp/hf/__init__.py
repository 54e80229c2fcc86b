"""The Hugging Face boundary: what reads or writes transformers' conventions, in one package.

- `config`: a model directory's config, read offline (`model_config`), and the causal LM it
  describes (`build_causal_lm`); what a run records of its transformers model for
  `export --hf` (`hf_config_record`: the config, the class `from_pretrained` rebuilds, the
  tied names, in the run directory's `hf_config.json`), and the config an export writes
  (`export_config`);
- `tokenizer`: a model directory's tokenizer files (hashed into the data cache's key, kept
  in the run directory's `hf_files/` for `export --hf`) and its fast tokenizer, read offline;
- `weights_in`: pretrained weights (a `.safetensors` file, or a Hugging Face model directory:
  `model.safetensors`, or an index and several files) into a model by name, each rank reading
  only the slices it holds (`--init-weights`), checked from the files' headers first;
- `weights_out`: a state dict as safetensors, one file (`export`) or a Hugging Face model
  directory (`export --hf`: config.json, weights files of at most a size and their index, a
  tied weight once, the tokenizer's files beside them), each appearing whole or not at all;
- `safetensors_file`: a `.safetensors` file's header and any slice of a tensor, read with
  plain reads, never mapped;
- `tp_plan`: a transformers model's own tensor-parallel plan (`_tp_plan`, from its config's
  `base_model_tp_plan`), in ddp_amp's styles, with sequence parallel on its blocks' norms;
- `attention`: a transformers model's attention layers routed to a function of ddp_amp's
  (context parallel's all-gather attention), registered in transformers' attention interface.

Imports `errors`, `durable` and `torch_api` from ddp_amp, nothing else; transformers and
safetensors only where they are used.
"""

from ddp_amp.hf.attention import attends_through_interface, use_attention
from ddp_amp.hf.config import (HF_CONFIG, TIED, build_causal_lm, export_config, hf_config_record, model_config,
                               read_model_directory, require_transformers, run_hf_config, unsharded_architectures)
from ddp_amp.hf.tokenizer import (HF_FILES, TOKENIZER_FILES, load_tokenizer, run_hf_files, saved_call_settings,
                                  tokenizer_files)
from ddp_amp.hf.tp_plan import ModelPlan, model_tensor_parallel_plan
from ddp_amp.hf.weights_in import (LoadedWeights, WeightHeaders, WeightsMatch, load_pretrained, match_weights,
                                   read_headers)
from ddp_amp.hf.weights_out import (ExportedTensors, check_hf_output, parse_size, require_safetensors,
                                    storable_tensors, tied_once, write_hf_directory, write_safetensors)

__all__ = [
                               "HF_CONFIG",
                               "HF_FILES",
                               "TIED",
                               "TOKENIZER_FILES",
                               "ExportedTensors",
                               "LoadedWeights",
                               "ModelPlan",
                               "WeightHeaders",
                               "WeightsMatch",
                               "attends_through_interface",
                               "build_causal_lm",
                               "check_hf_output",
                               "export_config",
                               "hf_config_record",
                               "load_pretrained",
                               "load_tokenizer",
                               "match_weights",
                               "model_config",
                               "model_tensor_parallel_plan",
                               "parse_size",
                               "read_headers",
                               "read_model_directory",
                               "require_safetensors",
                               "require_transformers",
                               "run_hf_config",
                               "run_hf_files",
                               "saved_call_settings",
                               "storable_tensors",
                               "tied_once",
                               "tokenizer_files",
                               "unsharded_architectures",
                               "use_attention",
                               "write_hf_directory",
                               "write_safetensors",
]
