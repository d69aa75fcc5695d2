"""Worker: loop over parallel layouts in ONE torchrun launch (re-initialising megatron's
groups each time) and record logits / grads / one optimizer step against HF.

argv: OUT_JSON then entries ``name:family:hf_dir:tp,pp,vpp,cp,ep,etp,sp:checks`` where
checks is a '+'-joined subset of {logits, grads, optim, distopt, mtp, mtp_train}.
Per layout (rank 0 writes): max |dlogit| vs HF transformers, vs the first layout of the same
family (the TP1/PP1 reference), max |dgrad| vs HF autograd of the same loss (mean over DP
ranks, each with its own batch), and max |dparam| after one Adam step vs torch.optim.Adam on HF.
``mtp``: the model is built with the checkpoint's MTP layer (megatron's MTP block, on the last stage):
max |dlogit| of its logits vs tests/_mtp_reference.py, and whether the export equals the checkpoint
bit for bit (MTP tensors included). ``mtp_train``: the main loss plus --enable-mtp-training's MTP loss
(``check_mtp_training``): the MTP loss value and every gradient vs transformers' modules.
"""

import json
import os

import torch

from megatron_rl.models import get_bridge, hf_module, parity
from megatron_rl.models.parallel import ParallelLayout, destroy_parallel, initialize_parallel


LENGTHS = [11, 6, 16, 4]


def parse(entry):
    name, family, hf_dir, dims, checks = entry.split(":")
    tp, pp, vpp, cp, ep, etp, sp = dims.split(",")
    layout = ParallelLayout(tp=int(tp), pp=int(pp), vpp=int(vpp) or None, cp=int(cp), ep=int(ep),
                            etp=int(etp) or None, sequence_parallel=sp == "1")
    return name, family, hf_dir, layout, set(checks.split("+"))


def wrap_ddp(chunks, use_distributed_optimizer):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=use_distributed_optimizer,
                                               overlap_grad_reduce=False)
    config = chunks[0].config
    config.finalize_model_grads_func = finalize_model_grads
    return [DistributedDataParallel(config=config, ddp_config=ddp_config, module=c, disable_bucketing=i > 0)
            for i, c in enumerate(chunks)]


def export_of(bridge, chunks, source):
    """Export HF-layout tensors of ``source(param)`` (e.g. main_grad) via the weight exporter."""
    params = [p for c in chunks for p in c.parameters()]
    saved = [p.data.clone() for p in params]
    for p in params:
        p.data.copy_(source(p))
    out = {k: v.clone() for k, v in bridge.export_hf_weights(chunks)}
    for p, s in zip(params, saved):
        p.data.copy_(s)
    return out


def checkpoint_layout(hf, named):
    """HF module tensors ``named`` under the checkpoint's names: transformers 5 keeps MoE experts
    fused in memory (``experts.gate_up_proj`` [E, 2f, h]) and renames some modules (Mixtral's
    ``block_sparse_moe``); checkpoints hold one tensor per expert under the original names.
    transformers' own reverse conversion, one decoder layer at a time (as save_pretrained)."""
    named = dict(named)
    out = {}
    for unit in hf_module.layer_units(named):
        out.update(hf_module.hf_checkpoint_names(hf, {n: named[n] for n in unit}))
    return out


def hf_buffer_names(hf):
    """Checkpoint names of HF persistent buffers (GLM's router e_score_correction_bias): exported
    by the bridge, never trained, so they have no gradient to compare."""
    params = dict(hf.named_parameters())
    return set(checkpoint_layout(hf, ((n, t) for n, t in hf.state_dict().items() if n not in params)))


def mtp_reference(hf_dir, cache):
    from _mtp_reference import MtpReference

    if hf_dir not in cache:
        cache[hf_dir] = MtpReference(hf_dir)
    return cache[hf_dir]


def check_mtp(rec, bridge, chunks, hf_dir, seqs, mtp_refs):
    """Megatron's MTP logits vs the reference (collective), and the export vs the checkpoint's tensors."""
    from safetensors.torch import load_file

    from megatron_rl.models import mtp

    with torch.no_grad():
        got = mtp.mtp_logits(chunks, seqs, bridge.vocab_size)
    ref = mtp_reference(hf_dir, mtp_refs)
    rec["mtp_vs_reference"] = max((g[0][:-1] - ref.logits(s)).abs().max().item() for g, s in zip(got, seqs))
    exported = {n: t.clone() for n, t in bridge.export_hf_weights(chunks)}
    source = load_file(os.path.join(hf_dir, "model.safetensors"))
    rec["mtp_export_bit_exact"] = set(exported) == set(source) and all(
        torch.equal(exported[n], source[n]) for n in source)


