"""The algorithm Spec: the only seam between a training backend and an RL algorithm.

A backend calls, in order, and never branches on the algorithm:

1. ``compute_advantages(samples, ...)`` on the WHOLE rollout batch (before DP
   sharding; batch statistics need every sample) -> per-sample, response-aligned
   advantage tensors. If ``prepare_batch(samples).advantages_need_logprobs`` the
   backend computes the old/ref log-probs first and passes them in.
2. ``prepare_batch(samples)`` -> which per-token
   fields the backend must produce with ``forward_only`` (old / ref / teacher
   log-probs) or carry from the samples (rollout log-probs), and whether the
   model output must include entropy. Also validates the samples.
3. ``extract_model_output(logits, target_ids, ...)`` inside the training forward
   -> log-probs (+ entropy) from the (vocab-parallel) logits.
4. ``compute_loss(LossInputs, LossDenominators)`` -> ``(loss, metric sums)``.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from megatron_rl.algorithms import advantages as adv
from megatron_rl.algorithms.config import PolicyGradientConfig
from megatron_rl.algorithms.losses import LossInputs, Metrics, compute_policy_loss, kl_estimate
from megatron_rl.data.packing import LossDenominators
from megatron_rl.data.types import AnySample
from megatron_rl.errors import ConfigError
from megatron_rl.ops import logprobs_and_entropy


@dataclass(frozen=True)
class BatchRequirements:
    """Per-token fields the trainer must put into ``LossInputs`` for this algorithm.

    ``old_logprobs``: a backend that takes exactly ONE optimizer step per rollout
    batch may skip the extra forward and leave it None: weights only change after
    the step, so the training forward's detached log-probs are the old ones exactly.
    """

    old_logprobs: bool  # forward_only under the pre-update weights
    ref_logprobs: bool  # forward_only under the reference model
    teacher_logprobs: bool  # forward_only under the OPD teacher
    rollout_logprobs: bool  # from Sample.rollout_logprobs (TIS, --use-rollout-logprobs)
    entropy: bool  # extract_model_output must also return entropy
    advantages_need_logprobs: bool  # compute old/ref log-probs BEFORE compute_advantages
    old_from_rollout: bool = False  # old log-probs = Sample.rollout_logprobs (--use-rollout-logprobs), no forward


@dataclass(frozen=True)
class ModelOutput:
    logprobs: torch.Tensor  # [T] float32, differentiable
    entropy: torch.Tensor | None  # [T] float32 or None


class Spec(abc.ABC):
    """Algorithm hooks; see the module docstring for the call order."""

    @abc.abstractmethod
    def compute_advantages(self, samples: Sequence[AnySample], *,
                           old_logprobs: Sequence[torch.Tensor | None] | None = None,
                           ref_logprobs: Sequence[torch.Tensor | None] | None = None) -> list[torch.Tensor]:
        """Per-sample response-aligned advantages (0 on masked tokens)."""

    @abc.abstractmethod
    def prepare_batch(self, samples: Sequence[AnySample]) -> BatchRequirements:
        """What the trainer must compute for this batch (``BatchRequirements``); validates the samples."""

    def needs_whole_batch(self) -> bool:
        """True when ``compute_advantages`` reads every sample's log-probs (e.g. KL folded into the
        reward): then every training rank needs the whole batch and all its log-probs, not only the
        samples it trains on. What ``prepare_batch`` requires depends on the algorithm's config, not
        on the samples (which it only validates), so an empty batch answers."""
        return self.prepare_batch([]).advantages_need_logprobs

    @abc.abstractmethod
    def extract_model_output(self, logits: torch.Tensor, target_ids: torch.Tensor, *, tp_group=None,
                             vocab_start_index: int | None = None, vocab_size: int | None = None,
                             with_entropy: bool = True) -> ModelOutput:
        """Log-probs (and entropy if required) of response tokens from this rank's logits shard
        (``vocab_size``: the real vocab when the logits carry megatron's vocab padding).

        ``with_entropy=False``: the forward-only passes (old/ref/teacher log-probs) keep only the
        log-probs, so they skip the entropy's extra pass over the vocab (a [tokens, vocab] product
        and sum per chunk: at a 152k vocab as large as the log-prob itself); the log-probs are
        bitwise the same either way."""

    @abc.abstractmethod
    def compute_loss(self, inputs: LossInputs, denoms: LossDenominators) -> tuple[torch.Tensor, Metrics]:
        """This micro-batch's share of the globally normalised loss, and metric sums."""


