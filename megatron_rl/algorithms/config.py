"""The policy-gradient algorithm knobs as one frozen, validated dataclass.

Field names follow the slime/Megatron flag names (``--eps-clip`` ->
``eps_clip``) so ``config/`` can map flags one-to-one; every validation error
names the flag and the fix. Validation happens at construction, so a Spec never
sees an inconsistent config.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.algorithms.kl_control import KL_CTRL_TYPES
from megatron_rl.errors import ConfigError

ADVANTAGE_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gpg", "opo", "remax",
                        "ppo", "none")
LOSS_AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")
# --policy-loss-type: verl's policy_loss.loss_mode names (docs/algorithms.md, "Policy loss"). vanilla is the
# PPO clip (GSPO is --advantage-estimator gspo). geo_mean and sapo are means over sequences (verl forces
# seq-mean-token-mean for them), so they only take seq_mean_token_mean.
POLICY_LOSSES = ("vanilla", "cispo", "gpg", "geo_mean", "sapo", "clip_cov", "kl_cov")
SEQUENCE_MEAN_LOSSES = ("geo_mean", "sapo")
# k3 and low_var_kl: the same clamped estimator (verl); a trailing + : verl's straight-through (k2's gradient)
KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl", "k1+", "k3+", "low_var_kl+")
# Off-policy correction (docs/algorithms.md, "Off-policy correction"): the level at which the ratio
# exp(old - rollout) is formed (verl's rollout_is / rollout_rs, slime's MIS tis_level / rs_level) and what
# happens to a ratio outside its bounds (slime's MIS tis_mode; AReaL's rejection_sampling action).
IS_LEVELS = ("token", "sequence", "geometric")
TIS_MODES = ("truncate", "mask")


@dataclass(frozen=True)
class PolicyGradientConfig:
    """Advantage estimator + policy loss. Defaults are plain GRPO with token-mean loss.

    ``advantage_estimator="none"`` drops the policy-gradient term: with
    ``opd_coef > 0`` that is pure on-policy distillation. ``loss_agg_mode=None``
    means the estimator's default: ``seq_mean_token_mean`` for GSPO (its objective
    is a mean over sequences: GSPO paper, verl), ``token_mean`` otherwise; it is
    resolved at construction, so ``cfg.loss_agg_mode`` is always a mode.
    """

    advantage_estimator: str = "grpo"  # --advantage-estimator
    grpo_std_normalization: bool = True  # --disable-grpo-std-normalization sets False (Dr.GRPO)
    grpo_std_level: str = "group"  # --grpo-std-level: the group's or the batch's reward std (advantages.py)
    advantage_eps: float = 1e-6
    policy_loss_type: str = "vanilla"  # --policy-loss-type (verl's policy_loss.loss_mode): POLICY_LOSSES
    sapo_tau_pos: float = 1.0  # --sapo-tau-pos: SAPO gate temperature for A > 0 (verl's tau_pos)
    sapo_tau_neg: float = 1.05  # --sapo-tau-neg: SAPO gate temperature for A <= 0 (verl's tau_neg)
    clip_cov_ratio: float = 2e-4  # --clip-cov-ratio: share of a micro-batch's loss tokens Clip-Cov may drop
    clip_cov_lb: float = 1.0  # --clip-cov-lb: Clip-Cov candidates have covariance in (lb, ub)
    clip_cov_ub: float = 5.0  # --clip-cov-ub
    kl_cov_ratio: float = 2e-4  # --kl-cov-ratio: share of a micro-batch's loss tokens KL-Cov penalises
    ppo_kl_coef: float = 0.1  # --ppo-kl-coef: KL-Cov's coefficient of |logp - old| on the selected tokens
    gamma: float = 1.0  # --gamma (REINFORCE++ returns, PPO's GAE)
    lambd: float = 1.0  # --lambd: GAE lambda (ppo)
    value_clip: float = 0.2  # --value-clip: the critic's clipped value loss (ppo)
    kl_coef: float = 0.0  # --kl-coef: KL penalty (the --kl-loss-type estimator) folded into REINFORCE++/PPO rewards
    kl_ctrl_type: str = "fixed"  # --kl-ctrl-type: fixed | adaptive (kl_control.py; verl's algorithm.kl_ctrl.type)
    kl_target: float = 0.1  # --kl-target: the adaptive controller's target KL (verl's target_kl)
    kl_horizon: float = 10000.0  # --kl-horizon: responses over which it corrects (verl's horizon)
    normalize_advantages: bool = False  # --normalize-advantages: batch whitening after the estimator
    loss_agg_mode: str | None = None  # --loss-agg-mode; None = the estimator's default (see the class doc)
    max_response_length: int = 0  # --rollout-max-response-len: Dr.GRPO's constant normaliser
    eps_clip: float = 0.2  # --eps-clip
    eps_clip_high: float | None = None  # --eps-clip-high (DAPO clip-higher); None = eps_clip
    eps_clip_c: float | None = None  # --eps-clip-c: dual-clip bound for negative advantages (> 1)
    use_gspo: bool = False  # --use-gspo: sequence-level geometric-mean ratio
    gspo_eps_clip: float = 3e-4  # --gspo-eps-clip
    gspo_eps_clip_high: float = 4e-4  # --gspo-eps-clip-high
    kl_loss_coef: float = 0.0  # --kl-loss-coef: KL-to-reference term in the loss
    log_kl: bool = False  # --use-kl-loss --kl-loss-coef 0 (slime): the KL is computed and logged, not added
    kl_loss_type: str = "k3"  # --kl-loss-type: k1 | k2 | k3 = low_var_kl (clamped low-variance)
    use_unbiased_kl: bool = False  # --use-unbiased-kl: KL term weighted by the ratio exp(logp - old)
    entropy_coef: float = 0.0  # --entropy-coef: entropy bonus (subtracted from the loss)
    use_tis: bool = False  # --use-tis: importance weight exp(old - rollout) on the PG (and OPD) term
    tis_cap: float = 2.0  # --tis-cap: C in clamp(exp(old - rollout), tis_clip_low, C)
    tis_clip_low: float = 0.0  # --tis-clip-low: lower bound of the TIS weight (slime's name)
    tis_level: str = "token"  # --tis-level: token | sequence (product) | geometric (per-token geometric mean)
    tis_mode: str = "truncate"  # --tis-mode: truncate (clamp) | mask (weight 0 outside the bounds)
    use_rs: bool = False  # --use-rs: rejection sampling, weight 0 where the ratio leaves the rs bounds
    rs_level: str = "token"  # --rs-level: token | sequence | geometric
    rs_upper_bound: float = 2.0  # --rs-upper-bound
    rs_lower_bound: float | None = None  # --rs-lower-bound; None = 1 / rs_upper_bound (verl, slime)
    use_rollout_logprobs: bool = False  # --use-rollout-logprobs: old log-probs = the engine's, no forward
    opd_coef: float = 0.0  # --opd-coef: on-policy distillation (reverse KL to teacher)
    temperature: float = 1.0  # --rollout-temperature: log-probs are taken at the sampling temperature
    logprob_chunk_size: int | None = None  # --log-probs-chunk-size: tokens per log-prob chunk (None: auto)
    # --custom-advantage-function-path: fn(args, rollout_data) replaces the estimator (slime's contract)
    custom_advantage_function_path: str | None = None
    rewards_normalization: bool = True  # --disable-rewards-normalization sets False: group baseline/std off
    get_mismatch_metrics: bool = False  # --get-mismatch-metrics: read rollout log-probs, log the mismatch only

    def __post_init__(self):
        def bad(flag, value, fix):
            raise ConfigError(f"{flag}={value!r} is invalid: {fix}")

        if self.advantage_estimator not in ADVANTAGE_ESTIMATORS:
            bad("--advantage-estimator", self.advantage_estimator, f"choose one of {ADVANTAGE_ESTIMATORS}")
        if self.policy_loss_type not in POLICY_LOSSES:
            bad("--policy-loss-type", self.policy_loss_type, f"choose one of {POLICY_LOSSES}")
        seq_loss = self.use_gspo or self.policy_loss_type in SEQUENCE_MEAN_LOSSES
        if self.loss_agg_mode is None:  # frozen: resolve the estimator's default once, here
            object.__setattr__(self, "loss_agg_mode", "seq_mean_token_mean" if seq_loss else "token_mean")
        self._check_policy_loss(bad)
        if self.use_gspo and self.loss_agg_mode == "token_mean":
            bad("--loss-agg-mode", self.loss_agg_mode, "GSPO's objective is a mean over sequences; token_mean "
                "weights each sequence by its length. Use seq_mean_token_mean (the default for gspo: leave "
                "--loss-agg-mode unset)")
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            bad("--loss-agg-mode", self.loss_agg_mode, f"choose one of {LOSS_AGG_MODES}")
        if self.kl_loss_type not in KL_ESTIMATORS:
            bad("--kl-loss-type", self.kl_loss_type, f"choose one of {KL_ESTIMATORS} (k3 is the low-variance one)")
        if self.loss_agg_mode == "seq_mean_token_sum_norm" and self.max_response_length <= 0:
            bad("--rollout-max-response-len", self.max_response_length,
                "--loss-agg-mode seq_mean_token_sum_norm (Dr.GRPO) divides by this constant; set it > 0")
        if not 0 < self.eps_clip < 1:
            bad("--eps-clip", self.eps_clip, "use a value in (0, 1), e.g. 0.2")
        if self.eps_clip_high is not None and not self.eps_clip_high > 0:
            bad("--eps-clip-high", self.eps_clip_high, "use a value > 0, e.g. 0.28, or leave it unset")
        if self.eps_clip_c is not None and not self.eps_clip_c > 1:
            bad("--eps-clip-c", self.eps_clip_c, "the dual-clip bound must be > 1, e.g. 3.0, or unset")
        if not (0 < self.gspo_eps_clip < 1 and self.gspo_eps_clip_high > 0):
            bad("--gspo-eps-clip", (self.gspo_eps_clip, self.gspo_eps_clip_high),
                "GSPO clips the sequence ratio tightly: use small positive values such as 3e-4 / 4e-4")
        if self.use_tis and not self.tis_cap >= 1:
            bad("--tis-cap", self.tis_cap, "the truncation cap must be >= 1, e.g. 2.0")
        if not 0 <= self.tis_clip_low < max(self.tis_cap, 1.0):
            bad("--tis-clip-low", self.tis_clip_low, f"use a lower bound in [0, --tis-cap {self.tis_cap}), e.g. 0.5")
        if self.tis_clip_low and not self.use_tis:
            bad("--tis-clip-low", self.tis_clip_low, "it bounds the TIS weight: add --use-tis or drop it")
        if self.use_rollout_logprobs and self.use_tis:
            bad("--use-rollout-logprobs", True, "with --use-tis the TIS weight exp(old - rollout) would be 1 "
                "(old log-probs ARE the rollout ones); drop one of the two flags")
        self._check_off_policy(bad)
        if self.use_unbiased_kl and not self.kl_loss_coef:
            bad("--use-unbiased-kl", True, "it weights the KL loss term: set --use-kl-loss --kl-loss-coef > 0 "
                "or drop it")
        if self.use_unbiased_kl and self.kl_loss_type.endswith("+"):
            bad("--kl-loss-type", self.kl_loss_type, "the straight-through estimators have no ratio-weighted form "
                "(--use-unbiased-kl); drop the + or --use-unbiased-kl")
        for flag, v in (("--kl-loss-coef", self.kl_loss_coef), ("--kl-coef", self.kl_coef),
                        ("--entropy-coef", self.entropy_coef), ("--opd-coef", self.opd_coef)):
            if v < 0:
                bad(flag, v, "coefficients are magnitudes; use a value >= 0")
        if not 0 < self.gamma <= 1:
            bad("--gamma", self.gamma, "use a discount in (0, 1]")
        if not self.temperature > 0:
            bad("--rollout-temperature", self.temperature, "log-probs need a sampling temperature > 0")
        if self.advantage_estimator == "none" and self.opd_coef == 0:
            bad("--advantage-estimator", "none", "with no policy-gradient term set --opd-coef > 0 (pure "
                "on-policy distillation) or pick grpo / rloo / reinforce_plus_plus")
        if not 0 <= self.lambd <= 1:
            bad("--lambd", self.lambd, "the GAE lambda is in [0, 1]")
        if not self.value_clip > 0:
            bad("--value-clip", self.value_clip, "use a positive clip range, e.g. 0.2")
        if (self.kl_coef and self.advantage_estimator not in ("reinforce_plus_plus", "ppo")  # baseline: in the loss
                and self.custom_advantage_function_path is None):  # a custom estimator reads rollout_data["kl"]
            bad("--kl-coef", self.kl_coef, "the reward-folded KL is REINFORCE++'s (or a "
                "--custom-advantage-function-path's, which reads rollout_data['kl']); for GRPO/RLOO use "
                "--kl-loss-coef (KL term in the loss) instead")
        self._check_kl_controller(bad)
        if not self.rewards_normalization and self.advantage_estimator not in (
                "grpo", "reinforce_plus_plus_baseline") and not self.use_gspo:
            bad("--disable-rewards-normalization", True, "it turns off the group baseline of grpo / gspo / "
                "reinforce_plus_plus_baseline (as slime); with --advantage-estimator "
                f"{self.advantage_estimator} rewards are never group-normalised: drop it")

    def _check_kl_controller(self, bad) -> None:
        """The adaptive controller steers the coefficient this engine folds into the rewards (kl_control.py)."""
        if self.kl_ctrl_type not in KL_CTRL_TYPES:
            bad("--kl-ctrl-type", self.kl_ctrl_type, f"choose one of {KL_CTRL_TYPES}")
        if self.kl_ctrl_type != "adaptive":
            return
        if not self.kl_coef or self.advantage_estimator != "reinforce_plus_plus" or \
                self.custom_advantage_function_path is not None:
            bad("--kl-ctrl-type", "adaptive", "it adapts the KL coefficient folded into the rewards: needs "
                "--advantage-estimator reinforce_plus_plus with --kl-coef > 0 (its starting value) and no "
                "--custom-advantage-function-path (which applies its own coefficient)")
        if not self.kl_target > 0 or not self.kl_horizon > 0:
            bad("--kl-target/--kl-horizon", (self.kl_target, self.kl_horizon), "both must be > 0 (verl's defaults: "
                "0.1 and 10000)")

    def _check_policy_loss(self, bad) -> None:
        """--policy-loss-type with what it combines with (validate.py refuses the same before workers start)."""
        kind = self.policy_loss_type
        if kind != "sapo" and (self.sapo_tau_pos, self.sapo_tau_neg) != (1.0, 1.05):
            bad("--sapo-tau-pos/--sapo-tau-neg", (self.sapo_tau_pos, self.sapo_tau_neg),
                "they shape the SAPO gate: add --policy-loss-type sapo or drop them")
        cov_knobs = (("--clip-cov-ratio", self.clip_cov_ratio, 2e-4, "clip_cov"),
                     ("--clip-cov-lb", self.clip_cov_lb, 1.0, "clip_cov"),
                     ("--clip-cov-ub", self.clip_cov_ub, 5.0, "clip_cov"),
                     ("--kl-cov-ratio", self.kl_cov_ratio, 2e-4, "kl_cov"),
                     ("--ppo-kl-coef", self.ppo_kl_coef, 0.1, "kl_cov"))
        for flag, value, default, owner in cov_knobs:
            if kind != owner and value != default:
                bad(flag, value, f"it configures --policy-loss-type {owner}: add that or drop it")
        if kind == "clip_cov" and not (0 < self.clip_cov_ratio <= 1 and self.clip_cov_lb < self.clip_cov_ub):
            bad("--clip-cov-ratio/--clip-cov-lb/--clip-cov-ub", (self.clip_cov_ratio, self.clip_cov_lb,
                                                                 self.clip_cov_ub),
                "the ratio must be in (0, 1] and lb < ub, e.g. 2e-4, 1.0, 5.0 (verl's defaults)")
        if kind == "kl_cov" and not (0 < self.kl_cov_ratio <= 1 and self.ppo_kl_coef >= 0):
            bad("--kl-cov-ratio/--ppo-kl-coef", (self.kl_cov_ratio, self.ppo_kl_coef),
                "the ratio must be in (0, 1] and the coefficient >= 0, e.g. 2e-4 and 0.1 (verl's defaults)")
        if kind == "vanilla":
            return
        if self.use_gspo:
            bad("--policy-loss-type", kind, "--advantage-estimator gspo is itself a policy loss (verl's "
                "loss_mode gspo); use --advantage-estimator grpo with it, or drop --policy-loss-type")
        if self.advantage_estimator == "none":
            bad("--policy-loss-type", kind, "--advantage-estimator none has no policy-gradient term; drop it")
        if self.eps_clip_c is not None:
            bad("--eps-clip-c", self.eps_clip_c, f"dual clip is part of the vanilla PPO loss, not of {kind}; drop it")
        if kind in SEQUENCE_MEAN_LOSSES and self.loss_agg_mode != "seq_mean_token_mean":
            bad("--loss-agg-mode", self.loss_agg_mode, f"--policy-loss-type {kind} is a mean over sequences (verl "
                "aggregates it with seq-mean-token-mean whatever loss_agg_mode says); use seq_mean_token_mean or "
                "leave --loss-agg-mode unset")
        if kind == "geo_mean":
            for flag, on, level in (("--use-tis", self.use_tis, self.tis_level), ("--use-rs", self.use_rs,
                                                                                   self.rs_level)):
                if on and level == "token":
                    bad(flag, True, "geo_mean's objective is one ratio per sequence, so its off-policy weight must "
                        f"be one per sequence too: add {flag.replace('use-', '')}-level geometric (or sequence)")
        if kind == "sapo" and not (self.sapo_tau_pos > 0 and self.sapo_tau_neg > 0):
            bad("--sapo-tau-pos/--sapo-tau-neg", (self.sapo_tau_pos, self.sapo_tau_neg),
                "the gate temperatures must be > 0, e.g. 1.0 and 1.05 (verl's defaults)")

    def _check_off_policy(self, bad) -> None:
        """The --tis-level/--tis-mode and --use-rs flags: known values, bounds that keep an on-policy
        token (ratio 1), and no knob given without the switch that reads it."""
        if self.tis_level not in IS_LEVELS:
            bad("--tis-level", self.tis_level, f"choose one of {IS_LEVELS}")
        if self.tis_mode not in TIS_MODES:
            bad("--tis-mode", self.tis_mode, f"choose one of {TIS_MODES} (slime's clip mode is truncate with "
                "--tis-clip-low > 0)")
        if not self.use_tis:
            for flag, value, default in (("--tis-level", self.tis_level, "token"),
                                         ("--tis-mode", self.tis_mode, "truncate")):
                if value != default:
                    bad(flag, value, "it shapes the TIS weight: add --use-tis or drop it")
        if self.rs_level not in IS_LEVELS:
            bad("--rs-level", self.rs_level, f"choose one of {IS_LEVELS}")
        if not self.rs_upper_bound >= 1:
            bad("--rs-upper-bound", self.rs_upper_bound, "a bound below 1 rejects on-policy tokens (ratio 1); "
                "use a value >= 1, e.g. 2.0 (token) or 1.001 (geometric)")
        if self.rs_lower_bound is not None and not 0 <= self.rs_lower_bound <= 1:
            bad("--rs-lower-bound", self.rs_lower_bound, "a bound above 1 rejects on-policy tokens (ratio 1); "
                "use a value in [0, 1], e.g. 0.5, or leave it unset (1 / --rs-upper-bound)")
        if not self.use_rs:
            rs_knobs: tuple[tuple[str, object, object], ...] = (
                ("--rs-level", self.rs_level, "token"), ("--rs-upper-bound", self.rs_upper_bound, 2.0),
                ("--rs-lower-bound", self.rs_lower_bound, None))
            for rs_flag, rs_value, rs_default in rs_knobs:
                if rs_value != rs_default:
                    bad(rs_flag, rs_value, "it configures rejection sampling: add --use-rs or drop it")
        if self.use_rollout_logprobs and self.use_rs:
            bad("--use-rollout-logprobs", True, "with --use-rs the ratio exp(old - rollout) would be 1 (old "
                "log-probs ARE the rollout ones) and nothing is ever rejected; drop one of the two flags")

    @property
    def rs_low(self) -> float:
        """The rejection sampling lower bound: --rs-lower-bound, unset = 1 / --rs-upper-bound (verl's and
        slime's default: a symmetric band in log space)."""
        return 1.0 / self.rs_upper_bound if self.rs_lower_bound is None else self.rs_lower_bound

    @property
    def needs_rollout_logprobs(self) -> bool:
        """Rollout (behaviour) log-probs are read by the loss: TIS, rejection sampling, as the old ones, or for the
        train-vs-rollout mismatch metrics alone (--get-mismatch-metrics)."""
        return self.use_tis or self.use_rs or self.use_rollout_logprobs or self.get_mismatch_metrics

    @property
    def clip_high(self) -> float:
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high
