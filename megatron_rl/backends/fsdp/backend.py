"""FSDPBackend: the policy as a HuggingFace model sharded with FSDP2 on a 1-D data-parallel mesh.

For models megatron-core does not cover, or users who want HF-native training: the
model is ``transformers.AutoModelForCausalLM`` from ``--hf-checkpoint``, every decoder
layer and then the root are ``torch.distributed.fsdp.fully_shard``-ed over all ranks
(gloo on CPU, NCCL on GPU). Nothing is parallel but data: ``holds_results`` is True on
every rank and ``pad_to_multiple`` is 1. Planning, packing, loss denominators, the
per-sample gather, weight tags and the algorithm ``Spec`` are the shared ones, so the
numbers match the megatron backend on the same model and batch (tested).

Loss normalisation, as in the megatron backend: each micro-batch's loss is a SUM divided
by the step's GLOBAL denominator (``algorithms.losses``), so gradients must be *summed*
over micro-batches and data-parallel ranks. Micro-batches accumulate into ``.grad``;
across ranks every FSDP module's gradient divide factor is 1 (reduce-scatter sums, where
FSDP2's default averages over the mesh).

Micro-batches reach the model through the padding fallback (``padding.py``): right-padded
rows with an attention mask, because SDPA on CPU has no variable-length kernel. The
varlen path (position ids + flash-attention) for GPUs is not built here.

Precision: fp32 by default; ``--bf16`` / ``--fp16`` are ``MixedPrecisionPolicy(param_dtype=
bf16|fp16, reduce_dtype=fp32)``: sharded fp32 parameters are the master weights and the
optimizer state, compute runs in the half type, gradients reduce in fp32. ``--fp16`` scales
the loss as megatron-core does (``loss_scale.py``: a step whose gradients overflow on any
rank is skipped and the scale backs off). Exported weights are cast to the half type then,
as the megatron backend exports them.

``--optimizer-cpu-offload`` is FSDP2's ``CPUOffloadPolicy``: sharded parameters, gradients
and optimizer state live in host memory, the optimizer steps on the CPU, each unit's
parameters are copied to the device for its all-gather. On a GPU the process group is
``cpu:gloo,cuda:nccl`` then, because gradient clipping and the overflow check reduce
host tensors (NCCL has no CPU backend: docs/peer-failures.md).

PPO's critic (``--advantage-estimator ppo``): a second HF trunk with a value head, loaded by
``load_hf_model`` and sharded by ``shard`` as the actor is, with its own optimizer, schedule and
loss scaler (``critic.py``); ``compute_values`` runs it, ``train_step`` steps it when the batch
carries returns (and skips the actor when ``train_actor`` is False).

Frozen roles (``--ref-load``, ``--opd-teacher-load``, HF directories): weights of the actor's shapes are a
weight tag (the shared ``WeightManager``, loaded through the live shards); weights of other shapes (a larger
teacher: ``roles.needs_own_model``) are a model of their own, frozen and sharded as the actor is
(``teacher.py``), whose log-probs run through the actor's forward path (``log_probs_of``).

Checkpoints: torch.distributed.checkpoint (DCP) in the megatron backend's checkpoint root
layout (``checkpoint.py``); a frozen role's own model is not saved (its flag reloads it). Not built in this
version (refused by ``config.validate`` before any worker starts): selective recompute,
``--optimizer-offload-fraction`` below 1, torch_dist ``--ref-load`` / ``--opd-teacher-load`` / model-dir
``--load``.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence, TypeVar

import torch
import torch.distributed as dist

from megatron_rl.algorithms.losses import LossInputs, reduce_metrics
from megatron_rl.algorithms.spec import ModelOutput, Spec
from megatron_rl.models.peft_adapter import AdapterExport
from megatron_rl.backends.base import TrainBackend, TrainBatch, WeightManager, bucketed, finish_step_metrics
from megatron_rl.backends.fsdp import lora as fsdp_lora
from megatron_rl.backends.fsdp.checkpoint import load_checkpoint, save_checkpoint
from megatron_rl.backends.fsdp.critic import FSDPCritic
from megatron_rl.backends.fsdp.loss_scale import LossScaler
from megatron_rl.backends.fsdp.optim import MegatronLRSchedule, build_optimizer, param_groups, train_on_micro_batches
from megatron_rl.backends.fsdp.padding import unpack_to_rows
from megatron_rl.backends.fsdp.teacher import FSDPFrozenModel
from megatron_rl.backends.loss_rows import (keep_rows, pack_output, padded_loss_rows, project_rows,
                                            projects_plainly, select_hf_rows, unpack_output)
from megatron_rl.backends.roles import needs_own_model
from megatron_rl.backends.sleep_tiers import plan_sleep
from megatron_rl.config import Config
from megatron_rl.data.packing import LossDenominators, MicroBatchPlan, PackedBatch
from megatron_rl.data.types import AnySample
from megatron_rl.errors import BackendError, CheckpointError, ConfigError
from megatron_rl.infra import collective_watch
from megatron_rl.infra.ports import free_port
from megatron_rl.models import model_dir
from megatron_rl.models.hf_checkpoint import HFCheckpoint
from megatron_rl.models.hf_module import checkpoint_tensors, hf_checkpoint_names, layer_of

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

_Module = TypeVar("_Module", bound=torch.nn.Module)  # shard() hands back the module it was given


def init_process_group(host_collectives: bool = False) -> None:
    """torch.distributed for the training ranks (gloo on CPU, NCCL on GPU), if nobody did yet.

    ``host_collectives``: on a GPU also a gloo backend for CPU tensors (``cpu:gloo,cuda:nccl``),
    which FSDP2's CPU offload needs for the gradient-norm and overflow reductions.
    Outside torchrun (no ``RANK``) a private one-rank TCP store, leaving ``os.environ`` alone
    so subprocesses started later do not inherit it (as ``models.parallel`` does for megatron)."""
    if dist.is_initialized():
        if host_collectives and torch.cuda.is_available() and "gloo" not in str(dist.get_backend()):
            raise BackendError(f"--optimizer-cpu-offload with --train-backend fsdp on a GPU reduces host tensors, "
                               f"but the process group was already initialised with {dist.get_backend()!r} only; "
                               "initialise it with backend='cpu:gloo,cuda:nccl' (or let the fsdp backend do it)")
        return
    backend = ("cpu:gloo,cuda:nccl" if host_collectives else "nccl") if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "RANK" in os.environ:
        dist.init_process_group(backend=backend, init_method="env://", timeout=collective_watch.timeout())
        return
    dist.init_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=collective_watch.timeout())


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of an HF causal LM (``model.model.layers`` for llama/qwen-style families)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise BackendError(f"--train-backend fsdp: {type(model).__name__} has no model.layers to shard one by one; "
                           "this HF architecture is not supported by the fsdp backend yet")
    return list(layers)


def attention_implementation(hf_dir: str) -> str:
    """transformers' SDPA attention where the architecture has it, else its eager attention: gpt-oss's
    attention sinks (a per-head logit in the softmax's denominator) have no SDPA form in transformers, which
    refuses ``sdpa`` for it; eager computes the same attention with masks, only slower."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = transformers.AutoConfig.from_pretrained(hf_dir)
    cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    return "sdpa" if cls is None or getattr(cls, "_supports_sdpa", False) else "eager"


#: HF causal-LM families whose forward returns ``lm_head``'s output as the logits, untouched (transformers 5:
#: no soft-capping, scaling or slicing after it; Gemma 2/3 soft-cap, Cohere and Granite scale: not listed)
PLAIN_LM_HEAD_MODEL_TYPES = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe",
                                       "qwen3_next", "glm4_moe", "deepseek_v3", "olmo2", "phi3"})


