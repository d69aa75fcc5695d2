"""The algorithm flags (``cfg.algorithm`` and the few rollout/batching flags a loss needs) -> a ``Spec``.

The algorithm package builds its own part from the frozen ``Config``, so the runner
never maps algorithm flags itself.
"""

from __future__ import annotations

import argparse

from megatron_rl.algorithms.config import PolicyGradientConfig
from megatron_rl.algorithms.spec import PolicyGradientSpec
from megatron_rl.config import Config
from megatron_rl.config.schema import iter_fields


def flag_namespace(cfg: Config) -> argparse.Namespace:
    """Every flag as one flat namespace, ``args.<flag_name>`` (``--n-samples-per-prompt`` ->
    ``args.n_samples_per_prompt``): the ``args`` slime hands to user functions. The names are slime's,
    so a function written for slime reads the same attributes; it is a copy (changing it changes nothing)."""
    return argparse.Namespace(**{f.name: getattr(getattr(cfg, group), f.name) for group, _, f in iter_fields()})


def spec_from_config(cfg: Config) -> PolicyGradientSpec:
    """``--loss-agg-mode`` unset passes None: the algorithm config picks the estimator's
    default (seq_mean_token_mean for GSPO, token_mean otherwise)."""
    a = cfg.algorithm
    estimator = "grpo" if a.advantage_estimator == "gspo" else a.advantage_estimator
    temperature = cfg.rollout.rollout_temperature or 1.0  # greedy rollouts: log-probs at temperature 1
    return PolicyGradientSpec(PolicyGradientConfig(
        advantage_estimator=estimator, use_gspo=a.advantage_estimator == "gspo",
        policy_loss_type=a.policy_loss_type, sapo_tau_pos=a.sapo_tau_pos, sapo_tau_neg=a.sapo_tau_neg,
        clip_cov_ratio=a.clip_cov_ratio, clip_cov_lb=a.clip_cov_lb, clip_cov_ub=a.clip_cov_ub,
        kl_cov_ratio=a.kl_cov_ratio, ppo_kl_coef=a.ppo_kl_coef,
        grpo_std_normalization=not a.disable_grpo_std_normalization, grpo_std_level=a.grpo_std_level,
        loss_agg_mode=a.loss_agg_mode,
        normalize_advantages=a.normalize_advantages, use_unbiased_kl=a.use_unbiased_kl,
        max_response_length=cfg.rollout.rollout_max_response_len, eps_clip=a.eps_clip,
        eps_clip_high=a.eps_clip_high, eps_clip_c=a.eps_clip_c,
        gamma=a.gamma, lambd=a.lambd, value_clip=a.value_clip,
        kl_loss_coef=a.kl_loss_coef if a.use_kl_loss else 0.0, kl_loss_type=a.kl_loss_type, kl_coef=a.kl_coef,
        kl_ctrl_type=a.kl_ctrl_type, kl_target=a.kl_target, kl_horizon=a.kl_horizon,
        log_kl=a.use_kl_loss and a.kl_loss_coef == 0,  # slime: --use-kl-loss --kl-loss-coef 0 logs the KL
        entropy_coef=a.entropy_coef, use_tis=a.use_tis, tis_cap=a.tis_cap, tis_clip_low=a.tis_clip_low,
        tis_level=a.tis_level, tis_mode=a.tis_mode, use_rs=a.use_rs, rs_level=a.rs_level,
        rs_upper_bound=a.rs_upper_bound, rs_lower_bound=a.rs_lower_bound,
        use_rollout_logprobs=a.use_rollout_logprobs, opd_coef=a.opd_kl_coef,
        temperature=temperature, logprob_chunk_size=cfg.batching.log_probs_chunk_size,
        custom_advantage_function_path=a.custom_advantage_function_path,
        rewards_normalization=not a.disable_rewards_normalization, get_mismatch_metrics=a.get_mismatch_metrics or a.true_on_policy_mode),
        args=flag_namespace(cfg) if a.custom_advantage_function_path else None)
