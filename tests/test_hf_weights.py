"""Hugging Face weights in and out: `--init-weights` loads a pretrained model's safetensors
(an index and several files) by name, each rank reading only the slices it holds under
--shard; `export --hf` writes a directory `from_pretrained` loads. Round trip on a small random
Llama through the transformers example: save_pretrained -> --init-weights -> 2 gloo ranks
--shard -> export --hf -> from_pretrained, whose logits are the trained model's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from ddp_amp import UsageError
from ddp_amp.hf import load_pretrained, read_headers
from ddp_amp.export import main as export_main
from tests.multiproc import run_train
from tests.torch_features import needs_sharding

transformers = pytest.importorskip("transformers")

TASK = "examples.hf_causal_lm:make_task"


def _pretrained(directory: Path) -> nn.Module:
    """A small random Llama with tied embeddings, saved as an index and several files."""
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(5)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(directory, max_shard_size="40KB")
    return model


def _args(pretrained: Path, run_dir: Path, *extra: str) -> list[str]:
    return ["--task", TASK, "--task-opt", f"model={pretrained}", "--task-opt", "seq=16", "--task-opt", "tokens=20000",
            "--init-weights", str(pretrained), "--device", "cpu", "--precision", "fp32", "--batch-size", "8",
            "--eval-every", "0", "--log-every", "1", "--run-dir", str(run_dir), *extra]


@needs_sharding
def test_a_pretrained_llama_round_trips_through_sharded_training_to_from_pretrained(tmp_path: Path) -> None:
    pretrained = tmp_path / "pretrained"
    original = _pretrained(pretrained)
    assert (pretrained / "model.safetensors.index.json").is_file() and len(list(pretrained.glob("*.safetensors"))) > 1
    result = run_train(_args(pretrained, tmp_path / "run", "--shard", "--max-steps", "3"), nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    # 20 tensors: the tied head is the embedding, in the files once; rank 0 read about half of them.
    line = next(line for line in result.stdout.splitlines() if "initial weights from" in line)
    assert "20 tensors" in line and "sharded: 2 x LlamaDecoderLayer" in result.stdout, result.stdout
    # Their random init was not drawn: every parameter is in the files.
    assert "drew no init for the 21 parameter names" in result.stdout and "drawn after all" not in result.stderr
    total = sum(p.numel() * p.element_size() for p in original.parameters())
    assert 0.4 * total < int(line.split(" bytes")[0].split(", ")[-1].replace(",", "")) < 0.6 * total, line

    out = tmp_path / "hf"
    assert export_main([str(tmp_path / "run"), "--to", str(out), "--hf", "--max-shard-size", "40KB"]) == 0
    assert (out / "config.json").is_file() and (out / "model.safetensors.index.json").is_file()
    # The model's own class, not the FSDP subclass sharding made of it; the names of the source, a
    # tied weight once (a sharded checkpoint holds it under both its names).
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert _names(out) == _names(pretrained) and "lm_head.weight" not in _names(out)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(loaded).__name__ == "LlamaForCausalLM" and loaded.lm_head.weight is loaded.model.embed_tokens.weight
    # A sharded run recorded before the fix named FSDP's subclass: the export names the model's own.
    recorded = tmp_path / "run" / "hf_config.json"
    recorded.write_text(json.dumps({**json.loads(recorded.read_text()), "architectures": ["FSDPLlamaForCausalLM"]}))
    assert export_main([str(tmp_path / "run"), "--to", str(tmp_path / "hf-old"), "--hf"]) == 0
    assert json.loads((tmp_path / "hf-old" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]

    # The trained model: the run's final checkpoint in a plain Llama of the run's config.
    assert export_main([str(tmp_path / "run"), "--to", str(tmp_path / "trained.safetensors")]) == 0
    trained = transformers.LlamaForCausalLM(original.config)
    trained.load_state_dict(load_file(tmp_path / "trained.safetensors"), strict=True)
    tokens = torch.randint(0, 300, (2, 16))
    with torch.no_grad():
        assert torch.equal(loaded.eval()(tokens).logits, trained.eval()(tokens).logits)
        # It started from the pretrained weights: 3 AdamW steps at lr <= 3e-3 move each by < 0.01,
        # while another init differs by about the weights' own size.
        moved = max((a - b).abs().max().item() for a, b in zip(trained.parameters(), original.parameters()))
        assert 0 < moved < 0.01, moved


def _names(directory: Path) -> set[str]:
    return set(json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"])


def _one_error_line(stderr: str) -> str:
    errors = [line for line in stderr.splitlines() if line.startswith("ddp_amp: error: ")]
    assert len(errors) == 1, stderr[-3000:]
    return errors[0]


@needs_sharding
def test_init_weights_are_checked_from_the_file_headers_before_the_model_is_built(tmp_path: Path) -> None:
    pretrained = tmp_path / "pretrained"
    _pretrained(pretrained)
    last = sorted(pretrained.glob("model-*.safetensors"))[-1]
    whole = last.read_bytes()
    last.write_bytes(whole[:-64])  # a copy cut short
    run_dir = tmp_path / "run"
    # --shard builds the model after the run directory is locked: none means nothing was built.
    result = run_train(_args(pretrained, run_dir, "--shard", "--max-steps", "1"), nproc=2)
    # Each rank exits 2 (bad input); torchrun reports that and exits 1 itself.
    assert result.returncode != 0 and "exitcode  : 2" in result.stderr and not run_dir.exists(), result.stderr[-3000:]
    line = _one_error_line(result.stderr)
    assert str(last) in line and "complete" in line, line
    last.write_bytes(whole)
    # A model of another size: the first name whose shape differs, with both shapes.
    other = tmp_path / "other"
    config = transformers.AutoConfig.from_pretrained(pretrained)
    config.intermediate_size = 48
    config.save_pretrained(other)
    args = _args(pretrained, run_dir, "--max-steps", "1")
    args[args.index(f"model={pretrained}")] = f"model={other}"
    result = run_train(args)
    assert result.returncode == 2 and not run_dir.exists() and "Traceback" not in result.stderr, result.stderr[-3000:]
    line = _one_error_line(result.stderr)
    assert "model.layers.0.mlp.gate_proj.weight" in line and "(48, 32)" in line and "(64, 32)" in line, line


def test_every_file_an_index_names_is_checked_from_its_header(tmp_path: Path) -> None:
    from safetensors.torch import save_file
    tensors = {name: value.detach() for name, value in Small().state_dict().items() if name != "head.weight"}
    files = {"embed.weight": "a.safetensors", "proj.weight": "b.safetensors", "proj.bias": "b.safetensors"}
    for file in set(files.values()):
        save_file({name: tensors[name] for name, owner in files.items() if owner == file}, str(tmp_path / file))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": files}))
    assert load_pretrained(Small(), tmp_path).tensors == 3
    whole = (tmp_path / "b.safetensors").read_bytes()
    cases = {"cut short": whole[:-8], "missing": None}
    for case, data in cases.items():
        (tmp_path / "b.safetensors").unlink()
        if data is not None:
            (tmp_path / "b.safetensors").write_bytes(data)
        with pytest.raises(UsageError) as refused:
            read_headers(tmp_path)
        assert "\n" not in str(refused.value) and "b.safetensors" in str(refused.value), (case, refused.value)
    (tmp_path / "b.safetensors").write_bytes(whole)
    moved = {**files, "embed.weight": "b.safetensors"}  # an index from another save than its files
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": moved}))
    with pytest.raises(UsageError) as refused:
        read_headers(tmp_path)
    assert "embed.weight" in str(refused.value) and "b.safetensors" in str(refused.value), refused.value


def test_without_shard_the_weights_load_whole_and_a_resume_takes_its_checkpoint(tmp_path: Path) -> None:
    pretrained = tmp_path / "pretrained"
    original = _pretrained(pretrained)
    run_dir = tmp_path / "run"
    # lr 1e-30 moves no fp32 weight (each is far above 1e-30 / 2**-24): the run ends where it started.
    first = run_train(_args(pretrained, run_dir, "--max-steps", "1", "--lr", "1e-30"))
    assert first.returncode == 0, first.stderr[-3000:]
    assert "drew no init for the 21 parameter names" in first.stdout and "drawn after all" not in first.stderr
    assert export_main([str(run_dir), "--to", str(tmp_path / "w.safetensors")]) == 0
    weights = load_file(tmp_path / "w.safetensors")
    assert all(torch.equal(weights[name], value) for name, value in original.state_dict().items())
    # A resume of the same run, same command line, takes the checkpoint's weights: the
    # pretrained files may be gone by then.
    for file in pretrained.glob("*.safetensors"):
        file.unlink()
    resumed = run_train(_args(pretrained, run_dir, "--max-steps", "2", "--lr", "1e-30"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resume from" in resumed.stdout and "initial weights" not in resumed.stdout


class Small(nn.Module):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, width)
        self.proj = nn.Linear(width, 3)
        self.head = nn.Linear(width, 10, bias=False)
        self.head.weight = self.embed.weight  # tied: the files hold it once


def _save(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, str(path))
    return path


def test_strict_loading_names_the_first_mismatch_in_one_line(tmp_path: Path) -> None:
    source = Small()
    full = {name: value for name, value in source.state_dict().items() if name != "head.weight"}
    model = Small()
    loaded = load_pretrained(model, _save(tmp_path / "ok.safetensors", full))
    assert loaded.tensors == 3 and torch.equal(model.head.weight, source.embed.weight)
    cases = {
        "missing": ({k: v for k, v in full.items() if k != "proj.bias"}, "proj.bias"),
        "unexpected": ({**full, "extra.weight": torch.zeros(2)}, "extra.weight"),
        "shape": ({**full, "proj.bias": torch.zeros(4)}, "proj.bias"),
    }
    for kind, (tensors, named) in cases.items():
        target = Small()
        before = {name: value.clone() for name, value in target.state_dict().items()}
        with pytest.raises(UsageError) as refused:
            load_pretrained(target, _save(tmp_path / f"{kind}.safetensors", tensors))
        message = str(refused.value)
        assert "\n" not in message and named in message and "--init-weights" in message, (kind, message)
        assert all(torch.equal(value, before[name]) for name, value in target.state_dict().items()), kind
    partial = load_pretrained(Small(), tmp_path / "missing.safetensors", strict=False)
    assert partial.missing == ("proj.bias",) and partial.tensors == 2
    for bad in (tmp_path / "nowhere", tmp_path):  # nothing there; a directory without weights
        with pytest.raises(UsageError) as refused:
            load_pretrained(Small(), bad)
        assert "\n" not in str(refused.value) and str(bad) in str(refused.value)


def test_a_bad_init_weights_path_stops_the_cli_before_anything_is_written(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = run_train(["--task", "mlp", "--init-weights", str(tmp_path / "missing"), "--device", "cpu",
                        "--max-steps", "1", "--run-dir", str(run_dir)])
    assert result.returncode == 2 and not run_dir.exists()
    assert "--init-weights" in result.stderr and "Traceback" not in result.stderr


def test_export_hf_refuses_an_existing_output_before_it_reads_any_checkpoint(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    existing = tmp_path / "hf"
    existing.mkdir()
    # The source is not even there: the output is refused first, before a checkpoint is looked for.
    assert export_main([str(tmp_path / "no-run"), "--to", str(existing), "--hf"]) == 2
    err = capsys.readouterr().err
    assert "--to" in err and "--force" in err and len(err.strip().splitlines()) == 1, err


def test_export_hf_of_a_run_without_a_transformers_config_is_refused_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = Path(__file__).parent / "fixtures" / "checkpoint_v0" / "single"  # an mlp run: no hf_config.json
    assert export_main([str(run_dir), "--to", str(tmp_path / "hf"), "--hf"]) == 2
    err = capsys.readouterr().err
    assert "--hf-config" in err and len(err.strip().splitlines()) == 1 and not (tmp_path / "hf").exists()
    # Given a config, the same checkpoint is written as a model directory.
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "none"}))
    assert export_main([str(run_dir), "--to", str(tmp_path / "hf"), "--hf", "--hf-config", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == {"model_type": "none"}
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_a_pytorch_pickle_is_named_as_one_not_as_a_damaged_file(tmp_path: Path) -> None:
    state = Small().state_dict()
    torch.save(state, tmp_path / "pytorch_model.bin")
    for source in (tmp_path / "pytorch_model.bin", tmp_path):  # the file named, and its directory
        with pytest.raises(UsageError) as refused:
            read_headers(source)
        message = str(refused.value)
        assert "\n" not in message and "PyTorch pickle" in message and "safe_serialization=True" in message, message
        assert "download it again" not in message


def _resident_kib(field: str) -> int:
    status = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith(field + ":")))


LAYERS = 16  # of 4 MiB each


def _load_peak(ctx: object, source: Path) -> dict[str, float]:
    """Collective: a sharded stack of Linears built, set up, then loaded from `source`; how far
    this rank's resident set rose during the load, over the bytes its shards hold."""
    from ddp_amp import Session
    from ddp_amp.parallel import ShardOptions

    with Session("fp32", "cpu", "gloo", shard=ShardOptions()) as session:
        model = session.setup(session.build_model(
            lambda: nn.Sequential(*(nn.Linear(1024, 1024, bias=False) for _ in range(LAYERS)))))
        shard_bytes = sum(p.to_local().numel() * 4 for p in Session.unwrap(model).parameters())
        Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from now
        before = _resident_kib("VmRSS")
        loaded = session.load_weights(model, source)
        risen = (_resident_kib("VmHWM") - before) * 1024
    return {"rise_over_shard": risen / shard_bytes, "read_over_shard": loaded.bytes_read / shard_bytes}


@needs_sharding
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="reads the peak resident set from /proc (Linux)")
def test_a_rank_loading_its_shards_keeps_no_more_than_one_tensors_slice_beside_them(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from tests.multiproc import run_ranks

    source = tmp_path / "model.safetensors"
    save_file({f"{layer}.weight": torch.randn(1024, 1024) for layer in range(LAYERS)}, str(source))
    for rank, peak in enumerate(run_ranks(_load_peak, 2, source, timeout=300)):
        # Each tensor's rows read into a buffer of its own, copied into the shard setup made, and
        # let go: the peak rises by about one slice (1/16 of the shards). Pages of a file mapped
        # (safetensors' own reader) stay in the resident set until it closes: the shards again.
        assert peak["read_over_shard"] == 1.0, (rank, peak)
        assert peak["rise_over_shard"] < 0.3, (rank, peak)
