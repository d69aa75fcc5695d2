"""Worker: PackedCoreAttention under TPxCP equals a single-process fp64 reference.

Every rank builds the same full q/k/v (same seed), takes its TP heads and its CP
tokens (megatron's load-balanced chunks), runs the module, and compares output
and q/k/v gradients with the reference restricted to its heads and tokens.
Writes ``{out_dir}/rank{r}.json`` with the max errors per case.

Job ``cp_attention`` of tests/dist/harness.py (TP*CP ranks): argv = OUT_DIR TP CP
"""

import copy
import json
import math
import os
import time

import torch
import torch.distributed as dist

import megatron_rl.compat  # noqa: F401  (first: megatron-core's cheap first import)
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_rl.models import cp_utils
from megatron_rl.models.attention import PackedCoreAttention

NP, NG, HN = 4, 2, 16
TOL = 1e-6  # fp32 module vs exact (fp64) reference
TOL64 = 1e-12  # fp64 module under CP vs fp64 module without CP


def ref_attention(q, k, v, causal):
    """fp64 eager attention of ONE sequence, q [s, np, hn], k/v [s, ng, hn] -> [s, np, hn]."""
    rep = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.size(-1))
    if causal:
        s = q.size(0)
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def reference_thd(q, k, v, cu_layout, real_lengths, causal):
    """Per-sequence fp64 reference on the padded layout; rows past the real length are 0."""
    out = torch.zeros_like(q)
    for i, a in enumerate(cu_layout[:-1].tolist()):
        n = real_lengths[i]
        if n:
            out[a:a + n] = ref_attention(q[a:a + n], k[a:a + n], v[a:a + n], causal)
    return out


