"""Megatron-LM training flags: where each one lands in megatron-core, and what it needs.

Why a table: each of these flags is a field of megatron-core's ``TransformerConfig``,
``DistributedDataParallelConfig`` or ``OptimizerConfig``; some also need a GPU,
transformer-engine or a code path this build does not have. One row per flag says all of
that, so the backend's config construction (``megatron_core_kwargs``), validation (values
megatron-core would reject; flags that cannot take effect here), ``--dry-run`` (what each
given flag needs) and docs/migrating-from-slime.md read the same facts.

A flag that cannot take effect on this machine is refused for a real run before any worker
starts (never ignored); ``--dry-run`` still validates and prints the plan, listing what the
real run will need, so a launch script can be checked on a laptop.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

from .architecture import hf_is_moe, read_hf_config, text_config
from .schema import Config


def _have_te() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def _have_cuda() -> bool:
    """An NVIDIA GPU this process may use, found without torch (config/ stays stdlib-only so
    --help and --dry-run answer without it): the driver lists a GPU and CUDA_VISIBLE_DEVICES
    does not hide them all. A GPU that torch then cannot use still fails at the backend's start."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    gpus = "/proc/driver/nvidia/gpus"
    return (os.path.isdir(gpus) and bool(os.listdir(gpus))) or os.path.exists("/dev/nvidia0")


def _te_at_least(version: str) -> bool:
    if not _have_te():
        return False
    from importlib.metadata import PackageNotFoundError, version as dist_version

    for dist in ("transformer_engine", "transformer-engine", "transformer_engine_torch"):
        try:
            have = dist_version(dist)
        except PackageNotFoundError:
            continue
        return tuple(int(p) for p in have.split(".")[:2] if p.isdigit()) >= tuple(int(p) for p in version.split("."))
    return False


#: requirement -> (probe on this machine, what it is, in words)
REQUIREMENTS: dict[str, tuple[Callable[[], bool], str]] = {
    "cuda": (_have_cuda, "a CUDA GPU"),
    "te": (_have_te, "transformer-engine (its attention kernels)"),
    "te_2_1": (lambda: _te_at_least("2.1"), "transformer-engine >= 2.1 (megatron-core's fused permutation)"),
    "no_te": (lambda: not _have_te(), "the local layer spec, which this build uses only without "
                                      "transformer-engine (with TE the TE spec and its attention are built)"),
    "te_deterministic": (lambda: not _have_te() or os.environ.get("NVTE_ALLOW_NONDETERMINISTIC_ALGO") == "0",
                         "NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 in the environment where transformer-engine is "
                         "installed (megatron-core raises when building TE attention otherwise)"),
    "grouped_gemm": (lambda: False, "grouped-GEMM experts in this build's layer specs and HF weight maps "
                                    "(models/spec.py builds one MLP per expert; not built yet)"),
    "flex_dispatcher": (lambda: False, "a flex dispatcher backend (DeepEP / HybridEP), which this build does "
                                       "not configure"),
}


@dataclass(frozen=True)
class MegatronFlag:
    """One flag: its config field, the megatron-core kwargs it becomes, what it needs.

    ``kwargs(value)`` -> ``{target: {field: value}}`` with target ``transformer`` (the
    bridge's TransformerConfig overrides), ``ddp`` or ``optimizer``; called only when the
    flag is given (not its default), so an unset flag leaves the bridge's HF-derived value.
    ``needs(value)`` -> requirement keys of :data:`REQUIREMENTS`. ``check(value, cfg)``
    -> why megatron-core (or this build) would reject the value, or None.
    ``effect`` is what docs/migrating-from-slime.md says the flag does here.
    """

    group: str
    field: str
    kwargs: Callable[[Any], dict]
    effect: str
    needs: Callable[[Any], tuple[str, ...]] = lambda value: ()
    check: Callable[[Any, Config], Optional[str]] = lambda value, cfg: None
    moe_only: bool = False
    default: Any = None

    @property
    def flag(self) -> str:
        return "--" + self.field.replace("_", "-")

    def value(self, cfg: Config) -> Any:
        return getattr(getattr(cfg, self.group), self.field)

    def given(self, cfg: Config) -> bool:
        value = self.value(cfg)
        if value is None or value is False:  # (not ``in (None, False)``: 0.0 == False)
            return False
        return self.default is None or value != self.default

    def shown(self, cfg: Config) -> str:
        value = self.value(cfg)
        return self.flag if value is True else f"{self.flag} {value}"


