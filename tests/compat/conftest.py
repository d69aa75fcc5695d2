"""Shared by the compat patch tests: a ColumnParallelLinear -> SiLU -> RowParallelLinear pair whose outputs
and gradients a patch must leave bitwise as megatron's own code computes them (``tp1_world``: tests/conftest.py)."""

import pytest
import torch


@pytest.fixture
def column_row_pair(tp1_world):
    """``run()``: one forward + backward of Column(16->24, bias) -> SiLU -> Row(24->16, bias) on a fixed
    ``[7, 1, 16]`` input and upstream gradient; returns [output, input grad, every parameter's grad]."""
    from megatron.core.tensor_parallel import layers
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_rl.compat import apply_cpu_compat, cpu_config_overrides

    apply_cpu_compat()
    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, **cpu_config_overrides())
    torch.manual_seed(0)
    col = layers.ColumnParallelLinear(16, 24, config=cfg, init_method=torch.nn.init.normal_, bias=True,
                                      gather_output=False)
    row = layers.RowParallelLinear(24, 16, config=cfg, init_method=torch.nn.init.normal_, bias=True,
                                   input_is_parallel=True, skip_bias_add=False)
    x0 = torch.randn(7, 1, 16, generator=torch.Generator().manual_seed(1))
    upstream = torch.randn(7, 1, 16, generator=torch.Generator().manual_seed(2))
    params = (*col.parameters(), *row.parameters())

    def run():
        for p in params:
            p.grad = None
        x = x0.clone().requires_grad_()
        out, _ = row(torch.nn.functional.silu(col(x)[0]))
        out.backward(upstream)
        return [out.detach(), x.grad, *(p.grad.clone() for p in params)]

    return run
