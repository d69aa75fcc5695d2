"""MegatronBackend: the policy on real megatron-core (DDP, optimizer, PP schedules).

The backend talks to megatron-core only through its public seams:
``initialize_parallel`` (our wrapper of ``parallel_state``), a bridge-built
``GPTModel`` per virtual stage, ``DistributedDataParallel``,
``get_megatron_optimizer`` + ``OptimizerParamScheduler`` and
``get_forward_backward_func``. Everything algorithmic comes from the ``Spec``.

Loss normalisation (why ``calculate_per_token_loss=True``): each micro-batch's
loss is already a SUM divided by the step's GLOBAL denominator (see
``algorithms.losses``), so gradients must be *summed* over micro-batches and DP
ranks, never averaged. With ``calculate_per_token_loss`` megatron-core 0.16
(a) does not divide a loss by the number of micro-batches when the loss
function returns ``(loss, num_tokens, metrics)`` and (b) makes DDP sum rather
than average over data parallelism; we return ``num_tokens = 0`` so
``finalize_model_grads`` finds a zero token total and applies no further scaling.
The result is independent of how samples were packed (tested).

Vocab padding: megatron pads the vocab to a multiple of 128 x TP; the log-prob op
is told the real vocab size and leaves those columns out of the softmax, so the
distribution is over the real vocab exactly as in HF and in the rollout engine.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import time
from functools import partial
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_rl.algorithms.losses import LossInputs, reduce_metrics
from megatron_rl.algorithms.spec import ModelOutput, Spec
from megatron_rl.models.peft_adapter import AdapterExport
from megatron_rl.backends.base import (ExportScope, TrainBackend, TrainBatch, WeightManager, bucketed,
                                      finish_step_metrics)
from megatron_rl.backends.loss_rows import LossRows, keep_rows, packed_loss_rows
from megatron_rl.backends.megatron.routing_replay import RoutingReplay, moe_pattern
from megatron_rl.backends.megatron.checkpoint import load_checkpoint, save_checkpoint
from megatron_rl.backends.sleep_tiers import MEMORY_SAVER_NOTE, plan_sleep
from megatron_rl.config import Config
from megatron_rl.config.megatron_flags import megatron_core_kwargs
from megatron_rl.data.packing import LossDenominators, MicroBatchPlan, PackedBatch, pad_multiple_for
from megatron_rl.data.types import AnySample
from megatron_rl.errors import BackendError, CheckpointError, ConfigError
from megatron_rl.infra import reloadable_groups
from megatron_rl.models import cp_utils, dist_io, get_bridge, model_dir
from megatron_rl.models.parallel import ParallelLayout, initialize_parallel
from megatron_rl.models.weights import unwrap

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def layout_from_config(cfg: Config) -> ParallelLayout:
    p = cfg.parallel
    return ParallelLayout(tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size,
                          vpp=p.virtual_pipeline_model_parallel_size, cp=p.context_parallel_size,
                          ep=p.expert_model_parallel_size, etp=p.expert_tensor_parallel_size,
                          sequence_parallel=p.sequence_parallel and p.tensor_model_parallel_size > 1)


def check_backend_config(cfg: Config) -> None:
    """Refuse, before any process group exists, what megatron-core cannot do on this machine."""
    cuda = torch.cuda.is_available()
    opt = cfg.optimizer
    if not cuda and opt.use_precision_aware_optimizer and not opt.optimizer_cpu_offload:
        raise ConfigError("--use-precision-aware-optimizer without --optimizer-cpu-offload needs "
                          "transformer-engine's FusedAdam on a GPU (docs/optimizer.md); on CPU add "
                          "--optimizer-cpu-offload or drop the flag.")
    if not cuda and opt.optimizer_cpu_offload and opt.optimizer_offload_fraction != 1.0:
        raise ConfigError(f"--optimizer-offload-fraction {opt.optimizer_offload_fraction}: on CPU only 1.0 is "
                          "supported (the 'device' part would be host memory too, and megatron-core 0.16.1 "
                          "fails to save it: docs/optimizer.md); use 1.0.")
    if cfg.precision.fp8_format and not cuda:
        raise ConfigError(f"--fp8-format {cfg.precision.fp8_format} needs an FP8-capable GPU "
                          "(Hopper or newer) with transformer-engine; drop it on CPU runs.")


def transformer_config_overrides(cfg: Config) -> dict:
    """``TransformerConfig`` fields the flags set on top of the bridge's HF-derived config.

    Pure (no megatron import) so a unit test can check that every flag arrives;
    ``Bridge.transformer_config(layout, **overrides)`` applies them last.
    FP8 follows Megatron-LM's ``core_transformer_config_from_args``: ``--fp8-format``
    is ``fp8``, ``--fp8-param-gather`` is ``fp8_param``; the recipe knobs keep
    their names. Without ``--fp8-format`` no fp8 field is set (megatron's defaults).
    """
    mem, pr = cfg.memory, cfg.precision
    overrides: dict = dict(calculate_per_token_loss=True)
    if mem.recompute_granularity:
        overrides.update(recompute_granularity=mem.recompute_granularity)
        if mem.recompute_granularity == "full":
            overrides.update(recompute_method=mem.recompute_method or "uniform",
                             recompute_num_layers=mem.recompute_num_layers or 1)
    if pr.fp8_format:
        overrides.update(fp8=pr.fp8_format, fp8_recipe=pr.fp8_recipe, fp8_margin=pr.fp8_margin,
                         fp8_amax_history_len=pr.fp8_amax_history_len,
                         fp8_amax_compute_algo=pr.fp8_amax_compute_algo, fp8_param=pr.fp8_param_gather)
    overrides.update(megatron_core_kwargs(cfg)["transformer"])  # Megatron-LM flags (config/megatron_flags.py)
    return overrides


def ddp_config_kwargs(cfg: Config) -> dict:
    """``DistributedDataParallelConfig`` fields (``fp8_param_gather`` as Megatron-LM sets it)."""
    return {**dict(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                   use_distributed_optimizer=cfg.optimizer.effective_distributed_optimizer,
                   fp8_param_gather=bool(cfg.precision.fp8_format and cfg.precision.fp8_param_gather)),
            **megatron_core_kwargs(cfg)["ddp"]}


def optimizer_config_kwargs(cfg: Config, params_dtype: torch.dtype) -> dict:
    """``OptimizerConfig`` fields from the flags (the Megatron-LM ones through config/megatron_flags.py)."""
    opt = cfg.optimizer
    return {**dict(
        optimizer=opt.optimizer, lr=opt.lr, min_lr=opt.min_lr, weight_decay=opt.weight_decay,
        adam_beta1=opt.adam_beta1, adam_beta2=opt.adam_beta2, adam_eps=opt.adam_eps,
        clip_grad=opt.grad_clip, bf16=cfg.precision.bf16, fp16=cfg.precision.fp16,
        params_dtype=params_dtype, use_distributed_optimizer=opt.effective_distributed_optimizer,
        optimizer_cpu_offload=opt.optimizer_cpu_offload,
        optimizer_offload_fraction=opt.optimizer_offload_fraction,
        use_precision_aware_optimizer=opt.use_precision_aware_optimizer,
        loss_scale=cfg.precision.loss_scale, initial_loss_scale=cfg.precision.initial_loss_scale,
        min_loss_scale=cfg.precision.min_loss_scale, loss_scale_window=cfg.precision.loss_scale_window,
        hysteresis=cfg.precision.hysteresis), **megatron_core_kwargs(cfg)["optimizer"]}


class MegatronBackend(TrainBackend):
    def initialize(self, cfg: Config, spec: Spec) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler


        check_backend_config(cfg)
        self.cfg = cfg
        self.spec = spec
        self.layout = layout_from_config(cfg)
        self.sleep_plan = plan_sleep(cfg.memory.offload_train_groups, backend="megatron",
                                     cuda=torch.cuda.is_available())
        if cfg.memory.effective_offload_train and self.sleep_plan.groups:
            reloadable_groups.install()  # before megatron's groups exist: they become rebuildable
        self.dp_size = initialize_parallel(self.layout, seed=cfg.runtime.seed)
        if cfg.parallel.sequence_parallel and not self.layout.sequence_parallel and dist.get_rank() == 0:
            log.warning("--sequence-parallel has no effect on the actor with --tensor-model-parallel-size 1 "
                        "(nothing to shard over; Megatron-LM turns it off there too)")
        if cfg.memory.effective_offload_train and dist.get_rank() == 0:
            log.info("trainer sleep (--offload-train/--colocate): %s", self.sleep_plan.describe())
            if torch.cuda.is_available() and importlib.util.find_spec("torch_memory_saver") is not None:
                log.info(MEMORY_SAVER_NOTE)
        self.ps = ps
        self._export_scope: Optional[ExportScope] = None
        self.dp_rank = ps.get_data_parallel_rank()
        self.pad_to_multiple = pad_multiple_for(self.layout.tp, self.layout.cp, self.layout.sequence_parallel)
        # the last-stage, TP-rank-0, CP-rank-0 rank of each DP rank holds its full results (others: copies)
        self.holds_results = (ps.is_pipeline_last_stage(ignore_virtual=True)
                              and ps.get_tensor_model_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0)
        self.bridge = get_bridge(cfg.model.hf_checkpoint, mtp_num_layers=cfg.megatron.mtp_num_layers or 0)
        self.params_dtype = _DTYPES[cfg.precision.params_dtype]
        self.chunks = self.bridge.build_model(self.layout, params_dtype=self.params_dtype,
                                              **transformer_config_overrides(cfg))
        self._mtp_denoms: Optional[LossDenominators] = None  # set while an --enable-mtp-training step runs
        if self.bridge.mtp_num_layers and not cfg.megatron.enable_mtp_training:  # loaded, checkpointed, exported
            from megatron_rl.models.mtp import freeze_mtp  # lazy: imports megatron-core's GPTModel

            freeze_mtp(self.chunks)
        self._load_initial_weights(cfg)
        self.lora: list = []  # --lora-rank: each chunk's adapters (models/lora.py); the base is frozen
        if cfg.lora.lora_rank:
            from megatron_rl.models import lora  # lazy: imports megatron-core's parallel layers

            self.lora = lora.attach_lora(self.bridge, self.chunks, lora.LoraSpec(
                cfg.lora.lora_rank, cfg.lora.lora_alpha, cfg.lora.lora_dropout, tuple(cfg.lora.lora_target_modules),
                init_seed=cfg.runtime.seed))
            if cfg.lora.lora_load:  # a PEFT adapter dir (validated against the flags before any worker started)
                from megatron_rl.models.peft_adapter import read_adapter_tensors  # lazy: a --lora-load run only

                lora.load_peft_tensors(self.lora, read_adapter_tensors(cfg.lora.lora_load, "--lora-load"))
            if dist.get_rank() == 0:
                log.info("%s%s", lora.describe(self.lora),
                         f", started from {cfg.lora.lora_load}" if cfg.lora.lora_load else "")
        self.model_config = self.chunks[0].config
        self.vocab_size = self.bridge.vocab_size
        self.padded_vocab_size = self.bridge.padded_vocab_size(self.layout.tp)

        ddp_config = DistributedDataParallelConfig(**ddp_config_kwargs(cfg))
        self.model = [DistributedDataParallel(config=self.model_config, ddp_config=ddp_config, module=chunk,
                                              disable_bucketing=i > 0)
                      for i, chunk in enumerate(self.chunks)]
        opt = cfg.optimizer
        opt_config = OptimizerConfig(**optimizer_config_kwargs(cfg, self.params_dtype))
        self.optimizer = get_megatron_optimizer(opt_config, self.model)
        total_steps = max(1, cfg.rollout.num_rollout * cfg.batching.optimizer_steps_per_rollout
                          * cfg.algorithm.num_steps_per_rollout_updates)
        decay = opt.lr_decay_iters or total_steps
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if opt.lr_warmup_iters else opt.lr, max_lr=opt.lr, min_lr=opt.min_lr,
            lr_warmup_steps=opt.lr_warmup_iters, lr_decay_steps=max(decay, opt.lr_warmup_iters + 1),
            lr_decay_style=opt.lr_decay_style, start_wd=opt.weight_decay, end_wd=opt.weight_decay,
            wd_incr_steps=1, wd_incr_style="constant")
        self.model_config.finalize_model_grads_func = finalize_model_grads
        self.model_config.grad_scale_func = self.optimizer.scale_loss
        self.weights = WeightManager.resolved(self._named_local_params, cfg.memory.ref_weights_location,
                                              offload_train=cfg.memory.effective_offload_train)
        self.optimizer_steps = 0
        self.pad_token_id = 0
        # the last stage's output layer, by its DDP-wrapped chunk (what the schedule hands _forward_step)
        self._output_layers = {id(m): c.output_layer for m, c in zip(self.model, self.chunks) if c.post_process}
        self._chunk_index = {id(m): i for i, m in enumerate(self.model)}
        self.routing: Optional[RoutingReplay] = None  # --use-routing-replay
        self._pass_samples: Sequence[AnySample] = ()
        if self.model_config.moe_enable_routing_replay:
            # R3: the engine's routes, over every MoE layer of the model
            pattern = moe_pattern(self.model_config) if cfg.megatron.use_rollout_routing_replay else None
            self.routing = RoutingReplay.attach(self.chunks, ps, self.layout, int(self.model_config.moe_router_topk),
                                                moe_pattern=pattern)
        self.critic = None  # ppo's value model (critic.py), on these ranks with this layout or its own
        if cfg.algorithm.advantage_estimator == "ppo":
            from megatron_rl.backends.megatron.critic import MegatronCritic  # lazy: only ppo builds one

            self.critic = MegatronCritic(self, cfg)

    # ---- helpers -------------------------------------------------------------

    def _named_local_params(self):
        """What a weight tag keeps: every parameter, or with LoRA the adapters only (the base is frozen, so the
        initial adapters are the whole difference to the base model: a reference costs adapter bytes)."""
        for i, chunk in enumerate(self.chunks):
            for name, p in chunk.named_parameters():
                if not self.lora or p.requires_grad:
                    yield f"{i}.{name}", p

    @property
    def _mtp_model(self):
        """This rank's model chunk holding the MTP block when --enable-mtp-training trains it, else None."""
        if not self.cfg.megatron.enable_mtp_training:
            return None
        return next((unwrap(c) for c in self.chunks if getattr(unwrap(c), "mtp_process", False)), None)

    @property
    def is_last_stage(self) -> bool:
        return self.ps.is_pipeline_last_stage(ignore_virtual=True)

    def _model_output(self, mb: PackedBatch, rows: LossRows, output: torch.Tensor,
                      with_entropy: bool = True) -> ModelOutput:
        """Response-aligned log-probs (+ entropy when ``with_entropy``) of one micro-batch from this rank's
        logits shard, which holds the loss rows only (``_output_rows``); 0.0 at response tokens without loss.

        With CP each rank holds 2 chunks of every sequence and computes the loss rows
        in its shard; a differentiable all-gather over the CP group reassembles the
        full sequence on every CP rank (see ``cp_utils.gather_packed_from_cp``).
        """
        logits = output[0] if output.dim() == 3 else output  # [rows, V/tp]
        tp_group = self.ps.get_tensor_model_parallel_group() if self.layout.tp > 1 else None
        start = self.ps.get_tensor_model_parallel_rank() * logits.shape[-1]
        out = self.spec.extract_model_output(logits, rows.targets.to(logits.device), tp_group=tp_group,
                                             vocab_start_index=start, vocab_size=self.vocab_size,
                                             with_entropy=with_entropy)
        if self.layout.cp == 1:
            return ModelOutput(rows.to_response(out.logprobs),
                               rows.to_response(out.entropy) if out.entropy is not None else None)

        local = mb.num_tokens // self.layout.cp

        def whole(values: torch.Tensor) -> torch.Tensor:
            return mb.gather_response(cp_utils.gather_packed_from_cp(rows.to_rows(values, local), mb.cu_seqlens))

        return ModelOutput(whole(out.logprobs), whole(out.entropy) if out.entropy is not None else None)

    def _forward_step(self, loss_fn, data_iterator, model):
        mb: PackedBatch = next(data_iterator)
        cp_rank = self.ps.get_context_parallel_rank()
        local_index = (cp_utils.cp_local_index(mb.cu_seqlens, cp_rank, self.layout.cp) if self.layout.cp > 1
                       else None)
        rows = packed_loss_rows(mb, local_index)  # on the host copy: no device sync
        device = next(model.parameters()).device
        mb = mb.to(device)
        tokens, positions = mb.tokens, mb.position_ids
        if self.layout.cp > 1:
            shard = cp_utils.shard_packed_for_cp(mb.tokens, mb.cu_seqlens, cp_rank, self.layout.cp)
            tokens, positions = shard.tensor, shard.position_ids
        layer = self._output_layers.get(id(model))
        if self._mtp_denoms is not None and getattr(unwrap(model), "mtp_process", False):
            from megatron_rl.models.mtp import mtp_targets  # lazy: imports megatron-core's GPTModel

            unwrap(model).mtp_targets = mtp_targets(
                mb.cu_seqlens, mb.response_lengths, mb.response_positions, mb.response_target_ids, mb.loss_mask,
                self.bridge.mtp_num_layers, max(self._mtp_denoms.global_tokens, 1), self.vocab_size,
                self.cfg.megatron.mtp_loss_scaling_factor)
        if self.routing is not None:
            self.routing.before_forward(self._chunk_index[id(model)], mb, self._pass_samples)
        with _output_rows(layer, rows) if layer is not None else contextlib.nullcontext():
            output = model(tokens[None], positions[None], None, packed_seq_params=mb.packed_seq_params())
        if self.routing is not None:
            self.routing.after_forward(self._chunk_index[id(model)], mb, self._pass_samples)
        return output, partial(loss_fn, mb, rows)

    def _start_routing(self, samples: Sequence[AnySample], mbs: list[PackedBatch], training: bool) -> None:
        """Routing replay (``routing_replay.py``): a forward pass over samples this rank has no routes for
        records them (the old-log-prob pass); every later pass over them replays."""
        if self.routing is None:
            return
        self._pass_samples = samples
        mine = [samples[i] for mb in mbs for i in mb.sample_indices.tolist()]
        record = not training and any(id(s) not in self.routing.records for s in mine)
        self.routing.start_pass(mine, record=record)

    def _end_routing(self, collect: bool = True) -> dict[str, float]:
        """Close the pass; a replaying pass reports how often the trainer's own router agreed (a collective:
        every rank; ``collect=False`` after a failed pass, whose peers may not get here)."""
        if self.routing is None:
            return {}
        agreement = self.routing.agreement
        recording = self.routing.recording
        self.routing.end_pass()
        self._pass_samples = ()
        if recording or not collect:
            return {}
        counts = torch.tensor([agreement.agreed, agreement.total], dtype=torch.float64)
        if dist.get_world_size() > 1:
            dist.all_reduce(counts)
        return {"route_agreement": float(counts[0] / counts[1])} if counts[1] > 0 else {}

    def _run_schedule(self, micro_batches: list[PackedBatch], loss_fn, forward_only: bool) -> list:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        n = len(micro_batches)
        vpp = self.layout.num_model_chunks
        iterators = [iter(micro_batches) for _ in range(vpp)] if vpp > 1 else iter(micro_batches)
        max_len = max(mb.num_tokens for mb in micro_batches)
        return get_forward_backward_func()(
            forward_step_func=partial(self._forward_step, loss_fn), data_iterator=iterators,
            model=self.model, num_microbatches=n, seq_length=max_len, micro_batch_size=1,
            forward_only=forward_only)

    # ---- TrainBackend --------------------------------------------------------

    def forward(self, samples: Sequence[AnySample], plan: Optional[MicroBatchPlan] = None,
                owned_only: bool = False) -> list[Optional[torch.Tensor]]:
        plan, mbs, _ = self.preprocess_rollout_data(samples, plan=plan)

        def loss_fn(mb, rows, output):
            out = self._model_output(mb, rows, output, with_entropy=False)  # log-probs are all a forward pass keeps
            lp = out.logprobs.detach().float()
            return lp.sum() * 0.0, torch.tensor(0, dtype=torch.int), {
                "logprobs": dict(zip(mb.sample_indices.tolist(), mb.split_response(lp.cpu())))}

        _set_mode(self.model, training=False)
        self._start_routing(samples, mbs, training=False)
        try:
            with torch.no_grad():
                store = self._run_schedule(mbs, loss_fn, forward_only=True)
        except BaseException:
            self._end_routing(collect=False)
            raise
        self._end_routing()
        local: dict[int, torch.Tensor] = {}
        for item in store:
            local.update(item["logprobs"])
        return self.gather_per_sample(local, samples, plan, owned_only)

    def compute_values(self, samples: Sequence[AnySample], plan: Optional[MicroBatchPlan] = None,
                       owned_only: bool = False) -> list[Optional[torch.Tensor]]:
        """The critic's values over the same packed micro-batches as the old-log-prob pass (``critic.py``)."""
        if self.critic is None:
            return super().compute_values(samples, plan, owned_only)
        if self.critic.share is not None:  # a layout of its own: its own plan of the batch, whole on every rank
            if owned_only:
                raise BackendError("compute_values(owned_only=True): a critic of its own layout has other "
                                   "data-parallel shares than the actor's; PPO holds the whole batch on every rank")
            return self.critic.compute_values(samples)
        plan, mbs, _ = self.preprocess_rollout_data(samples, plan=plan)
        return self.gather_per_sample(self.critic.values(mbs), samples, plan, owned_only)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        samples = batch.samples
        t0 = time.perf_counter()
        plan, mbs, denoms = self.preprocess_rollout_data(samples, batch)
        metrics = self._train_actor(samples, plan, mbs, denoms, t0) if batch.train_actor else {}
        if batch.returns is not None:  # ppo: one critic step beside the actor's
            if self.critic is None:
                raise BackendError("train_step got critic returns but this backend built no critic "
                                   "(--advantage-estimator ppo builds one)")
            assert denoms is not None, "a training batch has loss denominators"
            metrics.update(self.critic.train_on(batch, mbs, denoms, self.spec))
        return metrics

    def _train_actor(self, samples, plan, mbs, denoms, t0: float) -> dict[str, float]:

        def loss_fn(mb, rows, output):
            out = self._model_output(mb, rows, output)
            inputs = LossInputs.from_packed_batch(mb, out.logprobs, out.entropy)
            loss, metrics = self.spec.compute_loss(inputs, denoms)
            mtp_model = self._mtp_model
            if mtp_model is not None and mtp_model.last_mtp_loss is not None:  # this micro-batch's, normalised
                tokens = inputs.loss_mask.detach().double().sum()
                metrics["mtp_loss"] = (mtp_model.last_mtp_loss.double() * max(denoms.global_tokens, 1), tokens)
                mtp_model.last_mtp_loss = None
            # Under CP every CP rank computes the same full-sequence loss and the all-gather's
            # backward sums their gradients; DDP then sums over CP too: divide by cp once.
            return loss / self.layout.cp, torch.tensor(0, dtype=torch.int), {"metrics": metrics}

        _set_mode(self.model, training=True)
        for m in self.model:
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._start_routing(samples, mbs, training=True)
        self._mtp_denoms = denoms if self.cfg.megatron.enable_mtp_training else None
        try:
            store = self._run_schedule(mbs, loss_fn, forward_only=False)
        except BaseException:
            self._end_routing(collect=False)
            raise
        finally:
            self._mtp_denoms = None
            if self._mtp_model is not None:
                self._mtp_model.mtp_targets = None
        routing = self._end_routing()
        loss_scale = float(self.optimizer.get_loss_scale()) if self.cfg.precision.fp16 else None  # this step's
        update_ok, grad_norm, _ = self.optimizer.step()
        if update_ok:
            self.scheduler.step(increment=1)
            self.optimizer_steps += 1
        metrics: dict[str, float] = {}
        if self.is_last_stage:
            metrics = reduce_metrics([item["metrics"] for item in store],
                                     group=self.ps.get_data_parallel_group())
        # everyone (the driver especially, which may be a first-stage rank) gets the last stage's view;
        # without pipeline stages every rank is a last-stage rank and holds it already (the DP all-reduce)
        if dist.get_world_size() > 1 and self.layout.pp > 1:
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, metrics)
            metrics = next(m for m in gathered if m)
        metrics.update(routing)
        return finish_step_metrics({f"train/{k}": v for k, v in metrics.items()}, grad_norm=grad_norm,
                                   lr=self.optimizer.param_groups[0]["lr"], update_ok=update_ok,
                                   loss_scale=loss_scale, micro_batches=plan.num_micro_batches, started=t0)

    def export_weights(self, bucket_bytes: int, *, stage_only: bool = False,
                       merge_adapters: bool = True) -> Iterator[list[tuple[str, torch.Tensor]]]:
        with contextlib.ExitStack() as merged:  # LoRA: the engine gets the adapters folded into the weights
            for adapters in self.lora if merge_adapters else ():
                merged.enter_context(adapters.merged())
            # the MTP layers are frozen: the engine's own copy (from the same checkpoint) stays current
            yield from bucketed(self.bridge.export_hf_weights(self.chunks, bucket_bytes=bucket_bytes,
                                                              stage_only=stage_only, include_mtp=False),
                                bucket_bytes)

    def export_adapters(self, *, stage_only: bool = False) -> AdapterExport:
        """The adapters gathered over TP (and PP unless ``stage_only``): ``models/lora.full_adapter_tensors``."""
        if not self.lora:
            return super().export_adapters(stage_only=stage_only)
        from megatron_rl.models import lora  # lazy: imports megatron-core's parallel layers

        lo = self.cfg.lora
        return AdapterExport(lora.full_adapter_tensors(self.lora, stage_only=stage_only), lo.lora_rank,
                             float(lo.lora_alpha))

    def export_scope(self) -> ExportScope:
        """Each stage's sender: the rank of the stage at data-, tensor- and context-parallel rank 0
        (learned once with one all_gather, so every rank knows every stage's sender)."""
        if self._export_scope is None:
            ps = self.ps
            stages, stage = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
            lead = (ps.get_data_parallel_rank() == 0 and ps.get_tensor_model_parallel_rank() == 0
                    and ps.get_context_parallel_rank() == 0)
            mine = (stage, lead, dist.get_rank())
            everyone: list[Any] = [None] * dist.get_world_size()  # each rank's `mine`, once gathered
            dist.all_gather_object(everyone, mine)
            sources = tuple(min(r for s, is_lead, r in everyone if s == k and is_lead) for k in range(stages))
            self._export_scope = ExportScope(stages=stages, stage=stage, sources=sources)
        return self._export_scope

    def save(self, path: str, extra_state: dict) -> None:
        save_checkpoint(self, path, extra_state)

    def load(self, path: str) -> dict:
        return load_checkpoint(self, path)

    def sleep(self) -> None:
        """Free accelerator memory for a colocated engine (megatron's own RL offload hooks).

        GPU: gradient buffers are released and optimizer state moves to host memory
        (``offload_grad_buffers`` / ``offload_to_cpu``); parameters stay, the engine
        gets them by weight sync anyway. CPU: nothing to free (host memory is the
        only memory), so this is a no-op that the colocated loop still calls.
        """
        if not torch.cuda.is_available():
            return
        for m in self.model:
            m.offload_grad_buffers()
        if hasattr(self.optimizer, "offload_to_cpu"):
            self.optimizer.offload_to_cpu()
        if self.critic is not None:
            self.critic.sleep()
        torch.cuda.empty_cache()

    def wake(self) -> None:
        if not torch.cuda.is_available():
            return
        for m in self.model:
            m.restore_grad_buffers()
        if hasattr(self.optimizer, "restore_from_cpu"):
            self.optimizer.restore_from_cpu()
        if self.critic is not None:
            self.critic.wake()

    def release_comm_groups(self) -> int:
        """Every process group megatron and this backend made, destroyed (``--offload-train-groups``;
        infra/reloadable_groups.py): their NCCL communicators' memory goes to the engine. WORLD stays."""
        if not (self.cfg.memory.effective_offload_train and self.sleep_plan.groups):
            return 0
        count = reloadable_groups.destroy()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return count

    def restore_comm_groups(self) -> int:
        if not (self.cfg.memory.effective_offload_train and self.sleep_plan.groups):
            return 0
        return reloadable_groups.reload()

    def _load_initial_weights(self, cfg: Config) -> None:
        """``--hf-checkpoint``, or a model-only torch_dist dir given as ``--load`` (what
        ``convert_ckpt.py hf-to-dist`` writes; Megatron's ``--finetune`` start: weights only,
        fresh optimizer, step 0). Before the optimizer exists, so its master weights copy them."""
        path = cfg.checkpoint.load
        hf_dir = cfg.model.hf_checkpoint
        assert hf_dir is not None, "initialize built the bridge from --hf-checkpoint's config"
        if path is None or not model_dir.is_model_dir(path):
            # a dist-to-hf output carries checksums: damage is refused by file name, not trained on
            model_dir.check_hf_marker_once(hf_dir, f"checking --hf-checkpoint {hf_dir}")
            self.bridge.load_hf_weights(self.chunks, hf_dir)
            return
        meta = model_dir.read_marker(path)
        model_dir.check_fingerprint(path, meta, self.bridge, hf_dir)
        dist_io.check_checkpoint_matches_model(path, dist_io.checkpoint_model_tensors(path),
                                               dist_io.model_tensor_shapes(self.chunks), hf_dir)
        dist_io.load_dist_into(self.chunks, path)
        log.info("initial weights from the torch_dist model dir %s (--load); optimizer starts fresh", path)

    def load_frozen_weights(self, tag: str, path: str) -> None:
        """Store the weights at ``path`` under ``tag`` (``--ref-load`` / ``--opd-teacher-load``).

        ``path`` is an HF directory (config.json + safetensors) or a torch_dist
        checkpoint (a converted model dir, an ``iter_NNNNNNN`` dir or a checkpoint
        root). The weights pass through the live model once (so every layout and
        every strictness check of the loaders applies) and the live actor weights
        are put back afterwards. The architecture must be the policy's: a tag is
        a swap of the same parameters, not a second model.
        """
        flag = {"ref": "--ref-load", "teacher": "--opd-teacher-load"}.get(tag, tag)
        if not os.path.isdir(path):
            raise CheckpointError(f"{flag} {path}: no such directory")
        is_hf = os.path.isfile(os.path.join(path, "config.json")) and any(
            f.endswith(".safetensors") for f in os.listdir(path))

        def load_into_live() -> None:
            # the same marker, size and checksum checks as --load: a damaged reference or teacher
            # would otherwise skew every KL/distillation term without a word
            if is_hf:
                model_dir.check_hf_marker_once(path, f"checking {flag} {path}")
                self.bridge.load_hf_weights(self.chunks, path)
            else:
                resolved = model_dir.resolve_dist_dir(path)
                model_dir.read_marker(resolved)
                dist_io.load_dist_into(self.chunks, resolved)

        self.weights.load_tag(tag, load_into_live)
        log.info("loaded frozen %s weights from %s (%s)", tag, path, "HF" if is_hf else "torch_dist")


