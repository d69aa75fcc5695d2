"""torchrun worker (2 ranks, gloo): the C++ twins under TP=2 vs the single-process float64 reference.

Each rank holds half the vocab (V=2*1031: blocks and lanes end ragged). Row 0's
logits on rank 1 are all -inf (a shard with nothing to add). Writes the max
errors of log-probs, entropy and this rank's gradient shard, for fp32 and bf16
logits, the twins, the torch path and (when triton is importable; interpreter)
the Triton kernels, to ``<out>/rank<r>.json``.

Then the output projection fused into the op by row chunks (``ops.linear_logprobs_and_entropy``)
on each rank's vocab shard of a bf16 output layer (the last 40 columns of rank 1 megatron's vocab
padding) against the unfused path (``F.linear`` then the op), per implementation: whether the
log-probs, entropy and the hidden rows' (per-rank, not yet all-reduced) gradient are bitwise
equal, and the weight shard's gradient error relative to its scale, to ``<out>/linear_rank<r>.json``.
"""

import importlib.util
import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before triton.jit runs: the Triton kernels run interpreted on CPU

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_rl.ops import linear_logprobs_and_entropy, logprobs_and_entropy, naive_logprobs


IMPLS = ("cpu_ext", "torch") + (("triton",) if importlib.util.find_spec("triton") else ())


def main(out_dir):
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tp_group = dist.new_group(list(range(world)))
    n, v_local = 19, 1031
    g = torch.Generator().manual_seed(0)  # same full tensors on every rank
    full = torch.randn(n, world * v_local, generator=g, dtype=torch.float64) * 4
    full[0, v_local:] = -float("inf")
    target = torch.randint(0, world * v_local, (n,), generator=g)
    target[0] = 5
    g_lp, g_h = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)
    errors = {}
    for dtype in (torch.float32, torch.bfloat16):
        ref_x = full.to(dtype).double().requires_grad_()
        rlp, rh = naive_logprobs(ref_x, target, temperature=0.8, with_entropy=True)
        ((rlp * g_lp).sum() + (rh * g_h).sum()).backward()
        ref_grad = ref_x.grad[:, rank * v_local:(rank + 1) * v_local]
        for impl in IMPLS:
            os.environ["MEGATRON_RL_KERNELS"] = impl
            shard = full[:, rank * v_local:(rank + 1) * v_local].to(dtype).clone().requires_grad_()
            lp, h = logprobs_and_entropy(shard, target, tp_group=tp_group, temperature=0.8, with_entropy=True)
            ((lp.double() * g_lp).sum() + (h.double() * g_h).sum()).backward()
            name = f"{impl}/{'bf16' if dtype == torch.bfloat16 else 'fp32'}"
            errors[f"{name}/logprobs"] = (lp.double() - rlp).abs().max().item()
            errors[f"{name}/entropy"] = (h.double() - rh).abs().max().item()
            scale = ref_grad.abs().max().item()
            errors[f"{name}/grad"] = ((shard.grad.double() - ref_grad).abs().max().item()
                                      / (scale if dtype == torch.bfloat16 else 1.0))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(errors, f, indent=1)
    with open(os.path.join(out_dir, f"linear_rank{rank}.json"), "w") as f:
        json.dump(linear_checks(rank, world, tp_group), f, indent=1)
    dist.destroy_process_group()


def linear_checks(rank, world, tp_group):
    n, h, v_local = 45, 16, 1031
    real = world * v_local - 40
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(n, h, generator=g).bfloat16()
    weight = (torch.randn(world * v_local, h, generator=g) * 0.3).bfloat16()[rank * v_local:(rank + 1) * v_local]
    target = torch.randint(0, real, (n,), generator=g)
    g_lp, g_h = torch.randn(n, generator=g), torch.randn(n, generator=g)
    out = {}
    for impl in IMPLS:
        os.environ["MEGATRON_RL_KERNELS"] = impl
        got = []
        for fused in (False, True):
            x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            kw = dict(tp_group=tp_group, temperature=0.8, with_entropy=True, vocab_size=real)
            lp, ent = (linear_logprobs_and_entropy(x, w, target, chunk_size=16, **kw) if fused
                       else logprobs_and_entropy(F.linear(x, w), target, **kw))
            ((lp * g_lp).sum() + (ent * g_h).sum()).backward()
            got.append((lp.detach(), ent.detach(), x.grad, w.grad.float()))
        (lp0, e0, gx0, gw0), (lp1, e1, gx1, gw1) = got
        out[impl] = {"values_bitwise": torch.equal(lp0, lp1) and torch.equal(e0, e1),
                     "hidden_grad_bitwise": torch.equal(gx0, gx1),
                     "weight_grad_rel": ((gw0 - gw1).abs().max() / gw0.abs().max()).item()}
    return out


if __name__ == "__main__":
    main(sys.argv[1])
