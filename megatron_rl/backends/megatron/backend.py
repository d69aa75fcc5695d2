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
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_rl.algorithms.losses import LossInputs
from megatron_rl.algorithms.spec import Spec
from megatron_rl.models.peft_adapter import AdapterExport
from megatron_rl.backends.base import (ExportScope, TrainBackend, TrainBatch, WeightManager, bucketed,
                                      finish_step_metrics)
from megatron_rl.backends.megatron.engine_moe import use_engine_moe
from megatron_rl.backends.megatron.routing_replay import RoutingReplay, moe_pattern
from megatron_rl.backends.megatron.checkpoint import load_checkpoint, save_checkpoint
from megatron_rl.backends.megatron.critic import MegatronCritic
from megatron_rl.backends.megatron.frozen_role import MegatronFrozenRole
from megatron_rl.backends.megatron.role_model import (Optimization, RoleAttributes, RoleModel, load_model_dir,
                                                     lora_spec)
from megatron_rl.backends.megatron.settings import check_backend_config, layout_from_config
from megatron_rl.backends.roles import needs_own_model
from megatron_rl.backends.sleep_tiers import MEMORY_SAVER_NOTE, plan_sleep
from megatron_rl.config import Config
from megatron_rl.data.packing import ImageTokens, LossDenominators, MicroBatchPlan, PackedBatch, pad_multiple_for
from megatron_rl.data.types import AnySample
from megatron_rl.errors import CheckpointError
from megatron_rl.infra import reloadable_groups
from megatron_rl.models import cp_utils, dist_io, get_bridge, model_dir
from megatron_rl.models.parallel import LayoutScope, initialize_parallel
from megatron_rl.models.weights import unwrap
from megatron_rl.ops.batch_invariant import batch_invariant_mode

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ActorHooks:
    """The actor's additions to a pass (``role_model.PassHooks``): routing replay (R3: the engine's routes
    recorded by the old-log-prob pass and replayed by every later pass over the same samples,
    ``routing_replay.py``) and, with --enable-mtp-training, the MTP block's targets of each micro-batch."""

    def __init__(self, backend: "MegatronBackend") -> None:
        self.backend = backend
        self.mtp_denoms: Optional[LossDenominators] = None  # set while an --enable-mtp-training step runs
        self._pass_samples: Sequence[AnySample] = ()

    def start_pass(self, samples: Sequence[AnySample], micro_batches: list[PackedBatch], training: bool) -> None:
        """A forward pass over samples this rank has no routes for records them; every later pass replays."""
        routing = self.backend.routing
        if routing is None:
            return
        self._pass_samples = samples
        mine = [samples[i] for mb in micro_batches for i in mb.sample_indices.tolist()]
        record = not training and any(id(s) not in routing.records for s in mine)
        routing.start_pass(mine, record=record)

    def end_pass(self, collect: bool) -> dict[str, float]:
        """Close the pass; a replaying pass reports how often the trainer's own router agreed (a collective:
        every rank; ``collect=False`` after a failed pass, whose peers may not get here)."""
        routing = self.backend.routing
        if routing is None:
            return {}
        agreement, recording = routing.agreement, routing.recording
        routing.end_pass()
        self._pass_samples = ()
        if recording or not collect:
            return {}
        counts = torch.tensor([agreement.agreed, agreement.total], dtype=torch.float64)
        if dist.get_world_size() > 1:
            dist.all_reduce(counts)
        return {"route_agreement": float(counts[0] / counts[1])} if counts[1] > 0 else {}

    def before_forward(self, model, mb: PackedBatch) -> None:
        backend = self.backend
        if self.mtp_denoms is not None and getattr(unwrap(model), "mtp_process", False):
            from megatron_rl.models.mtp import mtp_targets  # lazy: imports megatron-core's GPTModel

            actor = backend.actor
            cp = actor.layout.cp  # a context-parallel rank scores the rows of its own shard
            local = cp_utils.cp_local_index(mb.cu_seqlens.cpu(), actor.pg.cp.rank(), cp) if cp > 1 else None
            unwrap(model).mtp_targets = mtp_targets(
                mb.cu_seqlens, mb.response_lengths, mb.response_positions, mb.response_target_ids, mb.loss_mask,
                backend.bridge.mtp_num_layers, max(self.mtp_denoms.global_tokens, 1), backend.vocab_size,
                backend.cfg.megatron.mtp_loss_scaling_factor, local_index=local,
                cp_group=actor.pg.cp if cp > 1 else None)
        if backend.routing is not None:
            backend.routing.before_forward(backend.actor.chunk_index(model), mb, self._pass_samples)

    def after_forward(self, model, mb: PackedBatch) -> None:
        if self.backend.routing is not None:
            self.backend.routing.after_forward(self.backend.actor.chunk_index(model), mb, self._pass_samples)


