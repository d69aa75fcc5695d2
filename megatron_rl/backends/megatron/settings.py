"""The flags' settings of a megatron-core role: its layout, TransformerConfig overrides, DDP and optimizer configs.

Pure functions of the ``Config`` (no megatron import: unit tests check that every flag arrives), used by every
role's build (``role_model.py``) and by the backend's checks before any process group exists.
"""

from __future__ import annotations

import torch

from megatron_rl.config import Config
from megatron_rl.config.megatron_flags import megatron_core_kwargs
from megatron_rl.errors import ConfigError
from megatron_rl.models.parallel import ParallelLayout


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
