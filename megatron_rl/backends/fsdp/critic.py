"""PPO's critic (value model) on the FSDP backend, colocated with the actor (``--advantage-estimator ppo``).

The critic is a second HF model beside the ``FSDPBackend``'s actor: the decoder trunk of
``AutoModelForCausalLM`` loaded from ``--hf-checkpoint`` (the actor's initial weights) or
``--critic-hf-checkpoint``, whose LM head is left out and a ``[hidden -> 1]`` value head put on the
final-normed hidden states. It is sharded as the actor is (each decoder layer, then the root, on the
same mesh with the same mixed precision, offload policy and gradient divide factor 1) and has its
own optimizer (``--critic-lr``, default ``--lr``), LR schedule (``--critic-lr-warmup-iters``,
``MegatronLRSchedule.for_critic``) and, with ``--fp16``, its own loss scaler: the semantics of the
megatron backend's ``MegatronCritic`` (``backends/megatron/critic.py``).

Why the values equal the megatron critic's on the same model and batch: the head is drawn exactly as
megatron's ``ValueHead`` draws it (a ``torch.Generator`` seeded with ``--seed``, ``normal_(0, std)``
on a ``[1, hidden]`` float32 tensor, zero bias) with megatron's std: the bridge leaves
``TransformerConfig.init_method_std`` at megatron-core's default (``MEGATRON_INIT_METHOD_STD``; it
does not map HF's ``initializer_range``), so taking the HF config's ``initializer_range`` would part
the two backends on any model whose value is not 0.02. Every rank draws the same head.

Token alignment: the value of response token ``t`` is the head's output at the position whose hidden
state predicts ``t`` (the padded rows' ``response_rows/cols``, the log-probs' alignment); the head
runs on the loss rows only (``backends.loss_rows``), values are float32 and 0.0 at tokens without loss.

Loss normalisation: the value loss is a globally normalised SUM (``Spec.compute_value_loss``), so, as
for the actor, micro-batches accumulate into ``.grad`` and the reduce-scatter sums over ranks.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from megatron_rl.algorithms.losses import reduce_metrics
from megatron_rl.backends.base import critic_step_metrics
from megatron_rl.backends.fsdp.loss_scale import LossScaler
from megatron_rl.backends.fsdp.optim import MegatronLRSchedule, build_optimizer, param_groups, train_on_micro_batches
from megatron_rl.backends.fsdp.padding import unpack_to_rows
from megatron_rl.backends.loss_rows import padded_loss_rows
from megatron_rl.data.packing import LossDenominators, PackedBatch
from megatron_rl.errors import BackendError
from megatron_rl.models import model_dir

if TYPE_CHECKING:
    from megatron_rl.algorithms.spec import Spec
    from megatron_rl.backends.base import TrainBatch
    from megatron_rl.backends.fsdp.backend import FSDPBackend
    from megatron_rl.config import Config

log = logging.getLogger(__name__)

#: megatron-core ``TransformerConfig.init_method_std``'s default, which the bridge keeps: the megatron
#: critic's head std (tests/dist/test_fsdp_critic.py checks the megatron critic's config against it)
MEGATRON_INIT_METHOD_STD = 0.02


class ValueHead(torch.nn.Module):
    """``[..., h] -> [..., 1]`` float32 values: megatron's ``ValueHead`` weights (module docstring), no global RNG
    drawn (an ``nn.Linear`` would consume the run's RNG stream in its default init)."""

    def __init__(self, hidden_size: int, *, std: float, seed: int):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(torch.empty(1, hidden_size).normal_(0.0, std, generator=gen))
        self.bias = torch.nn.Parameter(torch.zeros(1))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden, self.weight, self.bias).float()


class ValueModel(torch.nn.Module):
    """An HF decoder trunk (``model``: the causal LM's own ``.model``, so parameter names are the actor's) and a
    ``value_head``. Its ``forward`` is the FSDP root's: the root's parameters (embeddings, final norm, the head)
    are gathered around it."""

    def __init__(self, trunk: torch.nn.Module, hidden_size: int, *, std: float, seed: int):
        super().__init__()
        self.model = trunk
        self.value_head = ValueHead(hidden_size, std=std, seed=seed)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Values ``[len(rows), 1]`` at ``rows``, indices into the ``[n * width]`` flattened positions (not a view:
        FSDP hooks the root's output for the backward)."""
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        return self.value_head(hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows))


