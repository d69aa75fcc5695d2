"""MiniMax-M2's query / key norm, which megatron-core 0.16.1's ``qk_layernorm`` cannot express.

MiniMax-M2 (HF ``MiniMaxM2Attention``) normalises the whole query projection of a token, all heads at once:
``q = RMSNorm_{nh x hd}(q_proj(x))`` with one gain per channel (``q_norm.weight`` ``[nh x hd]``), and the keys
the same way over all key heads (``k_norm.weight`` ``[ng x hd]``). megatron's ``qk_layernorm`` builds its
``q_layernorm`` / ``k_layernorm`` over one head (``hidden_size_per_attention_head``) with a gain shared by the
heads. :class:`AllHeadsRMSNorm` takes that spec slot and computes HF's norm exactly:

* the input is megatron's ``[..., heads of this TP rank, head dim]`` query (or key) tensor; the mean square is
  over every head of the token, so each TP rank sums the squares of its own heads and the sums are all-reduced
  over the tensor-parallel group (an autograd all-reduce: every rank's heads feed every rank's output);
* the gain is sharded over TP with the heads (``partition_dim`` 0): rank r holds the channels of its heads,
  which is HF's ``q_norm.weight`` rows ``[r x nh/tp x hd, (r + 1) x nh/tp x hd)`` in HF's head order (megatron's
  query heads of query group g are HF's heads ``g x nh/ng ...``, as HF's GQA repeats them). Its gradient is
  complete on each rank (attention sees every token of the sequence, under SP too), so it carries no
  ``sequence_parallel`` tag.

Key heads replicated over TP ranks (``num_key_value_heads`` < TP) would be counted once per copy in the sum:
the bridge refuses that layout by name.
"""

from __future__ import annotations

from typing import Optional

import torch

_SUM_DIMS = (-2, -1)  # [..., heads, head_dim]


class _AllReduceSum(torch.autograd.Function):
    """Sum over ``group`` in the forward and in the backward (each rank's input feeds every rank's output)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        torch.distributed.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


class AllHeadsRMSNorm(torch.nn.Module):
    """RMSNorm over all ``heads`` heads of a token (HF MiniMax-M2's ``q_norm`` / ``k_norm``), in megatron's
    ``q_layernorm`` / ``k_layernorm`` slot. Built by megatron with ``hidden_size`` = the head dim; ``heads``
    (a spec param): the layer's query heads (``q_norm``) or key heads (``k_norm``) over all TP ranks."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, *, heads: int, **kwargs):
        super().__init__()
        from megatron.core import parallel_state, tensor_parallel  # lazy: initialised process groups

        tp = parallel_state.get_tensor_model_parallel_world_size()
        if heads % tp:
            raise ValueError(f"{heads} heads of the q/k norm are not divisible by the tensor-parallel size {tp}")
        self.head_dim, self.local_heads, self.total = hidden_size, heads // tp, heads * hidden_size
        self.eps = eps
        self.tp_group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None
        self.weight = torch.nn.Parameter(torch.ones(self.local_heads * hidden_size, dtype=config.params_dtype))
        tensor_parallel.set_tensor_model_parallel_attributes(self.weight, is_parallel=True, dim=0, stride=1)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        from megatron.core import parallel_state  # lazy: initialised process groups
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint  # lazy: megatron-core

        dp_cp = (metadata or {}).get("dp_cp_group") or parallel_state.get_data_parallel_group(
            with_context_parallel=True)
        return make_sharded_tensors_for_checkpoint({"weight": self.weight}, prefix, {"weight": 0}, sharded_offsets,
                                                   tp_group=parallel_state.get_tensor_model_parallel_group(),
                                                   dp_cp_group=dp_cp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        sum_sq = xf.pow(2).sum(dim=_SUM_DIMS, keepdim=True)
        if self.tp_group is not None:
            sum_sq = _AllReduceSum.apply(sum_sq, self.tp_group)
        out = xf * torch.rsqrt(sum_sq / self.total + self.eps)
        return self.weight.view(self.local_heads, self.head_dim) * out.to(x.dtype)
