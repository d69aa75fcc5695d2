"""PPO's critic (value model) on megatron-core, colocated with the actor (``--advantage-estimator ppo``).

The critic is a second ``GPTModel`` built by the same bridge on the actor's ranks, whose output
layer is a ``[hidden -> 1]`` value head (``ValueHead``, slime's ``LinearForLastLayer``); it has
its own DDP (grad buffers), its own megatron optimizer (distributed when the actor's is) and its
own LR schedule (``--critic-lr``, ``--critic-lr-warmup-iters``). It starts from the actor's
initial weights, or from ``--critic-hf-checkpoint`` / ``--critic-load`` (a model-only torch_dist
dir), with a fresh head (normal, std ``init_method_std``, zero bias, from ``--seed``, so every
rank draws the same head).

LoRA (``--lora-rank``): the critic gets adapters of its own (the actor's targets, rank and alpha; fresh, B = 0)
on its frozen trunk, and its value head trains in full, as verl's critic with ``lora_rank``. Its checkpoint
entries are whole (the frozen trunk too: a resume needs nothing else), unlike the actor's adapters-only ones.

Layout: the actor's by default. Its own (``--critic-tensor-model-parallel-size``,
``--critic-pipeline-model-parallel-size``, slime's critic role in ``--megatron-config-path``;
never virtual pipeline stages or context parallelism, so an actor with them has a critic without
them) is a :class:`~megatron_rl.models.parallel.LayoutScope` over the same ranks: megatron's
parallel state of the critic's layout, swapped in around everything the critic does. Its DP size
is then what its layout leaves of the ranks, and it plans, packs and gathers its own share of the
batch (``CriticShare``); PPO holds the whole batch on every rank, so nothing else moves.

Token alignment: the value of response token ``t`` is the head's output at the position whose
hidden state predicts ``t`` (``PackedBatch.response_positions``), the state before the token
is generated: the alignment of the log-probs (slime's ``get_values``, verl's ``values[:, -R-1:-1]``).
Values are 0.0 at tokens without loss (every consumer masks them).

Gradient algebra: without sequence parallelism the hidden states are replicated over TP, so
every TP rank computes the same values and loss and the head's and the trunk's gradients are
already whole on each rank (no TP reduction: that would count them TP times). With sequence
parallelism each rank runs the head on its slice of the tokens, the values are all-gathered
(backward: the split, ``tensor_parallel_output_grad=False``) and the head's parameters are
marked ``sequence_parallel`` so ``finalize_model_grads`` sums their partial gradients over TP,
as megatron does for layer norms. Losses are globally normalised SUMs as the actor's
(``calculate_per_token_loss``, DDP sums over DP): see ``backend.py``.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_rl.algorithms.losses import reduce_metrics
from megatron_rl.backends.base import DataParallelShare, TrainBatch
from megatron_rl.backends.loss_rows import packed_loss_rows
from megatron_rl.data.packing import LossDenominators, PackedBatch, pad_multiple_for
from megatron_rl.data.types import AnySample
from megatron_rl.errors import BackendError, CheckpointError
from megatron_rl.models.parallel import LayoutScope, ParallelLayout

log = logging.getLogger(__name__)


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


def critic_layout(cfg, actor: ParallelLayout) -> ParallelLayout:
    """The critic's layout on the actor's ranks: its own TP/PP where given, else the actor's; no virtual pipeline
    stages and no context parallelism (the critic's passes are built without them); the actor's expert layout."""
    p = cfg.parallel
    tp = p.critic_tensor_model_parallel_size or actor.tp
    return ParallelLayout(tp=tp, pp=p.critic_pipeline_model_parallel_size or actor.pp, vpp=None, cp=1,
                          ep=actor.ep, etp=actor.etp, sequence_parallel=bool(p.sequence_parallel) and tp > 1)


class CriticShare(DataParallelShare):
    """The critic's own share of the batch when its layout is not the actor's: its DP size and rank, its
    padding, which of its ranks hold results (read from its parallel state, in its scope)."""

    def __init__(self, cfg, scope: LayoutScope, pad_token_id: int) -> None:
        from megatron.core import parallel_state as ps  # lazy: megatron-core

        layout = scope.layout
        self.cfg = cfg
        self.pad_token_id = pad_token_id
        with scope:
            self.dp_size = ps.get_data_parallel_world_size()
            self.dp_rank = ps.get_data_parallel_rank()
            self.holds_results = (ps.is_pipeline_last_stage(ignore_virtual=True)
                                  and ps.get_tensor_model_parallel_rank() == 0)
        self.pad_to_multiple = pad_multiple_for(layout.tp, layout.cp, layout.sequence_parallel)

    @property
    def context_parallel_size(self) -> int:
        return 1


class MegatronCritic:
    """The value model beside a ``MegatronBackend``'s actor (module docstring)."""

    def __init__(self, backend, cfg) -> None:
        self.scope = LayoutScope(critic_layout(cfg, backend.layout), backend.layout)
        # its own share of each batch when its layout is not the actor's; else the actor's micro-batches serve
        self.share: Optional[CriticShare] = None if self.scope.same else CriticShare(cfg, self.scope,
                                                                                   backend.pad_token_id)
        with self.scope:
            self._build(backend, cfg)

    def _build(self, backend, cfg) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        from megatron_rl.backends.megatron.backend import (  # lazy: backend.py imports this module (a cycle)
            ddp_config_kwargs, optimizer_config_kwargs, transformer_config_overrides)

        self.backend = backend
        ps = backend.ps
        self.ps = ps
        self.chunks = backend.bridge.build_model(self.scope.layout, params_dtype=backend.params_dtype,
                                                 **transformer_config_overrides(cfg))
        hf_dir, dist_dir = cfg.checkpoint.critic_hf_checkpoint, cfg.checkpoint.critic_load
        source = hf_dir or dist_dir or "the actor's initial weights"
        if hf_dir:
            from megatron_rl.models import model_dir  # lazy: checksums of the HF dir

            model_dir.check_hf_marker_once(hf_dir, f"checking --critic-hf-checkpoint {hf_dir}")
            backend.bridge.load_hf_weights(self.chunks, hf_dir)
        elif dist_dir:
            self._load_dist_trunk(dist_dir, cfg.model.hf_checkpoint)
        elif self.share is not None or backend.lora:  # the actor's initial weights from their source (another
            # layout's shards, or an actor whose linears carry adapters): into the critic's own
            from megatron_rl.models import model_dir  # lazy: checksums of the HF dir

            load = cfg.checkpoint.load
            if load is not None and model_dir.is_model_dir(load):
                self._load_dist_trunk(load, cfg.model.hf_checkpoint, flag="--load")
            else:
                model_dir.check_hf_marker_once(cfg.model.hf_checkpoint,
                                               f"checking --hf-checkpoint {cfg.model.hf_checkpoint}")
                backend.bridge.load_hf_weights(self.chunks, cfg.model.hf_checkpoint)
        else:  # the actor's initial weights (HF or a --load model dir): the same layout, the same names
            with torch.no_grad():
                for actor, critic in zip(backend.chunks, self.chunks):
                    theirs = dict(actor.named_parameters())
                    for name, p in critic.named_parameters():
                        p.copy_(theirs[name])
        config = self.chunks[0].config
        for chunk in self.chunks:
            # the head is no tied output layer: with pipeline stages megatron would otherwise all-reduce the first
            # stage's embedding gradient with the last stage's "output weight" (the [1, h] head)
            chunk.share_embeddings_and_output_weights = False
            if chunk.post_process:
                old = chunk.output_layer
                chunk.output_layer = ValueHead(
                    config.hidden_size, std=float(config.init_method_std), seed=cfg.runtime.seed,
                    dtype=backend.params_dtype, device=next(chunk.parameters()).device,
                    sequence_parallel=bool(config.sequence_parallel),
                    tp_group=ps.get_tensor_model_parallel_group())
                del old
        self.config = config
        self.lora: list = []  # --lora-rank: the critic's own adapters on its frozen trunk; its value head trains
        if cfg.lora.lora_rank:
            from megatron_rl.models import lora  # lazy: imports megatron-core's parallel layers

            self.lora = lora.attach_lora(backend.bridge, self.chunks, lora.LoraSpec(
                cfg.lora.lora_rank, cfg.lora.lora_alpha, cfg.lora.lora_dropout, tuple(cfg.lora.lora_target_modules),
                init_seed=cfg.runtime.seed))
            for chunk in self.chunks:
                if chunk.post_process:
                    chunk.output_layer.requires_grad_(True)
        ddp_config = DistributedDataParallelConfig(**ddp_config_kwargs(cfg))
        self.model = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk,
                                              disable_bucketing=i > 0)
                      for i, chunk in enumerate(self.chunks)]
        # pipeline stages: only the last one's output is values (earlier ones pass hidden states on)
        self._post_process = {id(m): bool(c.post_process) for m, c in zip(self.model, self.chunks)}
        opt = cfg.optimizer
        lr = opt.critic_lr if opt.critic_lr is not None else opt.lr
        kwargs = optimizer_config_kwargs(cfg, backend.params_dtype)
        kwargs.update(lr=lr)
        self.optimizer = get_megatron_optimizer(OptimizerConfig(**kwargs), self.model)
        total_steps = max(1, cfg.rollout.num_rollout * cfg.batching.optimizer_steps_per_rollout
                          * cfg.algorithm.num_steps_per_rollout_updates)
        decay = opt.lr_decay_iters or total_steps
        warmup = opt.critic_lr_warmup_iters
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if warmup else lr, max_lr=lr, min_lr=min(opt.min_lr, lr),
            lr_warmup_steps=warmup, lr_decay_steps=max(decay, warmup + 1), lr_decay_style=opt.lr_decay_style,
            start_wd=opt.weight_decay, end_wd=opt.weight_decay, wd_incr_steps=1, wd_incr_style="constant")
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = self.optimizer.scale_loss
        self.optimizer_steps = 0
        if dist.get_rank() == 0:
            n = sum(p.numel() for c in self.chunks for p in c.parameters())
            log.info("critic: %d parameters on this rank, lr %g, from %s, layout %s", n, lr, source,
                     "the actor's" if self.share is None else
                     f"its own (TP {self.scope.layout.tp}, PP {self.scope.layout.pp}, DP {self.share.dp_size})")

    def _load_dist_trunk(self, path: str, hf_dir: str, flag: str = "--critic-load") -> None:
        """``--critic-load`` (or the actor's ``--load`` model dir, for a critic of its own layout): a model-only
        torch_dist dir, checked as ``--load``'s (marker, checksums, the model's fingerprint and every tensor's
        shape) and loaded while the output layer is still the policy's."""
        from megatron_rl.models import dist_io, model_dir  # lazy: dist_checkpointing

        if not model_dir.is_model_dir(path):
            raise CheckpointError(f"{flag} {path} is not a model-only torch_dist dir (a training checkpoint "
                                  "holds a critic beside the actor and resumes from --load/--save); give what "
                                  "convert_ckpt.py hf-to-dist writes, or use --critic-hf-checkpoint")
        meta = model_dir.read_marker(path)
        model_dir.check_fingerprint(path, meta, self.backend.bridge, hf_dir)
        dist_io.check_checkpoint_matches_model(path, dist_io.checkpoint_model_tensors(path),
                                               dist_io.model_tensor_shapes(self.chunks), hf_dir)
        dist_io.load_dist_into(self.chunks, path)

    # ---- passes ---------------------------------------------------------------

    def _forward_step(self, loss_fn, data_iterator, model):
        mb: PackedBatch = next(data_iterator)
        rows = packed_loss_rows(mb)
        device = next(model.parameters()).device
        mb = mb.to(device)
        output = model(mb.tokens[None], mb.position_ids[None], None, packed_seq_params=mb.packed_seq_params())
        if not self._post_process[id(model)]:  # hidden states for the next stage; the schedule calls no loss here
            return output, partial(loss_fn, mb, None)
        per_position = output.reshape(-1)  # [1, s, 1] -> [s]: one value per packed position
        values = rows.to_response(per_position.index_select(0, rows.rows.to(device)))
        return output, partial(loss_fn, mb, values)

    def _run_schedule(self, micro_batches: list[PackedBatch], loss_fn, forward_only: bool) -> list:
        from megatron.core.pipeline_parallel import get_forward_backward_func  # lazy: megatron-core

        return get_forward_backward_func()(
            forward_step_func=partial(self._forward_step, loss_fn), data_iterator=iter(micro_batches),
            model=self.model, num_microbatches=len(micro_batches),
            seq_length=max(mb.num_tokens for mb in micro_batches), micro_batch_size=1, forward_only=forward_only)

    def compute_values(self, samples: Sequence[AnySample]) -> list[Optional[torch.Tensor]]:
        """A critic of its own layout: every sample's values on every rank, over its own plan of the batch."""
        share = self.share
        assert share is not None, "a critic of the actor's layout runs over the actor's micro-batches"
        plan, mbs, _ = share.preprocess_rollout_data(samples)
        return share.gather_per_sample(self.values(mbs), samples, plan)

    def train_on(self, batch: TrainBatch, micro_batches: list[PackedBatch], denoms: LossDenominators,
                 spec) -> dict[str, float]:
        """One critic step over ``batch``: over the actor's micro-batches and denominators, or with a layout of
        its own over its own plan of the same samples (its DP ranks' shares and theirs of the denominators)."""
        if self.share is not None:
            if batch.old_values is None or batch.returns is None:
                raise BackendError("a critic step needs the batch's old values and returns")
            plan = self.share.plan_micro_batches(batch.samples)
            _, micro_batches, own = self.share.preprocess_rollout_data(batch.samples, batch, plan=plan)
            assert own is not None, "a training batch has loss denominators"
            denoms = own
        return self.train_step(micro_batches, denoms, spec)

    def values(self, micro_batches: list[PackedBatch]) -> dict[int, torch.Tensor]:
        """No-grad values of this rank's micro-batches, by sample index (float32, response-aligned)."""
        with self.scope:
            return self._values(micro_batches)

    def _values(self, micro_batches: list[PackedBatch]) -> dict[int, torch.Tensor]:
        def loss_fn(mb, values, output):
            v = values.detach().float()
            return v.sum() * 0.0, torch.tensor(0, dtype=torch.int), {
                "values": dict(zip(mb.sample_indices.tolist(), mb.split_response(v.cpu())))}

        _set_mode(self.model, training=False)
        with torch.no_grad():
            store = self._run_schedule(micro_batches, loss_fn, forward_only=True)
        local: dict[int, torch.Tensor] = {}
        for item in store:
            local.update(item["values"])
        return local

    def train_step(self, micro_batches: list[PackedBatch], denoms: LossDenominators, spec) -> dict[str, float]:
        """One critic optimizer step over this rank's micro-batches; ``critic/*`` metrics (docs/metrics.md)."""
        with self.scope:
            return self._train_step(micro_batches, denoms, spec)

    def _train_step(self, micro_batches: list[PackedBatch], denoms: LossDenominators, spec) -> dict[str, float]:
        t0 = time.perf_counter()

        def loss_fn(mb, values, output):
            assert mb.old_values is not None and mb.returns is not None, "packed with the critic's fields"
            loss, metrics = spec.compute_value_loss(values, mb.old_values, mb.returns, mb.loss_mask,
                                                    mb.response_lengths, denoms)
            return loss, torch.tensor(0, dtype=torch.int), {"metrics": metrics}

        _set_mode(self.model, training=True)
        for m in self.model:
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        store = self._run_schedule(micro_batches, loss_fn, forward_only=False)
        update_ok, grad_norm, _ = self.optimizer.step()
        if update_ok:
            self.scheduler.step(increment=1)
            self.optimizer_steps += 1
        metrics: dict[str, float] = {}
        if self.ps.is_pipeline_last_stage(ignore_virtual=True):
            metrics = reduce_metrics([item["metrics"] for item in store], group=self.ps.get_data_parallel_group())
        if self.ps.get_pipeline_model_parallel_world_size() > 1:  # every rank reports the last stage's view
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, metrics)
            metrics = next(m for m in gathered if m)
        out = {f"critic/{k}": v for k, v in metrics.items()}
        out["critic/grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        out["critic/lr"] = float(self.optimizer.param_groups[0]["lr"])
        out["critic/update_skipped"] = float(not update_ok)
        out["critic/step_time_s"] = time.perf_counter() - t0
        return out

    # ---- memory ---------------------------------------------------------------

    def sleep(self) -> None:
        with self.scope:
            for m in self.model:
                m.offload_grad_buffers()
            if hasattr(self.optimizer, "offload_to_cpu"):
                self.optimizer.offload_to_cpu()

    def wake(self) -> None:
        with self.scope:
            for m in self.model:
                m.restore_grad_buffers()
            if hasattr(self.optimizer, "restore_from_cpu"):
                self.optimizer.restore_from_cpu()

    def named_local_params(self) -> Sequence[tuple[str, torch.Tensor]]:
        return [(f"{i}.{name}", p) for i, chunk in enumerate(self.chunks) for name, p in chunk.named_parameters()]


def _set_mode(chunks, training: bool) -> None:
    for m in chunks:
        if m.training != training:
            m.train(training)
