"""The two megatron-core 0.16.1 patches experts with biases (gpt-oss) need (compat.patches): an SP
reduce-scatter over a one-rank group hands back its input (no autograd Function whose view an in-place
bias add would trip over), and an expert's RowParallelLinear bias is not marked sequence-parallel (so
finalize_model_grads does not sum its complete gradient over TP again). Their effect on a model is
proven against HF in tests/dist/test_parity_layouts.py (gpt_oss TP2+SP, TP2xPP2xEP2+SP with grads)."""

import torch

from megatron_rl.compat import apply_cpu_compat, cpu_config_overrides


class _Group:
    def size(self):
        return 1

    def rank(self):
        return 0


def test_one_rank_reduce_scatter_returns_its_input_and_an_inplace_add_works(tp1_world):
    apply_cpu_compat()
    from megatron.core.tensor_parallel import layers

    patched = layers.reduce_scatter_to_sequence_parallel_region
    x = torch.randn(6, 1, 4, requires_grad=True)
    y = x * 2.0
    out = patched(y, group=_Group())
    assert out is y
    out += 1.0  # MLP.forward's in-place expert fc2 bias add: fine on the plain tensor
    (grad,) = torch.autograd.grad(out.sum(), x)
    assert torch.equal(grad, torch.full_like(x, 2.0))


def test_expert_row_parallel_bias_is_not_sequence_parallel(tp1_world):
    apply_cpu_compat()
    from megatron.core.tensor_parallel import layers
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, **cpu_config_overrides())
    cfg.sequence_parallel = True  # megatron refuses SP at TP1 in the config; the layer only reads the flag

    def row(is_expert):
        return layers.RowParallelLinear(24, 16, config=cfg, init_method=torch.nn.init.normal_, bias=True,
                                        input_is_parallel=True, skip_bias_add=True, is_expert=is_expert)

    assert row(False).bias.sequence_parallel is True  # dense: megatron's marking kept
    assert row(True).bias.sequence_parallel is False
