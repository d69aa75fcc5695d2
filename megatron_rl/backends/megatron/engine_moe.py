"""The trainer's MoE layers in the rollout engine's arithmetic, for ``--true-on-policy-mode`` (docs/on-policy.md).

Why: under ``ops.batch_invariant`` every matmul, softmax and norm of the two forwards is one invariant form, but
megatron-core's MoE layer orders two steps otherwise than the engine's HF module (``Qwen3MoeSparseMoeBlock``,
``MixtralSparseMoeBlock``), the same numbers by algebra with other last bits:

* the expert weights: for a normalised top-k, megatron takes a softmax over the top-k logits; HF takes the fp32
  softmax over every expert, picks the top-k entries and divides them by their sum;
* where the weight multiplies: megatron's expert MLP scales the activation before ``fc2``
  (``silu(g) * u * p``, then ``fc2``); HF scales the expert's output (``fc2(silu(g) * u) * p``).

Both are put in HF's form here. The rest already agrees: the experts are the engine's (routing replay R3
replays them), each expert's MLP is one batch-invariant matmul per projection (the fused ``fc1`` gives the bits of
HF's ``gate_up_proj``: output columns are independent), and the combine adds a token's top-k contributions from
zeros in ascending expert order on both sides (megatron's ``unpermute`` scatter-adds the expert-sorted rows in
order; HF's expert loop ``index_add_``s expert by expert). The mode refuses what would break this (fused
permutation, grouped GEMM, routers of other families: ``config/on_policy_rules.py``).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from megatron_rl.backends.megatron.routing_replay import RoutingReplay


def _engine_routing(router: Any):
    """``TopKRouter.routing`` with HF's expert weights at the replayed experts. The z-loss and load-balancing
    losses attach as in megatron's own ``routing`` (identities in the forward: they add gradients only)."""
    from megatron.core.transformer.moe.moe_utils import compute_routing_scores_for_aux_loss  # lazy: megatron-core

    normalise = not router.config.moe_router_pre_softmax  # the bridge's reading of HF's norm_topk_prob

    def own_topk(scores, topk, num_groups=None, group_topk=None):
        return torch.topk(scores, k=topk, dim=1)

    def routing(logits: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        seq_length, bsz = logits.shape[:2]
        logits = logits.view(-1, router.config.num_moe_experts)
        if padding_mask is not None:
            padding_mask = padding_mask.reshape(-1)
        logits = router.apply_z_loss(logits, padding_mask=padding_mask)
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
        # the replayed experts (R3) and their scores; the trainer's own top-k only counts route agreement
        weights, experts = router.router_replay.get_replay_topk(scores, router.topk, None, None, own_topk)
        if normalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(logits.dtype)
        probs = torch.zeros_like(logits).scatter(1, experts, weights)
        routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, experts, True)
        if router.training and torch.is_grad_enabled() and router.is_aux_loss_enabled():
            aux_map, aux_scores = compute_routing_scores_for_aux_loss(
                logits, router.topk, router.score_function, fused=router.config.moe_router_fusion,
                padding_mask=padding_mask)
            masked = padding_mask is not None
            probs = router._apply_aux_loss(probs, aux_scores, aux_map, with_padding_mask=masked)
            probs = router._apply_seq_aux_loss(probs, aux_scores, aux_map, seq_length, bsz, with_padding_mask=masked)
            probs = router._apply_global_aux_loss(probs, aux_scores, aux_map, with_padding_mask=masked)
        return probs, routing_map

    return routing


def _engine_expert(mlp: Any):
    """An expert MLP's ``forward`` that scales its output by the token's weight (HF) instead of the activation."""
    plain = mlp.forward

    def forward(hidden_states: torch.Tensor, per_token_scale: Optional[torch.Tensor] = None, **kwargs: Any):
        out, bias = plain(hidden_states, None, **kwargs)
        if bias is not None:
            raise NotImplementedError("--true-on-policy-mode: expert MLPs with a bias are not in the engine's form")
        if per_token_scale is not None:
            out = (out * per_token_scale.unsqueeze(-1)).to(out.dtype)
        return out, None

    return forward


def use_engine_moe(chunks: Sequence[torch.nn.Module], routing: Optional[RoutingReplay]) -> None:
    """Put every MoE layer of ``chunks`` in the engine's arithmetic (module docstring). ``routing``: the
    backend's replay state (R3), whose routers get the engine's expert weights."""
    from megatron.core.transformer.moe.experts import SequentialMLP  # lazy: megatron-core

    if routing is None:
        raise RuntimeError("--true-on-policy-mode on a MoE model needs routing replay from the rollout (R3); "
                           "the config check should have refused this run")
    for r in routing.routers:
        r.router.routing = _engine_routing(r.router)
    for chunk in chunks:
        for module in chunk.modules():
            if module.__class__.__name__ in ("GroupedMLP", "TEGroupedMLP"):
                raise RuntimeError("--true-on-policy-mode: grouped-GEMM experts are not the batch-invariant ops; "
                                   "the config check should have refused --moe-grouped-gemm")
            if isinstance(module, SequentialMLP):
                for expert in module.local_experts:
                    expert.forward = _engine_expert(expert)
