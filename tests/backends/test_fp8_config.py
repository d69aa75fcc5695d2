"""FP8 flags reach megatron-core: every --fp8-* flag lands in the TransformerConfig (and
DDP config) the backend builds, and knobs that would change nothing are refused.

TE is not installed here, so the refusal of FP8 at run time stays (validation and
``check_backend_config``); the config path itself is exercised with the same
functions the backend calls (``transformer_config_overrides`` -> ``Bridge.transformer_config``).
"""

import pytest

from megatron_rl.backends.megatron.settings import (check_backend_config, ddp_config_kwargs, layout_from_config,
                                                   transformer_config_overrides)
from megatron_rl.config import collect_errors, parse_config
from megatron_rl.errors import ConfigError
from megatron_rl.models import get_bridge

FP8_FLAGS = ["--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-margin", "2",
             "--fp8-amax-history-len", "16", "--fp8-amax-compute-algo", "max", "--fp8-param-gather",
             "--use-distributed-optimizer", "--bf16"]
EXPECTED = dict(fp8="hybrid", fp8_recipe="delayed", fp8_margin=2, fp8_amax_history_len=16,
                fp8_amax_compute_algo="max", fp8_param=True)


@pytest.fixture
def hf_dir(tiny_hf_models):
    return tiny_hf_models("qwen2")


def _cfg(hf_dir, *extra):
    return parse_config(["--hf-checkpoint", hf_dir, *extra], validate=False)


def test_overrides_carry_every_fp8_flag(hf_dir):
    over = transformer_config_overrides(_cfg(hf_dir, *FP8_FLAGS))
    assert {k: over[k] for k in EXPECTED} == EXPECTED
    assert over["calculate_per_token_loss"] is True
    tensorwise = transformer_config_overrides(_cfg(hf_dir, "--fp8-format", "e4m3", "--fp8-recipe", "tensorwise"))
    assert (tensorwise["fp8"], tensorwise["fp8_recipe"], tensorwise["fp8_param"]) == ("e4m3", "tensorwise", False)
    assert ddp_config_kwargs(_cfg(hf_dir, *FP8_FLAGS))["fp8_param_gather"] is True


def test_no_fp8_flag_sets_no_fp8_field(hf_dir):
    over = transformer_config_overrides(_cfg(hf_dir))
    assert not [k for k in over if k.startswith("fp8")]
    assert ddp_config_kwargs(_cfg(hf_dir))["fp8_param_gather"] is False


def test_megatron_transformer_config_holds_the_fp8_flags(hf_dir):
    """The built megatron TransformerConfig (the bridge's, as the backend builds it) carries them."""
    from megatron.core.distributed import DistributedDataParallelConfig

    cfg = _cfg(hf_dir, *FP8_FLAGS)
    config = get_bridge(hf_dir).transformer_config(layout_from_config(cfg), **transformer_config_overrides(cfg))
    assert {k: getattr(config, k) for k in EXPECTED} == EXPECTED
    assert DistributedDataParallelConfig(**ddp_config_kwargs(cfg)).fp8_param_gather is True


@pytest.mark.parametrize("extra,needle", [
    (["--fp8-recipe", "tensorwise"], "--fp8-recipe tensorwise has no effect without --fp8-format"),
    (["--fp8-margin", "1"], "--fp8-margin 1 has no effect without --fp8-format"),
    (["--fp8-param-gather"], "--fp8-param-gather True has no effect without --fp8-format"),
    (["--fp8-format", "e4m3", "--fp8-recipe", "blockwise", "--fp8-amax-history-len", "8"],
     "--fp8-amax-history-len 8 only tunes the delayed recipe"),
    (["--fp8-format", "e4m3", "--fp8-amax-history-len", "0"], "--fp8-amax-history-len 0 must be >= 1"),
    (["--fp8-format", "e4m3", "--fp8-param-gather"], "add --use-distributed-optimizer"),
])
def test_knobs_that_would_do_nothing_are_refused(hf_dir, extra, needle):
    errors = collect_errors(_cfg(hf_dir, *extra))
    assert any(needle in e for e in errors), errors


def test_fp8_still_refused_without_te_and_gpu(hf_dir):
    cfg = _cfg(hf_dir, *FP8_FLAGS)
    assert any("needs transformer-engine" in e for e in collect_errors(cfg))
    with pytest.raises(ConfigError, match="--fp8-format hybrid needs an FP8-capable GPU"):
        check_backend_config(cfg)
