"""Worker for tests/dist/test_vocab_parallel.py (4 ranks, gloo).

Every rank builds the same full-vocab data from a fixed seed, keeps its TP shard,
and compares against the single-process float64 ``log_softmax`` reference:

* TP 1, 2, 4 (groups [r] / [0,1],[2,3] / [0..3]): log-probs, entropy and logit
  gradients; chunk sizes that do not divide the token count; temperature != 1;
  bf16 logits.
* TP2 x DP2 training step: samples split over DP ranks and uneven micro-batches,
  loss from the vocab-parallel op + ``compute_policy_loss`` with global
  denominators; DP-summed loss, output-layer weight gradients (all-reduced over
  DP) and metrics must equal the one-big-batch reference.
* TP 2 and 4 over megatron's padded vocab (``vocab_size``): ranks holding padding
  only, or real and padding columns, equal the reference over the real vocab.

Writes ``rank{r}.json``: ``{check_name: max_abs_error}``.
"""

import json
import time

import torch
import torch.distributed as dist

from megatron_rl.algorithms import LossInputs, PolicyGradientConfig, compute_policy_loss, reduce_metrics
from megatron_rl.data.packing import compute_loss_denominators
from megatron_rl.ops import logprobs_and_entropy, naive_logprobs

N_TOK, VOCAB = 29, 48


