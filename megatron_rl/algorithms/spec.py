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
from typing import Any

import torch

from megatron_rl.algorithms import advantages as adv
from megatron_rl.algorithms.config import PolicyGradientConfig
from megatron_rl.algorithms.kl_control import KLController, mean_sequence_kl
from megatron_rl.algorithms.losses import (LossInputs, Metrics, compute_policy_loss, compute_value_loss,
                                           kl_estimate)
from megatron_rl.data.packing import LossDenominators
from megatron_rl.data.types import AnySample
from megatron_rl.errors import ConfigError
from megatron_rl.infra.user_function import call_user_function, check_arity, load_user_function
from megatron_rl.ops import linear_logprobs_and_entropy, logprobs_and_entropy


CUSTOM_ADVANTAGE_FLAG = "--custom-advantage-function-path"


def load_custom_advantage(path: str) -> Callable:
    """The function ``--custom-advantage-function-path`` names (slime's dotted form too), checked to take
    ``(args, rollout_data)``."""
    fn = load_user_function(path, CUSTOM_ADVANTAGE_FLAG, example="my_adv:compute", dotted=True)
    check_arity(fn, 2, CUSTOM_ADVANTAGE_FLAG, path, "fn(args, rollout_data)")
    return fn


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
    values: bool = False  # the critic's values (forward_only of the value model) BEFORE compute_advantages (ppo)


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
        needs = self.prepare_batch([])
        return needs.advantages_need_logprobs or needs.values

    def compute_advantages_and_returns(self, samples: Sequence[AnySample], *,
                                       old_logprobs: Sequence[torch.Tensor | None] | None = None,
                                       ref_logprobs: Sequence[torch.Tensor | None] | None = None,
                                       values: Sequence[torch.Tensor | None] | None = None,
                                       ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Advantages and the critic's regression targets (``returns``; None for an algorithm without a
        critic, which is every one that does not ask for ``values`` in ``prepare_batch``)."""
        return self.compute_advantages(samples, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs), None

    def compute_value_loss(self, values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                           loss_mask: torch.Tensor, response_lengths,
                           denoms: LossDenominators) -> tuple[torch.Tensor, Metrics]:
        """The critic's loss of one micro-batch (an algorithm with a critic overrides it)."""
        raise ConfigError(f"{type(self).__name__} trains no critic; only --advantage-estimator ppo has one")

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

    def extract_model_output_from_hidden(self, hidden: torch.Tensor, weight: torch.Tensor,
                                         target_ids: torch.Tensor, *, tp_group=None,
                                         vocab_start_index: int | None = None, vocab_size: int | None = None,
                                         with_entropy: bool = True) -> ModelOutput:
        """``extract_model_output`` of the logits ``hidden @ weight.T`` (``hidden`` ``[n, h]``, ``weight`` this
        rank's ``[V/tp, h]`` shard of the output layer): what the backends call where the output layer may
        be fused into the log-prob op (``backends/loss_rows.py``). This default computes the logits of the
        ``n`` rows in one matmul, so a spec that reads logits its own way keeps working; an override may
        project them by chunks instead (``PolicyGradientSpec``), values unchanged."""
        logits = torch.matmul(hidden, weight.t())
        return self.extract_model_output(logits, target_ids, tp_group=tp_group, vocab_start_index=vocab_start_index,
                                         vocab_size=vocab_size, with_entropy=with_entropy)

    @abc.abstractmethod
    def compute_loss(self, inputs: LossInputs, denoms: LossDenominators) -> tuple[torch.Tensor, Metrics]:
        """This micro-batch's share of the globally normalised loss, and metric sums."""

    def state_dict(self) -> dict:
        """State that evolves over the run (the adaptive KL coefficient): saved in every checkpoint's extra state
        and restored on resume, so a resumed run continues bit for bit. Empty when there is none."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned (``{}``: the initial state)."""

    def advantage_metrics(self) -> dict[str, float]:
        """Metrics of the last ``compute_advantages`` (logged as ``train/<key>``)."""
        return {}


