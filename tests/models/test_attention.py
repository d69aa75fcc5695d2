"""PackedCoreAttention (single process): THD / SBHD / GQA / padding, values and grads.

References are written out here (eager fp64 softmax attention per sequence) and
megatron-core's own DotProductAttention on a padded SBHD batch, so the module is
checked against both the maths and the implementation it replaces.
"""

import contextlib
import math

import pytest
import torch
from megatron.core import parallel_state
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_rl.errors import ConfigError
from megatron_rl.models import cp_utils
from megatron_rl.models.attention import PackedCoreAttention

NP, NG, HN = 4, 2, 16  # heads, KV groups (GQA), head dim
TOL = dict(rtol=0, atol=1e-6)


@pytest.fixture(scope="module", autouse=True)
def model_parallel(tp1_world):
    """World-size-1 gloo + megatron parallel_state (tests/conftest.py::tp1_world)."""


@pytest.fixture
def megatron_on_cpu(monkeypatch):
    """The two CUDA-only pieces DotProductAttention touches, made CPU-safe for one test.

    Its score buffer comes from a CUDA global memory buffer and it always forks the
    CUDA RNG tracker (a no-op at dropout 0). megatron_rl.compat does this for real
    model runs; these tests only need eval-mode attention.
    """
    from megatron.core import tensor_parallel

    class CpuBuffer:
        def get_tensor(self, shape, dtype, name):
            return torch.empty(shape, dtype=dtype)

    class NoForkTracker:
        def fork(self, name="model-parallel-rng"):
            return contextlib.nullcontext()

    monkeypatch.setattr(parallel_state, "get_global_memory_buffer", lambda: CpuBuffer())
    monkeypatch.setattr(tensor_parallel, "get_cuda_rng_tracker", lambda: NoForkTracker())


def make_config(**kw):
    base = dict(num_layers=1, hidden_size=NP * HN, num_attention_heads=NP, num_query_groups=NG,
                use_cpu_initialization=True, attention_dropout=0.0)
    base.update(kw)
    return TransformerConfig(**base)


def make_attn(mask_type=AttnMaskType.causal, **kw):
    return PackedCoreAttention(make_config(**kw), 1, mask_type, "self").eval()


def ref_attention(q, k, v, causal, scale=None, valid=None):
    """Eager fp64 attention for ONE sequence: q [s, np, hn], k/v [s, ng, hn] -> [s, np*hn]."""
    s = q.size(0)
    rep = q.size(1) // k.size(1)
    q64, k64, v64 = q.double(), k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    scores = torch.einsum("qhd,khd->hqk", q64, k64) * scale
    if causal:
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v64)
    return out.reshape(s, -1).to(q.dtype)


def rand_qkv(t, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, NP, HN, generator=g, dtype=dtype).requires_grad_()
    k = torch.randn(t, NG, HN, generator=g, dtype=dtype).requires_grad_()
    v = torch.randn(t, NG, HN, generator=g, dtype=dtype).requires_grad_()
    return q, k, v


def seeded_like(x, seed=7):
    """Upstream gradients from their own seed: the process-wide RNG's state differs between runs."""
    return torch.randn(x.shape, generator=torch.Generator().manual_seed(seed), dtype=x.dtype)


def grads(out, upstream, *inputs):
    return torch.autograd.grad(out, inputs, upstream)


LENGTHS = [5, 1, 8, 3, 1, 13]


def cu_of(lengths):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32)


@pytest.mark.parametrize("lengths,dtype,tol", [
    (LENGTHS, torch.float32, TOL),
    # long rows: fp32 accumulation over 140 keys alone is ~1e-6, so prove exactness in fp64
    ([140, 2, 1, 3, 60, 140, 7], torch.float64, dict(rtol=0, atol=1e-12)),
], ids=["short_fp32", "mixed_fp64"])
@pytest.mark.parametrize("causal", [True, False])
def test_thd_matches_per_sequence_reference(causal, lengths, dtype, tol):
    """Values and grads per sequence; "mixed" lengths split into several SDPA buckets."""
    from megatron_rl.models.attention import _bucket

    segments = [(0, n, 0, n, None) for n in lengths]
    assert (len(_bucket(segments)) > 1) == (lengths != LENGTHS)
    attn = make_attn(AttnMaskType.causal if causal else AttnMaskType.no_mask)
    cu = cu_of(lengths)
    q, k, v = rand_qkv(int(cu[-1]), dtype=dtype)
    params = cp_utils.make_packed_seq_params(cu)
    out = attn(q, k, v, None, packed_seq_params=params)
    assert out.shape == (int(cu[-1]), NP * HN) and out.dtype == dtype
    upstream = seeded_like(out)
    got = grads(out, upstream, q, k, v)

    refs = [ref_attention(q[a:b], k[a:b], v[a:b], causal) for a, b in zip(cu[:-1], cu[1:])]
    ref = torch.cat(refs)
    torch.testing.assert_close(out, ref, **tol)
    want = grads(ref, upstream, q, k, v)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **tol)


