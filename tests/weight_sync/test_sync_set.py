"""What a weight sync sends, per model family, against the engine's side: the sync set, and buckets that
keep fused loads whole.

Every family's tiny HF model is loaded into a real megatron-core model (one rank), exported by the bridge
as the megatron backend's ``export_weights`` does (``bridge.export_hf_weights`` through ``bucketed``), and
also streamed in the HF module's order (the FSDP backend's export: ``checkpoint_tensors`` converted to the
checkpoint's names layer by layer).

* Buckets respect the engine's fused loads: for bucket sizes from one byte to the whole model, the tensors
  SGLang loads into one fused parameter (``models.fused_loads``; per family the fused kinds its loader
  builds, listed below from SGLang's ``stacked_params_mapping``) never straddle a bucket of the bucket
  stream the SGLang transports send bucket by bucket (``ExportStream.iter_buckets``: ``tensor`` into
  SGLang, ``distributed``) nor a shard file of the disk transport, and every tensor is sent exactly once.
* Non-parameter state is in the sync set: every tensor of the engine's HF module (parameters and
  persistent buffers, such as the sigmoid router's ``e_score_correction_bias``) is among the tensors one
  sync sends and equals the trainer's after it, though the trainer moved every tensor it holds first; the
  non-persistent buffers (rotary ``inv_freq`` ...) are derived from config.json, which a sync does not
  change: they equal those of a model built fresh from the exported tensors, and so do the logits.
"""

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from megatron_rl.backends.base import bucketed
from megatron_rl.models import get_bridge
from megatron_rl.models.fused_loads import FUSED_LOADS, group_of
from megatron_rl.models.hf_module import checkpoint_tensors, hf_checkpoint_names, layer_units
from megatron_rl.models.hf_tiny import FAMILIES
from megatron_rl.rollout import EmbeddedEngine
from megatron_rl.rollout.weight_dir import VersionedWeightDir
from megatron_rl.weight_sync.base import ExportStream
from megatron_rl.weight_sync.in_process import InProcessSynchronizer

# the fused parameters SGLang's loader of each family builds from several checkpoint tensors (its models'
# stacked_params_mapping, the MoE experts' w13, DeepSeek's q_a/kv_a pair); gpt-oss and Qwen3-Next store
# their experts / delta-net projections stacked already: one tensor, nothing to keep together
ENGINE_FUSES = {
    "llama": {"qkv_proj", "gate_up_proj"},
    "qwen2": {"qkv_proj", "gate_up_proj"},
    "qwen3": {"qkv_proj", "gate_up_proj"},
    "qwen3_moe": {"qkv_proj", "gate_up_proj"},
    "mixtral": {"qkv_proj", "w13"},
    "glm4_moe": {"qkv_proj", "gate_up_proj"},
    "deepseek_v3": {"fused_qkv_a_proj_with_mqa", "gate_up_proj"},
    "deepseek_v32": {"fused_qkv_a_proj_with_mqa", "gate_up_proj", "fused_wk_and_weights_proj"},
    "glm_moe_dsa": {"fused_qkv_a_proj_with_mqa", "gate_up_proj", "fused_wk_and_weights_proj"},
    "gpt_oss": {"qkv_proj"},
    "gemma3_text": {"qkv_proj", "gate_up_proj"},
    "qwen3_next": {"qkv_proj", "gate_up_proj"},
    "qwen3_5_text": {"qkv_proj", "gate_up_proj", "in_proj_qkvz", "in_proj_ba"},
    "qwen3_5_moe_text": {"qkv_proj", "gate_up_proj", "in_proj_qkvz", "in_proj_ba"},
    "minimax_m2": {"qkv_proj", "w13"},
    "gemma4_text": {"qkv_proj", "gate_up_proj"},
}


@pytest.fixture(scope="module")
def single_rank():
    from megatron_rl.models.parallel import ParallelLayout, initialize_parallel

    layout = ParallelLayout()
    initialize_parallel(layout, seed=0)
    return layout


@pytest.fixture(scope="module")
def trainers(single_rank, tiny_hf_models):
    """family -> (hf dir, bridge, megatron chunks loaded from it, an embedded engine on it), built once per
    family (the bucket test reads only the engine's module order and sizes)."""
    built: dict = {}

    def get(family):
        if family not in built:
            path = tiny_hf_models(family)
            bridge = get_bridge(path)
            chunks = bridge.build_model(single_rank)
            bridge.load_hf_weights(chunks, path)
            built[family] = (path, bridge, chunks, EmbeddedEngine(path))
        return built[family]

    return get