def _tc(**kw) -> Callable[[Any], dict]:
    """kwargs for TransformerConfig: ``_tc(key=None)`` maps the value itself to ``key``."""
    return lambda value: {"transformer": {k: (value if v is None else v) for k, v in kw.items()}}


def _aux_loss(value) -> dict:
    return {"transformer": {"moe_aux_loss_coeff": float(value),
                            "moe_router_load_balancing_type": "aux_loss" if value > 0 else "none"}}


def _dispatcher_check(value, cfg) -> Optional[str]:
    if value == "allgather":
        return ("allgather does not support variable sequence lengths, which packed RL micro-batches have "
                "(megatron-core rejects it); use alltoall")
    return None


def _load_balancing_check(value, cfg) -> Optional[str]:
    if value == "sinkhorn":
        return ("Sinkhorn routing balances the training tokens' scores before the top-k, so the trainer would "
                "pick other experts than HF and the rollout engine do; use aux_loss or none")
    coeff = cfg.megatron.moe_aux_loss_coeff
    if value in ("seq_aux_loss", "global_aux_loss") and coeff != 0:
        why = ("megatron-core computes the sequence-wise loss over a packed micro-batch as if it were one "
               "sequence, not per sample" if value == "seq_aux_loss" else
               "megatron-core's global tracker needs a per-step reset this trainer does not make")
        stated = "config.json's router_aux_loss_coef" if coeff is None else f"--moe-aux-loss-coeff {coeff}"
        return (f"with {stated} it would be a live loss, and {why}; add --moe-aux-loss-coeff 0 (as slime's "
                "scripts) or use aux_loss")
    return None


def _edge_stage_check(value, cfg) -> Optional[str]:
    """``--decoder-first/last-pipeline-num-layers``: what megatron-core's TransformerConfig checks of one edge
    stage (the split of the rest is the planner's: plan/validate.py)."""
    p = cfg.parallel
    if value < 1:
        return f"{value} must be >= 1"
    if p.pipeline_model_parallel_size < 2:
        return f"needs --pipeline-model-parallel-size > 1 (got {p.pipeline_model_parallel_size})"
    vpp = p.virtual_pipeline_model_parallel_size
    if vpp and value % vpp:
        return f"{value} is not divisible by --virtual-pipeline-model-parallel-size {vpp} (megatron-core)"
    return None


def _mtp_layers_check(value, cfg) -> Optional[str]:
    """``--mtp-num-layers``: 0 or exactly the checkpoint's MTP layer count (config.json, when readable)."""
    if value < 0:
        return f"{value} must be >= 0"
    path = cfg.model.hf_checkpoint
    if not path or not os.path.isfile(os.path.join(path, "config.json")):
        return None
    try:
        hf = text_config(read_hf_config(path))
    except (OSError, ValueError):
        return None  # an unreadable config.json is refused by the architecture check, by name
    have = int(hf.get("num_nextn_predict_layers") or 0)
    if value != have:
        return (f"config.json's num_nextn_predict_layers is {have}: megatron's MTP block maps the checkpoint's own "
                f"MTP layers, so pass --mtp-num-layers {have} (keep them) or 0 (skip them, as transformers does)"
                if have else "the checkpoint has no multi-token-prediction layers (config.json "
                "num_nextn_predict_layers); drop the flag")
    return None


def _mtp_training_check(value, cfg) -> Optional[str]:
    """``--enable-mtp-training``: the megatron backend at any TP (+SP), PP, CP, EP and DP; not with LoRA."""
    if not value:
        return None
    refusals = [
        (not cfg.megatron.mtp_num_layers, "needs --mtp-num-layers (the checkpoint's MTP layers); set it"),
        (cfg.precision.train_backend != "megatron", f"is built for --train-backend megatron only, not "
                                                    f"{cfg.precision.train_backend} (transformers' models have no "
                                                    f"MTP layers: they skip them on load); use megatron"),
        (cfg.lora.lora_rank > 0, "is not built with LoRA (--lora-rank): the MTP layers have no adapters; drop one"),
    ]
    return next((why for bad, why in refusals if bad), None)


_ALWAYS = "always on here, so the flag restates it"

