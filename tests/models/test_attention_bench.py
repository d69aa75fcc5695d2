"""CPU cost of PackedCoreAttention (THD) vs megatron's DotProductAttention (padded SBHD).

Run ``python tests/models/test_attention_bench.py`` for the table in docs/attention.md.
Under pytest only a tiny size runs, and it checks that the three paths being
timed compute the same valid-token outputs (a benchmark of wrong code is no
benchmark).
"""

import contextlib
import os
import time

import torch
import torch.distributed as dist

from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_rl.models import cp_utils
from megatron_rl.models.attention import PackedCoreAttention


class _CpuBuffer:
    def get_tensor(self, shape, dtype, name):
        return torch.empty(shape, dtype=dtype)


class _NoForkTracker:
    def fork(self, name="model-parallel-rng"):
        return contextlib.nullcontext()


def bench(lengths, heads=16, groups=4, head_dim=64, repeats=5, backward=True):
    """Median seconds per forward(+backward) for THD ours, padded SBHD ours, padded megatron.

    Returns ``(timings: dict, max_abs_diff_between_paths: float)``.
    """
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    cfg = TransformerConfig(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                            num_query_groups=groups, use_cpu_initialization=True, attention_dropout=0.0)
    ours = PackedCoreAttention(cfg, 1, AttnMaskType.causal, "self").eval()
    megatron = DotProductAttention(cfg, 1, AttnMaskType.causal, "self").eval()
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    t, s, b = int(cu[-1]), max(lengths), len(lengths)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(t, h, head_dim, generator=g) for h in (heads, groups, groups))
    params = cp_utils.make_packed_seq_params(cu)

    def padded(x):
        out = x.new_zeros(s, b, *x.shape[1:])
        for i, (a, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            out[: e - a, i] = x[a:e]
        return out

    qp, kp, vp = padded(q), padded(k), padded(v)
    causal_mask = torch.ones(1, 1, s, s, dtype=torch.bool).triu(1)
    runs = {
        "ours_thd": lambda x: ours(*x, None, packed_seq_params=params),
        "ours_padded_sbhd": lambda x: ours(*x, None),
        "megatron_padded_sbhd": lambda x: megatron(*x, causal_mask),
    }
    inputs = {"ours_thd": (q, k, v), "ours_padded_sbhd": (qp, kp, vp), "megatron_padded_sbhd": (qp, kp, vp)}
    timings, outputs = {}, {}
    for name, fn in runs.items():
        samples = []
        for _ in range(repeats + 1):
            x = [y.clone().requires_grad_(backward) for y in inputs[name]]
            start = time.perf_counter()
            out = fn(x)
            if backward:
                out.sum().backward()
            samples.append(time.perf_counter() - start)
        timings[name] = sorted(samples[1:])[len(samples[1:]) // 2]
        outputs[name] = out.detach()
    valid = torch.cat([outputs["megatron_padded_sbhd"][:n, i] for i, n in enumerate(lengths)])
    diff = max((outputs["ours_thd"] - valid).abs().max().item(),
               (torch.cat([outputs["ours_padded_sbhd"][:n, i] for i, n in enumerate(lengths)]) - valid)
               .abs().max().item())
    return timings, diff


@contextlib.contextmanager
def _cpu_megatron():
    made = not dist.is_initialized()
    if made:
        from _util import free_port

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    made_mp = not parallel_state.model_parallel_is_initialized()
    if made_mp:
        parallel_state.initialize_model_parallel()
    saved = parallel_state.get_global_memory_buffer, tensor_parallel.get_cuda_rng_tracker
    parallel_state.get_global_memory_buffer = lambda: _CpuBuffer()
    tensor_parallel.get_cuda_rng_tracker = lambda: _NoForkTracker()
    try:
        yield
    finally:
        parallel_state.get_global_memory_buffer, tensor_parallel.get_cuda_rng_tracker = saved
        if made_mp:
            parallel_state.destroy_model_parallel()
        if made:
            dist.destroy_process_group()


def test_benchmark_paths_agree():
    with _cpu_megatron():
        timings, diff = bench([7, 1, 12, 3], heads=4, groups=2, head_dim=16, repeats=1)
    assert set(timings) == {"ours_thd", "ours_padded_sbhd", "megatron_padded_sbhd"}
    assert diff <= 1e-6, diff


if __name__ == "__main__":
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    big = dict(heads=16, groups=4, head_dim=64)
    cases = {
        "uniform 8x256": ([256] * 8, big),
        "RL-like 16 seqs (32..512)": ([32, 480, 64, 512, 96, 200, 40, 300, 128, 256, 70, 400, 33, 150, 90, 310],
                                      big),
        "many short 64x24": ([24] * 64, big),
        "CPU demo 256 seqs 6..14, 4h x 16": ([6 + (7 * i) % 9 for i in range(256)],
                                             dict(heads=4, groups=2, head_dim=16)),
    }
    with _cpu_megatron():
        for name, (lengths, shape) in cases.items():
            for backward in (False, True):
                timings, diff = bench(lengths, backward=backward, repeats=9, **shape)
                print(f"{name:34s} tokens={sum(lengths):5d} {'fwd+bwd' if backward else 'fwd    '} "
                      + "  ".join(f"{k}={v * 1e3:8.1f}ms" for k, v in timings.items()) + f"  maxdiff={diff:.1e}")