MTP_FACTOR = 0.5  # the MTP loss's weight in the "mtp_train" check (--mtp-loss-scaling-factor / --mtp-num-layers)


def check_mtp_training(rec, bridge, chunks, hf, hf_dir, all_mbs, dp_rank, mtp_losses, mtp_refs):
    """``mtp_train``: after megatron's backward of the main + MTP loss (``parity.megatron_run`` with
    ``mtp_loss_factor``), each micro-batch's MTP loss vs tests/_mtp_reference.py (relative), and every gradient
    (the MTP layer's, the embedding's and output layer's, with their MTP copies, and the decoder's) vs HF autograd
    of the same loss. Collective."""
    ref = mtp_reference(hf_dir, mtp_refs)
    hf.zero_grad()
    ref.zero_grad()
    main = parity.hf_loss(hf, all_mbs)
    per_mb = [[sum(ref.loss(s, w) for s, w in zip(mb.seqs, mb.weights)) for mb in mbs] for mbs in all_mbs]
    mtp_total = sum(sum(losses) / len(losses) for losses in per_mb) / len(per_mb)
    (main + MTP_FACTOR * mtp_total).backward()
    want = [float(loss) for loss in per_mb[dp_rank]]
    rel = max((abs(a - b) / abs(b) for a, b in zip(mtp_losses, want)), default=-1.0)  # -1: no MTP stage here
    worst = torch.tensor([rel, float(len(mtp_losses) == len(want))])
    torch.distributed.all_reduce(worst, op=torch.distributed.ReduceOp.MAX)
    rec["mtp_loss_rel_diff"], rec["mtp_loss_on_last_stage"] = float(worst[0]), bool(worst[1])
    rec["mtp_loss"] = want
    hf_grads = checkpoint_layout(hf, ((n, p.grad) for n, p in hf.named_parameters()))
    own = ref.grads()
    prefix = f"model.layers.{ref.mtp_layer}."
    shared = {prefix + "embed_tokens.weight": hf_grads["model.embed_tokens.weight"],
              prefix + "shared_head.head.weight": hf_grads.get("lm_head.weight", hf_grads["model.embed_tokens.weight"])}
    if bridge.tie_word_embeddings:
        hf_grads.pop("lm_head.weight", None)
    want_grads = {**hf_grads, **own, **shared}
    got = export_of(bridge, chunks, lambda p: p.main_grad)
    got = {n: t for n, t in got.items() if n in want_grads or not n.endswith("e_score_correction_bias")}
    assert set(got) == set(want_grads), set(got) ^ set(want_grads)

    def worst_diff(names):
        return (max((got[n] - want_grads[n]).abs().max().item() for n in names),
                max(want_grads[n].abs().max().item() for n in names))

    rec["grad_max_abs_diff"], rec["grad_max_abs"] = worst_diff(got)
    rec["mtp_grad_max_abs_diff"], rec["mtp_grad_max_abs"] = worst_diff(own)
    rec["shared_grad_max_abs_diff"], rec["shared_grad_max_abs"] = worst_diff(
        list(shared) + ["model.embed_tokens.weight"] + (["lm_head.weight"] if "lm_head.weight" in got else []))