def test_thd_equals_padded_sbhd_and_megatron_dot_product_attention(megatron_on_cpu):
    """THD == our SBHD path on a right-padded batch == megatron's DotProductAttention."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    cu = cu_of(LENGTHS)
    q, k, v = rand_qkv(int(cu[-1]), seed=1)
    attn = make_attn()
    out_thd = attn(q, k, v, None, packed_seq_params=cp_utils.make_packed_seq_params(cu))

    s, b = max(LENGTHS), len(LENGTHS)

    def to_sbhd(x):
        pad = x.new_zeros(s, b, *x.shape[1:])
        for i, (a, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            pad[: e - a, i] = x[a:e]
        return pad

    qp, kp, vp = (to_sbhd(x.detach()).requires_grad_() for x in (q, k, v))
    out_ours = attn(qp, kp, vp, None)
    megatron = DotProductAttention(make_config(), 1, AttnMaskType.causal, "self").eval()
    causal_mask = torch.ones(1, 1, s, s, dtype=torch.bool).triu(1)  # True = masked (megatron)
    out_meg = megatron(qp, kp, vp, causal_mask)  # its default mask is built on CUDA
    assert out_ours.shape == out_meg.shape == (s, b, NP * HN)
    valid = torch.zeros(s, b, 1, dtype=torch.bool)
    for i, n in enumerate(LENGTHS):
        valid[:n, i] = True
    torch.testing.assert_close(out_ours, out_meg, **TOL)
    torch.testing.assert_close(to_sbhd(out_thd.detach()) * valid, out_ours.detach() * valid, **TOL)

    upstream = seeded_like(out_ours) * valid
    g_ours = grads(out_ours, upstream, qp, kp, vp)
    g_meg = grads(out_meg, upstream, qp, kp, vp)
    g_thd = grads(out_thd, torch.cat([upstream[:n, i] for i, n in enumerate(LENGTHS)]), q, k, v)
    for go, gm, gt in zip(g_ours, g_meg, g_thd):
        torch.testing.assert_close(go, gm, **TOL)
        torch.testing.assert_close(to_sbhd(gt), go * valid.unsqueeze(-1), **TOL)


def test_sbhd_padding_mask_matches_megatron(megatron_on_cpu):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    s, b = 6, 3
    g = torch.Generator().manual_seed(3)
    q = torch.randn(s, b, NP, HN, generator=g)
    k = torch.randn(s, b, NG, HN, generator=g)
    v = torch.randn(s, b, NG, HN, generator=g)
    lengths = torch.tensor([6, 4, 2])
    mask = (torch.arange(s)[None, :] >= lengths[:, None])[:, None, None, :]  # [b,1,1,sk] True=masked
    ours = make_attn(AttnMaskType.padding)(q, k, v, mask)
    meg = DotProductAttention(make_config(), 1, AttnMaskType.padding, "self").eval()(q, k, v, mask)
    torch.testing.assert_close(ours, meg, **TOL)


def test_thd_padded_layout_zero_rows_and_equal_valid_rows():
    """cu_seqlens_q_padded (TE convention): padding rows output 0 and change nothing else."""
    cu = cu_of(LENGTHS)
    q, k, v = rand_qkv(int(cu[-1]), seed=2)
    attn = make_attn()
    ref = attn(q, k, v, None, packed_seq_params=cp_utils.make_packed_seq_params(cu))
    multiple = 4
    (qp, kp, vp), cu_pad = zip(*[cp_utils.pad_packed(x, cu, multiple, pad_value=7.0) for x in (q, k, v)])
    cu_pad = cu_pad[0]
    params = cp_utils.make_packed_seq_params(cu_pad, cu)
    assert params.cu_seqlens_q_padded is not None
    out = attn(qp, kp, vp, None, packed_seq_params=params)
    index = torch.cat([torch.arange(a, a + n) for a, n in zip(cu_pad[:-1].tolist(), LENGTHS)])
    torch.testing.assert_close(out[index], ref, **TOL)
    pad_rows = torch.ones(out.size(0), dtype=torch.bool)
    pad_rows[index] = False
    assert torch.equal(out[pad_rows], torch.zeros_like(out[pad_rows]))
    upstream = seeded_like(out)
    gq, gk, gv = grads(out, upstream, q, k, v)
    wq, wk, wv = grads(ref, upstream[index], q, k, v)
    for got, want in ((gq, wq), (gk, wk), (gv, wv)):
        torch.testing.assert_close(got, want, **TOL)


def test_thd_zero_length_and_single_token_sequences():
    lengths = [0, 1, 4, 0, 1]
    cu = cu_of(lengths)
    q, k, v = rand_qkv(int(cu[-1]), seed=4)
    out = make_attn()(q, k, v, None, packed_seq_params=cp_utils.make_packed_seq_params(cu))
    rep = NP // NG
    # A length-1 sequence attends only to itself: output is its own value.
    torch.testing.assert_close(out[0].view(NP, HN), v[0].repeat_interleave(rep, 0), **TOL)
    torch.testing.assert_close(out[5].view(NP, HN), v[5].repeat_interleave(rep, 0), **TOL)
    torch.testing.assert_close(out[1:5], ref_attention(q[1:5], k[1:5], v[1:5], True), **TOL)


def test_softmax_scale_and_bf16():
    cu = cu_of([7, 9])
    q, k, v = rand_qkv(16, seed=5)
    attn = PackedCoreAttention(make_config(), 1, AttnMaskType.causal, "self", softmax_scale=0.3).eval()
    out = attn(q, k, v, None, packed_seq_params=cp_utils.make_packed_seq_params(cu))
    ref = torch.cat([ref_attention(q[:7], k[:7], v[:7], True, 0.3), ref_attention(q[7:], k[7:], v[7:], True, 0.3)])
    torch.testing.assert_close(out, ref, **TOL)
    qb, kb, vb = (x.detach().bfloat16() for x in (q, k, v))
    out_b = attn(qb, kb, vb, None, packed_seq_params=cp_utils.make_packed_seq_params(cu))
    assert out_b.dtype == torch.bfloat16
    torch.testing.assert_close(out_b.float(), ref.detach(), rtol=0, atol=3e-2)


def test_dropout_only_in_training(megatron_on_cpu):
    cu = cu_of([6, 6])
    q, k, v = rand_qkv(12, seed=6)
    attn = PackedCoreAttention(make_config(attention_dropout=0.5), 1, AttnMaskType.causal, "self")
    params = cp_utils.make_packed_seq_params(cu)
    ref = torch.cat([ref_attention(q[:6], k[:6], v[:6], True), ref_attention(q[6:], k[6:], v[6:], True)])
    torch.testing.assert_close(attn.eval()(q, k, v, None, packed_seq_params=params), ref, **TOL)
    attn.train()
    torch.manual_seed(0)
    a = attn(q, k, v, None, packed_seq_params=params)
    torch.manual_seed(0)
    b = attn(q, k, v, None, packed_seq_params=params)
    assert torch.equal(a, b)
    assert (a - ref).abs().max() > 1e-2


def test_bad_inputs_name_the_fix():
    attn = make_attn()
    q, k, v = rand_qkv(10)
    with pytest.raises(ConfigError, match="cu_seqlens"):
        attn(q, k, v, None, packed_seq_params=cp_utils.make_packed_seq_params(cu_of([4, 4])))
    with pytest.raises(ConfigError, match="attention_bias"):
        attn(q, k, v, None, attention_bias=torch.zeros(1))
    with pytest.raises(ConfigError, match="causal sliding windows only"):
        PackedCoreAttention(make_config(window_size=(4, 2)), 1, AttnMaskType.causal, "self")
    with pytest.raises(ConfigError, match="context-parallel-size"):
        PackedCoreAttention(make_config(context_parallel_size=2), 1, AttnMaskType.causal, "self")


def test_thd_plan_is_built_once_per_micro_batch():
    """Every layer gets the same PackedSeqParams: the buckets and index tensors are derived once for all of
    them (and the backward), a new micro-batch derives its own, and a reused plan gives the same bits."""
    from megatron_rl.models.attention import _THD_PLANS

    attn, other_layer = make_attn(), make_attn()
    cu = cu_of(LENGTHS)
    params = cp_utils.make_packed_seq_params(cu)
    q, k, v = rand_qkv(int(cu[-1]), seed=4)
    before = _THD_PLANS.builds
    first = attn(q, k, v, None, packed_seq_params=params)
    again = other_layer(q, k, v, None, packed_seq_params=params)
    assert _THD_PLANS.builds == before + 1 and torch.equal(first, again)
    fresh = attn(q, k, v, None, packed_seq_params=cp_utils.make_packed_seq_params(cu.clone()))
    assert _THD_PLANS.builds == before + 2 and torch.equal(first, fresh)


def test_key_padding_rule_and_plan():
    """Keys are padded to the CPU kernel's vector block only when the tail fills half a block, and only
    where the causal mask drops the padded slots (no CP); every real query still sees exactly its keys."""
    from megatron_rl.models.attention import _padded_keys, _plan_thd

    assert [_padded_keys(n, 16) for n in (7, 8, 11, 15, 16, 17, 23, 24, 33)] == [7, 16, 16, 16, 16, 17, 23, 32, 33]
    assert [_padded_keys(n, 1) for n in (1, 7, 11)] == [1, 7, 11]
    cu = cu_of([11, 9, 11, 3])
    params = cp_utils.make_packed_seq_params(cu)
    cpu = torch.device("cpu")
    causal = _plan_thd(params, True, 1, 0, int(cu[-1]), cpu, key_block=16)
    plain = _plan_thd(params, True, 1, 0, int(cu[-1]), cpu, key_block=1)
    assert [(g.max_q, g.max_k) for g in causal.groups] == [(g.max_q, 16 if g.max_q >= 8 else g.max_k)
                                                           for g in plain.groups]
    assert torch.equal(causal.src, plain.src)
    no_mask = _plan_thd(params, False, 1, 0, int(cu[-1]), cpu, key_block=16)
    assert all(g.max_k == g.max_q for g in no_mask.groups)  # without the causal mask a padded key would be seen


@pytest.mark.parametrize("lengths", [[11, 9, 11, 3, 1], [13, 5, 8, 12, 12, 2], [24, 20, 31, 17]])
def test_padded_keys_change_no_value_beyond_rounding(monkeypatch, lengths):
    """The same THD forward and backward with and without key padding: equal up to fp32 rounding (the
    kernel sums over a longer, zero-weighted block), and both equal the per-sequence fp64 reference."""
    import megatron_rl.models.attention as attention

    cu = cu_of(lengths)
    q, k, v = rand_qkv(int(cu[-1]), seed=9)
    results = []
    for block in (16, 1):
        monkeypatch.setattr(attention, "_key_block", lambda device, dtype, block=block: block)
        attention._THD_PLANS.clear()
        out = make_attn()(q, k, v, None, packed_seq_params=cp_utils.make_packed_seq_params(cu))
        results.append((out, grads(out, seeded_like(out), q, k, v)))
    attention._THD_PLANS.clear()
    (padded, padded_grads), (plain, plain_grads) = results
    torch.testing.assert_close(padded, plain, rtol=0, atol=2e-6)
    for a, b in zip(padded_grads, plain_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-6)
    ref = torch.cat([ref_attention(q[a:b], k[a:b], v[a:b], True) for a, b in zip(cu[:-1], cu[1:])])
    torch.testing.assert_close(padded, ref, **TOL)


def ref_sink_window(q, k, v, sinks, window_left):
    """Eager fp64 causal attention for ONE sequence with per-head sink logits in the softmax denominator
    (HF gpt-oss's eager attention) and a sliding window (key j visible from i iff i - window_left <= j <= i)."""
    s = q.size(0)
    rep = q.size(1) // k.size(1)
    q64, k64, v64 = q.double(), k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q64, k64) / math.sqrt(q.size(-1))
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    hidden = (j > i) if window_left is None else (j > i) | (i - j > window_left)
    scores = scores.masked_fill(hidden, float("-inf"))
    logits = torch.cat([scores, sinks.double().view(-1, 1, 1).expand(-1, s, 1)], dim=-1)
    probs = logits.softmax(-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", probs, v64).reshape(s, -1).to(q.dtype)


@pytest.mark.parametrize("window_layer", [True, False])
def test_sinks_and_sliding_window_match_the_reference(window_layer):
    """gpt-oss attention: learnable per-head sinks (values and gradients, sinks included) and a 3-key-back
    window on the layers window_attn_skip_freq marks, packed THD and SBHD alike."""
    cfg = make_config(softmax_type="learnable", window_size=(3, 0), window_attn_skip_freq=[1 if window_layer else 0])
    attn = PackedCoreAttention(cfg, 1, AttnMaskType.causal, "self").eval()
    assert attn.window_left == (3 if window_layer else None)
    assert attn.softmax_offset.shape == (NP,) and attn.softmax_offset.tensor_model_parallel
    with torch.no_grad():
        attn.softmax_offset.copy_(torch.tensor([0.5, -1.0, 2.0, 0.0]))
    cu = cu_of(LENGTHS)
    q, k, v = rand_qkv(int(cu[-1]), seed=7)
    out = attn(q, k, v, None, packed_seq_params=cp_utils.make_packed_seq_params(cu))
    bounds = cu.tolist()
    sinks = attn.softmax_offset.detach().clone().requires_grad_()
    qr, kr, vr = (x.detach().clone().requires_grad_() for x in (q, k, v))
    ref = torch.cat([ref_sink_window(qr[a:b], kr[a:b], vr[a:b], sinks, attn.window_left)
                     for a, b in zip(bounds, bounds[1:])])
    torch.testing.assert_close(out, ref, **TOL)
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g)
    for mine, theirs in ((q, qr), (k, kr), (v, vr), (attn.softmax_offset, sinks)):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=0, atol=1e-5)
    n = LENGTHS[0]  # SBHD: one sequence of batch 1
    sbhd = attn(q[:n, None].detach(), k[:n, None].detach(), v[:n, None].detach(), None)
    torch.testing.assert_close(sbhd[:, 0], ref[:n].detach(), **TOL)