#: One row per Megatron-LM training flag a slime script passes.
MEGATRON_FLAGS: tuple[MegatronFlag, ...] = (
    MegatronFlag("megatron", "attention_dropout", _tc(attention_dropout=None), "mapped: TransformerConfig."
                 "attention_dropout (unset: config.json's, 0; Megatron-LM's default is 0.1)"),
    MegatronFlag("megatron", "hidden_dropout", _tc(hidden_dropout=None), "mapped: TransformerConfig.hidden_dropout "
                 "(unset: 0; Megatron-LM's default is 0.1)"),
    MegatronFlag("megatron", "attention_softmax_in_fp32", _tc(attention_softmax_in_fp32=True),
                 "mapped: TransformerConfig.attention_softmax_in_fp32; " + _ALWAYS),
    MegatronFlag("megatron", "accumulate_allreduce_grads_in_fp32",
                 lambda value: {"ddp": {"grad_reduce_in_fp32": True}},
                 "mapped: DistributedDataParallelConfig.grad_reduce_in_fp32; " + _ALWAYS),
    MegatronFlag("megatron", "calculate_per_token_loss", _tc(calculate_per_token_loss=True),
                 "mapped: TransformerConfig.calculate_per_token_loss; " + _ALWAYS + " (losses are normalised by "
                 "the step's global token count, --loss-agg-mode)"),
    MegatronFlag("megatron", "attention_backend", _tc(attention_backend=None),  # the bridge makes it an AttnBackend
                 "mapped: TransformerConfig.attention_backend; flash/fused/unfused need transformer-engine on a "
                 "GPU, local the TE-less layer spec (refused otherwise for a real run)", default="auto",
                 needs=lambda v: {"flash": ("cuda", "te"), "fused": ("cuda", "te"), "unfused": ("cuda", "te"),
                                  "local": ("no_te",)}.get(v, ())),
    MegatronFlag("megatron", "deterministic_mode", _tc(deterministic_mode=True),
                 "mapped: TransformerConfig.deterministic_mode (with TE it needs "
                 "NVTE_ALLOW_NONDETERMINISTIC_ALGO=0)", needs=lambda v: ("te_deterministic",)),
    MegatronFlag("megatron", "moe_router_dtype", _tc(moe_router_dtype=None),
                 "mapped: TransformerConfig.moe_router_dtype (unset: fp32)", moe_only=True),
    MegatronFlag("megatron", "moe_token_dispatcher_type", _tc(moe_token_dispatcher_type=None),
                 "mapped: TransformerConfig.moe_token_dispatcher_type; alltoall (the default here) works, "
                 "allgather is refused (no variable-length support), flex needs DeepEP (not configured)",
                 moe_only=True, check=_dispatcher_check,
                 needs=lambda v: ("flex_dispatcher",) if v == "flex" else ()),
    MegatronFlag("megatron", "moe_enable_deepep", _tc(moe_enable_deepep=True),
                 "mapped: TransformerConfig.moe_enable_deepep; refused for a real run (the flex dispatcher's "
                 "DeepEP backend is not configured here); --dry-run accepts it", moe_only=True,
                 needs=lambda v: ("cuda", "flex_dispatcher"),
                 check=lambda v, cfg: None if cfg.megatron.moe_token_dispatcher_type == "flex" else (
                     "megatron-core uses DeepEP only in the flex dispatcher; add --moe-token-dispatcher-type flex")),
    MegatronFlag("megatron", "moe_grouped_gemm", _tc(moe_grouped_gemm=True),
                 "refused for a real run: grouped-GEMM experts are not built (models/spec.py builds one MLP per "
                 "expert); --dry-run accepts it", moe_only=True, needs=lambda v: ("grouped_gemm",)),
    MegatronFlag("megatron", "moe_permute_fusion", _tc(moe_permute_fusion=True),
                 "mapped: TransformerConfig.moe_permute_fusion; needs transformer-engine >= 2.1 on a GPU "
                 "(refused for a real run otherwise)", moe_only=True, needs=lambda v: ("cuda", "te_2_1")),
    MegatronFlag("megatron", "moe_aux_loss_coeff", _aux_loss,
                 "mapped: TransformerConfig.moe_aux_loss_coeff (0: moe_router_load_balancing_type none); unset: "
                 "config.json's router_aux_loss_coef", moe_only=True),
    MegatronFlag("megatron", "moe_router_load_balancing_type", _tc(moe_router_load_balancing_type=None),
                 "mapped: TransformerConfig.moe_router_load_balancing_type (after --moe-aux-loss-coeff, which "
                 "sets aux_loss or none); seq_aux_loss / global_aux_loss only with --moe-aux-loss-coeff 0, "
                 "sinkhorn refused", moe_only=True, check=_load_balancing_check),
    MegatronFlag("megatron", "moe_router_bias_update_rate", _tc(moe_router_bias_update_rate=None),
                 "mapped: TransformerConfig.moe_router_bias_update_rate; 0 (the bridge's value: the sigmoid "
                 "router's bias stays config.json's) only, a non-zero rate is refused", moe_only=True,
                 check=lambda v, cfg: None if v == 0 else (
                     "a non-zero rate makes megatron-core move the router's expert bias at every step; that "
                     "path (bias -> checkpoint -> engine weight sync) is not verified in this build yet. Use 0 "
                     "(slime's scripts) or drop the flag")),
    MegatronFlag("megatron", "no_rope_fusion", _tc(apply_rope_fusion=False),
                 "mapped: TransformerConfig.apply_rope_fusion false; megatron-core's default, " + _ALWAYS),
    MegatronFlag("megatron", "no_gradient_accumulation_fusion", _tc(gradient_accumulation_fusion=False),
                 "mapped: TransformerConfig.gradient_accumulation_fusion false; megatron-core's default, " + _ALWAYS),
    MegatronFlag("megatron", "transformer_impl", _tc(transformer_impl=None),
                 "mapped: TransformerConfig.transformer_impl; transformer_engine needs transformer-engine, local "
                 "the TE-less layer spec this build uses without it (refused otherwise for a real run)",
                 needs=lambda v: {"transformer_engine": ("te",), "local": ("no_te",)}[v]),
    MegatronFlag("megatron", "no_masked_softmax_fusion", _tc(masked_softmax_fusion=False),
                 "mapped: TransformerConfig.masked_softmax_fusion false; megatron-core's default, " + _ALWAYS),
    MegatronFlag("megatron", "no_check_for_nan_in_loss_and_grad",
                 lambda value: {"ddp": {"check_for_nan_in_grad": False}},
                 "mapped: DistributedDataParallelConfig.check_for_nan_in_grad false; megatron-core's default, "
                 + _ALWAYS),
    MegatronFlag("megatron", "moe_token_drop_policy", _tc(moe_token_drop_policy=None),
                 "mapped: TransformerConfig.moe_token_drop_policy; only probs (no expert capacity is set, so no "
                 "token is dropped and position would change nothing)", moe_only=True,
                 check=lambda v, cfg: None if v == "probs" else (
                     "only matters with an expert capacity factor, which this build does not set (no token is "
                     "dropped); drop it or use probs")),
    MegatronFlag("megatron", "use_routing_replay", _tc(moe_enable_routing_replay=True),
                 "mapped: TransformerConfig.moe_enable_routing_replay; the old-log-prob pass records each token's "
                 "experts, the reference pass and training replay them (R2, backends/megatron/routing_replay.py)",
                 moe_only=True, check=lambda v, cfg: (
                     "records the routes in the old-log-prob pass, which --use-rollout-logprobs skips; drop one "
                     "of them" if cfg.algorithm.use_rollout_logprobs else None)),
    MegatronFlag("megatron", "use_rollout_routing_replay", _tc(moe_enable_routing_replay=True),
                 "mapped: TransformerConfig.moe_enable_routing_replay; the engine records each token's experts "
                 "(Sample.routed_experts: the embedded engine, or SGLang's return_routed_experts, the launcher "
                 "starting it with --enable-return-routed-experts; custom generate functions pass on their last "
                 "Generation.routes, as the agent loop does) and every forward of the trainer replays them (R3, "
                 "backends/megatron/routing_replay.py)", moe_only=True),
    MegatronFlag("megatron", "mtp_num_layers", _tc(mtp_num_layers=None),
                 "mapped: TransformerConfig.mtp_num_layers; megatron-core's MTP block holds the checkpoint's MTP "
                 "layers (loaded, frozen, checkpointed, exported to HF; not sent to the rollout engine); only 0 "
                 "or config.json's num_nextn_predict_layers", default=0, check=_mtp_layers_check),
    MegatronFlag("megatron", "enable_mtp_training", lambda value: {},
                 "built: the actor's train step adds the MTP loss (each depth d's cross-entropy of token t+2+d at "
                 "the loss-masked response tokens, summed, divided by the step's loss-token count, times "
                 "--mtp-loss-scaling-factor / --mtp-num-layers) to the policy loss; as slime, only the MTP "
                 "layers get its gradient; any TP (+SP), PP, CP, EP and DP, megatron backend, no LoRA",
                 check=_mtp_training_check),
    MegatronFlag("megatron", "mtp_loss_scaling_factor", lambda value: {},
                 "built: weight of the MTP loss of --enable-mtp-training (divided by --mtp-num-layers, as "
                 "megatron's mtp_loss_scaling_factor)", default=0.2,
                 check=lambda v, cfg: None if v == 0.2 or cfg.megatron.enable_mtp_training else (
                     f"{v} scales the MTP loss of --enable-mtp-training, which is off; add it or drop the flag")),
    MegatronFlag("parallel", "decoder_first_pipeline_num_layers", _tc(num_layers_in_first_pipeline_stage=None),
                 "mapped: TransformerConfig.num_layers_in_first_pipeline_stage (uneven pipeline stages; the "
                 "planner checks the split, megatron-core places the layers)", check=_edge_stage_check),
    MegatronFlag("parallel", "decoder_last_pipeline_num_layers", _tc(num_layers_in_last_pipeline_stage=None),
                 "mapped: TransformerConfig.num_layers_in_last_pipeline_stage (uneven pipeline stages; the "
                 "planner checks the split, megatron-core places the layers)", check=_edge_stage_check),
    MegatronFlag("optimizer", "overlap_cpu_optimizer_d2h_h2d",
                 lambda value: {"optimizer": {"overlap_cpu_optimizer_d2h_h2d": True}},
                 "mapped: OptimizerConfig.overlap_cpu_optimizer_d2h_h2d (needs --optimizer-cpu-offload and a GPU: "
                 "it overlaps copies on CUDA streams)", needs=lambda v: ("cuda",),
                 check=lambda v, cfg: None if cfg.optimizer.optimizer_cpu_offload else (
                     "overlaps the hybrid CPU optimizer's copies, which only exist with --optimizer-cpu-offload; "
                     "add it or drop the flag")),
)