class BridgeBackend:
    """The megatron backend's ``export_weights`` (``backends/megatron/backend.py``) over a bridge and its
    chunks, without the optimizer and the rest a sync does not touch."""

    def __init__(self, bridge, chunks):
        self.bridge, self.chunks = bridge, chunks

    def export_weights(self, bucket_bytes):
        return bucketed(self.bridge.export_hf_weights(self.chunks, bucket_bytes=bucket_bytes, include_mtp=False),
                        bucket_bytes)


class StreamBackend:
    """A backend whose export is a fixed stream, bucketed as both real backends do."""

    def __init__(self, named):
        self.named = named

    def export_weights(self, bucket_bytes):
        return bucketed(iter(self.named), bucket_bytes)


def hf_module_order(model):
    """The FSDP backend's export stream: the module's checkpoint tensors, converted to the checkpoint's
    names one decoder layer at a time (``FSDPBackend._full_tensors_by_layer``)."""
    items = dict(checkpoint_tensors(model))
    return [item for names in layer_units(items) for item in hf_checkpoint_names(model, {n: items[n] for n in names})
            .items()]


def nbytes(t):
    return t.numel() * t.element_size()


def bucket_sizes(named):
    """One byte, every tensor's size and one byte either side, a geometric ladder to the whole model, past it."""
    total = sum(nbytes(t) for _, t in named)
    sizes = {1, total, total + 1}
    for _, t in named:
        sizes.update({nbytes(t) - 1, nbytes(t), nbytes(t) + 1})
    s = 1.0
    while s < total:
        sizes.add(int(s))
        s *= 1.6
    return sorted(x for x in sizes if x > 0)


def check_groups(family, containers, named):
    """``containers`` (lists of names: buckets, or shard files) hold every tensor of ``named`` once, and
    each fused group whole in one of them; the group kinds are the ones the family's engine fuses."""
    where = {}
    for k, names in enumerate(containers):
        for n in names:
            assert n not in where, f"{family}: {n} sent twice"
            where[n] = k
    assert sorted(where) == sorted(n for n, _ in named), f"{family}: not every tensor sent once"
    groups: dict = {}
    for n, _ in named:
        g = group_of(n)
        if g is not None:
            groups.setdefault(g.key, (g.load, set()))[1].add((g.member, where[n]))
    for key, (load, members) in groups.items():
        assert {m for m, _ in members} == set(load.members), f"{family}: {key} has members {members}"
        assert len({k for _, k in members}) == 1, f"{family}: fused {key} straddles {sorted(members)}"
    return {load.fused for load, _ in groups.values()}


