"""Worker: LoRA adapters (megatron_rl/models/lora.py) against HF PEFT at several layouts in ONE torchrun.

argv: OUT_JSON then entries ``name:family:hf_dir:tp,pp,ep,sp,distopt:targets`` (targets: ``all-linear`` or
'+'-joined HF module names). Per layout (rank 0 writes the record):
* the PEFT adapter on the HF model gets random A and B (B = 0 would hide every mapping error), saved
  as PEFT saves it; our adapters load those tensors (each rank its slice);
* logits vs HF + PEFT, and with the adapters disabled vs the plain HF model (the reference policy);
* gradients through megatron DDP + finalize_model_grads: every adapter tensor's local slice vs PEFT's
  autograd of the same loss (mean over DP ranks); no base parameter has a gradient or a buffer;
* one get_megatron_optimizer step (plain, and distributed on the 'distopt' entries): the optimizer
  holds exactly the adapter parameters, and every base weight is bitwise unchanged after it.
"""

import contextlib
import json

import torch

from megatron_rl.models import get_bridge, lora, parity
from megatron_rl.models.peft_adapter import AdapterExport, merged_weight
from megatron_rl.models.parallel import ParallelLayout, destroy_parallel, initialize_parallel

LENGTHS = [11, 6, 16, 4]
RANK, ALPHA = 4, 8.0


def peft_model(hf_dir: str, targets):
    from peft import LoraConfig, get_peft_model

    hf = parity.load_hf_model(hf_dir)
    cfg = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=targets)
    model = get_peft_model(hf, cfg)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def saved_name(name: str) -> str:
    """PEFT's in-memory parameter name -> its adapter_model.safetensors key."""
    return name.replace(".default.weight", ".weight")


