"""``--lora-sync adapter``: the embedded engine merges a PEFT adapter into its kept base weights and ends with
exactly the weights PEFT's own ``merge_and_unload`` gives, through the in-process and the disk transport.

The trainer side is HF PEFT itself (``get_peft_model`` on a tiny random qwen2, random A and B): its adapter
tensors under the saved keys are what the backends' ``export_adapters`` give, its ``merge_and_unload`` is the
merged export (the megatron backend's merge is checked against the same formula at every layout in
tests/dist/test_lora_layouts.py). The engine is the real embedded engine.
"""

import copy
import os
import sys

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
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "rollout"))  # the SGLang stand-in


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
    v0 = tmp_path / "w" / "v0"
    # the base in its own subdir: SGLang's /load_lora_adapter reads every safetensors file of the adapter's dir
    assert {ADAPTER_WEIGHTS, ADAPTER_CONFIG, "base"} <= set(os.listdir(v0))
    assert [f for f in os.listdir(v0) if f.endswith(".safetensors")] == [ADAPTER_WEIGHTS]
    assert {"model.safetensors", "config.json"} <= set(os.listdir(v0 / "base"))
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


def test_sglang_disk_adapter_sync_serves_the_adapter(hf, tmp_path):
    """--lora-sync adapter into SGLang (the protocol stand-in, real SGLang in scripts/test_sglang_real.sh --lora):
    each version's PEFT dir is loaded by /load_lora_adapter and every /generate names it; the first sync's base
    goes through /update_weights_from_disk (the index keeps the adapter file out of it); generations equal the
    embedded engine's, which merges the same adapter itself."""
    from megatron_rl.rollout import GenerateRequest, SamplingParams
    from megatron_rl.rollout.sglang import SGLangEngine
    from sglang_standin import SGLangStandIn  # tests/rollout: on sys.path above

    trainer, local = PeftTrainer(hf), EmbeddedEngine(hf)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    requests = [GenerateRequest(prompt_ids=[1, 5, 6, 7], group_index=0), GenerateRequest(prompt_ids=[2, 9], group_index=1)]

    def same_generations(engine) -> None:
        got, want = engine.generate(requests, greedy), local.generate(requests, greedy)
        assert [s.response_ids for s in got] == [s.response_ids for s in want]
        assert max(abs(a - b) for s, t in zip(got, want) for a, b in zip(s.rollout_logprobs, t.rollout_logprobs)) < 1e-5

    with SGLangStandIn(hf, enable_lora=True, max_lora_rank=RANK) as server:
        engine = SGLangEngine([server.url], health_interval_s=0, releases_memory=False)
        try:
            base_before = engine.generate(requests, greedy)
            sync = DiskSynchronizer(1 << 20, adapter=True, disk_dir=str(tmp_path / "w"), hf_checkpoint=hf)
            local_sync = InProcessSynchronizer(1 << 20, adapter=True)
            first = sync.sync(trainer, engine, version=0)
            local_sync.sync(trainer, local, version=0)
            assert first["sync/base_bytes"] > 0 and server.disk_updates == [("0", str(tmp_path / "w" / "v0" / "base"))]
            assert server.lora_loads == [("mrl-lora-v0", str(tmp_path / "w" / "v0"))]
            same_generations(engine)
            assert [s.response_ids for s in engine.generate(requests, greedy)] != \
                [s.response_ids for s in base_before]  # the adapter changes what is generated
            for version in (1, 2):
                trainer.step(version)
                m = sync.sync(trainer, engine, version=version)
                local_sync.sync(trainer, local, version=version)
                assert m["sync/bytes"] == trainer.export_adapters().nbytes and m["sync/base_bytes"] == 0
                assert len(server.disk_updates) == 1  # adapter-only versions load no base
                assert list(server.loras) == [f"mrl-lora-v{version}"]  # the previous version's unloaded
                assert engine.weight_version == version and server.weight_version == str(version)
                samples = engine.generate(requests, greedy)
                assert all(s.weight_version == version for s in samples)
                same_generations(engine)
            rows = [server.generated[r] for r in server.rids_served[-2:]]
            assert all(r["row"]["meta_info"]["weight_version"] == "2" for r in rows)
        finally:
            engine.close()