MEGATRON_FLAG_FIELDS = tuple(row.field for row in MEGATRON_FLAGS)


def megatron_core_kwargs(cfg: Config) -> dict[str, dict]:
    """``{"transformer": {...}, "ddp": {...}, "optimizer": {...}}``: the megatron-core config
    fields the given flags set (the backend applies each dict last, over its own values)."""
    out: dict[str, dict] = {"transformer": {}, "ddp": {}, "optimizer": {}}
    for row in MEGATRON_FLAGS:
        if row.given(cfg):
            for target, kw in row.kwargs(row.value(cfg)).items():
                out[target].update(kw)
    return out


def requirements(cfg: Config) -> list[tuple[str, list[str], list[str]]]:
    """``(flag with value, requirements in words, those missing on this machine)`` for every
    given flag that has requirements."""
    out = []
    for row in MEGATRON_FLAGS:
        needs = row.needs(row.value(cfg)) if row.given(cfg) else ()
        if needs:
            words = [REQUIREMENTS[n][1] for n in needs]
            missing = [REQUIREMENTS[n][1] for n in needs if not REQUIREMENTS[n][0]()]
            out.append((row.shown(cfg), words, missing))
    return out


def megatron_flag_errors(cfg: Config) -> list[str]:
    """Values megatron-core would reject, MoE knobs on a dense model and, for a real run, flags
    this machine cannot honour (a dry run lists those instead: runner/dry_run.py)."""
    errors = []
    moe = hf_is_moe(cfg)
    for row in MEGATRON_FLAGS:
        if not row.given(cfg):
            continue
        value, shown = row.value(cfg), row.shown(cfg)
        why = row.check(value, cfg)
        if why:
            errors.append(f"{shown}: {why}")
        if row.moe_only and moe is False:
            errors.append(f"{shown} configures MoE layers, but the model has no experts (a dense model); "
                          f"drop {row.flag}")
    if not cfg.mode.dry_run:
        for shown, _, missing in requirements(cfg):
            if missing:
                errors.append(f"{shown} cannot take effect here: it needs {' and '.join(missing)}, missing on "
                              "this machine; drop it for a run here (--dry-run checks the plan with it)")
    return errors