def _set_mode(chunks, training: bool) -> None:
    """``train()`` / ``eval()`` on each model chunk, skipped when it is in that mode already: the walk over
    every submodule costs ~0.8 ms on the demo's model and the ref pass follows the old-log-prob pass (as the
    second optimizer step follows the first) in the same mode. The backend is the only one that switches
    modes, always a whole chunk at once, so the chunk's own flag stands for its submodules'."""
    for m in chunks:
        if m.training != training:
            m.train(training)



@contextlib.contextmanager
def _output_rows(layer, rows: LossRows):
    """Run megatron's output layer (a ``ColumnParallelLinear``) on the loss rows only (``backends.loss_rows``).

    Under sequence parallelism its input is this TP rank's slice of the tokens: the
    hook gathers it first and the layer runs without sequence parallelism for this
    call, as megatron-core's own last-token inference path does. The gather's
    backward is a split (``tensor_parallel_output_grad=False``) because the layer's
    backward then all-reduces the input gradient over TP (``copy_to_tensor_model_parallel_region``),
    so each rank's partial gradient is summed exactly once.
    """
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region  # lazy: megatron-core

    sequence_parallel = layer.sequence_parallel

    def select(hidden: torch.Tensor) -> torch.Tensor:  # [s (/tp under SP), 1, h] -> [rows, 1, h]
        if sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False,
                                                          group=layer.tp_group)
        return hidden.index_select(0, rows.rows.to(hidden.device))

    layer.sequence_parallel = False
    try:
        with keep_rows(layer, select):
            yield
    finally:
        layer.sequence_parallel = sequence_parallel