def lm_head_is_plain(model, lm_head) -> bool:
    """Whether ``model``'s logits are exactly its ``lm_head``'s matmul (the family returns them untouched and
    the head is a plain bias-free ``nn.Linear``), so the chunked log-prob op may stand in for it."""
    return (getattr(model.config, "model_type", None) in PLAIN_LM_HEAD_MODEL_TYPES
            and projects_plainly(lm_head, torch.nn.Linear))


class FSDPBackend(TrainBackend):
    critic: Optional[FSDPCritic] = None
    def initialize(self, cfg: Config, spec: Spec) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

        self.cfg, self.spec = cfg, spec
        self.cpu_offload = cfg.optimizer.optimizer_cpu_offload
        init_process_group(host_collectives=self.cpu_offload)
        self.dp_size, self.dp_rank = dist.get_world_size(), dist.get_rank()
        self.sleep_plan = plan_sleep(cfg.memory.offload_train_groups, backend="fsdp", cuda=torch.cuda.is_available())
        if cfg.memory.effective_offload_train and self.dp_rank == 0:
            log.info("trainer sleep (--offload-train/--colocate): %s", self.sleep_plan.describe())
        self.pad_to_multiple = 1
        self.holds_results = True  # no tensor/pipeline/context parallelism: every rank is its DP rank's holder
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
        torch.manual_seed(cfg.runtime.seed)
        self.mesh = init_device_mesh(self.device.type, (self.dp_size,), mesh_dim_names=("dp",))

        hf = cfg.model.hf_checkpoint
        if hf is None:
            raise ConfigError("--train-backend fsdp builds the model from --hf-checkpoint (also when resuming "
                              "from its DCP checkpoints): give --hf-checkpoint DIR")
        if model_dir.is_model_dir(cfg.checkpoint.load):
            raise ConfigError(f"--load {cfg.checkpoint.load} is a torch_dist model dir (megatron's format); "
                              "--train-backend fsdp starts from --hf-checkpoint and resumes from its own DCP "
                              "checkpoints: convert it to HF (tools/convert_ckpt.py dist-to-hf) and pass "
                              "--hf-checkpoint")
        model_dir.check_hf_marker_once(hf, f"checking --hf-checkpoint {hf}")
        self.params_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16,
                             "float32": torch.float32}[cfg.precision.params_dtype]
        mp = MixedPrecisionPolicy(param_dtype=self.params_dtype, reduce_dtype=torch.float32) \
            if self.params_dtype != torch.float32 else MixedPrecisionPolicy()
        # pinned host memory makes the copies asynchronous; there is no device to pin for on CPU
        offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if self.cpu_offload else OffloadPolicy()
        self._fsdp_kwargs: dict[str, Any] = dict(mesh=self.mesh, mp_policy=mp, offload_policy=offload)
        lo = cfg.lora
        # --lora-rank: PEFT's adapters in the HF model, the base frozen (backends/fsdp/lora.py)
        self.lora_scaling: Optional[float] = float(lo.lora_alpha) / lo.lora_rank if lo.lora_rank else None
        model = self.shard(self.load_hf_model(hf, lora=True))
        self.model = model
        self.vocab_size = model.config.vocab_size
        self.pad_token_id = 0
        self.optimizer = build_optimizer(cfg.optimizer, param_groups(model.named_parameters()))
        self.scheduler = MegatronLRSchedule.from_config(self.optimizer, cfg)
        self.weights = WeightManager.resolved(self._named_local_params, cfg.memory.ref_weights_location,
                                              offload_train=cfg.memory.effective_offload_train)
        self.optimizer_steps = 0
        self.loss_scaler: Optional[LossScaler] = LossScaler.from_precision(cfg.precision) \
            if cfg.precision.fp16 else None
        self._offloaded = False
        self.critic = None  # ppo's value model (critic.py), sharded as the actor
        if cfg.algorithm.advantage_estimator == "ppo":
            self.critic = FSDPCritic(self, cfg)

    def load_hf_model(self, path: str, lora: bool = False) -> "PreTrainedModel":
        """``AutoModelForCausalLM`` from the HF dir ``path`` on this rank's device, unsharded: float32 master
        weights (--bf16 only changes the compute dtype: ``MixedPrecisionPolicy``), no KV cache, with full
        recompute when asked; ``lora``: the actor's --lora-rank adapters injected. The actor and the critic's
        trunk are loaded alike."""
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                                  attn_implementation=attention_implementation(path))
        HFCheckpoint(path).refuse_non_finite_parameters(model)  # inf/NaN named here, not as NaN logits later
        model.config.use_cache = False
        if lora and self.cfg.lora.lora_rank:
            fsdp_lora.attach(model, self.cfg.lora)  # in place
        if self.cfg.memory.recompute_granularity == "full":
            # megatron's full recompute at one layer per unit: every decoder layer's activations are
            # recomputed in the backward (transformers' per-layer checkpointing; validation refuses the rest)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.to(self.device)  # type: ignore[arg-type]  # transformers' @wraps(Module.to) hides the bound self
        return model

    def shard(self, model: _Module) -> _Module:
        """``fully_shard`` every decoder layer of ``model`` and then its root on the backend's mesh, with its mixed
        precision and offload policy, and gradients summed over ranks (the module docstring)."""
        from torch.distributed.fsdp import FSDPModule, fully_shard

        # reshard after every forward, the root too (its default keeps embeddings and head gathered
        # for the backward): a forward-only pass must leave only shards behind, which the weight
        # tags and export read
        for layer in decoder_layers(model):
            fully_shard(layer, reshard_after_forward=True, **self._fsdp_kwargs)
        fully_shard(model, reshard_after_forward=True, **self._fsdp_kwargs)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                # sum over DP: the loss is already globally normalised. A plain SUM collective (gloo
                # has no PREMUL_SUM, the op a custom divide factor otherwise becomes)
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)
        return model

    # ---- helpers -------------------------------------------------------------

    def _named_local_params(self):
        """This rank's shard of every parameter (the DTensor's local tensor, same storage); with LoRA the
        adapters only (what a weight tag keeps: the frozen base never moves)."""
        for name, p in self.model.named_parameters():
            if self.lora_scaling is not None and not p.requires_grad:
                continue
            with torch.no_grad():
                local = p.to_local() if hasattr(p, "to_local") else p
            yield name, local

    def _model_output(self, model: "PreTrainedModel", mb: PackedBatch, with_entropy: bool = True) -> ModelOutput:
        """Response-aligned log-probs (+ entropy when ``with_entropy``) of one micro-batch under ``model`` (the
        actor, or a frozen role's own model: ``teacher.py``) through the padding fallback.

        The ``lm_head`` sees only the loss rows' hidden states (``backends.loss_rows``):
        prompt, observation and pad positions get no logits; their log-probs read 0.0. Where the
        model uses its ``lm_head``'s output as its logits unchanged (``lm_head_is_plain``), the head
        is replaced for the call by the spec's chunked projection into log-probs (and entropy), so
        the loss rows' logits exist one chunk at a time (``ops.linear_logprob``).
        An empty micro-batch (a DP rank with fewer samples than micro-batches) still runs the
        model, so every rank issues the same FSDP all-gathers and reduce-scatters; its outputs
        are empty and it carries no loss."""
        padded = unpack_to_rows(mb, self.pad_token_id).to(self.device)
        rows = padded_loss_rows(mb, padded.response_rows, padded.response_cols, padded.input_ids.shape[1])
        lm_head = model.get_output_embeddings()
        select = select_hf_rows(rows)
        targets = rows.targets.to(self.device)
        if lm_head_is_plain(model, lm_head):
            def projected(hidden: torch.Tensor) -> torch.Tensor:  # [1, rows, k]: the rows' log-probs (+ entropy)
                kept = select(hidden)[0]
                return pack_output(self.spec.extract_model_output_from_hidden(
                    kept, lm_head.weight, targets, with_entropy=with_entropy)).unsqueeze(0)

            with project_rows(lm_head, projected):
                packed = model(input_ids=padded.input_ids, attention_mask=padded.attention_mask,
                               use_cache=False).logits
            out = unpack_output(packed)
        else:
            with keep_rows(lm_head, select):
                logits = model(input_ids=padded.input_ids, attention_mask=padded.attention_mask,
                               use_cache=False).logits  # [1, rows, V]
            out = self.spec.extract_model_output(logits[0].float(), targets, with_entropy=with_entropy)
        return ModelOutput(rows.to_response(out.logprobs),
                           rows.to_response(out.entropy) if out.entropy is not None else None)

    # ---- TrainBackend --------------------------------------------------------

    def forward(self, samples: Sequence[AnySample], plan: Optional[MicroBatchPlan] = None,
                owned_only: bool = False) -> list[Optional[torch.Tensor]]:
        return self.log_probs_of(self.model, samples, plan, owned_only)

    def log_probs_of(self, model: "PreTrainedModel", samples: Sequence[AnySample], plan: Optional[MicroBatchPlan],
                     owned_only: bool) -> list[Optional[torch.Tensor]]:
        """``forward``'s contract under ``model``: the actor's or a frozen role's own (both sharded on this
        backend's mesh, so every rank runs the same micro-batches and FSDP collectives)."""
        plan, mbs, _ = self.preprocess_rollout_data(samples, plan=plan)
        model.eval()
        local: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for mb in mbs:
                out = self._model_output(model, mb, with_entropy=False)  # log-probs are all a forward pass keeps
                lp = out.logprobs.detach().float().cpu()
                local.update(zip(mb.sample_indices.tolist(), mb.split_response(lp)))
        return self.gather_per_sample(local, samples, plan, owned_only)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        t0 = time.perf_counter()
        plan, mbs, denoms = self.preprocess_rollout_data(batch.samples, batch)
        assert denoms is not None, "preprocess_rollout_data computes the loss denominators when given a batch"
        metrics = self._train_actor(plan, mbs, denoms, t0) if batch.train_actor else {}
        metrics.update(self.critic_step(batch, mbs, denoms))  # ppo: one critic step beside the actor's
        return metrics

    def _train_actor(self, plan: MicroBatchPlan, mbs: list[PackedBatch], denoms: LossDenominators,
                     t0: float) -> dict[str, float]:
        def loss_of(mb: PackedBatch):
            out = self._model_output(self.model, mb)
            mb = mb.to(self.device)
            return self.spec.compute_loss(LossInputs.from_packed_batch(mb, out.logprobs, out.entropy), denoms)

        step, parts = train_on_micro_batches(self.model, self.optimizer, self.scheduler, self.loss_scaler,
                                             self.cfg.optimizer.grad_clip, "actor", mbs, loss_of)
        if step.update_ok:
            self.optimizer_steps += 1
        step_metrics = {f"train/{k}": v for k, v in reduce_metrics(parts, group=dist.group.WORLD).items()}
        return finish_step_metrics(step_metrics, grad_norm=step.grad_norm, lr=self.optimizer.param_groups[0]["lr"],
                                   update_ok=step.update_ok, loss_scale=step.loss_scale,
                                   micro_batches=plan.num_micro_batches, started=t0)

    def export_weights(self, bucket_bytes: int, *, stage_only: bool = False,
                       merge_adapters: bool = True) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full HF tensors under the checkpoint's names, in buckets. Collective: every rank
        all-gathers each parameter (``full_tensor``) in the same order and gets the same buckets.

        Why ``hf_checkpoint_names``: transformers 5 fuses some checkpoint tensors when it loads
        them (MoE experts become one ``experts.gate_up_proj``); the rollout engine and the HF
        checkpoint know the per-expert names, so each layer's tensors are converted back as
        ``save_pretrained`` does. Tied weights appear once, as in the checkpoint. One pipeline stage:
        ``stage_only`` exports the same. ``merge_adapters`` False: a LoRA run's frozen base weights."""
        yield from bucketed((item for unit in self._full_tensors_by_layer(merge_adapters)
                             for item in hf_checkpoint_names(self.model, unit).items()), bucket_bytes)

    def export_adapters(self, *, stage_only: bool = False) -> AdapterExport:
        """The adapters all-gathered over the FSDP mesh, float32 (the masters the merge uses), PEFT's keys."""
        if self.lora_scaling is None:
            return super().export_adapters(stage_only=stage_only)

        lo = self.cfg.lora
        saved = tuple(lo.lora_modules_to_save)
        with torch.no_grad():  # the adapters and the weights of --lora-modules-to-save (trained in full), whole
            tensors = {fsdp_lora.saved_key(name): (p.full_tensor() if hasattr(p, "full_tensor") else p.detach()).float()
                       for name, p in self.model.named_parameters()
                       if fsdp_lora.is_adapter(name) or fsdp_lora.is_saved(name, saved)}
        tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        return AdapterExport(tensors, lo.lora_rank, float(lo.lora_alpha), saved, tied)

    def _full_tensors_by_layer(self, merge_adapters: bool = True) -> Iterator[dict[str, torch.Tensor]]:
        """The gathered parameters (and persistent buffers, ``hf_module.checkpoint_tensors``), one dict per
        decoder layer (and one per run of other parameters), in ``named_parameters`` order: a conversion
        never spans layers."""
        unit: dict[str, torch.Tensor] = {}
        key = None
        for name, p in checkpoint_tensors(self.model):
            here = layer_of(name)  # "model.layers.7", or None outside the decoder layers
            if unit and here != key:
                yield self._export_unit(unit, merge_adapters)
                unit = {}
            key = here
            with torch.no_grad():
                unit[name] = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
        if unit:
            yield self._export_unit(unit, merge_adapters)

    def _export_unit(self, unit: dict[str, torch.Tensor], merge_adapters: bool = True) -> dict[str, torch.Tensor]:
        """The engine's tensors of one unit: LoRA adapters merged in float32 (plain HF names), then the run's
        dtype; ``merge_adapters`` False: the base weights under the plain HF names."""
        if self.lora_scaling is not None:
            unit = fsdp_lora.merge_unit(unit, self.lora_scaling, merge=merge_adapters)
        return {name: t.to(self.params_dtype) for name, t in unit.items()}

    def save(self, path: str, extra_state: dict) -> None:
        save_checkpoint(self, path, extra_state)

    def load(self, path: str) -> dict:
        return load_checkpoint(self, path)

    def load_frozen_weights(self, tag: str, path: str) -> None:
        """Hold the HF weights at ``path`` as the frozen role ``tag`` (``--ref-load``, ``--opd-teacher-load``),
        leaving the actor as it was.

        Weights of the actor's shapes become a weight tag: the full state dict is loaded on every rank and
        ``set_model_state_dict`` keeps each rank's shard (strict: a different architecture is refused); the
        tag then copies the local shards and the actor's shards are put back. Weights of other shapes
        (``roles.needs_own_model``: a larger teacher; another vocabulary is refused) become a frozen model of
        their own (``teacher.py``), consulted by ``maybe_compute_*_log_probs`` before the tags."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        import transformers

        flag = {"ref": "--ref-load", "teacher": "--opd-teacher-load"}.get(tag, tag)
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise CheckpointError(f"{flag} {path}: the fsdp backend loads HF directories (config.json + "
                                  "*.safetensors) only in this version")
        model_dir.check_hf_marker_once(path, f"checking {flag} {path}")
        if needs_own_model(self.cfg.model.hf_checkpoint, path, flag):
            self.frozen_roles[tag] = FSDPFrozenModel(self, tag, path)
            return
        self.frozen_roles.pop(tag, None)

        def load_into_live() -> None:
            other = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            HFCheckpoint(path).refuse_non_finite_parameters(other)
            full: dict[str, Any] = {n: p.detach() for n, p in other.named_parameters()}  # tied weights once, as ours
            try:
                set_model_state_dict(self.model, full, options=StateDictOptions(full_state_dict=True, strict=True))
            except (RuntimeError, KeyError, ValueError) as e:
                raise CheckpointError(f"{flag} {path} does not fit the policy model ({e}); a weight tag is the "
                                      "same architecture as --hf-checkpoint") from e

        self.weights.load_tag(tag, load_into_live)
        log.info("loaded frozen %s weights from %s (HF)", tag, path)

    def sleep(self) -> None:
        """Free accelerator memory for a colocated engine: sharded parameters, gradients and
        optimizer state (the actor's and ppo's critic's, and a frozen teacher's parameters) move to host memory. CPU: nothing to free, a no-op (as
        megatron's); with --optimizer-cpu-offload they live in host memory already, only the cache is freed.
        The GPU path is written but not tested in this version (no GPU in CI)."""
        if not torch.cuda.is_available() or self._offloaded:
            return
        if self.cpu_offload:
            torch.cuda.empty_cache()
            return
        self._move_state(torch.device("cpu"))
        self._offloaded = True
        torch.cuda.empty_cache()

    def wake(self) -> None:
        if not torch.cuda.is_available() or not self._offloaded or self.cpu_offload:
            return
        self._move_state(self.device)
        self._offloaded = False

    def resident_models(self) -> list[tuple[torch.nn.Module, Optional[torch.optim.Optimizer]]]:
        """Every model this backend keeps on the device, with its optimizer (None: a frozen role's own model):
        what ``sleep`` moves off the device and ``wake`` brings back."""
        held: list[tuple[torch.nn.Module, Optional[torch.optim.Optimizer]]] = [(self.model, self.optimizer)]
        if self.critic is not None:
            held.append((self.critic.model, self.critic.optimizer))
        held.extend((role.model, None) for role in self.frozen_roles.values() if isinstance(role, FSDPFrozenModel))
        return held

    def _move_state(self, device: torch.device) -> None:
        for model, optimizer in self.resident_models():
            # FSDP2 re-registers its sharded parameters after .to()
            model.to(device)
            if optimizer is None:
                continue
            for state in optimizer.state.values():
                for k, v in state.items():
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        state[k] = v.to(device, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