def main(argv):
    out_path, entries = argv[0], argv[1:]
    results = {}
    for entry in entries:
        name, family, hf_dir, dims, targets = entry.split(":")
        tp, pp, ep, sp, distopt = (int(x) for x in dims.split(","))
        layout = ParallelLayout(tp=tp, pp=pp, ep=ep, etp=1 if ep > 1 else None, sequence_parallel=sp == 1)
        target_list = "all-linear" if targets == "all-linear" else targets.split("+")
        dp = initialize_parallel(layout, seed=0)
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        bridge = get_bridge(hf_dir)
        chunks = bridge.build_model(layout)
        bridge.load_hf_weights(chunks, hf_dir)
        spec = lora.LoraSpec(RANK, ALPHA, target_modules=tuple([target_list] if isinstance(target_list, str)
                                                              else target_list))
        adapters = lora.attach_lora(bridge, chunks, spec)
        pm = peft_model(hf_dir, target_list)
        tensors = {saved_name(n): p.detach().clone() for n, p in pm.named_parameters() if "lora_" in n}
        lora.load_peft_tensors(adapters, tensors)
        base_before = {k: v.clone() for k, v in bridge.export_hf_weights(chunks)}
        # --lora-sync adapter: the gathered adapters are PEFT's tensors, and the engine's merge of them into the
        # base equals the trainer's merged export at this layout
        full = lora.full_adapter_tensors(adapters)
        sync_rec = {"gathered_adapters_equal": set(full) == set(tensors)
                    and all(torch.equal(full[k], tensors[k]) for k in tensors)}
        with contextlib.ExitStack() as merged:
            for a in adapters:
                merged.enter_context(a.merged())
            merged_export = {k: v.clone() for k, v in bridge.export_hf_weights(chunks)}
        adapter = AdapterExport(full, RANK, ALPHA)
        sync_rec["engine_merge_max_diff"] = max(
            (merged_export[f"{m}.weight"] - merged_weight(base_before[f"{m}.weight"], a, b, adapter.scaling))
            .abs().max().item() for m, (a, b) in adapter.modules().items())

        config = chunks[0].config
        config.finalize_model_grads_func = finalize_model_grads
        ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=bool(distopt), overlap_grad_reduce=False)
        model = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=c, disable_bucketing=i > 0)
                 for i, c in enumerate(chunks)]
        for m in model:
            m.zero_grad_buffer()
        num_mb = 2
        dp_rank = ps.get_data_parallel_rank()
        all_mbs = [parity.random_microbatches(bridge.vocab_size, LENGTHS, num_mb, seed=100 + r) for r in range(dp)]
        mbs = all_mbs[dp_rank]
        seqs = [s for mb in mbs for s in mb.seqs]
        logits = parity.megatron_run(model, mbs, bridge.vocab_size, packed=True, forward_only=False)
        rec = {"dp": dp, "layout": layout.describe(), **sync_rec}
        rec["vs_peft"] = parity.compare(logits, parity.hf_logits(pm, mbs), seqs)["max_abs_logit_diff"]
        with lora.adapters_disabled(adapters), torch.no_grad():
            base_logits = parity.megatron_run(chunks, mbs, bridge.vocab_size, packed=True)
        with pm.disable_adapter():
            rec["disabled_vs_hf"] = parity.compare(base_logits, parity.hf_logits(pm, mbs), seqs)["max_abs_logit_diff"]
        rec["adapter_moves_logits"] = max((a - b).abs().max().item() for a, b in zip(logits, base_logits))

        pm.zero_grad()
        parity.hf_loss(pm, all_mbs).backward()
        want = {saved_name(n): p.grad for n, p in pm.named_parameters() if "lora_" in n}
        diffs, biggest, keys = [], 0.0, set()
        for key, grad, dim, rank, size in lora.local_adapter_tensors(adapters, source=lambda p: p.main_grad):
            full = want[key]
            ref = full if dim < 0 else full.chunk(size, dim=dim)[rank]
            diffs.append((grad - ref).abs().max().item())
            biggest = max(biggest, ref.abs().max().item())
            keys.add(key)
        rec["grad_max_abs_diff"], rec["grad_max_abs"] = max(diffs), biggest
        rec["adapter_tensors_here"] = len(keys)
        rec["peft_tensors"] = len(want)
        trainable = [p for c in chunks for p in c.parameters() if p.requires_grad]
        adapter_params = [p for a in adapters for p in a.parameters()]
        rec["trainable_are_adapters"] = {id(p) for p in trainable} == {id(p) for p in adapter_params}
        rec["base_grads"] = sum(1 for c in chunks for n, p in c.named_parameters()
                                if not lora.is_adapter_name(n) and (p.grad is not None
                                                                    or getattr(p, "main_grad", None) is not None))

        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.0, clip_grad=1.0,
                                                     use_distributed_optimizer=bool(distopt), bf16=False, fp16=False),
                                     model)
        # what holds state: DDP's grad buffers and the optimizer's groups (this rank's shard with the
        # distributed optimizer: summed over the DP group) hold exactly the adapter parameters
        rec["adapter_params"] = sum(p.numel() for p in adapter_params)
        rec["grad_buffer_params"] = sum(p.numel() for m in model for b in m.buffers + m.expert_parallel_buffers
                                        for p in b.params)
        held = torch.tensor([float(sum(p.numel() for g in opt.param_groups for p in g["params"]))])
        if distopt:
            torch.distributed.all_reduce(held, group=ps.get_data_parallel_group())
        rec["optimizer_params"] = int(held)
        ok, _, _ = opt.step()
        rec["optim_ok"] = bool(ok)
        after = dict(bridge.export_hf_weights(chunks))
        rec["base_unchanged"] = set(after) == set(base_before) and all(torch.equal(after[k], base_before[k])
                                                                       for k in after)
        rec["adapters_moved"] = any(not torch.equal(p.detach(), tensors[k] if d < 0 else tensors[k].chunk(s, d)[r])
                                    for k, p, d, r, s in lora.local_adapter_tensors(adapters))
        gathered = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, rec)
        results[name] = gathered
        destroy_parallel()
    if torch.distributed.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
