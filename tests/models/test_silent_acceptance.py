"""Inputs that used to be accepted without a word are named where they are read.

Each class, at every reader of that input:

* an HF checkpoint of mixed dtypes (a float16 tensor in a float32 checkpoint): the converter refuses it; the
  trainer's loader and every transformers load (embedded engine, fsdp backend: ``refuse_non_finite_parameters``)
  warn, naming the tensor and its dtype;
* inf/NaN in a PEFT adapter dir: refused naming the tensor and the file by every reader of one
  (``peft_adapter.read_adapter_tensors``: both backends' ``--lora-load`` and the engines' adapter updates);
  was blamed on the bridge or on "NaN logits";
* a response budget the model's context cannot hold (``--rollout-max-response-len 100`` on a 64-position
  model): every generate path of the embedded engine takes its budget from one place, which warns naming
  the numbers; was capped silently.

In-process, the tiny HF models of tests/conftest.py.
"""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_rl.errors import CheckpointError, SyncError
from megatron_rl.models import hf_checkpoint
from megatron_rl.models.hf_checkpoint import NonFiniteWeights

VICTIM = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture
def mixed(tiny_hf_models, tmp_path, monkeypatch):
    """The tiny llama (float32) with one tensor stored as float16."""
    src = tiny_hf_models("llama")
    dst = tmp_path / "mixed"
    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    tensors[VICTIM] = tensors[VICTIM].half()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    monkeypatch.setattr(hf_checkpoint, "_MIXED_WARNED", set())  # once per process: fresh for each reader here
    return str(dst)


def _warned_mixed(caplog, path: str, reader: str) -> None:
    assert f"HF checkpoint {path} mixes dtypes" in caplog.text and f"1 F16: ['{VICTIM}']" in caplog.text \
        and f"{reader} casts each to its parameter dtype" in caplog.text, caplog.text


def test_mixed_dtypes_are_refused_by_the_converter_and_named_by_every_loader(mixed, tmp_path, caplog, monkeypatch):
    from megatron_rl.convert.hf_to_dist import convert_hf_to_dist
    from megatron_rl.models import dist_io, get_bridge
    from megatron_rl.models.parallel import ParallelLayout
    from megatron_rl.rollout.embedded import EmbeddedEngine

    with pytest.raises(CheckpointError, match="mixes dtypes"):
        convert_hf_to_dist(mixed, str(tmp_path / "dist"))
    caplog.set_level(logging.WARNING, logger="megatron_rl")
    dist_io.setup(ParallelLayout())
    bridge = get_bridge(mixed)
    bridge.load_hf_weights(bridge.build_model(ParallelLayout()), mixed)  # the trainer: loads, and says so
    _warned_mixed(caplog, mixed, "the trainer")
    caplog.clear()
    monkeypatch.setattr(hf_checkpoint, "_MIXED_WARNED", set())
    EmbeddedEngine(mixed)  # transformers' load (the fsdp backend's goes through the same check)
    _warned_mixed(caplog, mixed, "transformers' from_pretrained")
    caplog.clear()
    EmbeddedEngine(mixed)  # once per process and checkpoint: the trainer and the engine read one dir
    assert "mixes dtypes" not in caplog.text


def test_one_dtype_is_not_warned(tiny_hf_models, caplog, monkeypatch):
    monkeypatch.setattr(hf_checkpoint, "_MIXED_WARNED", set())
    caplog.set_level(logging.WARNING, logger="megatron_rl")
    hf_checkpoint.HFCheckpoint(tiny_hf_models("llama")).warn_mixed_dtypes("the trainer")
    assert "mixes dtypes" not in caplog.text


@pytest.fixture
def nan_adapter(tiny_hf_models, tmp_path):
    """A PEFT dir (peft's own save_pretrained) for the tiny qwen2, one NaN in one lora_B; and the model."""
    import transformers
    from peft import LoraConfig, get_peft_model

    hf = tiny_hf_models("qwen2")
    model = get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(hf),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    out = tmp_path / "adapter"
    model.save_pretrained(str(out))
    tensors = load_file(str(out / "adapter_model.safetensors"))
    victim = sorted(k for k in tensors if "lora_B" in k)[0]
    tensors[victim] = torch.full_like(tensors[victim], float("nan"))
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return hf, str(out), victim


def test_a_nan_adapter_is_refused_by_every_reader_naming_the_tensor_and_file(nan_adapter):
    from types import SimpleNamespace

    import transformers

    from megatron_rl.backends.fsdp import lora as fsdp_lora
    from megatron_rl.models.peft_adapter import AdapterExport, read_adapter_tensors
    from megatron_rl.rollout.embedded import EmbeddedEngine

    hf, adapter, victim = nan_adapter
    named = rf"'{victim}' in --lora-load {adapter}/adapter_model.safetensors holds non-finite values"
    with pytest.raises(NonFiniteWeights, match=named):  # the megatron backend's --lora-load reads this way
        read_adapter_tensors(adapter, "--lora-load")
    lo = SimpleNamespace(lora_rank=4, lora_alpha=8.0, lora_dropout=0.0, lora_target_modules=["q_proj", "v_proj"],
                         lora_load=adapter)
    with pytest.raises(NonFiniteWeights, match=named):  # the fsdp backend's --lora-load
        fsdp_lora.attach(transformers.AutoModelForCausalLM.from_pretrained(hf), lo)
    with pytest.raises(NonFiniteWeights, match=rf"'{victim}' in adapter dir {adapter}/adapter_model.safetensors"):
        AdapterExport.load(adapter)  # an adapter update's reader (the disk transport under --lora-sync adapter)
    with pytest.raises(SyncError, match=rf"{adapter} is not a readable PEFT dir .*'{victim}'.* holds non-finite"):
        EmbeddedEngine(hf).update_weights_from_disk(adapter, 1)


def test_a_response_budget_beyond_the_context_is_warned_on_every_generate_path(tiny_hf_models, caplog):
    from megatron_rl.data.types import GenerateRequest, SamplingParams
    from megatron_rl.rollout.embedded import EmbeddedEngine, EngineRow

    hf = tiny_hf_models("qwen2", max_position_embeddings=64)
    caplog.set_level(logging.WARNING, logger="megatron_rl")
    prompt = [3, 4, 5, 6, 7]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=100, seed=1, ignore_eos=True)
    cut = "a response may be 100 tokens long (--rollout-max-response-len"
    numbers = "a prompt of 5 tokens leaves 59 of the model's context (max_position_embeddings 64"

    samples = EmbeddedEngine(hf).generate([GenerateRequest(prompt_ids=prompt, group_index=0)], sampling)
    assert len(samples[0].response_ids) == 59 and samples[0].finish_reason == "length"
    assert cut in caplog.text and numbers in caplog.text, caplog.text

    caplog.clear()
    engine, rows, done = EmbeddedEngine(hf), [EngineRow(prompt, seed=1, max_new_tokens=100)], []
    engine.generate_continuous(sampling, lambda room: [rows.pop() for _ in range(min(room, len(rows)))],
                               lambda row, out: done.append(out))
    assert len(done) == 1 and cut in caplog.text and numbers in caplog.text, caplog.text
    assert caplog.text.count(cut) == 1  # once per engine