class FSDPCritic:
    """The value model beside an ``FSDPBackend``'s actor (module docstring); ``roles.Critic``. Always of the actor's
    layout (a 1-D data-parallel mesh): it runs over the actor's micro-batches (``share`` None)."""

    share = None

    def __init__(self, backend: "FSDPBackend", cfg: "Config") -> None:
        self.backend = backend
        self.cfg = cfg
        hf_dir = cfg.checkpoint.critic_hf_checkpoint
        if hf_dir:
            model_dir.check_hf_marker_once(hf_dir, f"checking --critic-hf-checkpoint {hf_dir}")
        source = hf_dir or cfg.model.hf_checkpoint
        assert source is not None, "FSDPBackend.initialize refuses a run without --hf-checkpoint"
        causal_lm = backend.load_hf_model(source, lora=True)  # --lora-rank: adapters of its own, trunk frozen
        trunk = getattr(causal_lm, "model", None)
        if trunk is None:
            raise BackendError(f"--advantage-estimator ppo with --train-backend fsdp: {type(causal_lm).__name__} has "
                               "no decoder trunk (.model) to put a value head on; use --train-backend megatron")
        model = ValueModel(trunk, int(causal_lm.config.hidden_size), std=MEGATRON_INIT_METHOD_STD,
                           seed=cfg.runtime.seed)
        del causal_lm  # its LM head is never used
        self.model = backend.shard(model)
        self.optimizer = build_optimizer(cfg.optimizer, param_groups(self.model.named_parameters()))
        self.scheduler = MegatronLRSchedule.for_critic(self.optimizer, cfg)
        self.loss_scaler: Optional[LossScaler] = LossScaler.from_precision(cfg.precision) \
            if cfg.precision.fp16 else None
        self.optimizer_steps = 0
        if dist.get_rank() == 0:
            n = sum(p.numel() for p in self.model.parameters())
            log.info("critic: %d parameters, lr %g, from %s", n, self.scheduler.max_lr,
                     hf_dir or f"the actor's initial weights ({source})")

    def _values(self, mb: PackedBatch) -> torch.Tensor:
        """Response-aligned float32 values of one micro-batch (carrying the graph in training). An empty micro-batch
        still runs the model (one placeholder row), so every rank issues the same FSDP collectives."""
        device = self.backend.device
        padded = unpack_to_rows(mb, self.backend.pad_token_id).to(device)
        rows = padded_loss_rows(mb, padded.response_rows, padded.response_cols, padded.input_ids.shape[1])
        per_row = self.model(padded.input_ids, padded.attention_mask, rows.rows.to(device))
        return rows.to_response(per_row.reshape(-1))

    def values(self, micro_batches: list[PackedBatch]) -> dict[int, torch.Tensor]:
        """No-grad values of this rank's micro-batches, by sample index (float32, response-aligned, on the CPU)."""
        self.model.eval()
        local: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for mb in micro_batches:
                v = self._values(mb).detach().float().cpu()
                local.update(zip(mb.sample_indices.tolist(), mb.split_response(v)))
        return local

    def train_on(self, batch: "TrainBatch", micro_batches: list[PackedBatch], denoms: LossDenominators,
                 spec: "Spec") -> dict[str, float]:
        """One critic step over the actor's micro-batches of ``batch`` (``roles.Critic``)."""
        return self.train_step(micro_batches, denoms, spec)

    def train_step(self, micro_batches: list[PackedBatch], denoms: LossDenominators, spec: "Spec") -> dict[str, float]:
        """One critic optimizer step over this rank's micro-batches; ``critic/*`` metrics (docs/metrics.md), the
        megatron critic's keys."""
        t0 = time.perf_counter()
        def loss_of(mb: PackedBatch):
            values = self._values(mb)
            mb = mb.to(self.backend.device)
            assert mb.old_values is not None and mb.returns is not None, "packed with the critic's fields"
            return spec.compute_value_loss(values, mb.old_values, mb.returns, mb.loss_mask, mb.response_lengths,
                                           denoms)

        step, parts = train_on_micro_batches(self.model, self.optimizer, self.scheduler, self.loss_scaler,
                                             self.cfg.optimizer.grad_clip, "critic", micro_batches, loss_of)
        if step.update_ok:
            self.optimizer_steps += 1
        return critic_step_metrics(reduce_metrics(parts, group=dist.group.WORLD), grad_norm=step.grad_norm,
                                   lr=self.optimizer.param_groups[0]["lr"], update_ok=step.update_ok, started=t0)
