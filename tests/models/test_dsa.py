"""DeepSeek Sparse Attention (deepseek_v32) in one process against HF transformers' own modules: the lightning
indexer's top-k selection on the same inputs (ties reported, scores compared where the selection is tie-free),
gradients of the whole model (the indexer frozen on both sides), the indexer's KL loss when it trains, and the
layouts megatron-core's DSA cannot run refused by name."""

import pytest
import torch

from megatron_rl.errors import BridgeError
from megatron_rl.models import get_bridge, hf_module


@pytest.fixture(scope="module")
def single_rank():
    from megatron_rl.models.parallel import ParallelLayout, initialize_parallel

    layout = ParallelLayout()
    initialize_parallel(layout, seed=0)
    return layout


@pytest.fixture(scope="module", params=["deepseek_v32", "glm_moe_dsa"])
def dsa_family(request):
    return request.param


@pytest.fixture(scope="module")
def dsa_model(single_rank, tiny_hf_models, dsa_family):
    return _build(single_rank, tiny_hf_models(dsa_family))


@pytest.fixture(scope="module")
def dsa(single_rank, tiny_hf_models):
    return _build(single_rank, tiny_hf_models("deepseek_v32"))


_BUILT: dict = {}  # path -> (bridge, megatron model, HF model): one build per tiny model for the module