@pytest.mark.parametrize("family", FAMILIES)
def test_no_bucket_or_shard_splits_what_the_engine_fuses_at_any_size(trainers, family, tmp_path):
    _, bridge, chunks, engine = trainers(family)
    megatron_order = [(n, t.clone()) for n, t in bridge.export_hf_weights(chunks, include_mtp=False)]
    engine_model = engine.model
    for order, named in (("megatron", megatron_order), ("fsdp", hf_module_order(engine_model))):
        sizes = bucket_sizes(named)
        for size in sizes:
            # the megatron backend's own export at the smallest and a middle size; its order does not depend on
            # the size (one rank), so the other sizes bucket the stream it gave
            real = order == "megatron" and size in (sizes[0], sizes[len(sizes) // 2])
            stream = ExportStream(BridgeBackend(bridge, chunks) if real else StreamBackend(named), size)
            buckets = [[n for n, _ in b] for b in stream.iter_buckets()]  # what tensor->SGLang, distributed send
            kinds = check_groups(f"{family}/{order}/{size} B", buckets, named)
            assert kinds == ENGINE_FUSES[family], f"{family}: fused kinds {kinds}"
            assert stream.bytes == sum(nbytes(t) for _, t in named)
            if size == 1:  # one load unit per bucket: a group is alone, never split
                assert all(len(b) == 1 or group_of(b[0]) is not None for b in buckets)
    # the disk transport's shard files (shard_bytes = the bucket size): a few sizes, files are slower
    weights = VersionedWeightDir(str(tmp_path / "w"), keep_versions=1)
    total = sum(nbytes(t) for _, t in megatron_order)
    for version, size in enumerate((1, total // 7, total // 2)):
        out = weights.write(iter(megatron_order), version, shard_bytes=size)
        index = os.path.join(out, "model.safetensors.index.json")
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
        check_groups(f"{family}/disk/{size} B", [[n for n, f in weight_map.items() if f == file] for file in files],
                     megatron_order)


def test_every_fused_kind_is_one_engine_fuses():
    """The table holds only SGLang's fusions, and every one of them occurs in some family we map."""
    assert {load.fused for load in FUSED_LOADS} == set().union(*ENGINE_FUSES.values())


@pytest.mark.parametrize("family", FAMILIES)
def test_every_tensor_the_forward_reads_is_synced_and_equal_after_one_sync(trainers, family, tmp_path):
    import transformers

    path, bridge, chunks, engine = trainers(family)
    from megatron_rl.models.weights import named_state_tensors
    from megatron_rl.models.wrappers import unwrap

    state = [t for chunk in chunks for _, t in named_state_tensors(unwrap(chunk))]
    saved = [t.detach().clone() for t in state]
    g = torch.Generator().manual_seed(7)
    try:
        with torch.no_grad():  # the trainer moves every tensor it holds: one left out of the sync stays stale
            for t in state:
                t.add_(0.01 * torch.randn(t.shape, generator=g, dtype=torch.float32).to(t.dtype))
        sync = InProcessSynchronizer(bucket_bytes=64 * 1024, check_equal=True)
        metrics = sync.sync(BridgeBackend(bridge, chunks), engine, version=1)
        sent = dict(bridge.export_hf_weights(chunks, include_mtp=False))
    finally:
        with torch.no_grad():
            for t, s in zip(state, saved):
                t.copy_(s)
    assert metrics["sync/checked_tensors"] == len(sent)
    # the forward's tensors, listed from the module itself (not from the engine's name map)
    model = engine.model
    persistent = {f"{m}.{b}" if m else b for m, mod in model.named_modules() for b, buf in mod._buffers.items()
                  if buf is not None and b not in mod._non_persistent_buffers_set}
    listed = hf_module_order(model)
    assert set(persistent) <= {n for n, _ in checkpoint_tensors(model)}
    assert sorted(n for n, _ in listed) == sorted(sent), f"{family}: the sync set is not the module's state"
    for name, tensor in listed:
        assert torch.equal(tensor, sent[name].to(tensor.dtype)), f"{family}: {name} differs after the sync"
    if family in ("glm4_moe", "deepseek_v3"):  # the router's selection bias is a buffer: it is synced too
        assert any(n.endswith("e_score_correction_bias") for n in persistent & set(sent))
    # a model built fresh from what the sync sent: equal module state, derived buffers and logits
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    for f in ("config.json", "generation_config.json"):
        if os.path.exists(os.path.join(path, f)):
            with open(os.path.join(path, f)) as src, open(ref_dir / f, "w") as dst:
                dst.write(src.read())
    tied = getattr(model.config, "tie_word_embeddings", False)
    save_file({n: t.contiguous() for n, t in sent.items() if not (tied and n == "lm_head.weight")},
              str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
    ref, info = transformers.AutoModelForCausalLM.from_pretrained(str(ref_dir), dtype=torch.float32,
                                                                  output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], f"{family}: {info}"
    mine = dict(model.state_dict(keep_vars=True)) | {n: b for n, b in model.named_buffers()}
    theirs = dict(ref.state_dict(keep_vars=True)) | {n: b for n, b in ref.named_buffers()}
    assert sorted(mine) == sorted(theirs)
    for name, t in mine.items():
        assert torch.equal(t, theirs[name]), f"{family}: {name} differs from a model built from the sync"
    ids = torch.randint(0, bridge.vocab_size, (1, 9), generator=g)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref.eval()(ids).logits)


def test_load_units_keep_order_close_a_group_at_its_last_member_or_its_layers_end():
    """The cases the tiny models leave out: MLA without a q latent (``q_proj`` has no k/v: the group ends with
    its layer), members with others between them, the checkpoint's alphabetical order, a stream's end."""
    from megatron_rl.models.fused_loads import load_units

    names = ["model.embed_tokens.weight",
             "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
             "model.layers.0.self_attn.kv_b_proj.weight", "model.layers.0.mlp.down_proj.weight",
             "model.layers.1.self_attn.k_proj.weight", "model.layers.1.self_attn.o_proj.weight",
             "model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.v_proj.weight",
             "model.layers.1.mlp.gate_proj.weight", "model.norm.weight", "model.layers.2.mlp.up_proj.weight"]
    units = [[n.removeprefix("model.").removeprefix("layers.") for n, _ in u] for u in load_units((n, None) for n in names)]
    assert units == [
        ["embed_tokens.weight"],
        ["0.self_attn.q_proj.weight", "0.self_attn.kv_a_proj_with_mqa.weight", "0.self_attn.kv_b_proj.weight",
         "0.mlp.down_proj.weight"],  # q_proj's group stays open to the layer's end: no k/v comes
        ["1.self_attn.k_proj.weight", "1.self_attn.o_proj.weight", "1.self_attn.q_proj.weight",
         "1.self_attn.v_proj.weight"],
        ["1.mlp.gate_proj.weight"],  # left alone when the layer ended (model.norm is another scope)
        ["norm.weight"],
        ["2.mlp.up_proj.weight"],  # the stream's end
    ]
    assert [n for u in load_units((n, None) for n in names) for n, _ in u] == names  # the order kept