class PolicyGradientSpec(Spec):
    """GRPO / Dr.GRPO / RLOO / REINFORCE++(-baseline) with PPO-clip or GSPO, KL, entropy, off-policy
    correction (TIS / decoupled PPO, rejection sampling) and OPD terms."""

    def __init__(self, cfg: PolicyGradientConfig):
        self.cfg = cfg

    def prepare_batch(self, samples: Sequence[AnySample]) -> BatchRequirements:
        cfg = self.cfg
        for flag, on in (("--use-tis", cfg.use_tis), ("--use-rs", cfg.use_rs),
                         ("--use-rollout-logprobs", cfg.use_rollout_logprobs)):
            if not on:
                continue
            for i, s in enumerate(samples):
                if s.num_rollout_logprobs != s.response_length:
                    raise ConfigError(
                        f"{flag} needs rollout log-probs for every response token, but sample {i} "
                        f"(group {s.group_index}) has {s.num_rollout_logprobs} for {s.response_length} "
                        f"tokens: have the rollout engine return token log-probs, or drop {flag}")
        kl_in_reward = cfg.advantage_estimator == "reinforce_plus_plus" and cfg.kl_coef > 0
        return BatchRequirements(
            # GSPO and TIS read old log-probs even on the first update; PPO ratios too. With
            # --use-rollout-logprobs they are the engine's (no forward): the user accepts the mismatch.
            old_logprobs=not cfg.use_rollout_logprobs,
            ref_logprobs=cfg.kl_loss_coef > 0 or cfg.log_kl or kl_in_reward,
            teacher_logprobs=cfg.opd_coef > 0,
            rollout_logprobs=cfg.needs_rollout_logprobs,
            entropy=True,  # cheap (same pass); always logged to watch for entropy collapse
            advantages_need_logprobs=kl_in_reward,
            old_from_rollout=cfg.use_rollout_logprobs,
        )

    def compute_advantages(self, samples, *, old_logprobs=None, ref_logprobs=None):
        cfg = self.cfg
        _check_loss_masks(samples)
        lengths = [s.response_length for s in samples]
        mask = adv.flat_loss_mask([s.effective_loss_mask() for s in samples])
        rewards = torch.tensor([float(s.reward) for s in samples], dtype=torch.float32)
        groups = [s.group_index for s in samples]
        if cfg.advantage_estimator == "none":
            return adv.per_sample(torch.zeros_like(mask), lengths)
        if cfg.advantage_estimator in ("grpo", "rloo"):
            per_seq = (adv.rloo_advantages(rewards, groups) if cfg.advantage_estimator == "rloo" else
                       adv.grpo_advantages(rewards, groups, normalize_std=cfg.grpo_std_normalization,
                                           eps=cfg.advantage_eps))
            flat = adv.broadcast_to_tokens(per_seq, lengths, mask)
        else:  # reinforce_plus_plus(_baseline)
            kl = None
            if cfg.kl_coef > 0:
                if old_logprobs is None or ref_logprobs is None:
                    raise ConfigError("--kl-coef with --advantage-estimator reinforce_plus_plus folds KL into the "
                                      "rewards: compute old and ref log-probs before compute_advantages and pass them")
                # slime's compute_advantages_and_returns: the --kl-loss-type estimator of KL(old || ref)
                kl = kl_estimate(torch.cat(list(old_logprobs)).float(), torch.cat(list(ref_logprobs)).float(),
                                 cfg.kl_loss_type)
            baseline = groups if cfg.advantage_estimator == "reinforce_plus_plus_baseline" else None
            flat = adv.reinforce_plus_plus_advantages(rewards, lengths, mask, kl=kl, kl_coef=cfg.kl_coef,
                                                      gamma=cfg.gamma, group_index=baseline)
        if cfg.normalize_advantages:  # --normalize-advantages: whiten the whole batch after the estimator
            flat = adv.masked_whiten(flat, mask)
        return adv.per_sample(flat, lengths)

    def extract_model_output(self, logits, target_ids, *, tp_group=None, vocab_start_index=None, vocab_size=None,
                             with_entropy=True):
        logprobs, entropy = logprobs_and_entropy(logits, target_ids, tp_group=tp_group,
                                                 vocab_start_index=vocab_start_index, vocab_size=vocab_size,
                                                 temperature=self.cfg.temperature, with_entropy=with_entropy,
                                                 chunk_size=self.cfg.logprob_chunk_size)
        return ModelOutput(logprobs, entropy)

    def compute_loss(self, inputs, denoms):
        return compute_policy_loss(inputs, denoms, self.cfg)


def _check_loss_masks(samples: Sequence[AnySample]) -> None:
    for i, s in enumerate(samples):
        if s.loss_mask and len(s.loss_mask) != s.response_length:
            raise ValueError(f"sample {i} (group {s.group_index}) has {len(s.loss_mask)} loss_mask entries for "
                             f"{s.response_length} response tokens: the mask is response-aligned (one entry "
                             f"per response token, or empty for all ones)")


_REGISTRY: dict[str, tuple[Callable[..., Spec], type]] = {
    "policy_gradient": (PolicyGradientSpec, PolicyGradientConfig),
}


def register_spec(name: str, factory: Callable[..., Spec], config_cls: type) -> None:
    """Make ``get_spec(name, cfg)`` build ``factory(cfg)`` for configs of ``config_cls``."""
    _REGISTRY[name] = (factory, config_cls)


def get_spec(name: str, cfg) -> Spec:
    """Build the registered Spec ``name`` from its frozen config."""
    if name not in _REGISTRY:
        raise ConfigError(f"--algorithm {name!r} is not registered; choose one of {sorted(_REGISTRY)}")
    factory, config_cls = _REGISTRY[name]
    if not isinstance(cfg, config_cls):
        raise ConfigError(f"--algorithm {name!r} needs a {config_cls.__name__}, got {type(cfg).__name__}")
    return factory(cfg)