def full_inputs(t, seed):
    """fp32 values held in fp64, so the fp64 reference sees exactly the module's inputs."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(t, h, HN, generator=g).double() for h in (NP, NG, NG, NP))


def check(name, got, want, results, tol=TOL):
    err = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    results[name] = err
    results[name + "#peak"] = want.abs().max().item() if got.numel() else 0.0
    if not err <= tol:
        raise AssertionError(f"rank {dist.get_rank()} {name}: max abs err {err} > {tol}")


def run_thd_case(tag, attn, single, tp_rank, tp, cp_rank, cp, lengths, multiple, te_padding, causal,
                 results):
    """``attn``: the CP module under test; ``single``: the same module without CP (whole batch)."""
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    q64, k64, v64, up64 = full_inputs(int(cu[-1]), seed=len(lengths) + 7 * causal)
    q64, cu_pad = cp_utils.pad_packed(q64, cu, multiple)
    k64, _ = cp_utils.pad_packed(k64, cu, multiple)
    v64, _ = cp_utils.pad_packed(v64, cu, multiple)
    up64, _ = cp_utils.pad_packed(up64, cu, multiple)
    if te_padding:  # real lengths in cu_seqlens_q, padded layout in cu_seqlens_q_padded
        params = cp_utils.make_packed_seq_params(cu_pad, cu)
        real = lengths
    else:  # padded layout is the sequence (padding tokens are ordinary tail tokens)
        params = cp_utils.make_packed_seq_params(cu_pad)
        real = (cu_pad[1:] - cu_pad[:-1]).tolist()
    ref_in = [x.clone().requires_grad_() for x in (q64, k64, v64)]
    ref = reference_thd(*ref_in, cu_pad, real, causal)
    ref_grads = torch.autograd.grad(ref, ref_in, up64)

    hq = slice(tp_rank * NP // tp, (tp_rank + 1) * NP // tp)
    hk = slice(tp_rank * NG // tp, (tp_rank + 1) * NG // tp)
    shard = cp_utils.shard_packed_for_cp(torch.arange(int(cu_pad[-1])), cu_pad, cp_rank, cp)
    idx = shard.tensor
    q = q64[idx][:, hq].float().requires_grad_()
    k = k64[idx][:, hk].float().requires_grad_()
    v = v64[idx][:, hk].float().requires_grad_()
    out = attn(q, k, v, None, packed_seq_params=params)
    assert out.shape == (idx.numel(), (NP // tp) * HN), out.shape
    up = up64[idx][:, hq].float().reshape(out.shape)
    gq, gk, gv = torch.autograd.grad(out, (q, k, v), up)
    check(f"{tag}/out", out.view(-1, NP // tp, HN), ref[idx][:, hq], results)
    check(f"{tag}/dq", gq, ref_grads[0][idx][:, hq], results)
    check(f"{tag}/dk", gk, ref_grads[1][idx][:, hk], results)
    check(f"{tag}/dv", gv, ref_grads[2][idx][:, hk], results)
    # CP vs the single-process module on the whole batch (this rank's heads), both in fp64:
    # two fp32 runs with different kernel blockings may each be 1e-6 off the exact value, so
    # the like-for-like comparison is made where rounding cannot hide a wrong mask or offset.
    qs, ks, vs = (x[:, h].clone().requires_grad_() for x, h in ((q64, hq), (k64, hk), (v64, hk)))
    out_s = single(qs, ks, vs, None, packed_seq_params=params)
    gqs, gks, gvs = torch.autograd.grad(out_s, (qs, ks, vs), up64[:, hq].reshape(out_s.shape))
    qc, kc, vc = (x[idx][:, h].clone().requires_grad_() for x, h in ((q64, hq), (k64, hk), (v64, hk)))
    out_c = attn(qc, kc, vc, None, packed_seq_params=params)
    gqc, gkc, gvc = torch.autograd.grad(out_c, (qc, kc, vc), up64[idx][:, hq].reshape(out_c.shape))
    check(f"{tag}/out_vs_single_fp64", out_c, out_s[idx], results, TOL64)
    check(f"{tag}/dq_vs_single_fp64", gqc, gqs[idx], results, TOL64)
    check(f"{tag}/dk_vs_single_fp64", gkc, gks[idx], results, TOL64)
    check(f"{tag}/dv_vs_single_fp64", gvc, gvs[idx], results, TOL64)
    # reassembling the full output across CP ranks gives the reference everywhere
    full = cp_utils.gather_packed_from_cp(out.detach(), cu_pad)
    check(f"{tag}/gathered_out", full.view(-1, NP // tp, HN), ref[:, hq], results)


def run_sbhd_case(attn, tp_rank, tp, cp_rank, cp, results):
    s, b = 8 * cp, 3
    g = torch.Generator().manual_seed(11)
    q64, k64, v64, up64 = (torch.randn(s, b, h, HN, generator=g).double() for h in (NP, NG, NG, NP))
    ref_in = [x.clone().requires_grad_() for x in (q64, k64, v64)]
    ref = torch.stack([ref_attention(*(x[:, j] for x in ref_in), True) for j in range(b)], dim=1)
    ref_grads = torch.autograd.grad(ref, ref_in, up64)
    hq = slice(tp_rank * NP // tp, (tp_rank + 1) * NP // tp)
    hk = slice(tp_rank * NG // tp, (tp_rank + 1) * NG // tp)

    def local(x, heads):
        return cp_utils.shard_sbhd_for_cp(x, 0, cp_rank, cp)[:, :, heads]

    q, k, v = (local(x, h).float().requires_grad_() for x, h in ((q64, hq), (k64, hk), (v64, hk)))
    out = attn(q, k, v, None)
    assert out.shape == (s // cp, b, (NP // tp) * HN), out.shape
    gq, gk, gv = torch.autograd.grad(out, (q, k, v), local(up64, hq).float().reshape(out.shape))
    check("sbhd/out", out.view(s // cp, b, NP // tp, HN), local(ref, hq), results)
    check("sbhd/dq", gq, local(ref_grads[0], hq), results)
    check("sbhd/dk", gk, local(ref_grads[1], hk), results)
    check("sbhd/dv", gv, local(ref_grads[2], hk), results)


def main(argv):
    out_dir, tp, cp = argv[0], int(argv[1]), int(argv[2])
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    cp_rank = parallel_state.get_context_parallel_rank()
    cfg = TransformerConfig(num_layers=1, hidden_size=NP * HN, num_attention_heads=NP, num_query_groups=NG,
                            tensor_model_parallel_size=tp, context_parallel_size=cp,
                            use_cpu_initialization=True, attention_dropout=0.0)
    causal = PackedCoreAttention(cfg, 1, AttnMaskType.causal, "self").eval()
    no_mask = PackedCoreAttention(cfg, 1, AttnMaskType.no_mask, "self").eval()
    # Same heads per rank, no CP: the single-process result CP must reproduce.
    cfg1 = copy.copy(cfg)
    cfg1.context_parallel_size = 1
    pg1 = ProcessGroupCollection(tp=parallel_state.get_tensor_model_parallel_group())
    single_causal = PackedCoreAttention(cfg1, 1, AttnMaskType.causal, "self", pg_collection=pg1).eval()
    single_no_mask = PackedCoreAttention(cfg1, 1, AttnMaskType.no_mask, "self", pg_collection=pg1).eval()
    results = {}
    t0 = time.perf_counter()
    lengths = [5, 1, 12, 7, 0, 2, 9]  # uneven, incl. length 1 and an empty sequence
    multiple = cp_utils.cp_pad_multiple(cp)
    run_thd_case("thd_causal", causal, single_causal, tp_rank, tp, cp_rank, cp, lengths, multiple, False, True, results)
    run_thd_case("thd_causal_te_padding", causal, single_causal, tp_rank, tp, cp_rank, cp, lengths, multiple, True, True,
                 results)
    run_thd_case("thd_no_mask_te_padding", no_mask, single_no_mask, tp_rank, tp, cp_rank, cp, lengths, multiple, True, False,
                 results)
    # sequence parallel padding: multiple of 2*cp*tp
    run_thd_case("thd_causal_sp_padding", causal, single_causal, tp_rank, tp, cp_rank, cp, [3, 17, 4],
                 cp_utils.cp_pad_multiple(cp, tp, sequence_parallel=True), True, True, results)
    run_sbhd_case(causal, tp_rank, tp, cp_rank, cp, results)
    results["seconds"] = time.perf_counter() - t0
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(results, f)