def err(a, b):
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def full_case(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(N_TOK, VOCAB, generator=g, dtype=torch.float64) * 3
    target = torch.randint(0, VOCAB, (N_TOK,), generator=g)
    g_lp = torch.randn(N_TOK, generator=g, dtype=torch.float64)
    g_h = torch.randn(N_TOK, generator=g, dtype=torch.float64)
    return logits, target, g_lp, g_h


def check_tp(results, tp_group, tp_size, tp_rank, tag):
    vl = VOCAB // tp_size
    cases = [("fp32_T0.8_chunk7", torch.float32, 0.8, 7), ("fp32_T1_auto", torch.float32, 1.0, None),
             ("bf16_T1.3_chunk5", torch.bfloat16, 1.3, 5)]
    for seed, (name, dtype, temp, chunk) in enumerate(cases):
        logits, target, g_lp, g_h = full_case(seed)
        logits = logits.to(dtype)  # bf16: the reference sees the same rounded values
        shard = logits[:, tp_rank * vl:(tp_rank + 1) * vl].clone().requires_grad_()
        lp, h = logprobs_and_entropy(shard, target, tp_group=tp_group, temperature=temp, chunk_size=chunk,
                                     with_entropy=True)
        ((lp.double() * g_lp).sum() + (h.double() * g_h).sum()).backward()
        ref = logits.double().requires_grad_()
        rlp, rh = naive_logprobs(ref, target, temperature=temp, with_entropy=True)
        ((rlp * g_lp).sum() + (rh * g_h).sum()).backward()
        rgrad = ref.grad[:, tp_rank * vl:(tp_rank + 1) * vl]
        scale = 1.0 if dtype == torch.float32 else float(rgrad.abs().max())  # bf16 grad: relative
        results[f"{tag}/{name}/logprobs"] = err(lp, rlp)
        results[f"{tag}/{name}/entropy"] = err(h, rh)
        results[f"{tag}/{name}/grad"] = err(shard.grad, rgrad) / scale


def check_padded_vocab(results, tp_group, tp_size, tp_rank, tag, vocab=17):
    """megatron's vocab padding across TP ranks: only the first ``vocab`` of the 48 columns are real, so
    at TP4 rank 1 holds 5 real + 7 padding columns and ranks 2-3 padding alone. The padding holds
    garbage (not -inf): it must change nothing and get gradient 0."""
    vl = VOCAB // tp_size
    logits, target, g_lp, g_h = full_case(7)
    target = target % vocab
    logits[:, vocab:] = 1e4
    shard = logits[:, tp_rank * vl:(tp_rank + 1) * vl].float().clone().requires_grad_()
    lp, h = logprobs_and_entropy(shard, target, tp_group=tp_group, temperature=0.9, chunk_size=6, with_entropy=True,
                                 vocab_size=vocab)
    ((lp.double() * g_lp).sum() + (h.double() * g_h).sum()).backward()
    ref = logits[:, :vocab].double().requires_grad_()
    rlp, rh = naive_logprobs(ref, target, temperature=0.9, with_entropy=True)
    ((rlp * g_lp).sum() + (rh * g_h).sum()).backward()
    rgrad = torch.cat([ref.grad, torch.zeros(N_TOK, VOCAB - vocab, dtype=torch.float64)], 1)
    results[f"{tag}/padded_vocab/logprobs"] = err(lp, rlp)
    results[f"{tag}/padded_vocab/entropy"] = err(h, rh)
    results[f"{tag}/padded_vocab/grad"] = err(shard.grad, rgrad[:, tp_rank * vl:(tp_rank + 1) * vl])


def check_tp2_dp2_step(results, tp_group, tp_rank, dp_group, dp_rank):
    """DP rank 0 trains samples {0,3,4} as micro-batches [[0,3],[4]]; DP rank 1 {1,2,5} as [[5],[1,2]]."""
    lengths = [5, 0, 7, 3, 6, 8]
    hidden_size, vl = 8, VOCAB // 2
    g = torch.Generator().manual_seed(11)
    n = sum(lengths)
    hidden = torch.randn(n, hidden_size, generator=g, dtype=torch.float64)
    weight = torch.randn(VOCAB, hidden_size, generator=g, dtype=torch.float64)
    target = torch.randint(0, VOCAB, (n,), generator=g)
    mask = (torch.rand(n, generator=g) > 0.25).double()
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    with torch.no_grad():
        base, _ = naive_logprobs(hidden @ weight.T, target)
    old = base + 0.1 * torch.randn(n, generator=g, dtype=torch.float64)
    ref_lp = base + 0.1 * torch.randn(n, generator=g, dtype=torch.float64)
    rollout = base + 0.1 * torch.randn(n, generator=g, dtype=torch.float64)
    cfg = PolicyGradientConfig(eps_clip_high=0.28, kl_loss_coef=0.1, entropy_coef=0.01, use_tis=True,
                               loss_agg_mode="seq_mean_token_mean")
    offsets = torch.tensor([0] + lengths).cumsum(0).tolist()

    def tokens(idx):
        return torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in idx])

    def inputs(idx, logprobs, entropy):
        t = tokens(idx)
        return LossInputs(logprobs, adv[t], mask[t], [lengths[i] for i in idx], old_logprobs=old[t],
                          ref_logprobs=ref_lp[t], rollout_logprobs=rollout[t], entropy=entropy)

    # Reference: one process, whole batch, full vocab, float64.
    ref_w = weight.clone().requires_grad_()
    all_idx = list(range(len(lengths)))
    lp, h = naive_logprobs(hidden @ ref_w.T, target, with_entropy=True)
    d_all = compute_loss_denominators(torch.split(mask, lengths))
    ref_loss, ref_metrics = compute_policy_loss(inputs(all_idx, lp, h), d_all, cfg)
    ref_loss.backward()
    ref_metrics = reduce_metrics([ref_metrics])

    # Distributed: DP shard of samples, TP shard of the output layer, uneven micro-batches.
    micro_batches = [[[0, 3], [4]], [[5], [1, 2]]][dp_rank]
    mine = [i for mb in micro_batches for i in mb]
    d = compute_loss_denominators(torch.split(mask[tokens(mine)], [lengths[i] for i in mine]), group=dp_group)
    w_shard = weight[tp_rank * vl:(tp_rank + 1) * vl].clone().float().requires_grad_()
    local_loss, metrics = torch.zeros((), dtype=torch.float64), []
    for mb in micro_batches:
        t = tokens(mb)
        logits = hidden[t].float() @ w_shard.T  # ColumnParallelLinear output: [tokens, V/tp]
        lp, h = logprobs_and_entropy(logits, target[t], tp_group=tp_group, chunk_size=4, with_entropy=True)
        loss, m = compute_policy_loss(inputs(mb, lp.double(), h.double()), d, cfg)
        loss.backward()
        local_loss += loss.detach()
        metrics.append(m)
    dist.all_reduce(local_loss, group=dp_group)
    dist.all_reduce(w_shard.grad, group=dp_group)  # DDP with SUM (loss already globally normalised)
    dist_metrics = reduce_metrics(metrics, group=dp_group)
    results["tp2dp2/loss"] = abs(local_loss.item() - ref_loss.item())
    results["tp2dp2/weight_grad"] = err(w_shard.grad, ref_w.grad[tp_rank * vl:(tp_rank + 1) * vl])
    results["tp2dp2/metrics"] = max(abs(dist_metrics[k] - ref_metrics[k]) for k in ref_metrics)
    results["tp2dp2/metric_names"] = float(sorted(dist_metrics) != sorted(ref_metrics))


def main(argv):
    out_dir = argv[0]
    t0 = time.time()
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 4, "this worker expects 4 ranks"
    results = {}
    tp1 = [dist.new_group([r]) for r in range(4)]
    tp2 = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp2 = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    check_tp(results, tp1[rank], 1, 0, "tp1")
    check_tp(results, tp2[rank // 2], 2, rank % 2, "tp2")
    check_tp(results, dist.group.WORLD, 4, rank, "tp4")
    check_padded_vocab(results, tp2[rank // 2], 2, rank % 2, "tp2")
    check_padded_vocab(results, dist.group.WORLD, 4, rank, "tp4")
    check_tp2_dp2_step(results, tp2[rank // 2], rank % 2, dp2[rank % 2], rank // 2)
    results["seconds"] = time.time() - t0
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(results, f, indent=1)
