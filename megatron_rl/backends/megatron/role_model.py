"""One role's megatron-core model on this process's ranks, built one way for every role (``backends/roles.py``).

The actor, ppo's critic and a frozen teacher of other shapes are each a :class:`RoleModel`: model chunks built
by a bridge (the role's own: a critic or teacher may be of another size or family) at a layout, its weights
loaded, its head (the policy's output layer for log-probs, or a ``[hidden -> 1]`` :class:`ValueHead`), LoRA
adapters when asked, and, when the role trains, megatron-core's DDP, optimizer and LR schedule.

Process groups: each role's layout is a :class:`~megatron_rl.models.parallel.LayoutScope` (the actor's too) whose
``ProcessGroupCollection`` goes to every megatron-core call that takes one: ``GPTModel`` (so the modules hold the
role's groups), ``DistributedDataParallel``, ``get_megatron_optimizer``, the forward-backward schedule and its
``P2PCommunicator`` (and through the schedule ``finalize_model_grads``); our own collectives (the log-prob op's TP
reduction, the CP gather, the metrics' DP reduction) take the collection's groups too. megatron's
``parallel_state`` of the role's layout is swapped in (``with self.scope``) only around the calls that still
read its globals, each named where it is: the model's build and weight load, the schedule's passes, the
checkpoint's sharded state dict (``checkpoint.py``). Nothing else a role does reads them: DDP and the optimizer
are built, stepped, offloaded and restored outside the swap.

The passes are the role's too: :meth:`RoleModel.run_schedule` (megatron's forward-backward schedule over the
role's chunks), :meth:`forward_step` (the head's alignment of outputs to response tokens), :meth:`train_pass`
(one optimizer step and the last pipeline stage's metrics on every rank). The actor adds routing replay and
MTP through :class:`PassHooks`; the algorithm's losses come from the caller's ``loss_fn``.

Loss normalisation (``calculate_per_token_loss`` and ``num_tokens = 0``), the vocab padding and the value
head's gradient algebra are explained in ``backend.py`` and ``critic.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, NamedTuple, Optional, Protocol, Sequence

import torch
import torch.distributed as dist

from megatron_rl.algorithms.losses import reduce_metrics
from megatron_rl.algorithms.spec import ModelOutput
from megatron_rl.backends.loss_rows import (LossRows, keep_rows, pack_output, packed_loss_rows, project_rows,
                                            projects_plainly, unpack_output)
from megatron_rl.backends.megatron.settings import (ddp_config_kwargs, optimizer_config_kwargs,
                                                   transformer_config_overrides)
from megatron_rl.backends.base import DataParallelShare
from megatron_rl.data.packing import PackedBatch, pad_multiple_for
from megatron_rl.models import cp_utils
from megatron_rl.models.parallel import LayoutScope, ParallelLayout

log = logging.getLogger(__name__)

HEADS = ("logprob", "value")


class PassHooks(Protocol):
    """What the actor adds to a pass (routing replay, MTP targets); a role without any passes None."""

    def start_pass(self, samples: Sequence, micro_batches: list[PackedBatch], training: bool) -> None: ...

    def end_pass(self, collect: bool) -> dict[str, float]: ...

    def before_forward(self, model, mb: PackedBatch) -> None: ...

    def after_forward(self, model, mb: PackedBatch) -> None: ...


@dataclass(frozen=True)
class Optimization:
    """A trainable role's optimizer: its peak learning rate and warm-up (the rest are the run's flags)."""

    lr: float
    warmup_iters: int


class StepResult(NamedTuple):
    """One optimizer step of a role (``RoleModel.train_pass``)."""

    metrics: dict  # the loss metrics, reduced over DP, the last stage's view on every rank
    grad_norm: Any
    update_ok: bool
    loss_scale: Optional[float]  # --fp16: the step's loss scale
    extra: dict  # what the pass hooks reported (routing replay's agreement)


class ValueHead(torch.nn.Module):
    """``[s, 1, h] -> [s, 1, 1]`` float32 values; takes the place of ``GPTModel.output_layer`` (whose call
    passes ``weight=`` for tied embeddings and ``runtime_gather_output``: both ignored)."""

    def __init__(self, hidden_size: int, *, std: float, seed: int, dtype: torch.dtype, device,
                 sequence_parallel: bool, tp_group):
        super().__init__()
        from megatron.core.tensor_parallel.layers import (  # lazy: megatron-core
            set_defaults_if_not_set_tensor_model_parallel_attributes)

        gen = torch.Generator().manual_seed(seed)  # the same head on every rank, whatever the device
        self.weight = torch.nn.Parameter(torch.empty(1, hidden_size).normal_(0.0, std, generator=gen)
                                         .to(device=device, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, device=device, dtype=dtype))
        self.sequence_parallel = sequence_parallel
        self.tp_group = tp_group
        for p in (self.weight, self.bias):
            set_defaults_if_not_set_tensor_model_parallel_attributes(p)  # replicated over TP, not split
            if sequence_parallel:
                setattr(p, "sequence_parallel", True)  # finalize_model_grads all-reduces it over TP

    def forward(self, hidden: torch.Tensor, weight: Optional[torch.Tensor] = None,
                runtime_gather_output: Optional[bool] = None):
        values = torch.nn.functional.linear(hidden, self.weight, self.bias).float()
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region  # lazy: megatron-core

            values = gather_from_sequence_parallel_region(values, tensor_parallel_output_grad=False,
                                                          group=self.tp_group)
        return values, None


def load_model_dir(chunks: list, path: str, bridge, config_dir: str) -> None:
    """A model-only torch_dist dir (or a training checkpoint's iter dir) into ``chunks``, checked as ``--load``'s:
    its marker and checksums, the model's fingerprint against ``config_dir/config.json`` and every tensor's shape
    against the chunks (a mismatch names the tensor, never a silent partial load)."""
    from megatron_rl.models import dist_io, model_dir  # lazy: dist_checkpointing

    meta = model_dir.read_marker(path)
    model_dir.check_fingerprint(path, meta, bridge, config_dir)
    dist_io.check_checkpoint_matches_model(path, dist_io.checkpoint_model_tensors(path),
                                           dist_io.model_tensor_shapes(chunks), config_dir)
    dist_io.load_dist_into(chunks, path)


def lora_spec(cfg):
    """``models.lora.LoraSpec`` of ``--lora-rank`` (every trainable role gets adapters of its own), or None."""
    lo = cfg.lora
    if not lo.lora_rank:
        return None
    from megatron_rl.models import lora  # lazy: imports megatron-core's parallel layers

    return lora.LoraSpec(lo.lora_rank, lo.lora_alpha, lo.lora_dropout, tuple(lo.lora_target_modules),
                         init_seed=cfg.runtime.seed, modules_to_save=tuple(lo.lora_modules_to_save))


def role_layout(cfg, actor: ParallelLayout, tp: Optional[int] = None, pp: Optional[int] = None) -> ParallelLayout:
    """A second role's layout on the actor's ranks: its own TP/PP where given, else the actor's; no virtual
    pipeline stages and no context parallelism (a second role's passes are built without them); the actor's
    expert layout."""
    tp = tp or actor.tp
    return ParallelLayout(tp=tp, pp=pp or actor.pp, vpp=None, cp=1, ep=actor.ep, etp=actor.etp,
                          sequence_parallel=bool(cfg.parallel.sequence_parallel) and tp > 1)


class RoleShare(DataParallelShare):
    """A second role's own share of the batch when its layout is not the actor's: its DP size and rank, its
    padding, which of its ranks hold results (from its process groups)."""

    def __init__(self, cfg, scope: LayoutScope, pad_token_id: int) -> None:
        layout, pg = scope.layout, scope.pg_collection
        self.cfg = cfg
        self.pad_token_id = pad_token_id
        self.dp_size, self.dp_rank = pg.dp.size(), pg.dp.rank()
        self.holds_results = pg.pp.rank() == pg.pp.size() - 1 and pg.tp.rank() == 0
        self.pad_to_multiple = pad_multiple_for(layout.tp, layout.cp, layout.sequence_parallel)

    @property
    def context_parallel_size(self) -> int:
        return 1


class RoleModel:
    """One role's model chunks (and, when it trains, DDP, optimizer, schedule) at one layout (module docstring);
    ``pg``: the layout's ``ProcessGroupCollection``.

    ``load(chunks)`` writes the role's initial weights (before the head is put on and the adapters attached, so a
    value role loads a policy checkpoint's trunk). ``lora``: a ``models.lora.LoraSpec`` (adapters on a frozen
    base; a value head trains in full). ``optimization`` None: a frozen role (no gradients, no DDP, eval mode)."""

    def __init__(self, name: str, cfg, bridge, scope: LayoutScope, *, params_dtype: torch.dtype, head: str,
                 load: Callable[[list], None], optimization: Optional[Optimization],
                 lora=None, lora_load: Optional[Callable[[list], None]] = None,
                 prepare: Optional[Callable[[list], None]] = None, hooks: Optional[PassHooks] = None) -> None:
        if head not in HEADS:
            raise ValueError(f"a role's head is one of {HEADS}, not {head!r}")
        self.name, self.cfg, self.bridge, self.scope, self.head = name, cfg, bridge, scope, head
        self.layout, self.pg = scope.layout, scope.pg_collection
        self.params_dtype = params_dtype
        self.hooks = hooks
        self.optimizer: Any = None  # megatron's MegatronOptimizer of a trainable role
        self.scheduler: Any = None
        self.optimizer_steps = 0
        self._build(load, optimization, lora, lora_load, prepare)

    def _build(self, load, optimization: Optional[Optimization], lora_spec, lora_load, prepare) -> None:
        # parallel_state of the role's layout while the chunks are built and loaded: megatron-core 0.16.1's
        # get_num_layers_to_build / get_transformer_layer_offset (the bridge's block_spec) read its pipeline rank,
        # GPTModel builds its MultiTokenPredictionBlock without the collection (the MTP layers take its groups),
        # and our weight loaders (models/weights.py, models/dist_io.py) read its TP/EP/PP groups and VPP rank and
        # build the sharded state dict without a DP-CP group (ensure_metadata_has_dp_cp_group reads its own)
        with self.scope:
            self.chunks = self.bridge.build_model(self.layout, params_dtype=self.params_dtype,
                                                  pg_collection=self.pg, **transformer_config_overrides(self.cfg))
            if prepare is not None:
                prepare(self.chunks)
            load(self.chunks)
        self.config = self.chunks[0].config
        if self.head == "value":
            self._put_value_heads()
        self.lora: list = []
        if lora_spec is not None:
            from megatron_rl.models import lora  # lazy: imports megatron-core's parallel layers

            self.lora = lora.attach_lora(self.bridge, self.chunks, lora_spec)
            if lora_load is not None:
                lora_load(self.lora)
            for chunk in self.chunks:
                if self.head == "value" and chunk.post_process:
                    chunk.output_layer.requires_grad_(True)  # the value head trains in full (verl's critic)
        self.vocab_size = self.bridge.vocab_size
        if optimization is None:
            for chunk in self.chunks:
                chunk.requires_grad_(False)
                chunk.eval()
            self.model = list(self.chunks)
        else:
            self._build_optimizer(optimization)
        self._output_layers = {id(m): c.output_layer for m, c in zip(self.model, self.chunks) if c.post_process}
        self._chunk_index = {id(m): i for i, m in enumerate(self.model)}
        self._post_process = {id(m): bool(c.post_process) for m, c in zip(self.model, self.chunks)}
        self._pass_head: Optional[tuple] = None  # (spec, with_entropy) of the pass running: see _output_rows

    def _put_value_heads(self) -> None:
        for chunk in self.chunks:
            # the head is no tied output layer: with pipeline stages megatron would otherwise all-reduce the first
            # stage's embedding gradient with the last stage's "output weight" (the [1, h] head)
            chunk.share_embeddings_and_output_weights = False
            if chunk.post_process:
                old = chunk.output_layer
                chunk.output_layer = ValueHead(
                    self.config.hidden_size, std=float(self.config.init_method_std), seed=self.cfg.runtime.seed,
                    dtype=self.params_dtype, device=next(chunk.parameters()).device,
                    sequence_parallel=bool(self.config.sequence_parallel),
                    tp_group=self.pg.tp)
                del old

    def _build_optimizer(self, optimization: Optimization) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        cfg, lr, warmup = self.cfg, optimization.lr, optimization.warmup_iters
        ddp_config = DistributedDataParallelConfig(**ddp_config_kwargs(cfg))
        self.model = [DistributedDataParallel(config=self.config, ddp_config=ddp_config, module=chunk,
                                              disable_bucketing=i > 0, pg_collection=self.pg)
                      for i, chunk in enumerate(self.chunks)]
        kwargs = optimizer_config_kwargs(cfg, self.params_dtype)
        kwargs.update(lr=lr)
        # no gloo groups with a collection (megatron-core refuses them): the distributed optimizer uses its gloo DP
        # group only for the legacy dp_zero formats and the memory-efficient reshardable one, which we never write
        # (checkpoint.py: fully_reshardable, gathered over its own DP group)
        self.optimizer = get_megatron_optimizer(OptimizerConfig(**kwargs), self.model, use_gloo_process_groups=False,
                                                pg_collection=self.pg)
        opt = cfg.optimizer
        total_steps = max(1, cfg.rollout.num_rollout * cfg.batching.optimizer_steps_per_rollout
                          * cfg.algorithm.num_steps_per_rollout_updates)
        decay = opt.lr_decay_iters or total_steps
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if warmup else lr, max_lr=lr, min_lr=min(opt.min_lr, lr),
            lr_warmup_steps=warmup, lr_decay_steps=max(decay, warmup + 1), lr_decay_style=opt.lr_decay_style,
            start_wd=opt.weight_decay, end_wd=opt.weight_decay, wd_incr_steps=1, wd_incr_style="constant")
        self.config.finalize_model_grads_func = finalize_model_grads  # the schedule passes it the role's collection
        self.config.grad_scale_func = self.optimizer.scale_loss

    def chunk_index(self, model) -> int:
        """Which virtual stage ``model`` (what the schedule hands a forward step) is."""
        return self._chunk_index[id(model)]

    @property
    def trainable(self) -> bool:
        return self.optimizer is not None

    def describe(self, source: str, dp: Optional[int] = None) -> str:
        """One log line: size on this rank, learning rate (or frozen), source, layout (``dp``: a second layout's
        data-parallel size)."""
        n = sum(p.numel() for c in self.chunks for p in c.parameters())
        lr = f", lr {self.scheduler.max_lr:g}" if self.scheduler is not None else ", frozen"
        lay = self.layout
        layout = "the actor's" if self.scope.same else f"its own (TP {lay.tp}, PP {lay.pp}, DP {dp})"
        return f"{self.name}: {n} parameters on this rank{lr}, from {source}, layout {layout}"

    # ---- passes ---------------------------------------------------------------

    def set_mode(self, training: bool) -> None:
        """``train()`` / ``eval()`` on each model chunk, skipped when it is in that mode already: the walk over
        every submodule costs ~0.8 ms on the demo's model and passes of one mode follow each other. Only the role
        switches its modes, always a whole chunk at once, so the chunk's own flag stands for its submodules'."""
        for m in self.model:
            if m.training != training:
                m.train(training)

    def run_schedule(self, micro_batches: list[PackedBatch], loss_fn, forward_only: bool) -> list:
        """megatron's forward(-backward) schedule over this rank's micro-batches (one iterator per virtual stage), on
        the role's groups: the schedule, its ``P2PCommunicator`` and ``finalize_model_grads`` take its collection."""
        from megatron.core.pipeline_parallel import get_forward_backward_func  # lazy: megatron-core
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator  # lazy: megatron-core

        layout, pg = self.layout, self.pg
        vpp = layout.num_model_chunks
        iterators = [iter(micro_batches) for _ in range(vpp)] if vpp > 1 else iter(micro_batches)
        schedule = get_forward_backward_func(pp_size=layout.pp, vp_size=vpp if vpp > 1 else None)
        p2p = P2PCommunicator(pp_group=pg.pp, config=self.config) if layout.pp > 1 else None
        # parallel_state of the role's layout around the passes: megatron-core 0.16.1's modules still read globals in
        # some forwards, which a recomputed layer (--recompute-granularity) runs again in the backward:
        # Attention.get_query_key_value_tensors the TP rank (fewer query groups than TP ranks), GPTModel's MTP loss
        # logging the DP-CP group and the MTP block's layers (built without the collection) their groups,
        # TransformerLayer / MoELayer's te_checkpoint the TP group (FP8 with recompute)
        with self.scope:
            return schedule(
                forward_step_func=partial(self.forward_step, loss_fn), data_iterator=iterators, model=self.model,
                num_microbatches=len(micro_batches), seq_length=max(mb.num_tokens for mb in micro_batches),
                micro_batch_size=1, forward_only=forward_only, p2p_communicator=p2p, pg_collection=pg)

    def forward_step(self, loss_fn, data_iterator, model):
        """One micro-batch through one chunk: ``loss_fn(mb, rows_or_values, output)`` gets the log-prob head's loss
        rows (``LossRows``) or the value head's response-aligned values (None on a stage before the last)."""
        mb: PackedBatch = next(data_iterator)
        cp = self.layout.cp
        if self.head == "value":
            return self._value_step(loss_fn, mb, model)
        cp_rank = self.pg.cp.rank()
        local_index = cp_utils.cp_local_index(mb.cu_seqlens, cp_rank, cp) if cp > 1 else None
        rows = packed_loss_rows(mb, local_index)  # on the host copy: no device sync
        mb = mb.to(next(model.parameters()).device)
        layer = self._output_layers.get(id(model))
        if self.hooks is not None:
            self.hooks.before_forward(model, mb)
        head = None
        if layer is not None and self._pass_head is not None and _fusable(layer):
            rows = dataclasses.replace(rows, projected=True)
            head = partial(self._project, *self._pass_head, rows)
        with _output_rows(layer, rows, head) if layer is not None else contextlib.nullcontext():
            output = model(*self._model_inputs(mb), None, packed_seq_params=mb.packed_seq_params(),
                           **_image_inputs(mb))
        if self.hooks is not None:
            self.hooks.after_forward(model, mb)
        return output, partial(loss_fn, mb, rows)

    def _model_inputs(self, mb: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids [1, t], position_ids)`` of a micro-batch as the model takes them: this context-parallel
        rank's chunks of a text batch (``[1, t]`` positions); a vision-language batch whole on every CP rank, with
        its ``[3, 1, T]`` M-RoPE rows (the model writes the image features in, then keeps its own chunks:
        ``models/vision_language.py``)."""
        if mb.has_mrope:
            return mb.tokens[None], mb.position_ids[:, None]
        if self.layout.cp > 1:
            shard = cp_utils.shard_packed_for_cp(mb.tokens, mb.cu_seqlens, self.pg.cp.rank(), self.layout.cp)
            return shard.tensor[None], shard.position_ids[None]
        return mb.tokens[None], mb.position_ids[None]

    def _value_step(self, loss_fn, mb: PackedBatch, model):
        rows = packed_loss_rows(mb)
        device = next(model.parameters()).device
        mb = mb.to(device)
        output = model(*self._model_inputs(mb), None, packed_seq_params=mb.packed_seq_params(), **_image_inputs(mb))
        if not self._post_process[id(model)]:  # hidden states for the next stage; the schedule calls no loss here
            return output, partial(loss_fn, mb, None)
        per_position = output.reshape(-1)  # [1, s, 1] -> [s]: one value per packed position
        values = rows.to_response(per_position.index_select(0, rows.rows.to(device)))
        return output, partial(loss_fn, mb, values)

    def _project(self, spec, with_entropy: bool, rows: LossRows, hidden: torch.Tensor,
                 weight: torch.Tensor) -> ModelOutput:
        """The loss rows' log-probs (+ entropy) from their hidden states ``[n, h]`` and the output layer's weight
        shard, the projection fused into the log-prob op (``Spec.extract_model_output_from_hidden``)."""
        tp_group = self.pg.tp if self.layout.tp > 1 else None
        start = self.pg.tp.rank() * weight.shape[0]
        return spec.extract_model_output_from_hidden(hidden, weight, rows.targets.to(hidden.device),
                                                     tp_group=tp_group, vocab_start_index=start,
                                                     vocab_size=self.vocab_size, with_entropy=with_entropy)

    def model_output(self, spec, mb: PackedBatch, rows: LossRows, output: torch.Tensor,
                     with_entropy: bool = True) -> ModelOutput:
        """Response-aligned log-probs (+ entropy when ``with_entropy``) of one micro-batch from this rank's
        logits shard, which holds the loss rows only (``_output_rows``); 0.0 at response tokens without loss.
        When the output layer was projected (``rows.projected``) its output holds the rows' log-probs (and the
        entropy when the pass asked for it) already, computed chunk by chunk by the pass's spec.

        With CP each rank holds 2 chunks of every sequence and computes the loss rows in its shard; a
        differentiable all-gather over the CP group reassembles the full sequence on every CP rank
        (``cp_utils.gather_packed_from_cp``). Megatron pads the vocab to a multiple of 128 x TP; the log-prob op
        is told the real vocab size and leaves those columns out of the softmax."""
        if rows.projected:
            out = unpack_output(output)
            if not with_entropy:
                out = ModelOutput(out.logprobs, None)
        else:
            logits = output[0] if output.dim() == 3 else output  # [rows, V/tp]
            tp_group = self.pg.tp if self.layout.tp > 1 else None
            start = self.pg.tp.rank() * logits.shape[-1]
            out = spec.extract_model_output(logits, rows.targets.to(logits.device), tp_group=tp_group,
                                            vocab_start_index=start, vocab_size=self.vocab_size,
                                            with_entropy=with_entropy)
        if self.layout.cp == 1:
            return ModelOutput(rows.to_response(out.logprobs),
                               rows.to_response(out.entropy) if out.entropy is not None else None)

        local = mb.num_tokens // self.layout.cp

        def whole(values: torch.Tensor) -> torch.Tensor:
            return mb.gather_response(cp_utils.gather_packed_from_cp(rows.to_rows(values, local), mb.cu_seqlens,
                                                                     cp_group=self.pg.cp))

        return ModelOutput(whole(out.logprobs), whole(out.entropy) if out.entropy is not None else None)

    def forward_only(self, samples: Sequence, micro_batches: list[PackedBatch], spec) -> dict[int, torch.Tensor]:
        """No-grad response-aligned float32 outputs of this rank's micro-batches, by sample index: the log-probs of
        a log-prob role, the values of a value role. Runs in the role's layout."""
        def loss_fn(mb, head_out, output):
            if self.head == "value":
                out = head_out.detach().float()
            else:  # log-probs are all a forward pass keeps
                out = self.model_output(spec, mb, head_out, output, with_entropy=False).logprobs.detach().float()
            return out.sum() * 0.0, torch.tensor(0, dtype=torch.int), {
                "out": dict(zip(mb.sample_indices.tolist(), mb.split_response(out.cpu())))}

        self.set_mode(training=False)
        if self.hooks is not None:
            self.hooks.start_pass(samples, micro_batches, training=False)
        self._pass_head = (spec, False) if self.head == "logprob" else None
        try:
            with torch.no_grad():
                store = self.run_schedule(micro_batches, loss_fn, forward_only=True)
        except BaseException:
            if self.hooks is not None:
                self.hooks.end_pass(collect=False)
            raise
        finally:
            self._pass_head = None
        if self.hooks is not None:
            self.hooks.end_pass(collect=True)
        local: dict[int, torch.Tensor] = {}
        for item in store:
            local.update(item["out"])
        return local

    def train_pass(self, samples: Sequence, micro_batches: list[PackedBatch], loss_fn, spec=None) -> "StepResult":
        """One optimizer step over this rank's micro-batches (``StepResult``): the loss metrics reduced over DP on
        the last pipeline stage and given to every rank, and what the hooks report for the pass (the routes'
        agreement). ``loss_fn(mb, head_out, output)`` returns ``(loss, metrics)``. ``spec``: the log-prob head's
        algorithm, whose ``extract_model_output_from_hidden`` then runs inside the output layer (log-probs and
        entropy by row chunks, ``_output_rows``); None: the output layer returns the loss rows' logits."""
        assert self.optimizer is not None and self.scheduler is not None, f"the {self.name} role is frozen"
        pg = self.pg

        def schedule_loss(mb, head_out, output):
            loss, metrics = loss_fn(mb, head_out, output)
            return loss, torch.tensor(0, dtype=torch.int), {"metrics": metrics}

        self.set_mode(training=True)
        for m in self.model:
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        if self.hooks is not None:
            self.hooks.start_pass(samples, micro_batches, training=True)
        self._pass_head = (spec, True) if spec is not None and self.head == "logprob" else None
        try:
            store = self.run_schedule(micro_batches, schedule_loss, forward_only=False)
        except BaseException:
            if self.hooks is not None:
                self.hooks.end_pass(collect=False)
            raise
        finally:
            self._pass_head = None
        extra = self.hooks.end_pass(collect=True) if self.hooks is not None else {}
        # fp16: the scale this step's loss was multiplied by (the step may back it off)
        loss_scale = float(self.optimizer.get_loss_scale()) if self.cfg.precision.fp16 else None
        update_ok, grad_norm, _ = self.optimizer.step()  # its own groups (grad norm, found-inf, the DP gather)
        if update_ok:
            self.scheduler.step(increment=1)
            self.optimizer_steps += 1
        metrics: dict[str, float] = {}
        if pg.pp.rank() == pg.pp.size() - 1:
            metrics = reduce_metrics([item["metrics"] for item in store], group=pg.dp)
        # everyone (the driver especially, which may be a first-stage rank) gets the last stage's view; without
        # pipeline stages every rank is a last-stage rank and holds it already (the DP all-reduce)
        if pg.pp.size() > 1:
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, metrics)
            metrics = next(m for m in gathered if m)
        return StepResult(metrics, grad_norm, bool(update_ok), loss_scale, extra)

    # ---- memory ---------------------------------------------------------------

    def sleep(self) -> None:
        """Gradient buffers released and optimizer state to host memory (megatron's RL offload hooks)."""
        if self.optimizer is None:
            return
        for m in self.model:
            m.offload_grad_buffers()
        if hasattr(self.optimizer, "offload_to_cpu"):
            self.optimizer.offload_to_cpu()

    def wake(self) -> None:
        if self.optimizer is None:
            return
        for m in self.model:
            m.restore_grad_buffers()
        if hasattr(self.optimizer, "restore_from_cpu"):
            self.optimizer.restore_from_cpu()

    def named_local_params(self, trainable_only: bool = False):
        """``"{chunk}.{name}", parameter`` of this rank's chunks (``trainable_only``: those with gradients)."""
        for i, chunk in enumerate(self.chunks):
            for name, p in chunk.named_parameters():
                if not trainable_only or p.requires_grad:
                    yield f"{i}.{name}", p