class MegatronBackend(RoleAttributes, TrainBackend):
    """The run's roles on megatron-core (``backends/roles.py``): the actor, ppo's critic (``critic.py``) and any
    frozen role of other shapes (``frozen_role.py``), each a ``RoleModel`` built by ``role_model.py``."""

    critic: Optional[MegatronCritic] = None

    def initialize(self, cfg: Config, spec: Spec) -> None:
        from megatron.core import parallel_state as ps

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
        self.pad_token_id = 0
        self._vision_exported = False  # --freeze-vision-tower: whether an export has sent the tower once
        if self.bridge.vision_language:  # micro-batches carry the samples' images and M-RoPE positions
            self.image_tokens = ImageTokens(self.bridge.image_token_id, self.bridge.spatial_merge_size)
        self.routing: Optional[RoutingReplay] = None  # --use-routing-replay
        self.hooks = ActorHooks(self)
        self.role = RoleModel("actor", cfg, self.bridge, LayoutScope(self.layout, self.layout),
                               params_dtype=self.params_dtype, head="logprob", load=self._load_initial_weights,
                               optimization=Optimization(cfg.optimizer.lr, cfg.optimizer.lr_warmup_iters),
                               lora=lora_spec(cfg), lora_load=self._load_lora, prepare=self._freeze_parts,
                               hooks=self.hooks)
        if self.lora and dist.get_rank() == 0:
            from megatron_rl.models import lora  # lazy: imports megatron-core's parallel layers

            saved = lora.saved_parameter_count(self.chunks)
            log.info("%s%s%s", lora.describe(self.lora),
                     f", {saved} of modules to save ({' '.join(cfg.lora.lora_modules_to_save)})" if saved else "",
                     f", started from {cfg.lora.lora_load}" if cfg.lora.lora_load else "")
        self.vocab_size = self.bridge.vocab_size
        self.padded_vocab_size = self.bridge.padded_vocab_size(self.layout.tp)
        self.weights = WeightManager.resolved(self._named_local_params, cfg.memory.ref_weights_location,
                                              offload_train=cfg.memory.effective_offload_train)
        if self.model_config.moe_enable_routing_replay:
            # R3: the engine's routes, over every MoE layer of the model
            pattern = moe_pattern(self.model_config) if cfg.megatron.use_rollout_routing_replay else None
            self.routing = RoutingReplay.attach(self.chunks, ps, self.layout, int(self.model_config.moe_router_topk),
                                                moe_pattern=pattern)
        if cfg.algorithm.true_on_policy_mode and getattr(self.model_config, "num_moe_experts", None):
            use_engine_moe(self.chunks, self.routing)  # the MoE layers in the engine's arithmetic (R3 experts)
        self.critic = None  # ppo's value model, on these ranks with this layout or its own
        if cfg.algorithm.advantage_estimator == "ppo":
            self.critic = MegatronCritic(self, cfg)

    @property
    def actor(self) -> RoleModel:
        """The actor's model: ``role``, so ``RoleAttributes``' names (``chunks``, ``model``, ``optimizer``, ...) are
        the actor's."""
        return self.role

    @property
    def model_config(self):
        """The actor's ``TransformerConfig``."""
        return self.actor.config

    # ---- helpers -------------------------------------------------------------

    def _freeze_parts(self, chunks: list) -> None:
        """Parts loaded but not trained are frozen (no gradient, no optimizer state; loaded and checkpointed, never
        stepped): an MTP block without --enable-mtp-training (exported: the engine holds its own copy), and a
        vision-language model's tower under --freeze-vision-tower (not exported: the engine keeps the one it
        loaded, which is the trainer's)."""
        if self.bridge.mtp_num_layers and not self.cfg.megatron.enable_mtp_training:
            from megatron_rl.models.mtp import freeze_mtp  # lazy: imports megatron-core's GPTModel

            freeze_mtp(chunks)
        if self.cfg.model.freeze_vision_tower:
            for chunk in chunks:
                vision = getattr(chunk, "vision", None)  # the first pipeline stage's
                if vision is not None:
                    vision.requires_grad_(False)

    def _load_lora(self, adapters: list) -> None:
        """--lora-load: a PEFT adapter dir (validated against the flags before any worker started)."""
        if self.cfg.lora.lora_load:
            from megatron_rl.models import lora  # lazy: imports megatron-core's parallel layers
            from megatron_rl.models.peft_adapter import read_adapter_tensors  # lazy: a --lora-load run only

            lora.load_peft_tensors(adapters, read_adapter_tensors(self.cfg.lora.lora_load, "--lora-load"))

    def _named_local_params(self):
        """What a weight tag keeps: every parameter, or with LoRA the adapters only (the base is frozen, so the
        initial adapters are the whole difference to the base model: a reference costs adapter bytes)."""
        return self.actor.named_local_params(trainable_only=bool(self.lora))

    @property
    def _mtp_model(self):
        """This rank's model chunk holding the MTP block when --enable-mtp-training trains it, else None."""
        if not self.cfg.megatron.enable_mtp_training:
            return None
        return next((unwrap(c) for c in self.chunks if getattr(unwrap(c), "mtp_process", False)), None)

    @property
    def trained_roles(self) -> list[RoleModel]:
        """The roles with an optimizer: what sleep offloads and a checkpoint saves."""
        return [self.actor] + ([self.critic.role] if self.critic is not None else [])

    @property
    def is_last_stage(self) -> bool:
        return self.ps.is_pipeline_last_stage(ignore_virtual=True)

    # ---- TrainBackend --------------------------------------------------------

    def forward(self, samples: Sequence[AnySample], plan: Optional[MicroBatchPlan] = None,
                owned_only: bool = False) -> list[Optional[torch.Tensor]]:
        plan, mbs, _ = self.preprocess_rollout_data(samples, plan=plan)
        with batch_invariant_mode(self.cfg.algorithm.true_on_policy_mode):  # the engine's arithmetic per token
            per_mb = self.actor.forward_only(samples, mbs, self.spec)
        return self.gather_per_sample(per_mb, samples, plan, owned_only)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        samples = batch.samples
        t0 = time.perf_counter()
        plan, mbs, denoms = self.preprocess_rollout_data(samples, batch)
        with batch_invariant_mode(self.cfg.algorithm.true_on_policy_mode):  # the first minibatch's ratio exactly 1
            metrics = self._train_actor(samples, plan, mbs, denoms, t0) if batch.train_actor else {}
        metrics.update(self.critic_step(batch, mbs, denoms))  # ppo: one critic step beside the actor's
        return metrics

    def _train_actor(self, samples, plan, mbs, denoms, t0: float) -> dict[str, float]:
        actor = self.actor

        def loss_fn(mb, rows, output):
            out = actor.model_output(self.spec, mb, rows, output)
            inputs = LossInputs.from_packed_batch(mb, out.logprobs, out.entropy)
            loss, metrics = self.spec.compute_loss(inputs, denoms)
            mtp_model = self._mtp_model
            if mtp_model is not None and mtp_model.last_mtp_loss is not None:  # this micro-batch's, normalised
                tokens = inputs.loss_mask.detach().double().sum()
                metrics["mtp_loss"] = (mtp_model.last_mtp_loss.double() * max(denoms.global_tokens, 1), tokens)
                mtp_model.last_mtp_loss = None
            # Under CP every CP rank computes the same full-sequence loss and the all-gather's
            # backward sums their gradients; DDP then sums over CP too: divide by cp once.
            return loss / self.layout.cp, metrics

        self.hooks.mtp_denoms = denoms if self.cfg.megatron.enable_mtp_training else None
        try:
            step = actor.train_pass(samples, mbs, loss_fn, spec=self.spec)
        finally:
            self.hooks.mtp_denoms = None
            if self._mtp_model is not None:
                self._mtp_model.mtp_targets = None
        metrics = {**step.metrics, **step.extra}
        return finish_step_metrics({f"train/{k}": v for k, v in metrics.items()}, grad_norm=step.grad_norm,
                                   lr=self.optimizer.param_groups[0]["lr"], update_ok=step.update_ok,
                                   loss_scale=step.loss_scale, micro_batches=plan.num_micro_batches, started=t0)

    def export_weights(self, bucket_bytes: int, *, stage_only: bool = False,
                       merge_adapters: bool = True) -> Iterator[list[tuple[str, torch.Tensor]]]:
        with contextlib.ExitStack() as merged:  # LoRA: the engine gets the adapters folded into the weights
            for adapters in self.lora if merge_adapters else ():
                merged.enter_context(adapters.merged())
            # the MTP layers go to the engine when it drafts with them (--speculative-algorithm: trained by
            # --enable-mtp-training, or frozen but needed again after a release); otherwise the engine has none.
            # --freeze-vision-tower: the tower goes with the first export only (the trainer's may come from --load,
            # not the engine's --hf-checkpoint); it never moves after that, so the engine's copy stays the trainer's
            with_vision = not (self.cfg.model.freeze_vision_tower and self._vision_exported)
            yield from bucketed(self.bridge.export_hf_weights(self.chunks, bucket_bytes=bucket_bytes,
                                                              stage_only=stage_only, include_mtp=self.syncs_mtp,
                                                              include_vision=with_vision), bucket_bytes)
            self._vision_exported = True

    @property
    def syncs_mtp(self) -> bool:
        """Whether the weight sync carries the MTP layers: the embedded engine drafts with them
        (--speculative-algorithm). An SGLang engine's draft worker keeps the checkpoint's MTP layers it loaded at
        launch (its target model skips MTP names), so they are not sent there."""
        r = self.cfg.rollout
        return bool(self.bridge.mtp_num_layers) and r.speculative_algorithm is not None and \
            r.rollout_backend == "embedded"

    def export_adapters(self, *, stage_only: bool = False) -> AdapterExport:
        """The adapters gathered over TP (and PP unless ``stage_only``): ``models/lora.full_adapter_tensors``."""
        if not self.lora:
            return super().export_adapters(stage_only=stage_only)
        from megatron_rl.models import lora  # lazy: imports megatron-core's parallel layers

        lo = self.cfg.lora
        saved = lora.saved_module_tensors(self.bridge, self.chunks) if lo.lora_modules_to_save else None
        return AdapterExport(lora.full_adapter_tensors(self.lora, stage_only=stage_only, saved=saved), lo.lora_rank,
                             float(lo.lora_alpha), tuple(lo.lora_modules_to_save),
                             bool(self.bridge.tie_word_embeddings))

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
        for role in self.trained_roles:
            role.sleep()
        for frozen in self.frozen_roles.values():
            frozen.sleep()
        torch.cuda.empty_cache()

    def wake(self) -> None:
        if not torch.cuda.is_available():
            return
        for role in self.trained_roles:
            role.wake()
        for frozen in self.frozen_roles.values():
            frozen.wake()

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

    def _load_initial_weights(self, chunks: list) -> None:
        """``--hf-checkpoint``, or a model-only torch_dist dir given as ``--load`` (what
        ``convert_ckpt.py hf-to-dist`` writes; Megatron's ``--finetune`` start: weights only,
        fresh optimizer, step 0). Before the optimizer exists, so its master weights copy them."""
        cfg = self.cfg
        path = cfg.checkpoint.load
        hf_dir = cfg.model.hf_checkpoint
        assert hf_dir is not None, "initialize built the bridge from --hf-checkpoint's config"
        if path is None or not model_dir.is_model_dir(path):
            # a dist-to-hf output carries checksums: damage is refused by file name, not trained on
            model_dir.check_hf_marker_once(hf_dir, f"checking --hf-checkpoint {hf_dir}")
            self.bridge.load_hf_weights(chunks, hf_dir)
            return
        load_model_dir(chunks, path, self.bridge, hf_dir)
        log.info("initial weights from the torch_dist model dir %s (--load); optimizer starts fresh", path)

    def load_frozen_weights(self, tag: str, path: str) -> None:
        """Store the weights at ``path`` under ``tag`` (``--ref-load`` / ``--opd-teacher-load``).

        ``path`` is an HF directory (config.json + safetensors) or a torch_dist
        checkpoint (a converted model dir, an ``iter_NNNNNNN`` dir or a checkpoint
        root). The weights pass through the live model once (so every layout and
        every strictness check of the loaders applies) and the live actor weights
        are put back afterwards: a tag is a swap of the same parameters. Weights of
        other shapes (``roles.needs_own_model``: a larger teacher) get a frozen model
        of their own instead (``frozen_role.py``).
        """
        flag = {"ref": "--ref-load", "teacher": "--opd-teacher-load"}.get(tag, tag)
        if not os.path.isdir(path):
            raise CheckpointError(f"{flag} {path}: no such directory")
        if needs_own_model(self.cfg.model.hf_checkpoint, path, flag):  # other shapes: a model of its own
            self.frozen_roles[tag] = MegatronFrozenRole(self, tag, path, flag)
            return
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