def test_sglang_lora_replies_and_refusals(hf, tmp_path):
    """The stand-in's LoRA endpoints through the real client: SGLang's refusals in its words, raised as SyncError."""
    from megatron_rl.rollout.sglang import SGLangClient
    from megatron_rl.rollout.sglang.engine import ADAPTER_CONFIG as ENGINE_CONFIG
    from sglang_standin import SGLangStandIn

    assert ENGINE_CONFIG == ADAPTER_CONFIG  # the SGLang engine's torch-free copy
    peft_dir = tmp_path / "peft"
    peft_dir.mkdir()
    PeftTrainer(hf).export_adapters().save(str(peft_dir))
    with SGLangStandIn(hf) as plain, SGLangClient(plain.url, connect_retries=0) as client:
        with pytest.raises(SyncError, match="LoRA is not enabled. Please set `--enable-lora` to enable LoRA."):
            client.load_lora_adapter("a", str(peft_dir))
        with pytest.raises(Exception, match="LoRA adapter 'a' was requested, but LoRA is not enabled"):
            client.generate([[1, 2]], [{"max_new_tokens": 1}], lora_path="a")
    with SGLangStandIn(hf, enable_lora=True, max_lora_rank=RANK) as server, \
            SGLangClient(server.url, connect_retries=0) as client:
        assert client.load_lora_adapter("a", str(peft_dir))["loaded_adapters"] == {"a": str(peft_dir)}
        with pytest.raises(SyncError, match="Failed to load LoRA adapter a because it is already loaded"):
            client.load_lora_adapter("a", str(peft_dir))
        with pytest.raises(Exception, match="Got LoRA adapter that has never been loaded: b"):
            client.generate([[1, 2]], [{"max_new_tokens": 1}], lora_path="b")
        client.unload_lora_adapter("a")
        with pytest.raises(SyncError, match="LoRA with name a does not exist"):
            client.unload_lora_adapter("a")
        client.generate([[1, 2]], [{"max_new_tokens": 1}], lora_path="a")  # reloaded from its path, as SGLang does
        assert server.lora_loads == [("a", str(peft_dir))] * 2
        # the same adapter from tensors (SGLang's from-tensors route) generates the same rows
        adapter = AdapterExport.load(str(peft_dir))
        client.load_lora_adapter_from_tensors("t", adapter.config(), adapter.tensors.items())
        greedy = [{"max_new_tokens": 5, "temperature": 0.0}]
        by_dir, by_tensors = (client.generate([[1, 5, 6]], greedy, lora_path=n)[0] for n in ("a", "t"))
        assert by_dir["output_ids"] == by_tensors["output_ids"] and \
            by_dir["meta_info"]["output_token_logprobs"] == by_tensors["meta_info"]["output_token_logprobs"]