def _build(layout, path):
    import transformers

    if path not in _BUILT:
        bridge = get_bridge(path)
        chunks = bridge.build_model(layout)
        bridge.load_hf_weights(chunks, path)
        _BUILT[path] = (bridge, chunks[0], transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    return _BUILT[path]


def _boundary_ties(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Rows whose k-th and (k+1)-th best finite scores are equal: their top-k set is not unique."""
    top = scores.sort(dim=-1, descending=True).values
    if top.shape[-1] <= k:
        return torch.zeros(top.shape[:-1], dtype=torch.bool)
    return (top[..., k - 1] == top[..., k]) & torch.isfinite(top[..., k])


def test_indexer_selects_what_transformers_selects(dsa_model):
    """DeepSeek-V3.2 (rotate-half RoPE on the indexer) and GLM-5 (interleaved pairs)."""
    _, model, hf = dsa_model
    interleaved = hf.config.model_type == "glm_moe_dsa"
    s, k = 19, hf.config.index_topk
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, s, hf.config.hidden_size, generator=gen)
    qr = torch.randn(1, s, hf.config.q_lora_rank, generator=gen)
    causal = torch.full((s, s), float("-inf")).triu(1)
    pos = torch.arange(s)[None]
    checked = tied_rows = 0
    for i, layer in enumerate(hf.model.layers):
        ref_idx = layer.self_attn.indexer(x, qr, hf.model.rotary_emb(x, pos), causal[None], pos).long()
        ours = model.decoder.layers[i].self_attention.core_attention.indexer
        with torch.no_grad():
            scores, idx = ours.scores(x.transpose(0, 1), qr.transpose(0, 1), causal[None])
        ties = _boundary_ties(scores, k)  # rows whose top-k set is not unique: either tied key may be chosen
        same = torch.sort(idx, -1).values == torch.sort(ref_idx, -1).values
        assert same.all(-1)[~ties].all(), f"layer {i}: top-{k} sets differ in tie-free rows"
        kth = scores.sort(dim=-1, descending=True).values[..., k - 1:k]
        for sel in (idx, ref_idx):  # a tied row: both hold every key above the boundary, and only tied keys more
            chosen = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, sel, True)
            assert not ((scores > kth) & ~chosen).any() and not (chosen & (scores < kth)).any(), f"layer {i}"
        tied_rows += int(ties.sum())
        # HF's own scores (its forward returns the indices only): its formula on its modules
        ind = layer.self_attn.indexer
        with torch.no_grad():
            cos, sin = hf.model.rotary_emb(x, pos)
            q = ind.wq_b(qr).view(1, s, ind.n_heads, ind.head_dim)
            kk = ind.k_norm(ind.wk(x))
            r = ind.qk_rope_head_dim

            def rope(t, c, sn):
                a, b = t[..., :r], t[..., r:]
                if interleaved:  # HF's apply_rotary_pos_emb_interleave: pairs gathered into halves first
                    a = torch.cat((a[..., 0::2], a[..., 1::2]), -1)
                h1, h2 = a.chunk(2, -1)
                return torch.cat((a * c + torch.cat((-h2, h1), -1) * sn, b), -1)

            q, kk = rope(q, cos[:, :, None], sin[:, :, None]), rope(kk, cos, sin)
            ref = torch.einsum("bsh,bsht->bst", ind.weights_proj(x) * ind.n_heads ** -0.5,
                               torch.relu(torch.einsum("bshd,btd->bsht", q, kk) * ind.softmax_scale)) + causal
        finite = torch.isfinite(ref)
        assert torch.equal(finite, torch.isfinite(scores))
        assert (scores[finite] - ref[finite]).abs().max().item() <= 1e-5
        checked += 1
    assert checked == hf.config.num_hidden_layers
    print(f"{hf.config.model_type}: {tied_rows} of {checked * s} rows tie at the top-{k} boundary")


def _named_grads(bridge, model):
    """HF-named gradients of the megatron model (zeros where frozen) through the weight exporter."""
    params = list(model.parameters())
    saved = [p.data.clone() for p in params]
    for p in params:
        p.data.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
    out = {n: t.clone() for n, t in bridge.export_hf_weights([model])}
    for p, s in zip(params, saved):
        p.data.copy_(s)
    return out


def _loss(logits, ids, w):
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0] * w[:, :-1]).sum()


def _megatron_backward(bridge, model, ids, w):
    model.zero_grad()
    _loss(model(ids, torch.arange(ids.shape[1]).expand(*ids.shape), attention_mask=None)[..., :bridge.vocab_size],
          ids, w).backward()


def test_gradients_equal_transformers_with_the_indexer_frozen(dsa):
    bridge, model, hf = dsa
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, bridge.vocab_size, (2, 14), generator=gen)
    w = torch.rand(2, 14, generator=gen)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and all(".core_attention.indexer." in n for n in frozen)
    model.train()
    _megatron_backward(bridge, model, ids, w)
    main = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    hf.train()
    hf.zero_grad()
    _loss(hf(ids).logits, ids, w).backward()
    hf_frozen = {n for n, p in hf.named_parameters() if p.grad is None}
    assert hf_frozen and all(".indexer." in n for n in hf_frozen)
    named = {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in hf.named_parameters()}
    hf_grads = {}  # under the checkpoint's names (transformers keeps the experts stacked in memory)
    for unit in hf_module.layer_units(named):
        hf_grads.update(hf_module.hf_checkpoint_names(hf, {n: named[n] for n in unit}))
    got = _named_grads(bridge, model)
    buffers = {n for n in got if n.endswith("e_score_correction_bias")}  # a buffer on both sides: no gradient
    assert set(got) - buffers == set(hf_grads), set(got) ^ set(hf_grads)
    assert all(not got[n].any() for n in hf_frozen)
    scale = max(g.abs().max().item() for g in hf_grads.values())
    worst = max((got[n] - hf_grads[n]).abs().max().item() for n in hf_grads)
    assert worst <= 1e-5 * max(1.0, scale), (worst, scale)
    hf.eval()
    # DeepSeek's indexer training: a KL loss towards the main attention (dsa_indexer_loss_coeff > 0) trains the
    # indexer alone: its inputs are detached, so the main model's gradients do not move
    config = model.config
    try:
        config.dsa_indexer_loss_coeff = 1.0
        for name in frozen:
            model.get_parameter(name).requires_grad_(True)
        _megatron_backward(bridge, model, ids, w)
        for name in frozen:
            assert model.get_parameter(name).grad.abs().max().item() > 0, name
        for name, grad in main.items():
            assert torch.equal(model.get_parameter(name).grad, grad), name
    finally:
        config.dsa_indexer_loss_coeff = 0.0
        for name in frozen:
            model.get_parameter(name).requires_grad_(False)
        model.zero_grad()
        model.eval()


def test_context_parallelism_is_refused_by_name(tiny_hf_models):
    from megatron_rl.models.parallel import ParallelLayout

    bridge = get_bridge(tiny_hf_models("deepseek_v32"))
    with pytest.raises(BridgeError, match="--context-parallel-size 2 .*DeepSeek Sparse Attention"):
        bridge.transformer_config(ParallelLayout(cp=2))
