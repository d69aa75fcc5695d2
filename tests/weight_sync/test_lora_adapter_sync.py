"""``--lora-sync adapter``: the embedded engine merges a PEFT adapter into its kept base weights and ends with
exactly the weights PEFT's own ``merge_and_unload`` gives, through the in-process and the disk transport.

The trainer side is HF PEFT itself (``get_peft_model`` on a tiny random qwen2, random A and B): its adapter
tensors under the saved keys are what the backends' ``export_adapters`` give, its ``merge_and_unload`` is the
merged export (the megatron backend's merge is checked against the same formula at every layout in
tests/dist/test_lora_layouts.py). The engine is the real embedded engine.
"""

import copy
import os

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.backends.base import bucketed
from megatron_rl.errors import SyncError
from megatron_rl.models.peft_adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, AdapterExport
from megatron_rl.rollout import EmbeddedEngine
from megatron_rl.weight_sync.disk import DiskSynchronizer
from megatron_rl.weight_sync.in_process import InProcessSynchronizer

RANK, ALPHA = 4, 8.0


class PeftTrainer:
    """A PEFT model as the trainer: ``export_adapters`` / ``export_weights`` as the TrainBackend contract says."""

    def __init__(self, hf_dir: str):
        import transformers
        from peft import LoraConfig, get_peft_model

        self.names = list(load_file(os.path.join(hf_dir, "model.safetensors")))  # the checkpoint's HF names
        model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        self.pm = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules="all-linear"))
        self.step(0)

    def step(self, seed: int) -> None:
        """New adapter values (what an optimizer step does to them)."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for n, p in self.pm.named_parameters():
                if "lora_" in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1)

    def export_adapters(self, *, stage_only: bool = False) -> AdapterExport:
        return AdapterExport({"base_model.model." + n[len("base_model.model."):].replace(".default.weight", ".weight"):
                              p.detach().clone() for n, p in self.pm.named_parameters() if "lora_" in n}, RANK, ALPHA)

    def export_weights(self, bucket_bytes: int, *, stage_only: bool = False, merge_adapters: bool = True):
        if merge_adapters:
            state = copy.deepcopy(self.pm).merge_and_unload().state_dict()
        else:
            with self.pm.disable_adapter():
                state = {k.replace("base_model.model.", "").replace(".base_layer", ""): v
                         for k, v in self.pm.state_dict().items() if "lora_" not in k}
        return bucketed(((n, state[n].detach().clone()) for n in self.names), bucket_bytes)


@pytest.fixture(scope="module")
def hf(tiny_hf_models):
    return tiny_hf_models("qwen2")


def engine_equals_merged(engine, trainer) -> None:
    live = dict(engine.named_weights())
    merged = dict(item for bucket in trainer.export_weights(1 << 30) for item in bucket)
    differ = [n for n, t in merged.items() if not torch.equal(live[n], t)]
    assert not differ and set(live) == set(merged), differ[:5]


def test_in_process_adapter_sync_equals_peft_merge(hf):
    trainer, engine = PeftTrainer(hf), EmbeddedEngine(hf)
    sync = InProcessSynchronizer(1 << 20, check_equal=True, adapter=True)
    first = sync.sync(trainer, engine, version=0)  # base model + adapter
    engine_equals_merged(engine, trainer)
    adapter_bytes = trainer.export_adapters().nbytes
    model_bytes = sum(t.numel() * t.element_size() for b in trainer.export_weights(1 << 30) for _, t in b)
    assert first["sync/adapter_bytes"] == adapter_bytes and first["sync/base_bytes"] == model_bytes
    assert first["sync/checked_tensors"] == len(trainer.names)
    for version in (1, 2):
        trainer.step(version)
        m = sync.sync(trainer, engine, version=version)
        assert m["sync/bytes"] == adapter_bytes < model_bytes / 3 and m["sync/base_bytes"] == 0
        assert engine.weight_version == version
        engine_equals_merged(engine, trainer)  # merged from the base kept once, not from the last merge

    # what is refused leaves the engine at its version, serving
    bad = trainer.export_adapters()
    key = next(k for k in bad.tensors if k.endswith("q_proj.lora_A.weight"))
    with pytest.raises(SyncError, match=r"refused; the engine stays at version 2: .*q_proj.weight: A \(3, "):
        engine.update_adapter(AdapterExport({**bad.tensors, key: bad.tensors[key][:3]}, RANK, ALPHA), 3)
    assert engine.weight_version == 2 and engine.health().ok
    engine_equals_merged(engine, trainer)
    fresh = EmbeddedEngine(hf)
    assert fresh.adapter_base_needed()
    with pytest.raises(SyncError, match="holds no base weights to merge the adapter into"):
        fresh.update_adapter(bad, 1)
    engine.release()  # colocated: an engine holding an adapter's base keeps its weights on the host
    engine.resume()
    assert not engine.adapter_base_needed() and engine.health().ok
    trainer.step(3)
    assert sync.sync(trainer, engine, version=3)["sync/bytes"] == adapter_bytes
    engine_equals_merged(engine, trainer)
    with pytest.raises(SyncError):  # a failed full update loses the weights: the next sync brings the base
        engine.update_weights([("model.norm.weight", torch.zeros(1))], 4)
    assert engine.adapter_base_needed()
    assert sync.sync(trainer, engine, version=4)["sync/base_bytes"] == model_bytes
    engine_equals_merged(engine, trainer)


def test_disk_adapter_sync_writes_peft_dirs(hf, tmp_path):
    trainer, engine = PeftTrainer(hf), EmbeddedEngine(hf)
    sync = DiskSynchronizer(1 << 20, check_equal=True, adapter=True, disk_dir=str(tmp_path / "w"), hf_checkpoint=hf)
    sync.sync(trainer, engine, version=0)
    assert {ADAPTER_WEIGHTS, ADAPTER_CONFIG, "model.safetensors"} <= set(os.listdir(tmp_path / "w" / "v0"))
    trainer.step(1)
    m = sync.sync(trainer, engine, version=1)
    assert {ADAPTER_WEIGHTS, ADAPTER_CONFIG} <= set(os.listdir(tmp_path / "w" / "v1"))
    assert not any(f.startswith("model") for f in os.listdir(tmp_path / "w" / "v1"))
    assert m["sync/checked_tensors"] == len(trainer.names) and engine.weight_version == 1
    engine_equals_merged(engine, trainer)
    # the dir is PEFT's own format: PEFT loads it onto the base model and merges to the same weights
    import transformers
    from peft import PeftModel

    base = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(tmp_path / "w" / "v1")).merge_and_unload().state_dict()
    live = dict(engine.named_weights())
    assert all(torch.equal(live[n], merged[n]) for n in trainer.names if n in merged)