class RoleAttributes:
    """A holder of one ``RoleModel`` (``role``) exposing its model by the names the checkpoints, the weight sync and
    the tests read: the backend (its actor) and the critic."""

    role: RoleModel

    @property
    def chunks(self) -> list:
        return self.role.chunks

    @property
    def model(self) -> list:
        return self.role.model

    @property
    def optimizer(self):
        return self.role.optimizer

    @property
    def scheduler(self):
        return self.role.scheduler

    @property
    def lora(self) -> list:
        return self.role.lora

    @property
    def config(self):
        return self.role.config

    @property
    def optimizer_steps(self) -> int:
        return self.role.optimizer_steps

    @optimizer_steps.setter
    def optimizer_steps(self, value: int) -> None:
        self.role.optimizer_steps = value


def _image_inputs(mb: PackedBatch) -> dict[str, torch.Tensor]:
    """The vision-language model's image keywords of a micro-batch (none for a batch without images)."""
    if mb.pixel_values is None or mb.image_grid_thw is None:
        return {}
    return {"pixel_values": mb.pixel_values, "image_grid_thw": mb.image_grid_thw}


def _fusable(layer) -> bool:
    """Whether the output layer may be replaced by the chunked log-prob op for a pass: megatron's plain
    ``ColumnParallelLinear`` (``loss_rows.projects_plainly``) with its shard of the logits as output (not gathered
    over TP) and its weight gradient computed in its backward (no deferred embedding wgrad)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear  # lazy: megatron-core

    return (projects_plainly(layer, ColumnParallelLinear) and not layer.gather_output
            and not getattr(layer, "explicit_expert_comm", False)
            and not getattr(layer.config, "defer_embedding_wgrad_compute", False))


@contextlib.contextmanager
def _output_rows(layer, rows: LossRows, head: Optional[Callable[[torch.Tensor, torch.Tensor], ModelOutput]] = None):
    """Run megatron's output layer (a ``ColumnParallelLinear``) on the loss rows only (``backends.loss_rows``).

    Under sequence parallelism its input is this TP rank's slice of the tokens: the
    hook gathers it first and the layer runs without sequence parallelism for this
    call, as megatron-core's own last-token inference path does. The gather's
    backward is a split (``tensor_parallel_output_grad=False``) because the layer's
    backward then all-reduces the input gradient over TP (``copy_to_tensor_model_parallel_region``),
    so each rank's partial gradient is summed exactly once.

    ``head`` (``(hidden [n, h], weight shard) -> ModelOutput``): the layer's forward is replaced for the call by
    one that runs ``head`` on the kept rows and returns their packed ``[n, 1, k]`` log-probs (and entropy)
    instead of logits (``loss_rows.project_rows``); GPTModel hands it on as ``[1, n, k]``. The rows' gradient is
    all-reduced over TP as the layer's own backward does (unless the layer disables that reduction), and the
    weight is the one the model passes (the tied embedding's) or the layer's.
    """
    from megatron.core.tensor_parallel import (copy_to_tensor_model_parallel_region,  # lazy: megatron-core
                                               gather_from_sequence_parallel_region)

    sequence_parallel = layer.sequence_parallel

    def select(hidden: torch.Tensor) -> torch.Tensor:  # [s (/tp under SP), 1, h] -> [rows, 1, h]
        if sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False,
                                                          group=layer.tp_group)
        return hidden.index_select(0, rows.rows.to(hidden.device))

    def projected(input_: torch.Tensor, weight: Optional[torch.Tensor] = None, runtime_gather_output=None):
        assert head is not None
        hidden = select(input_)[:, 0]  # [rows, h]
        if layer.tp_group.size() > 1 and not layer.disable_grad_reduce:
            hidden = copy_to_tensor_model_parallel_region(hidden, group=layer.tp_group)
        return pack_output(head(hidden, layer.weight if weight is None else weight)).unsqueeze(1), None

    layer.sequence_parallel = False
    try:
        with keep_rows(layer, select) if head is None else project_rows(layer, projected):
            yield
    finally:
        layer.sequence_parallel = sequence_parallel
