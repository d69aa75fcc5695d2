"""The activation estimate (plan/activations.py) against the bytes megatron-core's autograd graph really keeps for one
packed micro-batch of a tiny model, in one process on a 1-rank gloo group (the CPU path: ``local`` kernels).

Measured as the sum of the unique storages ``torch.autograd.graph.saved_tensors_hooks`` sees during the forward,
parameters left out (plan/memory.py counts those); the estimate must be within 10%, without recompute, with full
recompute (uniform and block), with a MoE model and with DeepSeek-V3's MLA (its latents; on CPU megatron's unfused
attention keeps fp32 q, k, v and the softmax). Sequences of one length: the CPU attention pads each sequence
to the longest (the GPU's THD kernels do not), so equal lengths keep the padding out of the comparison."""

import pytest
import torch

from megatron_rl.plan.activations import ActivationFlags, stage_activations
from megatron_rl.plan.memory import MegatronLayout, ModelArch

pytestmark = pytest.mark.usefixtures("tp1_world")

SEQS, SEQ_LEN = 4, 64  # one packed micro-batch of 256 tokens


def saved_bytes(model, tokens, positions, psp) -> int:
    """Bytes of the unique non-parameter storages the forward's autograd graph keeps."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(tokens, positions, None, packed_seq_params=psp)
    out.float().sum().backward()  # the graph is whole: the backward runs
    return sum(seen.values())


def _measure(path: str, **recompute) -> int:
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_rl.models import get_bridge
    from megatron_rl.models.parallel import ParallelLayout

    torch.manual_seed(0)
    [model] = get_bridge(path).build_model(ParallelLayout(), params_dtype=torch.bfloat16, **recompute)
    n = SEQS * SEQ_LEN
    cu = torch.arange(0, n + 1, SEQ_LEN, dtype=torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                          cu_seqlens_kv_padded=cu, max_seqlen_q=SEQ_LEN, max_seqlen_kv=SEQ_LEN)
    tokens = torch.randint(0, 200, (1, n))
    positions = torch.arange(SEQ_LEN).repeat(SEQS)[None]
    return saved_bytes(model, tokens, positions, psp)


CASES = [
    ("qwen3", {}, {}),
    ("qwen3", dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
     dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)),
    ("qwen3", dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
     dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2)),
    ("qwen3_moe", {}, {}),
    ("deepseek_v3", {}, {}),
]


@pytest.mark.parametrize("family,megatron,flags", CASES, ids=["dense", "full_uniform", "full_block2", "moe", "mla"])
def test_estimate_is_within_10_percent_of_the_saved_tensors(tiny_hf_models, family, megatron, flags):
    path = tiny_hf_models(family)
    measured = _measure(path, **megatron)
    arch = ModelArch.from_path(path)
    est = stage_activations(arch, MegatronLayout(world=1), ActivationFlags(tokens=SEQS * SEQ_LEN, kernels="local",
                                                                          seq_len=SEQ_LEN, **flags), 0)
    assert est.in_flight == 1
    assert abs(est.per_microbatch - measured) <= 0.10 * measured, (family, flags, est.per_microbatch, measured,
                                                                    est.terms)