class PolicyGradientSpec(Spec):
    """GRPO / Dr.GRPO / RLOO / GPG / OPO / REINFORCE++(-baseline) with PPO-clip, GSPO or a --policy-loss-type
    (CISPO, GPG, GMPO, SAPO), KL, entropy, off-policy
    correction (TIS / decoupled PPO, rejection sampling) and OPD terms."""

    def __init__(self, cfg: PolicyGradientConfig, *, custom_advantage_fn: Callable | None = None,
                 args: Any = None):
        """``custom_advantage_fn`` (loaded from ``cfg.custom_advantage_function_path`` when not given) is called
        as slime calls it, ``fn(args, rollout_data)``; ``args`` is the run's flags as one namespace
        (``from_config.flag_namespace``)."""
        self.cfg = cfg
        self.args = args
        self.custom_advantage_fn = custom_advantage_fn
        path = cfg.custom_advantage_function_path
        if self.custom_advantage_fn is None and path is not None:
            self.custom_advantage_fn = load_custom_advantage(path)
        if self.custom_advantage_fn is not None:
            check_arity(self.custom_advantage_fn, 2, CUSTOM_ADVANTAGE_FLAG, str(path), "fn(args, rollout_data)")
        adaptive = cfg.kl_ctrl_type == "adaptive"  # --kl-ctrl-type: the coefficient of KL in the rewards
        self.kl_ctrl = KLController(cfg.kl_coef, cfg.kl_target if adaptive else None,
                                    cfg.kl_horizon if adaptive else None)
        self.last_advantage_metrics: dict[str, float] = {}

    def state_dict(self) -> dict:
        return {"kl_ctrl": self.kl_ctrl.state_dict()} if self.kl_ctrl.adaptive else {}

    def load_state_dict(self, state: dict) -> None:
        self.kl_ctrl.load_state_dict(state.get("kl_ctrl") or {})

    def advantage_metrics(self) -> dict[str, float]:
        return dict(self.last_advantage_metrics)

    def prepare_batch(self, samples: Sequence[AnySample]) -> BatchRequirements:
        cfg = self.cfg
        for flag, on in (("--use-tis", cfg.use_tis), ("--use-rs", cfg.use_rs),
                         ("--use-rollout-logprobs", cfg.use_rollout_logprobs),
                         ("--get-mismatch-metrics", cfg.get_mismatch_metrics)):
            if not on:
                continue
            for i, s in enumerate(samples):
                if s.num_rollout_logprobs != s.response_length:
                    raise ConfigError(
                        f"{flag} needs rollout log-probs for every response token, but sample {i} "
                        f"(group {s.group_index}) has {s.num_rollout_logprobs} for {s.response_length} "
                        f"tokens: have the rollout engine return token log-probs, or drop {flag}")
        kl_in_reward = cfg.kl_coef > 0 and (cfg.advantage_estimator in ("reinforce_plus_plus", "ppo")
                                            or self.custom_advantage_fn is not None)
        return BatchRequirements(
            # GSPO and TIS read old log-probs even on the first update; PPO ratios too. With
            # --use-rollout-logprobs they are the engine's (no forward): the user accepts the mismatch.
            old_logprobs=not cfg.use_rollout_logprobs,
            ref_logprobs=cfg.kl_loss_coef > 0 or cfg.log_kl or kl_in_reward,
            teacher_logprobs=cfg.opd_coef > 0,
            rollout_logprobs=cfg.needs_rollout_logprobs,
            entropy=True,  # cheap (same pass); always logged to watch for entropy collapse
            # a custom estimator gets the whole batch's log-probs, as slime's rollout_data holds them
            advantages_need_logprobs=kl_in_reward or self.custom_advantage_fn is not None,
            old_from_rollout=cfg.use_rollout_logprobs,
            values=cfg.advantage_estimator == "ppo",
        )

    def compute_advantages_and_returns(self, samples, *, old_logprobs=None, ref_logprobs=None, values=None):
        if self.cfg.advantage_estimator != "ppo":
            return super().compute_advantages_and_returns(samples, old_logprobs=old_logprobs,
                                                          ref_logprobs=ref_logprobs)
        return self._ppo(samples, old_logprobs, ref_logprobs, values)

    def _ppo(self, samples, old_logprobs, ref_logprobs, values) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """PPO's advantages and returns (slime's ``ppo`` estimator): token rewards ``-kl_coef * kl_t`` on loss
        tokens plus the sample's reward on its last loss token, then GAE (``gae_advantages``, --gamma,
        --lambd) against the critic's values; ``--normalize-advantages`` whitens the advantages over the
        batch (verl always does for GAE; slime only with the flag), never the returns."""
        cfg = self.cfg
        _check_loss_masks(samples)
        if values is None or any(v is None for v in values):
            raise ConfigError("--advantage-estimator ppo needs the critic's values of every sample of the batch "
                              "before its advantages: compute them (TrainBackend.compute_values) and pass them")
        lengths = [s.response_length for s in samples]
        if self.custom_advantage_fn is not None:  # slime: the function sets advantages AND the critic's returns
            rewards32 = torch.tensor([float(s.reward) for s in samples], dtype=torch.float32)
            flat_mask = adv.flat_loss_mask([s.effective_loss_mask() for s in samples])
            flat, custom_returns = self._custom_advantages(samples, rewards32, [s.group_index for s in samples],
                                                           flat_mask, old_logprobs, ref_logprobs, values=values)
            assert custom_returns is not None, "with values the custom function must set returns (checked there)"
            if cfg.normalize_advantages:
                flat = adv.masked_whiten(flat, flat_mask)
            return adv.per_sample(flat, lengths), custom_returns
        mask = adv.flat_loss_mask([s.effective_loss_mask() for s in samples]).double()
        rewards = torch.tensor([float(s.reward) for s in samples], dtype=torch.float64)
        token_rewards = torch.zeros_like(mask)
        if cfg.kl_coef > 0:
            kl = self._reward_kl(old_logprobs, ref_logprobs)
            token_rewards = token_rewards - cfg.kl_coef * kl.to(torch.float64) * mask
        if mask.numel():
            seg = adv.segment_ids(lengths)
            pos = torch.arange(mask.numel())
            last = torch.full((len(lengths),), -1, dtype=torch.long).scatter_reduce(
                0, seg, torch.where(mask > 0, pos, torch.full_like(pos, -1)), reduce="amax")
            has = last >= 0
            token_rewards = token_rewards.index_add(0, last[has], rewards[has])
        flat_values = torch.cat([v.detach().double().reshape(-1) for v in values]) if values else mask
        advantages, returns = adv.gae_advantages(token_rewards, flat_values, lengths, loss_mask=mask,
                                                 gamma=cfg.gamma, lam=cfg.lambd)
        if cfg.normalize_advantages:
            advantages = adv.masked_whiten(advantages, mask)
        return adv.per_sample(advantages, lengths), adv.per_sample(returns, lengths)

    def compute_value_loss(self, values, old_values, returns, loss_mask, response_lengths, denoms):
        cfg = self.cfg
        assert cfg.loss_agg_mode is not None, "resolved in PolicyGradientConfig.__post_init__"
        return compute_value_loss(values, old_values, returns, loss_mask, response_lengths, denoms,
                                  value_clip=cfg.value_clip, loss_agg_mode=cfg.loss_agg_mode,
                                  max_response_length=cfg.max_response_length)

    def compute_advantages(self, samples, *, old_logprobs=None, ref_logprobs=None):
        cfg = self.cfg
        _check_loss_masks(samples)
        lengths = [s.response_length for s in samples]
        mask = adv.flat_loss_mask([s.effective_loss_mask() for s in samples])
        rewards = torch.tensor([float(s.reward) for s in samples], dtype=torch.float32)
        groups = [s.group_index for s in samples]
        if self.custom_advantage_fn is not None and cfg.advantage_estimator == "ppo":
            raise ConfigError("--advantage-estimator ppo with --custom-advantage-function-path: the function also "
                              "sets the critic's returns from its values; call compute_advantages_and_returns("
                              "samples, values=...)")
        if self.custom_advantage_fn is not None:
            flat, _ = self._custom_advantages(samples, rewards, groups, mask, old_logprobs, ref_logprobs)
        elif cfg.advantage_estimator == "none":
            return adv.per_sample(torch.zeros_like(mask), lengths)
        elif cfg.advantage_estimator == "remax":  # verl: returns - baseline on the loss tokens (not whitened)
            # per sample, no statistic: a session's branches share its reward and its prompt's greedy baseline, so
            # each takes the session's advantage (counted once whatever its branch count); taken from the session's
            # first branch so that it is the session's by construction
            owner = trajectory_owners(samples)
            per_sample = rewards - _remax_baselines(samples)
            flat = adv.broadcast_to_tokens(per_sample[torch.tensor(owner, dtype=torch.long)] if owner else per_sample,
                                           lengths, mask)
        elif cfg.advantage_estimator == "ppo":
            raise ConfigError("--advantage-estimator ppo needs the critic's values: call "
                              "compute_advantages_and_returns(samples, values=...)")
        elif cfg.advantage_estimator in ("grpo", "rloo", "gpg", "opo"):
            # a trajectory split into branches (Sample.branch) counts once in its group: the estimator runs over
            # one reward per trajectory and each branch takes its trajectory's advantage
            owner = trajectory_owners(samples)
            heads = sorted(set(owner))
            t_rewards, t_groups = rewards[heads], [groups[i] for i in heads]
            if cfg.advantage_estimator == "rloo":
                per_traj = adv.rloo_advantages(t_rewards, t_groups)
            elif cfg.advantage_estimator == "gpg":
                per_traj = adv.gpg_advantages(t_rewards, t_groups)
            elif cfg.advantage_estimator == "opo":  # baseline weighted by each trajectory's loss-token count
                counts = dict.fromkeys(heads, 0)
                for i, s in enumerate(samples):
                    counts[owner[i]] += sum(s.effective_loss_mask())
                per_traj = adv.opo_advantages(t_rewards, t_groups, [counts[h] for h in heads])
            else:
                per_traj = self._grpo_rewards(t_rewards, t_groups)
            at = {h: k for k, h in enumerate(heads)}
            per_seq = per_traj[torch.tensor([at[o] for o in owner], dtype=torch.long)] if owner else per_traj
            flat = adv.broadcast_to_tokens(per_seq, lengths, mask)
        else:  # reinforce_plus_plus(_baseline)
            # a trajectory split into branches is one episode: its branches (consecutive in the batch, so one
            # contiguous run of flat tokens) are one response here, in branch order, the reward once on its last
            # loss token, so every branch's returns carry the reward and the KL penalties after them, and the group
            # mean counts the trajectory once; the whitening is over tokens, each trained once
            owner = trajectory_owners(samples)
            heads = sorted(set(owner))
            t_lengths = [0] * len(heads)
            at = {h: k for k, h in enumerate(heads)}
            for i, n in enumerate(lengths):
                t_lengths[at[owner[i]]] += n
            t_rewards, t_groups = rewards[heads], [groups[i] for i in heads]
            kl = None
            beta = self.kl_ctrl.value  # --kl-coef, or where the adaptive controller has moved it
            if cfg.kl_coef > 0:
                kl = self._reward_kl(old_logprobs, ref_logprobs)
                current_kl = mean_sequence_kl(kl, mask, t_lengths)
                self.kl_ctrl.update(current_kl, n_steps=len(heads))  # verl: after the rewards took beta
                self.last_advantage_metrics = {"reward_kl": current_kl, "reward_kl_coef": beta}
            baseline = (t_groups if cfg.advantage_estimator == "reinforce_plus_plus_baseline"
                        and cfg.rewards_normalization else None)  # slime: no group mean with the flag
            flat = adv.reinforce_plus_plus_advantages(t_rewards, t_lengths, mask, kl=kl, kl_coef=beta,
                                                      gamma=cfg.gamma, group_index=baseline)
        if cfg.normalize_advantages:  # --normalize-advantages: whiten the whole batch after the estimator
            flat = adv.masked_whiten(flat, mask)
        return adv.per_sample(flat, lengths)

    def _reward_kl(self, old_logprobs, ref_logprobs) -> torch.Tensor:
        """The KL folded into the token rewards (``--kl-coef``; REINFORCE++, PPO): slime's
        compute_advantages_and_returns, the ``--kl-loss-type`` estimator of KL(old || ref), flat over the batch."""
        if old_logprobs is None or ref_logprobs is None:
            raise ConfigError(f"--kl-coef with --advantage-estimator {self.cfg.advantage_estimator} folds KL into the "
                              "rewards: compute old and ref log-probs before compute_advantages and pass them")
        return kl_estimate(torch.cat(list(old_logprobs)).float(), torch.cat(list(ref_logprobs)).float(),
                           self.cfg.kl_loss_type)

    def _grpo_rewards(self, rewards: torch.Tensor, groups) -> torch.Tensor:
        """GRPO's per-sample advantage; ``--disable-rewards-normalization``: the raw reward (slime passes
        unnormalised rewards straight to its GRPO returns)."""
        if not self.cfg.rewards_normalization:
            return rewards
        return adv.grpo_advantages(rewards, groups, normalize_std=self.cfg.grpo_std_normalization,
                                   eps=self.cfg.advantage_eps, std_level=self.cfg.grpo_std_level)

    def _custom_advantages(self, samples, rewards, groups, mask, old_logprobs, ref_logprobs, values=None,
                           ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """``--custom-advantage-function-path``: slime's ``compute_advantages_and_returns`` contract; returns the
        flat masked advantages and, with ``values`` (PPO's critic), the returns the function set.

        ``rollout_data`` holds, per sample (lists in batch order): ``rewards`` (group-normalised as slime's
        ``_post_process_rewards`` does for grpo/gspo, mean-subtracted for reinforce_plus_plus_baseline, raw
        otherwise and with ``--disable-rewards-normalization``; a trajectory split into branches counts once in
        its group and each branch holds its trajectory's), ``raw_reward``, ``trajectory_index`` (the number of
        the sample's trajectory in the batch, 0, 1, ...: a trajectory's branches share one, so a function can
        count each once; not in slime's contract, where every sample is its own), ``response_lengths``,
        ``total_lengths``, ``loss_masks`` (float tensors), ``log_probs`` (old), ``ref_log_probs`` (None when no
        reference is computed), ``rollout_log_probs`` (None when not read), ``kl`` (the ``--kl-loss-type``
        estimator of old vs ref, zeros with ``--kl-coef 0``), ``values`` (the critic's, float32, with
        ``--advantage-estimator ppo``; else None). The function must set ``rollout_data["advantages"]``: one
        tensor of ``response_length`` values per sample, and with a critic ``rollout_data["returns"]`` the same
        way (the critic's regression targets; not read without one). Masked tokens get advantage 0;
        ``--normalize-advantages`` then whitens the advantages, as slime does after the custom function."""
        cfg = self.cfg
        where = f"{CUSTOM_ADVANTAGE_FLAG} {cfg.custom_advantage_function_path}"
        lengths = [s.response_length for s in samples]
        masks = adv.per_sample(mask, lengths)
        # the group statistics count a trajectory split into branches once (its first branch's reward stands for
        # it), and each branch gets its trajectory's shaped reward
        owner = trajectory_owners(samples)
        heads = sorted(set(owner))
        t_rewards, t_groups = rewards[heads], [groups[i] for i in heads]
        if cfg.advantage_estimator == "grpo" or cfg.use_gspo:
            t_shaped = self._grpo_rewards(t_rewards, t_groups)
        elif cfg.advantage_estimator == "reinforce_plus_plus_baseline" and cfg.rewards_normalization:
            _, inverse = torch.unique(torch.as_tensor(t_groups), return_inverse=True)
            g_sum = torch.zeros(int(inverse.max()) + 1 if len(t_rewards) else 0, dtype=torch.float64)
            g_sum.index_add_(0, inverse, t_rewards.double())
            g_cnt = torch.zeros_like(g_sum).index_add_(0, inverse, torch.ones(len(t_rewards), dtype=torch.float64))
            t_shaped = (t_rewards.double() - (g_sum / g_cnt)[inverse]).float()
        else:
            t_shaped = t_rewards
        at = {h: k for k, h in enumerate(heads)}
        trajectory = [at[o] for o in owner]
        shaped = t_shaped[torch.tensor(trajectory, dtype=torch.long)] if owner else t_shaped
        old = None if old_logprobs is None else [t.float() for t in old_logprobs]
        ref = None if ref_logprobs is None or any(t is None for t in ref_logprobs) else [t.float() for t in
                                                                                          ref_logprobs]
        if cfg.kl_coef > 0 and old is not None and ref is not None:
            kl = [kl_estimate(o, r, cfg.kl_loss_type) for o, r in zip(old, ref)]
        else:
            kl = [torch.zeros(n, dtype=torch.float32) for n in lengths]
        rollout_data: dict[str, Any] = {
            "rewards": shaped.tolist(), "raw_reward": rewards.tolist(), "trajectory_index": trajectory,
            "response_lengths": lengths,
            "total_lengths": [s.total_length for s in samples], "loss_masks": masks,
            "log_probs": old, "ref_log_probs": ref, "kl": kl,
            "values": None if values is None else [v.detach().float().cpu() for v in values],
            "rollout_log_probs": ([torch.tensor(s.rollout_logprobs, dtype=torch.float32) for s in samples]
                                  if cfg.needs_rollout_logprobs else None)}
        assert self.custom_advantage_fn is not None
        call_user_function(self.custom_advantage_fn, self.args, rollout_data, where=where,  # bounded, one line
                           timeout_s=float(getattr(self.args, "user_function_timeout", 3600.0)))
        pieces = _per_token_output(rollout_data, "advantages", lengths, where)
        flat = (torch.cat(pieces) if pieces else torch.zeros(0)) * mask
        if values is None:
            return flat, None
        returns = [r * m for r, m in zip(_per_token_output(rollout_data, "returns", lengths, where), masks)]
        return flat, returns

    def extract_model_output(self, logits, target_ids, *, tp_group=None, vocab_start_index=None, vocab_size=None,
                             with_entropy=True):
        logprobs, entropy = logprobs_and_entropy(logits, target_ids, tp_group=tp_group,
                                                 vocab_start_index=vocab_start_index, vocab_size=vocab_size,
                                                 temperature=self.cfg.temperature, with_entropy=with_entropy,
                                                 chunk_size=self.cfg.logprob_chunk_size)
        return ModelOutput(logprobs, entropy)

    def extract_model_output_from_hidden(self, hidden, weight, target_ids, *, tp_group=None, vocab_start_index=None,
                                         vocab_size=None, with_entropy=True):
        """The output projection fused into the log-prob op, ``--log-probs-chunk-size`` rows at a time: the
        logits never exist beyond one chunk (``ops.linear_logprob``); values those of ``extract_model_output``."""
        logprobs, entropy = linear_logprobs_and_entropy(hidden, weight, target_ids, tp_group=tp_group,
                                                        vocab_start_index=vocab_start_index, vocab_size=vocab_size,
                                                        temperature=self.cfg.temperature, with_entropy=with_entropy,
                                                        chunk_size=self.cfg.logprob_chunk_size)
        return ModelOutput(logprobs, entropy)

    def compute_loss(self, inputs, denoms):
        return compute_policy_loss(inputs, denoms, self.cfg)


def _per_token_output(rollout_data: dict, key: str, lengths: Sequence[int], where: str) -> list[torch.Tensor]:
    """``rollout_data[key]`` as a custom advantage function must leave it: one finite float tensor of each
    sample's response length, per sample (float32 on the host)."""
    out = rollout_data.get(key)
    if not isinstance(out, (list, tuple)) or len(out) != len(lengths):
        got = f"a {type(out).__name__} of {len(out)}" if isinstance(out, (list, tuple)) else repr(type(out))
        raise ConfigError(f"{where} left rollout_data[{key!r}] as {got}; it must set it to a list of "
                          f"{len(lengths)} per-sample tensors (one value per response token)")
    pieces = []
    for i, (a, n) in enumerate(zip(out, lengths)):
        t = torch.as_tensor(a.detach() if isinstance(a, torch.Tensor) else a, dtype=torch.float32).cpu()
        if t.shape != (n,):
            raise ConfigError(f"{where}: rollout_data[{key!r}][{i}] has shape {tuple(t.shape)} but sample "
                              f"{i} has {n} response tokens; give one value per response token")
        if not torch.isfinite(t).all():
            raise ConfigError(f"{where}: rollout_data[{key!r}][{i}] holds non-finite values")
        pieces.append(t)
    return pieces


def trajectory_owners(samples: Sequence[AnySample]) -> list[int]:
    """For each sample, the index of its trajectory's first branch (``Sample.branch`` 0; itself when it is one).

    A trajectory's branches are consecutive in the batch, numbered 0, 1, ... (``rollout/endpoint/trajectory.py``):
    a sample with branch k > 0 must follow branch k-1 of the same group, else the batch was reordered and the
    trajectories cannot be told apart (``ValueError``)."""
    owner: list[int] = []
    for i, s in enumerate(samples):
        b = int(getattr(s, "branch", 0) or 0)
        if b == 0:
            owner.append(i)
            continue
        prev = samples[i - 1] if i else None
        if prev is None or int(getattr(prev, "branch", 0) or 0) != b - 1 or prev.group_index != s.group_index:
            raise ValueError(f"sample {i} (group {s.group_index}) is branch {b} of a trajectory but does not follow "
                             f"its branch {b - 1} in the batch: a trajectory's branches must stay consecutive")
        owner.append(owner[-1])
    return owner


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


def _remax_baselines(samples) -> torch.Tensor:
    """Each sample's ``reward_baseline`` (the greedy response's reward the rollout manager attached)."""
    missing = [i for i, s in enumerate(samples) if s.reward_baseline is None]
    if missing:
        raise ConfigError(f"--advantage-estimator remax: {len(missing)} sample(s) (first: {missing[0]}, group "
                          f"{samples[missing[0]].group_index}) carry no reward_baseline, the reward of the greedy "
                          "response the rollout manager generates per prompt for ReMax; samples from "
                          "--load-debug-rollout-data saved by a run with another estimator lack it")
    return torch.tensor([float(s.reward_baseline) for s in samples], dtype=torch.float32)
