"""Pack rollout samples into THD micro-batches for megatron-core.

A training step receives a rollout batch (a list of ``Sample``). This module
decides which samples each data-parallel (DP) rank trains on in which
micro-batch (a ``MicroBatchPlan``), lays one micro-batch out as a padding-free
packed sequence (a ``PackedBatch``: tokens back to back, ``cu_seqlens`` marks
the boundaries), and counts the loss denominators of the whole step.

Two batching modes, named after their flags:

* dynamic (``--use-dynamic-batch-size --max-tokens-per-gpu N``): a micro-batch
  holds at most ``N`` tokens per GPU. With context parallelism every CP rank
  holds ``1/cp_size`` of each sequence, so the budget for the *global*
  (unsharded, padded) sequences of one micro-batch is ``N * cp_size``.
  Samples are first split across DP ranks with token sums balanced
  (Karmarkar-Karp with equal sample counts, refined by pairwise swaps; equal
  counts guarantee every rank can reach the common micro-batch count), then each rank's samples are packed
  first-fit-decreasing into micro-batches, then micro-batch counts are made
  equal across DP ranks by splitting the heaviest micro-batches of ranks that
  have fewer (pipeline schedules need every DP rank to run the same number).
* fixed (``--micro-batch-size M``): ``M`` samples per micro-batch, sharded
  across DP ranks the way megatron's pretraining sampler does it.

Invariants of a plan: every sample index appears in exactly one micro-batch;
every DP rank has exactly ``num_micro_batches`` micro-batches; in dynamic mode
each micro-batch's padded token count is <= ``token_budget``. A micro-batch is
empty only when the step has too few samples to give every rank that many
(fewer samples than ``dp_size * num_micro_batches``); ``pack_samples`` turns
an empty micro-batch into one all-pad sequence with no loss tokens, so the
schedule still runs it and it contributes zero loss and zero gradient.

Loss normalisation: the denominators (loss-masked response tokens, samples)
are counted for the whole step *before* micro-batching and all-reduced over
DP, so a token's loss weight does not depend on which micro-batch or rank it
landed in. See ``compute_loss_denominators``.
"""

from __future__ import annotations

import array
import operator
from dataclasses import dataclass, fields, replace
from typing import Any, Iterable, Mapping, Sequence

import torch

from megatron_rl.data.partition import first_fit_decreasing, karmarkar_karp, refine_by_swaps
from megatron_rl.data.types import AnySample
from megatron_rl.errors import ConfigError
from megatron_rl.models.mrope import check_image_tokens, mrope_position_ids

# --------------------------------------------------------------------------- planning


