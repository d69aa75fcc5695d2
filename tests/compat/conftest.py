"""Shared by the compat patch tests: megatron's parallel state at world size 1 (gloo) and a
ColumnParallelLinear -> SiLU -> RowParallelLinear pair whose outputs and gradients a patch must leave
bitwise as megatron's own code computes them."""

import os

import pytest
import torch


@pytest.fixture(scope="module")
def tp1_world():
    """World-size-1 gloo + megatron's parallel state, torn down only if made here."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from _util import free_port

    made = not dist.is_initialized()
    if made:
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(free_port())
        dist.init_process_group("gloo", rank=0, world_size=1)
    made_mp = not parallel_state.model_parallel_is_initialized()
    if made_mp:
        parallel_state.initialize_model_parallel()
    yield
    if made_mp:
        parallel_state.destroy_model_parallel()
    if made:
        dist.destroy_process_group()


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