class SavedModulesTrainer(PeftTrainer):
    """PEFT with ``modules_to_save=["embed_tokens"]`` on a model whose output layer is its embedding (PEFT's
    ``ensure_weight_tying``): the export holds the trained embedding beside the adapters, as the backends' do."""

    def __init__(self, hf_dir: str):
        import transformers
        from peft import LoraConfig, get_peft_model

        self.names = list(load_file(os.path.join(hf_dir, "model.safetensors")))
        model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        self.pm = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules="all-linear",
                                                   modules_to_save=["embed_tokens"], ensure_weight_tying=True))
        self.step(0)

    def step(self, seed: int) -> None:
        super().step(seed)
        with torch.no_grad():
            emb = self.pm.base_model.model.model.embed_tokens.modules_to_save["default"].weight
            emb.add_(torch.randn(emb.shape, generator=torch.Generator().manual_seed(seed + 100)) * 0.1)

    def export_adapters(self, *, stage_only: bool = False) -> AdapterExport:
        from peft import get_peft_model_state_dict

        tensors = {k: v.detach().clone() for k, v in get_peft_model_state_dict(self.pm).items()}
        return AdapterExport(tensors, RANK, ALPHA, ("embed_tokens",), True)

    def export_weights(self, bucket_bytes: int, *, stage_only: bool = False, merge_adapters: bool = True):
        merged = copy.deepcopy(self.pm).merge_and_unload().state_dict()
        state = self.pm.state_dict()
        if not merge_adapters:  # the adapted linears' base weights; the embedding as trained (it is no adapter)
            merged = {n: state.get(f"base_model.model.{n[:-len('.weight')]}.base_layer.weight", t)
                      for n, t in merged.items()}
        return bucketed(((n, merged[n].detach().clone()) for n in self.names), bucket_bytes)


def test_adapter_sync_carries_the_modules_to_save(tiny_hf_models, tmp_path):
    """--lora-modules-to-save: each adapter sync sets the engine's embedding to the trainer's (in-process and as
    a PEFT dir that PEFT itself loads), and an update without them, once sent, is refused, not silently stale."""
    hf = tiny_hf_models("qwen2", tie_word_embeddings=True)
    trainer = SavedModulesTrainer(hf)
    engine, on_disk = EmbeddedEngine(hf), EmbeddedEngine(hf)
    sync = InProcessSynchronizer(1 << 20, check_equal=True, adapter=True)
    disk = DiskSynchronizer(1 << 20, check_equal=True, adapter=True, disk_dir=str(tmp_path / "w"), hf_checkpoint=hf)
    for version in (0, 1):
        trainer.step(version)
        m = sync.sync(trainer, engine, version=version)
        disk.sync(trainer, on_disk, version=version)
        engine_equals_merged(engine, trainer)
        engine_equals_merged(on_disk, trainer)
    assert m["sync/adapter_bytes"] == trainer.export_adapters().nbytes and m["sync/base_bytes"] == 0
    import json

    import transformers
    from peft import PeftModel

    v1 = tmp_path / "w" / "v1"
    config = json.loads((v1 / ADAPTER_CONFIG).read_text())
    assert config["modules_to_save"] == ["embed_tokens"] and config["ensure_weight_tying"] is True
    assert {"base_model.model.model.embed_tokens.weight", "base_model.model.lm_head.weight"} <= set(
        load_file(str(v1 / ADAPTER_WEIGHTS)))
    base = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, str(v1))
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    with torch.no_grad():
        want = trainer.pm(ids).logits
        assert torch.allclose(peft_model(ids).logits, want, atol=1e-5, rtol=0)
    merged = peft_model.merge_and_unload().state_dict()
    live = dict(engine.named_weights())
    assert all(torch.equal(live[n], merged[n]) for n in trainer.names if n in merged)

    without = trainer.export_adapters()
    tensors = {k: t for k, t in without.tensors.items() if ".lora_" in k}
    with pytest.raises(SyncError, match="weight.s. of the modules to save sent before are not sent now"):
        engine.update_adapter(AdapterExport(tensors, RANK, ALPHA), 2)
    assert engine.weight_version == 1

    class Forgetful(SavedModulesTrainer):  # a backend whose export drops the modules it declares
        def export_adapters(self, *, stage_only: bool = False) -> AdapterExport:
            return AdapterExport(tensors, RANK, ALPHA, ("embed_tokens",), True)

    forgetful = Forgetful.__new__(Forgetful)
    forgetful.__dict__.update(trainer.__dict__)
    with pytest.raises(SyncError, match=r"holds no weight of the modules to save \['embed_tokens'\]"):
        sync.sync(forgetful, engine, version=2)