def test_off_by_one_softmax_is_a_zero_sink():
    """softmax_type="off-by-one": a fixed sink logit 0 per head (no parameter)."""
    attn = PackedCoreAttention(make_config(softmax_type="off-by-one"), 1, AttnMaskType.causal, "self").eval()
    assert not list(attn.parameters())
    cu = cu_of(LENGTHS)
    q, k, v = rand_qkv(int(cu[-1]), seed=8)
    out = attn(q, k, v, None, packed_seq_params=cp_utils.make_packed_seq_params(cu))
    bounds, zeros = cu.tolist(), torch.zeros(NP)
    ref = torch.cat([ref_sink_window(q[a:b], k[a:b], v[a:b], zeros, None) for a, b in zip(bounds, bounds[1:])])
    torch.testing.assert_close(out, ref, **TOL)


def test_alternating_window_and_full_layers_each_reuse_their_plan():
    """gpt-oss alternates sliding-window and full layers: each kind derives its THD plan once per micro-batch."""
    from megatron_rl.models.attention import _THD_PLANS, _THD_PLANS_WINDOWED

    cfg = make_config(num_layers=4, window_size=(3, 0), window_attn_skip_freq=[1, 0, 1, 0])
    layers = [PackedCoreAttention(cfg, n, AttnMaskType.causal, "self").eval() for n in (1, 2, 3, 4)]
    assert [a.window_left for a in layers] == [3, None, 3, None]
    cu = cu_of(LENGTHS)
    params = cp_utils.make_packed_seq_params(cu)
    q, k, v = rand_qkv(int(cu[-1]), seed=9)
    layers[0](q, k, v, None, packed_seq_params=params)  # the windowed memo exists from here on
    full, windowed = _THD_PLANS.builds, _THD_PLANS_WINDOWED[3].builds
    fresh = cp_utils.make_packed_seq_params(cu.clone())
    outs = [a(q, k, v, None, packed_seq_params=fresh) for a in layers]
    assert (_THD_PLANS.builds, _THD_PLANS_WINDOWED[3].builds) == (full + 1, windowed + 1)
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3])
    assert (outs[0] - outs[1]).abs().max() > 1e-2  # the window matters on these lengths