def padded_length(length: int, pad_to_multiple: int = 1) -> int:
    """Length of a sequence after padding it up to a multiple of ``pad_to_multiple``."""
    return -(-length // pad_to_multiple) * pad_to_multiple


def pad_multiple_for(tp_size: int = 1, cp_size: int = 1, sequence_parallel: bool = False) -> int:
    """Per-sequence padding multiple that THD needs under the given parallelism.

    Context parallelism splits each sequence into ``2 * cp_size`` chunks (load
    balancing for causal attention), so its length must divide by that;
    sequence parallelism splits the token dimension over TP ranks, so every
    CP rank's share must divide by ``tp_size``. Both at once need the product.
    """
    cp_multiple = 2 * cp_size if cp_size > 1 else 1
    tp_multiple = tp_size if sequence_parallel else 1
    return cp_multiple * tp_multiple


@dataclass(frozen=True)
class MicroBatchPlan:
    """Which samples each DP rank trains on in each micro-batch of one step.

    ``micro_batches[dp_rank][mb]`` is a tuple of indices into the rollout batch.
    ``token_budget`` is the padded-token cap of one micro-batch's global
    sequences (``max_tokens_per_gpu * cp_size``), or None in fixed mode.
    """

    micro_batches: tuple[tuple[tuple[int, ...], ...], ...]
    token_budget: int | None
    pad_to_multiple: int = 1

    @property
    def dp_size(self) -> int:
        return len(self.micro_batches)

    @property
    def num_micro_batches(self) -> int:
        return len(self.micro_batches[0]) if self.micro_batches else 0

    def rank(self, dp_rank: int) -> tuple[tuple[int, ...], ...]:
        """The micro-batches (sample index tuples) of one DP rank."""
        return self.micro_batches[dp_rank]

    def rank_samples(self, dp_rank: int) -> list[int]:
        """All sample indices one DP rank trains on this step, ascending."""
        return sorted(i for mb in self.micro_batches[dp_rank] for i in mb)


def _check_positive(name: str, value, flag: str) -> None:
    try:
        ok = not isinstance(value, bool) and operator.index(value) >= 1
    except TypeError:
        ok = False
    if not ok:
        raise ConfigError(f"{flag} must be a positive integer, got {name}={value!r}")


def plan_dynamic_micro_batches(
    seq_lengths: Sequence[int],
    *,
    dp_size: int,
    max_tokens_per_gpu: int,
    cp_size: int = 1,
    pad_to_multiple: int = 1,
    rank_parts: Sequence[Sequence[int]] | None = None,
) -> MicroBatchPlan:
    """Plan token-budgeted micro-batches balanced across DP ranks (``--use-dynamic-batch-size``).

    ``seq_lengths[i]`` is the full length (prompt + response) of rollout sample
    ``i``. Each sequence counts as ``padded_length(L, pad_to_multiple)`` tokens.
    The budget per micro-batch is ``max_tokens_per_gpu * cp_size`` because each
    CP rank holds ``1/cp_size`` of every sequence.

    ``rank_parts`` (one index list per DP rank) fixes which samples each DP rank
    gets when that was decided elsewhere (the forward pass of a rollout follows
    the training steps' split, ``plan_owner_aligned``); by default the ranks'
    token sums are balanced (Karmarkar-Karp, then swaps). Either way each rank's
    samples are cut into micro-batches under the budget, the same count on every rank.

    Raises ConfigError naming ``--max-tokens-per-gpu`` if one sequence alone is
    over budget (sequences are never split across micro-batches).
    """
    _check_positive("dp_size", dp_size, "data-parallel size")
    _check_positive("max_tokens_per_gpu", max_tokens_per_gpu, "--max-tokens-per-gpu")
    _check_positive("cp_size", cp_size, "--context-parallel-size")
    _check_positive("pad_to_multiple", pad_to_multiple, "pad_to_multiple")
    budget = max_tokens_per_gpu * cp_size
    padded = []
    for i, length in enumerate(seq_lengths):
        if length < 1:
            raise ConfigError(f"rollout sample {i} has length {length}; every sample needs at least one token")
        p = padded_length(int(length), pad_to_multiple)
        if p > budget:
            need = -(-p // cp_size)
            raise ConfigError(
                f"rollout sample {i} has {length} tokens ({p} after padding to a multiple of "
                f"{pad_to_multiple}), more than one micro-batch may hold: --max-tokens-per-gpu "
                f"{max_tokens_per_gpu} x --context-parallel-size {cp_size} = {budget}. Sequences are "
                f"never split across micro-batches; raise --max-tokens-per-gpu to at least {need}, "
                f"raise --context-parallel-size, or cap prompt/response lengths in rollout.")
        padded.append(p)

    if rank_parts is None:
        rank_parts = refine_by_swaps(karmarkar_karp(padded, dp_size, equal_size=True), padded)
    elif len(rank_parts) != dp_size or sorted(i for part in rank_parts for i in part) != list(range(len(padded))):
        raise ValueError(f"rank_parts must split samples 0..{len(padded) - 1} over {dp_size} DP ranks, each once")
    else:
        rank_parts = [sorted(part) for part in rank_parts]
    per_rank: list[list[list[int]]] = []
    for part in rank_parts:
        bins = first_fit_decreasing([padded[i] for i in part], budget)
        per_rank.append([[part[j] for j in b] for b in bins])

    target = max(len(mbs) for mbs in per_rank)
    for mbs in per_rank:
        _split_to_count(mbs, target, padded)

    def mb_key(mb):
        return (-sum(padded[i] for i in mb), mb[0] if mb else len(padded))

    ordered = tuple(tuple(tuple(sorted(mb)) for mb in sorted(mbs, key=mb_key)) for mbs in per_rank)
    return MicroBatchPlan(micro_batches=ordered, token_budget=budget, pad_to_multiple=pad_to_multiple)


def _split_to_count(mbs: list[list[int]], target: int, padded: Sequence[int]) -> None:
    """Split the heaviest multi-sample micro-batches in two until there are ``target``.

    Splitting only removes tokens from a micro-batch, so the budget still holds.
    When every micro-batch has one sample left, empty micro-batches make up the
    count (only possible when the rank has fewer samples than ``target``).
    """
    while len(mbs) < target:
        splittable = [j for j, mb in enumerate(mbs) if len(mb) >= 2]
        if not splittable:
            mbs.append([])
            continue
        j = max(splittable, key=lambda j: (sum(padded[i] for i in mbs[j]), -j))
        mb = mbs.pop(j)
        halves = karmarkar_karp([padded[i] for i in mb], 2)
        if not all(halves):  # cannot happen for >= 2 items, kept as a guard
            halves = [list(range(len(mb) // 2)), list(range(len(mb) // 2, len(mb)))]
        mbs.extend([mb[x] for x in h] for h in halves)


def plan_fixed_micro_batches(
    num_samples: int,
    *,
    dp_size: int,
    micro_batch_size: int,
    global_batch_size: int | None = None,
    ragged: bool = False,
) -> MicroBatchPlan:
    """Plan ``micro_batch_size`` samples per micro-batch (``--micro-batch-size``).

    Sharding follows megatron's pretraining sampler: the step is cut into
    chunks of ``micro_batch_size * dp_size`` consecutive samples and DP rank
    ``r`` takes the ``r``-th slice of each chunk. ``ragged``: a step whose
    count is no multiple of that (an agent session split into branches adds
    samples: rollout/endpoint/trajectory.py) puts its last, short chunk on the
    ranks in contiguous shares that differ by one at most; a rank whose share
    is empty gets an empty micro-batch (one all-pad sequence, no loss), so
    every rank runs the same number.
    """
    _check_positive("dp_size", dp_size, "data-parallel size")
    _check_positive("micro_batch_size", micro_batch_size, "--micro-batch-size")
    if global_batch_size is not None and global_batch_size != num_samples:
        raise ConfigError(
            f"the rollout batch has {num_samples} samples but --global-batch-size is "
            f"{global_batch_size}; set --global-batch-size to the number of samples per step "
            f"(rollout batch size x samples per prompt).")
    per_step = micro_batch_size * dp_size
    if ragged and num_samples >= 1 and num_samples % per_step:
        full, left = divmod(num_samples, per_step)
        base = full * per_step
        shares = [left // dp_size + (r < left % dp_size) for r in range(dp_size)]
        starts = [base + sum(shares[:r]) for r in range(dp_size)]
        return MicroBatchPlan(micro_batches=tuple(
            tuple(tuple(range(j * per_step + r * micro_batch_size, j * per_step + (r + 1) * micro_batch_size))
                  for j in range(full)) + (tuple(range(starts[r], starts[r] + shares[r])),)
            for r in range(dp_size)), token_budget=None, pad_to_multiple=1)
    if num_samples < 1 or num_samples % per_step:
        raise ConfigError(
            f"--global-batch-size {num_samples} is not a positive multiple of --micro-batch-size "
            f"{micro_batch_size} x data-parallel size {dp_size} = {per_step}; choose "
            f"--global-batch-size as a multiple of {per_step} (e.g. "
            f"{max(per_step, num_samples // per_step * per_step)}) or change --micro-batch-size.")
    num_mb = num_samples // per_step
    ranks = tuple(
        tuple(tuple(range(j * per_step + r * micro_batch_size, j * per_step + (r + 1) * micro_batch_size))
              for j in range(num_mb))
        for r in range(dp_size))
    return MicroBatchPlan(micro_batches=ranks, token_budget=None, pad_to_multiple=1)


def step_bounds(samples: Sequence[AnySample], global_batch_size: int) -> list[tuple[int, int]]:
    """``(start, end)`` of each training step of a rollout batch: ``global_batch_size`` samples each, or, when the
    batch holds trajectories split into branches (``Sample.branch`` > 0), ``global_batch_size`` trajectories
    each with all their branches (a trajectory is never cut between two optimizer steps, and a rollout takes as
    many optimizer steps as without the split). A pure function of the samples: the same on every rank."""
    n = len(samples)
    heads = [i for i, s in enumerate(samples) if not getattr(s, "branch", 0)]
    if len(heads) == n:
        return [(start, min(start + global_batch_size, n)) for start in range(0, n, global_batch_size)]
    starts = heads[::global_batch_size]
    return list(zip(starts, starts[1:] + [n]))


def plan_owner_aligned(step_plans: Sequence[tuple[int, MicroBatchPlan]], num_samples: int,
                       plan_rank_parts) -> MicroBatchPlan:
    """The forward plan of a rollout whose DP ranks keep the samples they will train on.

    ``step_plans``: ``(offset, plan)`` of every training step, the plan's indices
    relative to ``offset`` (the step's first sample in the rollout). DP rank ``d``
    trains on the union of its shares of every step, so the forward over the whole
    rollout gives rank ``d`` exactly those samples and its old/reference log-probs
    never have to travel to another data-parallel rank. ``plan_rank_parts(parts)``
    cuts fixed per-rank parts into micro-batches (dynamic or fixed mode, the caller's).
    With one DP rank this is the plan of the whole batch, as without alignment.
    """
    if not step_plans:
        raise ValueError("plan_owner_aligned needs at least one training step's plan")
    dp = step_plans[0][1].dp_size
    parts: list[list[int]] = [[] for _ in range(dp)]
    for offset, plan in step_plans:
        for d in range(dp):
            parts[d].extend(offset + i for i in plan.rank_samples(d))
    owned = sorted(i for part in parts for i in part)
    if owned != list(range(num_samples)):
        raise ValueError(f"the training steps' plans cover {len(set(owned))} of {num_samples} samples "
                         "(or some twice): every sample must be trained on by exactly one DP rank")
    return plan_rank_parts([sorted(part) for part in parts])


# --------------------------------------------------------------------------- packed layout

@dataclass
class PackedBatch:
    """One THD micro-batch: sequences back to back, no padding between them.

    Packed (position) tensors, length ``T = cu_seqlens[-1]``:
      ``tokens``, ``position_ids`` (restart at 0 per sequence and keep counting
      through the sequence's pad tail).
    Per sequence (``n = len(sample_indices)``):
      ``cu_seqlens`` int32 [n+1] boundaries of the *padded* sequences in ``tokens``;
      ``cu_seqlens_unpadded`` int32 [n+1] cumulative real lengths (what attention
      must see: TE's ``cu_seqlens_q`` vs ``cu_seqlens_q_padded``);
      ``prompt_lengths``, ``response_lengths``, ``sample_indices`` (into the rollout batch).
    Response-aligned flat tensors, length ``R = response_lengths.sum()``
    (see ``data.types``: entry ``i`` of a sample belongs to ``response_ids[i]``):
      ``loss_mask`` float32, optional ``advantages``, ``old_logprobs``,
      ``ref_logprobs``, ``rollout_logprobs``, ``teacher_logprobs``, ``old_values``, ``returns`` float32;
      ``response_positions`` int64: packed position whose output predicts that
      token; ``response_target_ids``: the token it predicts.
    Pad tokens never appear in the response-aligned tensors, so they carry no
    loss. An empty micro-batch (``is_empty``) is one all-pad sequence with
    ``n = 0`` samples: ``cu_seqlens`` then has two entries.

    Packed for a vision-language model (``pack_samples(image_tokens=...)``): ``position_ids`` is ``[3, T]``,
    each sequence's own M-RoPE rows (``models.mrope.mrope_position_ids``; a pad tail keeps counting on from the
    sequence's largest position), and ``pixel_values`` ``[patches, width]`` / ``image_grid_thw`` ``[images, 3]``
    are the images of its samples concatenated in sample order, so the k-th run of image-pad tokens in
    ``tokens`` is the k-th grid's features (what the model scatters, before any context-parallel split).
    """

    tokens: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_unpadded: torch.Tensor
    max_seqlen: int
    sample_indices: torch.Tensor
    prompt_lengths: torch.Tensor
    response_lengths: torch.Tensor
    response_positions: torch.Tensor
    response_target_ids: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    rollout_logprobs: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None
    old_values: torch.Tensor | None = None  # the critic's values before the step (ppo)
    returns: torch.Tensor | None = None  # the critic's regression targets (ppo's GAE returns)
    pixel_values: torch.Tensor | None = None  # the samples' image patches, in sample order (vision-language)
    image_grid_thw: torch.Tensor | None = None  # their grids, one row per image

    @property
    def has_mrope(self) -> bool:
        """Packed for a vision-language model: three position rows (M-RoPE) per token."""
        return self.position_ids.dim() == 2

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    @property
    def is_empty(self) -> bool:
        return self.sample_indices.numel() == 0

    def gather_response(self, per_position: torch.Tensor) -> torch.Tensor:
        """Pick, from per-position model outputs over the packed tokens, the response-aligned rows.

        ``per_position`` has ``T`` in dim 0 (or shape ``[1, T, ...]``, megatron's
        batch-of-one THD layout); output at position ``t`` is the model's
        prediction for token ``t + 1`` of the same sequence. Returns ``[R, ...]``
        in the order of the flat response-aligned tensors. Needs the full
        packed sequence: gather CP shards first.
        """
        if per_position.dim() >= 2 and per_position.shape[0] == 1 and per_position.shape[1] == self.num_tokens:
            per_position = per_position[0]
        if per_position.shape[0] != self.num_tokens:
            raise ValueError(f"gather_response expects {self.num_tokens} positions in dim 0, "
                             f"got shape {tuple(per_position.shape)}")
        return per_position.index_select(0, self.response_positions.to(per_position.device))

    def split_response(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Split a flat response-aligned tensor back into one piece per sample."""
        return list(torch.split(flat, self.response_lengths.tolist()))

    def to(self, device: torch.device | str) -> "PackedBatch":
        moved: dict[str, Any] = {
            f.name: (v.to(device) if isinstance(v := getattr(self, f.name), torch.Tensor) else v)
            for f in fields(self)}
        return replace(self, **moved)

    def packed_seq_params(self):
        """megatron-core ``PackedSeqParams`` for this layout (THD, padded boundaries kept apart)."""
        from megatron.core.packed_seq_params import PackedSeqParams

        return PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=self.cu_seqlens_unpadded, cu_seqlens_kv=self.cu_seqlens_unpadded,
            cu_seqlens_q_padded=self.cu_seqlens, cu_seqlens_kv_padded=self.cu_seqlens,
            max_seqlen_q=self.max_seqlen, max_seqlen_kv=self.max_seqlen)


def _response_values(name: str, values, idx: int, expected: int):
    """Entry ``idx`` of a per-sample field (list or tensor), checked to be response-aligned."""
    v = values[idx]
    n = v.numel() if isinstance(v, torch.Tensor) else len(v)
    if n != expected:
        raise ValueError(f"{name} of rollout sample {idx} has {n} entries but its response has "
                         f"{expected} tokens; per-token fields are response-aligned (one entry per "
                         f"response token, see megatron_rl.data.types)")
    return v


def _long_tensor(values: list) -> torch.Tensor:
    """int64 tensor of a list of ints through an ``array`` buffer: 3x faster than ``torch.tensor(list)``
    for the ~thousands of token ids of a micro-batch, same values."""
    if not values:
        return torch.zeros(0, dtype=torch.long)
    return torch.frombuffer(array.array("q", values), dtype=torch.long)


def _flat_float32(parts: list) -> torch.Tensor:
    """One float32 tensor of response-aligned pieces (tensors are concatenated, not round-tripped
    through Python floats: the same values, a hundred times faster for a rollout batch)."""
    if parts and all(isinstance(v, torch.Tensor) and v.dim() == 1 for v in parts):
        return torch.cat(parts).to(torch.float32)  # mixed dtypes promote first: each value still rounds once
    flat: list[float] = []
    for v in parts:
        flat.extend(v.tolist() if isinstance(v, torch.Tensor) else v)
    return torch.tensor(flat, dtype=torch.float32)


@dataclass(frozen=True)
class ImageTokens:
    """What packing needs of a vision-language model: the image-pad token id its processor writes per merged
    patch and the merger's patch side (``spatial_merge_size``); from the bridge (``Qwen2_5_VLBridge``)."""

    image_token_id: int
    spatial_merge_size: int


def _vision_rows(samples: Sequence[AnySample], sample_indices: Sequence[int], padded: Sequence[int],
                 image_tokens: ImageTokens) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(position_ids [3, T], pixel_values, image_grid_thw)`` of a micro-batch packed for a vision-language
    model. Each sample is checked first (``check_image_tokens``): a sample whose image-pad tokens and images
    disagree is refused naming the rollout sample, before any model runs."""
    positions, pixels, grids = [], [], []
    token, merge = image_tokens.image_token_id, image_tokens.spatial_merge_size
    for idx, plen in zip(sample_indices, padded):
        s = samples[idx]
        ids = torch.tensor(list(s.prompt_ids) + list(s.response_ids), dtype=torch.long)
        vision = s.multimodal_inputs
        grid = torch.from_numpy(vision.image_grid_thw).long() if vision is not None else None
        what = f"rollout sample {idx}"
        check_image_tokens(ids, grid, token, merge, what,
                           pixel_rows=int(vision.pixel_values.shape[0]) if vision is not None else None)
        rows = mrope_position_ids(ids, grid, token, merge, what)
        start = int(rows.max()) + 1 if rows.numel() else 0
        positions.append(torch.cat([rows, (start + torch.arange(plen - len(ids))).expand(3, -1)], dim=1))
        if vision is not None and grid is not None:
            pixels.append(torch.from_numpy(vision.pixel_values).float())
            grids.append(grid)
    if not positions:  # an empty micro-batch: one all-pad sequence
        positions.append(torch.arange(sum(padded)).expand(3, -1))
    return (torch.cat(positions, dim=1), torch.cat(pixels) if pixels else None,
            torch.cat(grids) if grids else None)


def pack_samples(
    samples: Sequence[AnySample],
    sample_indices: Sequence[int],
    *,
    pad_to_multiple: int = 1,
    pad_token_id: int = 0,
    advantages: Sequence | None = None,
    old_logprobs: Sequence | None = None,
    ref_logprobs: Sequence | None = None,
    teacher_logprobs: Sequence | None = None,
    old_values: Sequence | None = None,
    returns: Sequence | None = None,
    image_tokens: ImageTokens | None = None,
) -> PackedBatch:
    """Lay out ``samples[i] for i in sample_indices`` as one THD ``PackedBatch``.

    ``advantages`` / ``*_logprobs`` are indexed like ``samples`` (the whole
    rollout batch); entry ``i`` is a list or tensor of ``samples[i].response_length``
    response-aligned values. ``rollout_logprobs`` and ``loss_mask`` come from the
    samples themselves (``rollout_logprobs`` is kept only if every sample has it).
    Each sequence is padded with ``pad_token_id`` up to a multiple of
    ``pad_to_multiple`` (see ``pad_multiple_for``).

    ``image_tokens`` (a vision-language model's): the batch carries its samples' images
    (``Sample.multimodal_inputs``) and M-RoPE positions (``PackedBatch``); without it a sample with
    images is refused (a text-only model cannot take them).

    Runs once per micro-batch of every forward and training step, so the per-sample
    work is list extends; positions and index tensors are built with tensor ops.
    """
    _check_positive("pad_to_multiple", pad_to_multiple, "pad_to_multiple")
    extra: dict[str, Sequence | Mapping[int, Sequence] | None] = {
        "advantages": advantages, "old_logprobs": old_logprobs,
        "ref_logprobs": ref_logprobs, "teacher_logprobs": teacher_logprobs, "old_values": old_values,
        "returns": returns}
    sample_indices = list(sample_indices)
    chosen = [samples[i] for i in sample_indices]
    # Samples with an empty response need no rollout log-probs and decide nothing either way.
    with_tokens = [(i, s) for i, s in zip(sample_indices, chosen) if s.response_ids]
    have_rollout = [len(s.rollout_logprobs) == len(s.response_ids) for _, s in with_tokens]
    if any(have_rollout) and not all(have_rollout):
        missing = [i for (i, _), h in zip(with_tokens, have_rollout) if not h]
        raise ValueError(f"rollout samples {missing[:8]} have no rollout_logprobs while others in the "
                         f"micro-batch do; the engine must return token log-probs for every sample")
    if have_rollout and all(have_rollout):
        extra["rollout_logprobs"] = {i: samples[i].rollout_logprobs for i in sample_indices}

    tokens: list[int] = []
    targets: list[int] = []
    loss_mask: list[int] | None = None  # None while every mask so far is the default (all ones)
    flat: dict[str, list] = {k: [] for k, v in extra.items() if v is not None}
    prompt_lengths: list[int] = []
    response_lengths: list[int] = []
    padded: list[int] = []
    real: list[int] = []
    for idx, s in zip(sample_indices, chosen):
        p, r = len(s.prompt_ids), len(s.response_ids)
        if image_tokens is None and getattr(s, "multimodal_inputs", None) is not None:
            raise ConfigError(f"rollout sample {idx} carries images (--multimodal-keys) but the model is text-only "
                              "(its --hf-checkpoint has no vision tower); train a vision-language checkpoint or "
                              "drop the images")
        if p < 1:
            raise ConfigError(f"rollout sample {idx} has an empty prompt; the first response token then has no "
                              f"position that predicts it. Give every prompt at least one token (e.g. a BOS "
                              f"token / the chat template).")
        length = p + r
        plen = padded_length(length, pad_to_multiple)
        tokens.extend(s.prompt_ids)
        tokens.extend(s.response_ids)
        if plen > length:
            tokens.extend([pad_token_id] * (plen - length))
        targets.extend(s.response_ids)
        if s.loss_mask:
            if len(s.loss_mask) != r:
                raise ValueError(f"loss_mask of rollout sample {idx} has {len(s.loss_mask)} entries but its "
                                 f"response has {r} tokens; loss_mask is response-aligned")
            if loss_mask is None:
                loss_mask = [1] * sum(response_lengths)
            loss_mask.extend(s.loss_mask)
        elif loss_mask is not None:
            loss_mask.extend([1] * r)
        for name in flat:
            flat[name].append(_response_values(name, extra[name], idx, r))
        prompt_lengths.append(p)
        response_lengths.append(r)
        padded.append(plen)
        real.append(length)

    if not chosen:  # empty micro-batch: one all-pad sequence, no loss tokens
        tokens = [pad_token_id] * pad_to_multiple
        padded, real = [pad_to_multiple], [pad_to_multiple]
    long, f32 = torch.long, torch.float32
    seq_lens = torch.tensor(padded, dtype=long)
    cu = torch.zeros(len(padded) + 1, dtype=long)
    torch.cumsum(seq_lens, 0, out=cu[1:])
    cu_real = torch.zeros(len(real) + 1, dtype=long)
    torch.cumsum(torch.tensor(real, dtype=long), 0, out=cu_real[1:])
    total = int(cu[-1])
    # position of each token within its (padded) sequence (a vision-language model's: its M-RoPE rows)
    positions = torch.arange(total, dtype=long) - torch.repeat_interleave(cu[:-1], seq_lens, output_size=total)
    pixel_values = image_grid_thw = None
    if image_tokens is not None:
        positions, pixel_values, image_grid_thw = _vision_rows(samples, sample_indices, padded, image_tokens)
    p_len, r_len = torch.tensor(prompt_lengths, dtype=long), torch.tensor(response_lengths, dtype=long)
    n_resp = int(r_len.sum())
    # response-aligned rows: the position predicting response token j of a sample is start + p - 1 + j
    r_start = torch.cumsum(r_len, 0) - r_len  # first response-aligned row of each sample
    resp_pos = (torch.arange(n_resp, dtype=long)
                + torch.repeat_interleave(cu[:-1][:len(r_len)] + p_len - 1 - r_start, r_len, output_size=n_resp))
    return PackedBatch(
        tokens=_long_tensor(tokens),
        position_ids=positions,
        cu_seqlens=cu.to(torch.int32),
        cu_seqlens_unpadded=cu_real.to(torch.int32),
        max_seqlen=max(padded),
        sample_indices=torch.tensor(sample_indices, dtype=long),
        prompt_lengths=p_len,
        response_lengths=r_len,
        response_positions=resp_pos,
        response_target_ids=_long_tensor(targets),
        loss_mask=(torch.ones(n_resp, dtype=f32) if loss_mask is None else torch.tensor(loss_mask, dtype=f32)),
        pixel_values=pixel_values,
        image_grid_thw=image_grid_thw,
        **{name: _flat_float32(vals) for name, vals in flat.items()},
    )


def pack_plan_rank(samples: Sequence[AnySample], plan: MicroBatchPlan, dp_rank: int, **kwargs) -> list[PackedBatch]:
    """Pack every micro-batch of one DP rank (kwargs as for ``pack_samples``; padding from the plan)."""
    kwargs.setdefault("pad_to_multiple", plan.pad_to_multiple)
    return [pack_samples(samples, mb, **kwargs) for mb in plan.rank(dp_rank)]


# --------------------------------------------------------------------------- loss denominators


@dataclass(frozen=True)
class LossDenominators:
    """Token and sample counts that normalise the loss of one whole training step.

    ``local_*`` count this DP rank's samples, ``global_*`` all DP ranks'.
    ``*_tokens`` counts loss-masked response tokens (mask != 0); ``*_samples``
    counts every sample, including ones whose mask is all zero. Dividing a
    micro-batch's summed token loss by ``global_tokens`` makes the step loss a
    token mean over the whole step whatever the packing; with megatron's DP
    gradient *averaging* (divide by ``dp_size``) multiply by ``dp_size`` as well.
    """

    local_tokens: int
    local_samples: int
    global_tokens: int
    global_samples: int


def _count_loss_tokens(mask) -> int:
    """Entries of one response-aligned loss mask that are not 0 (a list is counted in Python:
    building a tensor per sample cost more than the rest of a training step's bookkeeping)."""
    if isinstance(mask, torch.Tensor):
        return int((mask != 0).sum())
    mask = mask if isinstance(mask, (list, tuple)) else list(mask)
    return len(mask) - mask.count(0)


def compute_loss_denominators(loss_masks: Iterable, group=None) -> LossDenominators:
    """Count this rank's loss tokens and samples for the step; all-reduce over ``group``.

    ``loss_masks`` holds one response-aligned mask (list or tensor) per sample
    this DP rank owns this step. Call it once per step, before micro-batching.
    With ``group`` (the DP process group) the counts are summed over its ranks
    (a collective: every rank of the group must call it); without, global = local.
    """
    tokens = samples = 0
    for mask in loss_masks:
        tokens += _count_loss_tokens(mask)
        samples += 1
    if group is None:
        return LossDenominators(tokens, samples, tokens, samples)
    import torch.distributed as dist

    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    counts = torch.tensor([tokens, samples], dtype=torch.int64, device=device)
    dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
    return LossDenominators(tokens, samples, int(counts[0]), int(counts[1]))


def plan_loss_denominators(samples: Sequence[AnySample], plan: MicroBatchPlan) -> list[LossDenominators]:
    """Denominators of every DP rank from the plan alone (no communication; same result
    as ``compute_loss_denominators`` with the DP group, since every rank sees the plan)."""
    local = [compute_loss_denominators(samples[i].effective_loss_mask() for i in plan.rank_samples(r))
             for r in range(plan.dp_size)]
    g_tok = sum(d.local_tokens for d in local)
    g_smp = sum(d.local_samples for d in local)
    return [LossDenominators(d.local_tokens, d.local_samples, g_tok, g_smp) for d in local]


def micro_batch_tokens(plan: MicroBatchPlan, seq_lengths: Sequence[int]) -> list[list[int]]:
    """Padded token count of every micro-batch, ``[dp_rank][mb]`` (for metrics and benchmarks)."""
    m = plan.pad_to_multiple
    return [[sum(padded_length(seq_lengths[i], m) for i in mb) for mb in mbs] for mbs in plan.micro_batches]


__all__ = [
    "MicroBatchPlan", "PackedBatch", "ImageTokens", "LossDenominators", "padded_length", "pad_multiple_for",
    "plan_dynamic_micro_batches", "plan_fixed_micro_batches", "plan_owner_aligned", "step_bounds", "pack_samples", "pack_plan_rank",
    "compute_loss_denominators", "plan_loss_denominators", "micro_batch_tokens",
]
