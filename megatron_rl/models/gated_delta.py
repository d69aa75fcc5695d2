"""Gated delta-net (Qwen3-Next ``linear_attention`` layers) as a megatron ``self_attention`` submodule.

megatron-core 0.16.1 ships ``megatron.core.ssm.gated_delta_net.GatedDeltaNet``, but it raises
``NotImplementedError`` for packed sequences (every RL micro-batch here is packed THD with
``cu_seqlens``), needs the GPU-only ``fla`` / ``causal_conv1d`` kernels, and fuses its input projection
by kind (all q, all k, ...) where Qwen3-Next checkpoints group it by key head. :class:`PackedGatedDeltaNet`
is a sibling with the same role and TP sharding, written in torch:

* ``in_proj_qkvz`` / ``in_proj_ba``: column-parallel linears holding HF's ``in_proj_qkvz`` / ``in_proj_ba``
  unchanged. HF lays both out per key head (``[q (dk), k (dk), v (r dv), z (r dv)]`` and ``[b (r), a (r)]``
  for each of the ``nk`` key heads, ``r = nv / nk`` value heads per key head), so a contiguous TP shard is
  whole key-head groups: each TP rank owns ``nk / tp`` key heads and their ``r`` value heads each.
* ``conv_weight`` ``[channels, 1, K]``: the depthwise causal convolution over ``[q, k, v]``, stored per
  key-head group (``[q_g, k_g, v_g]`` for each group g; HF's ``conv1d.weight`` puts all q, then all k,
  then all v channels), so it shards with the heads (rule kind ``gdn_conv``).
* ``A_log``, ``dt_bias`` ``[nv]``: sharded with the value heads. ``out_norm`` (HF ``norm``): an RMSNorm
  over each value head gated by ``silu(z)``, one weight ``[dv]`` shared by every head; each TP rank sees
  its heads only, so its gradient is summed over TP in backward.
* ``out_proj``: row-parallel (HF ``out_proj``).

The recurrence: per value head, ``S <- S exp(g)``, ``S <- S + k (beta (v - S^T k))^T``, ``o = S^T q``,
with q and k L2-normalised and q scaled by ``dk^-0.5``; computed chunk-wise in float32 as fla and HF's
torch fallback compute it (chunks of 64 tokens, one triangular solve per chunk, the state carried from
chunk to chunk). Why not token by token: such a loop in float32 rounds differently enough to move the
tiny test model's logits by ~1e-5 from HF's. Invariants: the convolution's window and the state restart
at every sequence start of the packed layout (``cu_seqlens_q_padded`` if set, else ``cu_seqlens_q``), so no token sees another
sequence; padding rows (positions past a sequence's real length) output 0; an SBHD batch runs each
column as one sequence. Context parallelism is not built (the state would have to be handed from rank
to rank); the Qwen3-Next bridge refuses CP > 1 by name.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """HF / fla's ``x * rsqrt(sum(x^2) + eps)`` over the last dim."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def sequence_starts(total: int, packed_seq_params, device) -> tuple[Tensor, Tensor]:
    """(``start[t]``: index of the first token of t's sequence, ``valid[t]``: t is a real token), for a
    packed THD row of ``total`` tokens (every token real and one sequence when ``packed_seq_params`` is
    None)."""
    positions = torch.arange(total, device=device)
    if packed_seq_params is None:
        return torch.zeros_like(positions), torch.ones(total, dtype=torch.bool, device=device)
    real = packed_seq_params.cu_seqlens_q.to(device=device, dtype=torch.long)
    padded = packed_seq_params.cu_seqlens_q_padded
    layout = real if padded is None else padded.to(device=device, dtype=torch.long)
    if int(layout[-1]) != total:
        raise ValueError(f"gated delta-net got {total} packed tokens but cu_seqlens end at {int(layout[-1])} "
                         "(context parallelism is not supported for gated delta-net layers)")
    seq = torch.bucketize(positions, layout[1:], right=True)  # sequence index of each token
    start = layout[seq]
    valid = positions - start < (real[1:] - real[:-1])[seq]
    return start, valid


def causal_conv1d(x: Tensor, weight: Tensor, start: Tensor) -> Tensor:
    """Depthwise causal convolution of ``x`` ``[b, T, C]`` with ``weight`` ``[C, K]`` (HF's ``conv1d``:
    output t = sum_j weight[:, K-1-j] * x[t-j]), taps before ``start[t]`` read as zero."""
    kernel = weight.shape[-1]
    positions = torch.arange(x.shape[1], device=x.device)
    out = x * weight[:, kernel - 1]
    for j in range(1, kernel):
        shifted = F.pad(x, (0, 0, j, 0))[:, :x.shape[1]]
        keep = (positions - j >= start).to(x.dtype)[None, :, None]
        out = out + shifted * keep * weight[:, kernel - 1 - j]
    return out


def chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, chunk_size: int = 64) -> Tensor:
    """The gated delta rule over whole sequences, chunk by chunk, in float32 (the algorithm of fla's
    ``chunk_gated_delta_rule`` and HF's torch fallback, same chunk size and operation order): within a chunk
    the delta-rule updates are one unit-lower-triangular solve, the state is carried from chunk to chunk.
    q, k ``[B, T, H, dk]`` (already one per value head), v ``[B, T, H, dv]``, g (log decay, <= 0) and beta
    ``[B, T, H]``; every row starts from a zero state. Returns ``[B, T, H, dv]`` float32."""
    total = q.shape[1]
    q = l2norm(q.float()) * (q.shape[-1] ** -0.5)
    k = l2norm(k.float())
    q, k, v = (x.float().transpose(1, 2) for x in (q, k, v))  # [B, H, T, d]
    g, beta = (x.float().transpose(1, 2) for x in (g, beta))  # [B, H, T]
    pad = (chunk_size - total % chunk_size) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    b, h, n = q.shape[0], q.shape[1], (total + pad) // chunk_size
    q, k, v_beta, k_beta = (x.reshape(b, h, n, chunk_size, x.shape[-1]) for x in (q, k, v_beta, k_beta))
    cum = g.reshape(b, h, n, chunk_size).cumsum(-1)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay  # its strict lower triangle: the intra-chunk updates
    intra = (q @ k.transpose(-1, -2)) * decay
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    q = q * cum.exp()[..., None]
    k = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    state = v.new_zeros(b, h, k.shape[-1], v.shape[-1])
    outs = []
    for i in range(n):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        outs.append(q[:, :, i] @ state + intra[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    return torch.stack(outs, dim=2).reshape(b, h, n * chunk_size, -1)[:, :, :total].transpose(1, 2)


def gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, start: Tensor) -> Tensor:
    """:func:`chunk_gated_delta_rule` with the state restarting where ``start[t] == t``: a packed row
    (``B == 1``) is regrouped as one row per sequence (``start``: :func:`sequence_starts`), run, and put
    back in packed order. q, k ``[B, T, H, dk]``, v ``[B, T, H, dv]``, g, beta ``[B, T, H]``."""
    total = q.shape[1]
    positions = torch.arange(total, device=start.device)
    if q.shape[0] != 1 or not bool((start != 0).any()):  # one sequence per row already
        return chunk_gated_delta_rule(q, k, v, g, beta)
    seq = torch.cumsum((start == positions).long(), 0) - 1  # sequence index of each token
    offset = positions - start
    rows, width = int(seq[-1]) + 1, int(offset.max()) + 1

    def regroup(x: Tensor) -> Tensor:
        grid = x.new_zeros(rows, width, *x.shape[2:])
        grid[seq, offset] = x[0]
        return grid

    out = chunk_gated_delta_rule(regroup(q), regroup(k), regroup(v), regroup(g), regroup(beta))
    return out[seq, offset][None]


class PackedGatedDeltaNet(MegatronModule):
    """A Qwen3-Next ``linear_attention`` layer in the ``self_attention`` slot of a megatron layer; see the
    module docstring. ``gdn``: ``(num_key_heads, num_value_heads, key_head_dim, value_head_dim,
    conv_kernel)``."""

    def __init__(self, config, submodules=None, layer_number: int = 1, attn_mask_type=None, *,
                 gdn: tuple[int, int, int, int, int], pg_collection=None, **kwargs):
        super().__init__(config)
        from megatron.core import parallel_state  # lazy: initialised process groups

        nk, nv, dk, dv, kernel = gdn
        tp = parallel_state.get_tensor_model_parallel_world_size()
        if nk % tp:
            raise ValueError(f"linear_num_key_heads={nk} is not divisible by the tensor-parallel size {tp}")
        self.layer_number = layer_number
        self.nk, self.nv, self.dk, self.dv = nk // tp, nv // tp, dk, dv
        self.r = nv // nk
        h = config.hidden_size
        init = config.init_method
        common = dict(config=config, init_method=init, bias=False, skip_bias_add=True, is_expert=False)
        self.in_proj_qkvz = tensor_parallel.ColumnParallelLinear(h, nk * (2 * dk + 2 * self.r * dv),
                                                                 gather_output=False, **common)
        self.in_proj_ba = tensor_parallel.ColumnParallelLinear(h, 2 * nv, gather_output=False, **common)
        self.out_proj = tensor_parallel.RowParallelLinear(nv * dv, h, input_is_parallel=True,
                                                          init_method=config.output_layer_init_method,
                                                          config=config, bias=False, skip_bias_add=True,
                                                          is_expert=False)
        channels = self.nk * (2 * dk + self.r * dv)
        dtype = config.params_dtype
        self.conv_weight = torch.nn.Parameter(torch.empty(channels, 1, kernel, dtype=dtype))
        self.A_log = torch.nn.Parameter(torch.empty(self.nv, dtype=dtype).uniform_(0.01, 16).log_())
        self.dt_bias = torch.nn.Parameter(torch.ones(self.nv, dtype=dtype))
        torch.nn.init.normal_(self.conv_weight, 0.0, 0.02)
        for param in (self.conv_weight, self.A_log, self.dt_bias):
            tensor_parallel.set_tensor_model_parallel_attributes(param, is_parallel=True, dim=0, stride=1)
        self.out_norm = torch.nn.Module()
        self.out_norm.weight = torch.nn.Parameter(torch.ones(dv, dtype=dtype))
        self.eps = float(config.layernorm_epsilon)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        from megatron.core.transformer.utils import (  # lazy: megatron-core's checkpoint helpers
            make_sharded_tensors_for_checkpoint, sharded_state_dict_default)

        from megatron.core import parallel_state  # lazy: initialised process groups

        groups = dict(tp_group=parallel_state.get_tensor_model_parallel_group(),
                      dp_cp_group=(metadata or {}).get("dp_cp_group")
                      or parallel_state.get_data_parallel_group(with_context_parallel=True))
        own = {n: p for n, p in self._parameters.items() if p is not None}
        out = make_sharded_tensors_for_checkpoint(own, prefix, {"conv_weight": 0, "A_log": 0, "dt_bias": 0},
                                                  sharded_offsets, **groups)
        out.update(make_sharded_tensors_for_checkpoint({"weight": self.out_norm.weight}, f"{prefix}out_norm.", {},
                                                       sharded_offsets, **groups))
        for name in ("in_proj_qkvz", "in_proj_ba", "out_proj"):
            out.update(sharded_state_dict_default(getattr(self, name), f"{prefix}{name}.", sharded_offsets,
                                                  metadata))
        return out

    def forward(self, hidden_states: Tensor, attention_mask=None, packed_seq_params=None, **kwargs):
        """``hidden_states`` ``[s, b, h]`` (``[s / tp, b, h]`` under SP) -> ``(out [s, b, h], None)``."""
        if kwargs.get("inference_context") is not None:
            raise NotImplementedError("gated delta-net layers have no megatron inference cache here")
        qkvz, _ = self.in_proj_qkvz(hidden_states)
        ba, _ = self.in_proj_ba(hidden_states)
        s, b = qkvz.shape[:2]
        nk, r, dk, dv = self.nk, self.r, self.dk, self.dv
        qkvz = qkvz.view(s, b, nk, 2 * dk + 2 * r * dv).transpose(0, 1)  # [b, s, nk, ...]
        ba = ba.view(s, b, nk, 2 * r).transpose(0, 1)
        qkv, z = torch.split(qkvz, [2 * dk + r * dv, r * dv], dim=-1)
        beta_in, a = torch.split(ba, [r, r], dim=-1)
        start, valid = sequence_starts(s, packed_seq_params if b == 1 else None, hidden_states.device)
        mixed = causal_conv1d(qkv.reshape(b, s, -1), self.conv_weight[:, 0], start)
        mixed = F.silu(mixed).view(b, s, nk, -1)
        q, k, v = torch.split(mixed, [dk, dk, r * dv], dim=-1)
        q, k = (x.repeat_interleave(r, dim=2) for x in (q, k))  # value head j reads key head j // r
        v = v.reshape(b, s, nk * r, dv)
        beta = beta_in.reshape(b, s, nk * r).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.reshape(b, s, nk * r).float() + self.dt_bias)
        core = gated_delta_rule(q, k, v, g, beta, start).to(hidden_states.dtype)
        # HF's Qwen3NextRMSNormGated: weight * rmsnorm(core) (cast back first) * silu(z), computed in float32
        norm_weight = tensor_parallel.copy_to_tensor_model_parallel_region(self.out_norm.weight)  # TP-sum its grad
        cf = core.float()
        normed = (cf * torch.rsqrt(cf.pow(2).mean(-1, keepdim=True) + self.eps)).to(core.dtype)
        gated = norm_weight * normed * F.silu(z.reshape(b, s, nk * r, dv).float())
        out = (gated.to(hidden_states.dtype) * valid[None, :, None, None]).reshape(b, s, -1).transpose(0, 1)
        out, bias = self.out_proj(out.contiguous())
        return out, bias
