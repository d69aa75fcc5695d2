"""The FSDP backend's fp16 loss scaler against megatron-core's grad scalers, and the loss-scale flags.

Why against megatron-core itself: ``--fp16`` and its loss-scale flags must mean the same under
both backends, so the overflow patterns below (long clean runs, bursts, the floor) go through
``DynamicGradScaler`` / ``ConstantGradScaler`` and ``LossScaler`` step by step and every
scale and tracker must agree. The DP2 run (skipped steps on every rank, the scale backing off)
is in tests/dist/test_fsdp_backend.py.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from megatron_rl.backends.fsdp.loss_scale import LossScaler
from megatron_rl.config import parse_config
from megatron_rl.errors import ConfigError


@pytest.fixture
def parse(tiny_hf_models):
    hf = tiny_hf_models("qwen2")
    return lambda *argv: parse_config(["--hf-checkpoint", hf, *argv])


def _megatron_scalers():
    import megatron_rl.compat as compat

    compat.apply_cpu_compat()  # megatron's scalers keep their scale in a 'cuda' tensor
    from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler

    return ConstantGradScaler, DynamicGradScaler


def _patterns():
    rng = random.Random(3)
    yield "clean then bursts", [False] * 7 + [True] * 3 + [False] * 9 + [True, False, True, True] + [False] * 8
    yield "overflow to the floor", [True] * 40 + [False] * 5
    yield "random", [rng.random() < 0.3 for _ in range(200)]


@pytest.mark.parametrize("name,found", list(_patterns()), ids=[n for n, _ in _patterns()])
@pytest.mark.parametrize("initial,minimum,window,hysteresis", [(2.0 ** 32, 1.0, 4, 2), (2.0 ** 10, 4.0, 3, 1),
                                                               (256.0, 1.0, 1, 3)])
def test_dynamic_scaler_equals_megatron(name, found, initial, minimum, window, hysteresis):
    _, DynamicGradScaler = _megatron_scalers()
    ours = LossScaler(scale=initial, min_scale=minimum, growth_interval=window, hysteresis=hysteresis,
                      hysteresis_tracker=hysteresis)
    theirs = DynamicGradScaler(initial_scale=initial, min_scale=minimum, growth_factor=2.0, backoff_factor=0.5,
                               growth_interval=window, hysteresis=hysteresis)
    for step, inf in enumerate(found):
        if theirs.scale.isinf():  # megatron keeps the scale in float32: past 2**128 it is inf for good
            assert math.isfinite(ours.scale) and ours.scale >= 2.0 ** 128
            break
        assert ours.scale == float(theirs.scale.item()), (name, step)
        ours.update(inf)
        theirs.update(inf)
        assert (ours.growth_tracker, ours.hysteresis_tracker) == \
            (theirs._growth_tracker, theirs._hysteresis_tracker), (name, step)
    else:
        assert ours.scale == float(theirs.scale.item())


def test_constant_scale_never_moves(parse):
    ConstantGradScaler, _ = _megatron_scalers()
    pr = parse("--fp16", "--loss-scale", "128").precision
    ours, theirs = LossScaler.from_precision(pr), ConstantGradScaler(128.0)
    for inf in (True, True, False, True):
        ours.update(inf)
        theirs.update(inf)
        assert ours.scale == float(theirs.scale.item()) == 128.0


def test_from_flags_and_state_round_trip(parse):
    pr = parse(*["--fp16", "--initial-loss-scale", "65536", "--min-loss-scale", "2",
                       "--loss-scale-window", "10", "--hysteresis", "3"]).precision
    s = LossScaler.from_precision(pr)
    assert (s.scale, s.min_scale, s.growth_interval, s.hysteresis, s.hysteresis_tracker, s.dynamic) == \
        (65536.0, 2.0, 10, 3, 3, True)
    s.update(True)
    s.update(False)
    other = LossScaler.from_precision(pr)
    other.load_state_dict(s.state_dict())
    assert other == s
    default = LossScaler.from_precision(parse("--fp16").precision)
    assert (default.scale, default.min_scale, default.growth_interval, default.hysteresis) == (2.0 ** 32, 1.0,
                                                                                               1000, 2)


def test_unscale_divides_and_finds_any_overflow():
    s = LossScaler(scale=8.0)
    grads = [torch.full((3,), 16.0), torch.full((2, 2), -4.0), torch.empty(0)]
    assert s.unscale_and_check(grads) is False
    assert torch.equal(grads[0], torch.full((3,), 2.0)) and torch.equal(grads[1], torch.full((2, 2), -0.5))
    for bad in (float("inf"), float("nan"), float("-inf")):
        grads = [torch.ones(4), torch.tensor([1.0, bad])]
        assert s.unscale_and_check(grads) is True
    assert s.unscale_and_check([]) is False


@pytest.mark.parametrize("argv,match", [
    (["--loss-scale", "1024"], "--loss-scale 1024.0 only acts with --fp16"),
    (["--bf16", "--initial-loss-scale", "65536"], "--initial-loss-scale 65536.0 only acts with --fp16"),
    (["--hysteresis", "4"], "--hysteresis 4 only acts with --fp16"),
    (["--fp16", "--loss-scale", "0"], "--loss-scale 0.0 must be > 0"),
    (["--fp16", "--loss-scale-window", "0"], "--loss-scale-window 0 must be >= 1"),
    (["--fp16", "--hysteresis", "0"], "--hysteresis 0 must be >= 1"),
    (["--fp16", "--min-loss-scale", "8", "--initial-loss-scale", "4"], "--min-loss-scale 8.0 is above"),
])
def test_loss_scale_flags_refused_where_they_cannot_act(parse, argv, match):
    with pytest.raises(ConfigError, match=match):
        parse(*argv)


def test_megatron_optimizer_gets_the_loss_scale_flags(parse):
    from megatron_rl.backends.megatron.settings import optimizer_config_kwargs

    cfg = parse(*["--fp16", "--initial-loss-scale", "4096", "--min-loss-scale", "2",
                        "--loss-scale-window", "50", "--hysteresis", "3"])
    kw = optimizer_config_kwargs(cfg, torch.float16)
    assert (kw["fp16"], kw["loss_scale"], kw["initial_loss_scale"], kw["min_loss_scale"], kw["loss_scale_window"],
            kw["hysteresis"]) == (True, None, 4096.0, 2.0, 50, 3)
    assert optimizer_config_kwargs(parse("--fp16", "--loss-scale", "8"), torch.float16)["loss_scale"] == 8.0
