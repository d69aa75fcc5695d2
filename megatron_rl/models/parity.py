"""Run one token batch through megatron-core and through HF ``transformers``.

Shared by ``tools/check_parity.py`` and the multi-rank parity tests, so both
measure the same thing. Megatron is driven the way the backend drives it:
``get_forward_backward_func`` (works for every PP/VPP layout), packed THD input
with ``PackedSeqParams`` when PackedCoreAttention is available (sharded over CP
ranks with :mod:`megatron_rl.models.cp_utils`), right-padded ``[b, s]`` otherwise.

Loss used for gradient checks: ``sum_t w_t * -log p(x_{t+1} | x_{<=t})`` over each
microbatch with fixed per-token weights ``w_t`` (0 on each sequence's last
token), padded-vocab logits masked out. Megatron averages it over microbatches
(its legacy 2-tuple loss path) and DDP averages over DP ranks; :func:`hf_loss`
computes that same quantity for the reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_rl.errors import ConfigError
from megatron_rl.models import cp_utils
from megatron_rl.models.weights import unwrap


@dataclass
class Microbatch:
    seqs: list  # LongTensor [L_i] each
    weights: list  # FloatTensor [L_i] each (0 on the last token)


def random_microbatches(vocab_size: int, lengths: list[int], num_microbatches: int, seed: int) -> list[Microbatch]:
    """Sequences of the given lengths, split into ``num_microbatches`` consecutive groups."""
    if num_microbatches < 1 or num_microbatches > len(lengths):
        raise ConfigError(f"--num-microbatches={num_microbatches} must be in 1..{len(lengths)} (number of sequences)")
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab_size, (n,), generator=gen) for n in lengths]
    weights = []
    for n in lengths:
        w = torch.rand(n, generator=gen) + 0.5
        w[-1] = 0.0
        weights.append(w)
    bounds = [round(i * len(lengths) / num_microbatches) for i in range(num_microbatches + 1)]
    return [Microbatch(seqs[a:b], weights[a:b]) for a, b in zip(bounds, bounds[1:])]


# ------------------------------------------------------------------------- HF
def load_hf_model(hf_dir: str):
    import transformers

    from megatron_rl.models.hf_module import hf_config  # lazy: as transformers above

    return transformers.AutoModelForCausalLM.from_pretrained(hf_dir, config=hf_config(hf_dir),
                                                             dtype=torch.float32).eval()


def hf_logits(hf_model, microbatches: list[Microbatch]) -> list[torch.Tensor]:
    """Per-sequence logits ``[L_i, V]`` (one sequence per HF forward: no padding effects)."""
    out = []
    with torch.no_grad():
        for mb in microbatches:
            for seq in mb.seqs:
                out.append(hf_model(seq[None]).logits[0].float())
    return out


def _weighted_nll(logits: torch.Tensor, seq: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits.float(), dim=-1)
    target = torch.roll(seq, -1)
    return -(logp.gather(-1, target[:, None])[:, 0] * weights).sum()


def hf_loss(hf_model, microbatches_per_dp_rank: list[list[Microbatch]]) -> torch.Tensor:
    """The loss whose gradient megatron + DDP produce: mean over DP ranks and microbatches."""
    total: torch.Tensor | float = 0.0
    for mbs in microbatches_per_dp_rank:
        for mb in mbs:
            for seq, w in zip(mb.seqs, mb.weights):
                total = total + _weighted_nll(hf_model(seq[None]).logits[0], seq, w) / len(mbs)
    assert isinstance(total, torch.Tensor), "hf_loss needs at least one sequence"
    return total / len(microbatches_per_dp_rank)


# ------------------------------------------------------------------- megatron
def _prepare(mb: Microbatch, packed: bool, config):
    """Model inputs for this rank plus what the loss needs (all on this rank's tokens)."""
    from megatron.core import parallel_state as ps

    tp, cp = ps.get_tensor_model_parallel_world_size(), ps.get_context_parallel_world_size()
    targets = [torch.roll(s, -1) for s in mb.seqs]
    if packed:
        lengths = [len(s) for s in mb.seqs]
        cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
        multiple = cp_utils.cp_pad_multiple(cp, tp, config.sequence_parallel)
        tokens, cu_pad = cp_utils.pad_packed(torch.cat(mb.seqs), cu, multiple)
        tgt, _ = cp_utils.pad_packed(torch.cat(targets), cu, multiple)
        wts, _ = cp_utils.pad_packed(torch.cat(mb.weights), cu, multiple)
        shard = cp_utils.shard_packed_for_cp(tokens, cu_pad, ps.get_context_parallel_rank(), cp)
        local = lambda t: cp_utils.shard_packed_for_cp(t, cu_pad, ps.get_context_parallel_rank(), cp).tensor  # noqa
        return dict(
            input_ids=shard.tensor[None], position_ids=shard.position_ids[None],
            packed_seq_params=cp_utils.make_packed_seq_params(cu_pad, cu),
            targets=local(tgt)[None], weights=local(wts)[None], cu=cu, cu_pad=cu_pad, seq_length=int(cu_pad[-1]))
    if cp > 1:
        raise ConfigError("--context-parallel-size > 1 needs packed sequences (PackedCoreAttention)")
    s_max = max(len(s) for s in mb.seqs)
    s_max = -(-s_max // tp) * tp if config.sequence_parallel else s_max
    b = len(mb.seqs)
    ids = torch.zeros(b, s_max, dtype=torch.long)
    tgt = torch.zeros(b, s_max, dtype=torch.long)
    wts = torch.zeros(b, s_max)
    for i, (s, t, w) in enumerate(zip(mb.seqs, targets, mb.weights)):
        ids[i, :len(s)], tgt[i, :len(s)], wts[i, :len(s)] = s, t, w
    return dict(input_ids=ids, position_ids=torch.arange(s_max).expand(b, s_max).contiguous(),
                packed_seq_params=None, targets=tgt, weights=wts, seq_length=s_max)


def _mask_padded_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    local = logits.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * local
    if start + local <= vocab_size:
        return logits
    cols = torch.arange(start, start + local, device=logits.device)
    return logits.masked_fill(cols >= vocab_size, torch.finfo(logits.dtype).min)


def _full_logits(logits: torch.Tensor, prep: dict, mb: Microbatch, packed: bool, vocab_size: int):
    """This rank's vocab-parallel logits -> per-sequence ``[L_i, vocab_size]`` (collective in TP/CP)."""
    from megatron.core import tensor_parallel

    full = tensor_parallel.gather_from_tensor_model_parallel_region(logits.detach().float())
    if packed:
        tokens = cp_utils.gather_packed_from_cp(full[0], prep["cu_pad"])
        cu_pad = prep["cu_pad"].tolist()
        return [tokens[a:a + len(s), :vocab_size].contiguous() for a, s in zip(cu_pad, mb.seqs)]
    return [full[i, :len(s), :vocab_size].contiguous() for i, s in enumerate(mb.seqs)]


def _mtp_targets(prep: dict, mb: Microbatch, depths: int, vocab_size: int, factor: float):
    """The MTP loss of the parity loss's tokens (``models/mtp.py``): depth d at position t scores token
    ``t + 2 + d`` with the weight the main loss gives that token; this CP rank's rows."""
    from megatron.core import parallel_state as ps

    from megatron_rl.models import mtp  # lazy: imports megatron-core's GPTModel

    cu_pad, lengths = prep["cu_pad"], [len(s) for s in mb.seqs]
    positions = torch.cat([torch.arange(a, a + n - 1) for a, n in zip(cu_pad[:-1].tolist(), lengths)])
    cp = ps.get_context_parallel_world_size()
    local = cp_utils.cp_local_index(cu_pad, ps.get_context_parallel_rank(), cp) if cp > 1 else None
    return mtp.mtp_targets(cu_pad, torch.tensor([n - 1 for n in lengths]), positions,
                           torch.cat([s[1:] for s in mb.seqs]), torch.cat([w[:-1] for w in mb.weights]), depths, 1.0,
                           vocab_size, factor, local_index=local,
                           cp_group=ps.get_context_parallel_group() if cp > 1 else None)


def megatron_run(model_chunks, microbatches: list[Microbatch], vocab_size: int, packed: bool,
                 forward_only: bool = True, mtp_loss_factor: Optional[float] = None,
                 mtp_losses: Optional[list] = None) -> Optional[list[torch.Tensor]]:
    """Forward (and backward unless ``forward_only``) through megatron's schedule.

    Returns per-sequence logits ``[L_i, vocab_size]`` on every rank of the last
    pipeline stage and broadcasts them to the whole PP group, so every rank
    returns the same list. With ``forward_only=False`` gradients land where DDP
    puts them (``param.main_grad``) after ``finalize_model_grads``.

    ``mtp_loss_factor`` (a model built with its MTP block, packed input): the loss also holds the MTP block's
    (``--enable-mtp-training``'s, :func:`_mtp_targets`) times ``mtp_loss_factor / mtp_num_layers``; each
    micro-batch's unscaled MTP loss is appended to ``mtp_losses`` on the last pipeline stage.
    """
    from functools import partial

    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    config = unwrap(model_chunks[0]).config
    preps = [_prepare(mb, packed, config) for mb in microbatches]
    collected: list = []

    def loss_func(prep, mb, model, output):
        from megatron.core import tensor_parallel

        if mtp_losses is not None and getattr(unwrap(model), "mtp_targets", None) is not None:
            mtp_losses.append(float(unwrap(model).last_mtp_loss))

        collected.append(_full_logits(output, prep, mb, packed, vocab_size))
        logits = _mask_padded_vocab(output, vocab_size)
        # vocab_parallel_cross_entropy wants [s, b, V/tp] and edits its input in
        # place: hand it a private copy (transpose of a b=1 tensor may be a view).
        nll = tensor_parallel.vocab_parallel_cross_entropy(
            logits.float().transpose(0, 1).clone(memory_format=torch.contiguous_format), prep["targets"].transpose(0, 1).contiguous())
        loss = (nll.transpose(0, 1) * prep["weights"]).sum()
        return loss, {"loss": loss.detach()}

    def make_iter():
        return iter(list(zip(preps, microbatches)))

    def forward_step(data_iterator, model):
        prep, mb = next(data_iterator)
        if mtp_loss_factor is not None and getattr(unwrap(model), "mtp_process", False):
            unwrap(model).mtp_targets = _mtp_targets(prep, mb, config.mtp_num_layers, vocab_size, mtp_loss_factor)
        out = model(prep["input_ids"], prep["position_ids"], attention_mask=None,
                    packed_seq_params=prep["packed_seq_params"])
        return out, partial(loss_func, prep, mb, model)

    iters = [make_iter() for _ in model_chunks]
    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iters if len(model_chunks) > 1 else iters[0],
        model=model_chunks if len(model_chunks) > 1 else model_chunks[0],
        num_microbatches=len(microbatches),
        seq_length=max(p["seq_length"] for p in preps),
        micro_batch_size=1 if packed else max(len(mb.seqs) for mb in microbatches),
        forward_only=forward_only,
    )
    for chunk in model_chunks:
        if getattr(unwrap(chunk), "mtp_process", False):
            unwrap(chunk).mtp_targets = None
    logits = [t for group in collected for t in group]
    if ps.get_pipeline_model_parallel_world_size() > 1:
        shapes = [(len(s), vocab_size) for mb in microbatches for s in mb.seqs]
        if not ps.is_pipeline_last_stage():
            logits = [torch.empty(shape) for shape in shapes]
        group = ps.get_pipeline_model_parallel_group()
        src = torch.distributed.get_process_group_ranks(group)[-1]
        for t in logits:
            torch.distributed.broadcast(t, src=src, group=group)
    return logits


def compare(megatron_logits: list[torch.Tensor], reference_logits: list[torch.Tensor], seqs) -> dict:
    """Per-sequence max |delta logit| and max |delta log-prob of the next token|."""
    per_seq = []
    for m, r, s in zip(megatron_logits, reference_logits, seqs):
        dl = (m - r).abs().max().item()
        tgt = torch.roll(s, -1)[:-1, None]
        lm = torch.log_softmax(m, -1)[:-1].gather(-1, tgt)
        lr = torch.log_softmax(r, -1)[:-1].gather(-1, tgt)
        dp = (lm - lr).abs().max().item() if len(s) > 1 else 0.0
        per_seq.append({"length": len(s), "max_abs_logit_diff": dl, "max_abs_logprob_diff": dp})
    return {"max_abs_logit_diff": max(p["max_abs_logit_diff"] for p in per_seq),
            "max_abs_logprob_diff": max(p["max_abs_logprob_diff"] for p in per_seq),
            "per_sequence": per_seq}