def main(argv):
    out_path, entries = argv[0], argv[1:]
    results, reference_logits, hf_cache, mtp_refs = {}, {}, {}, {}
    for entry in entries:
        name, family, hf_dir, layout, checks = parse(entry)
        dp = initialize_parallel(layout, seed=0)
        from megatron.core import parallel_state as ps

        bridge = get_bridge(hf_dir, mtp_num_layers=1 if checks & {"mtp", "mtp_train"} else 0)
        chunks = bridge.build_model(layout)
        bridge.load_hf_weights(chunks, hf_dir)
        num_mb = layout.pp if (layout.vpp or 1) > 1 else 2
        dp_rank = ps.get_data_parallel_rank()
        all_mbs = [parity.random_microbatches(bridge.vocab_size, LENGTHS, num_mb, seed=100 + r) for r in range(dp)]
        if hf_dir not in hf_cache:
            hf_cache[hf_dir] = parity.load_hf_model(hf_dir)
        hf = hf_cache[hf_dir]
        rec = {"layout": layout.describe(), "dp": dp}
        train = bool(checks & {"grads", "optim", "distopt", "mtp_train"})
        mtp_losses: list = []
        if train:
            model = wrap_ddp(chunks, "distopt" in checks)
            for m in model:
                m.zero_grad_buffer()
            logits = parity.megatron_run(model, all_mbs[dp_rank], bridge.vocab_size, packed=True, forward_only=False,
                                         mtp_loss_factor=MTP_FACTOR if "mtp_train" in checks else None,
                                         mtp_losses=mtp_losses)
        else:
            for c in chunks:
                c.eval()
            with torch.no_grad():
                logits = parity.megatron_run(chunks, all_mbs[dp_rank], bridge.vocab_size, packed=True)
        ref = parity.hf_logits(hf, all_mbs[dp_rank])
        seqs = [s for mb in all_mbs[dp_rank] for s in mb.seqs]
        rec["vs_hf"] = parity.compare(logits, ref, seqs)["max_abs_logit_diff"]
        if "mtp" in checks:
            check_mtp(rec, bridge, chunks, hf_dir, seqs, mtp_refs)
        key = (family, dp_rank)
        if key not in reference_logits:
            reference_logits[key] = logits
        rec["vs_reference_layout"] = max((a - b).abs().max().item() for a, b in zip(logits, reference_logits[key]))
        if "mtp_train" in checks:
            check_mtp_training(rec, bridge, chunks, hf, hf_dir, all_mbs, dp_rank, mtp_losses, mtp_refs)
        elif train:
            hf.zero_grad()
            parity.hf_loss(hf, all_mbs).backward()
            # frozen on both sides (DeepSeek-V3.2's indexer: HF runs it under no_grad, the bridge freezes it): no
            # gradient, compared as zeros once the two frozen sets are checked equal
            hf_frozen = set(checkpoint_layout(hf, ((n, p) for n, p in hf.named_parameters() if p.grad is None)))
            hf_grads = checkpoint_layout(hf, ((n, torch.zeros_like(p) if p.grad is None else p.grad)
                                              for n, p in hf.named_parameters()))
            if bridge.tie_word_embeddings:
                hf_grads.pop("lm_head.weight", None)
            got = export_of(bridge, chunks, lambda p: p.main_grad if p.requires_grad else torch.zeros_like(p))
            buffers = hf_buffer_names(hf) - {"lm_head.weight"}  # tied: in HF's state dict, not a parameter
            marks = export_of(bridge, chunks, lambda p: torch.full_like(p, float(not p.requires_grad)))
            frozen = {n for n, t in marks.items() if n not in buffers and bool((t == 1).all())}
            assert frozen == hf_frozen, frozen ^ hf_frozen
            rec["frozen"] = len(frozen)
            assert buffers <= set(got), buffers - set(got)
            got = {n: t for n, t in got.items() if n not in buffers}
            assert set(got) == set(hf_grads), set(got) ^ set(hf_grads)
            rec["grad_max_abs_diff"] = max((got[n] - hf_grads[n]).abs().max().item() for n in got)
            rec["grad_max_abs"] = max(g.abs().max().item() for g in hf_grads.values())
        if checks & {"optim", "distopt"}:
            from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

            # adam_eps=1 keeps the check smooth: a first Adam step is g/(|g|+eps), and with a
            # tiny eps it would amplify 1e-6 grad noise on near-zero grads to lr-sized steps.
            opt_config = OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.0, clip_grad=1.0,
                                         adam_eps=1.0, use_distributed_optimizer="distopt" in checks,
                                         bf16=False, fp16=False)
            optimizer = get_megatron_optimizer(opt_config, model)
            ok, grad_norm, _ = optimizer.step()
            hf_grad_norm = float(torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0))
            hf_opt = torch.optim.AdamW(hf.parameters(), lr=1e-2, weight_decay=0.0, eps=1.0)
            hf_opt.step()
            got = {k: v.clone() for k, v in bridge.export_hf_weights(chunks)}
            want = checkpoint_layout(hf, ((n, p.detach()) for n, p in hf.named_parameters()))
            rec["optim_ok"] = bool(ok)
            rec["grad_norm"] = [float(grad_norm), hf_grad_norm]
            rec["param_max_abs_diff_after_step"] = max((got[n] - want[n].detach()).abs().max().item() for n in got)
            hf_cache.pop(hf_dir)  # its weights moved
        results[name] = rec
        destroy_parallel()
    if torch.distributed.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
