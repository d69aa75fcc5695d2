"""The CPU shim on its own: each patch applied, idempotent, and a no-op with CUDA."""

import torch

import megatron_rl.compat as compat
from megatron_rl.compat import cpu_torch, patches


def test_cpu_patches_applied_and_idempotent():
    first = compat.apply_cpu_compat()
    expected = {p.name for p in patches.CPU_PATCHES + patches.CPU_SPEED_PATCHES + patches.NO_TE_PATCHES
                + patches.ANY_HOST_PATCHES}
    assert set(first) == expected and all(v == "applied" for v in first.values()), first
    import megatron.core.parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    cuda_fn = torch.Tensor.cuda
    get_state = mrandom._get_cuda_rng_state
    assert ps.torch is cpu_torch.CPU_TORCH
    assert compat.apply_cpu_compat() == first  # second call: same outcome, nothing re-wrapped
    assert torch.Tensor.cuda is cuda_fn and mrandom._get_cuda_rng_state is get_state
    # the patched helpers are what megatron's modules call
    assert token_dispatcher.maybe_move_tensor_to_cpu is moe_utils.maybe_move_tensor_to_cpu
    assert moe_utils.te_general_gemm is None


def test_device_redirection_is_scoped_to_megatron():
    compat.apply_cpu_compat()
    mt = cpu_torch.CPU_TORCH
    t = mt.zeros(3, device="cuda", pin_memory=True)
    assert t.device.type == "cpu"
    assert mt.tensor([1.0], device=mt.cuda.current_device()).device.type == "cpu"
    assert mt.device("cuda", 0) == torch.device("cpu") and isinstance(torch.device("cpu"), mt.device)
    with mt.cuda.stream(mt.cuda.Stream()):
        mt.cuda.synchronize()
    # outside megatron.core, torch behaves as torch (no silent CPU fallback)
    assert torch.tensor([1.0]).type() == "torch.FloatTensor"
    try:
        torch.zeros(1).cuda()
    except (AssertionError, RuntimeError):
        pass
    else:
        raise AssertionError("Tensor.cuda() outside megatron must still fail without CUDA")


def test_tensor_type_check_answers_cuda_spelling_inside_megatron():
    compat.apply_cpu_compat()
    ns = {"__name__": "megatron.core.optimizer.fake", "torch": torch}
    exec("def f(t):\n    return t.type(), t.cuda() is t\n", ns)
    assert ns["f"](torch.zeros(1)) == ("torch.cuda.FloatTensor", True)
    assert ns["f"](torch.zeros(1, dtype=torch.bfloat16))[0] == "torch.cuda.BFloat16Tensor"


def test_rng_tracker_forks_cpu_state():
    compat.apply_cpu_compat()
    from megatron.core.tensor_parallel import random as mrandom

    tracker = mrandom.CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 123)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with tracker.fork("model-parallel-rng"):
        a = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)  # outer stream untouched
    torch.manual_seed(123)
    assert torch.equal(a, torch.rand(3))  # the fork drew from the tracked seed


def test_noop_when_cuda_is_available(monkeypatch):
    monkeypatch.setattr(compat, "_APPLIED", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    calls = []
    monkeypatch.setattr(patches, "run_patches", lambda ps_, applied: calls.append([p.name for p in ps_]))
    compat.apply_cpu_compat()
    assert calls == [[p.name for p in patches.ANY_HOST_PATCHES], [p.name for p in patches.NO_TE_PATCHES]]
    assert compat.cpu_config_overrides() == {}


def test_speed_only_patches_are_cpu_only_and_every_megatron_wrapper_names_its_signature():
    """A GPU host runs megatron's own code where a patch only saves time: the speed patches are in no group a CUDA
    host applies (test_noop_when_cuda_is_available lists those), and every patch that wraps a megatron function
    says which parameters it was written for."""
    import inspect

    speed = {p.name for p in patches.CPU_SPEED_PATCHES}
    assert speed == {"thd_rope_gather", "tp1_region_identity", "plain_linear"}
    assert all(p.speed_only for p in patches.CPU_SPEED_PATCHES)
    assert not speed & {p.name for p in patches.ANY_HOST_PATCHES + patches.NO_TE_PATCHES}
    unchecked = [p.name for p in patches.CPU_PATCHES + patches.CPU_SPEED_PATCHES + patches.ANY_HOST_PATCHES
                 + patches.NO_TE_PATCHES if "_require(" in inspect.getsource(p.apply)
                 and not any(", (" in line or ', ("' in line for line in inspect.getsource(p.apply).splitlines()
                             if "_require(" in line)]
    assert unchecked == ["jit_fuser", "hybrid_optimizer_safe_globals", "mla_have_te"], unchecked  # none wraps a function


def _refusing(monkeypatch, module, attr, fake):
    monkeypatch.setattr(module, attr, fake)
    return fake


def test_a_patch_refuses_a_function_with_another_signature(monkeypatch):
    """Megatron-LM main's linear_with_grad_accumulation_and_async_allreduce (no async_grad_allreduce): the speed
    patch refuses to wrap it, names both signatures, leaves megatron's function in place, and run_patches skips it
    with a warning even on the version we target. A needed patch refusing raises there instead."""
    import warnings

    import pytest
    from megatron.core.tensor_parallel import layers
    from megatron.core.transformer.moe import moe_utils

    def main_linear(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
                    grad_output_buffer=None, wgrad_deferral_limit=0, tp_group=None):
        raise AssertionError("never called")

    fake = _refusing(monkeypatch, layers, "linear_with_grad_accumulation_and_async_allreduce", main_linear)
    with pytest.raises(patches.SignatureChanged, match=r"layers.linear_with_grad_accumulation_and_async_allreduce "
                                                        r"takes \(input, .*, wgrad_deferral_limit, tp_group\), not "
                                                        r"the \(.*, async_grad_allreduce, tp_group\) this patch was "
                                                        r"written for \(megatron-core 0.16.1\): refusing to wrap it"):
        patches.patch_plain_linear()
    assert layers.linear_with_grad_accumulation_and_async_allreduce is fake
    applied = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        patches.run_patches([p for p in patches.CPU_SPEED_PATCHES if p.name == "plain_linear"], applied)
    assert applied["plain_linear"].startswith("skipped: SignatureChanged: ")
    assert any("patch 'plain_linear'" in str(w.message) and "refusing to wrap it" in str(w.message) for w in caught)
    assert layers.linear_with_grad_accumulation_and_async_allreduce is fake

    _refusing(monkeypatch, moe_utils, "maybe_move_tensor_to_cpu", lambda tensor, as_numpy=False: tensor)
    with pytest.raises(patches.SignatureChanged, match=r"maybe_move_tensor_to_cpu takes \(tensor, as_numpy\)"):
        patches.run_patches([p for p in patches.CPU_PATCHES if p.name == "moe_split_sizes"], {})


def test_cpu_config_overrides_turn_off_cuda_paths():
    o = compat.cpu_config_overrides()
    assert o["use_cpu_initialization"] and not o["batch_p2p_comm"] and not o["gradient_accumulation_fusion"]


# ---- megatron-core's HybridDeviceOptimizer (--optimizer-cpu-offload) ------------------------------------


def _hybrid(params, **kw):
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    kw = {"offload_fraction": 1.0, "cpu_optimizer_cls": torch.optim.AdamW, "gpu_optimizer_cls": torch.optim.AdamW,
          "param_update_in_fp32": True, "overlap_cpu_optimizer_d2h_h2d": False, "lr": 0.1,
          "weight_decay": 0.01, **kw}
    return HybridDeviceOptimizer([{"params": list(params)}], **kw)


def test_hybrid_optimizer_offloads_every_tensor_it_is_given_on_cpu():
    """megatron's own copy-step-copy-back path runs: host copies, CPU AdamW on them, results
    copied back; equal to torch AdamW on the parameters themselves."""
    compat.apply_cpu_compat()
    torch.manual_seed(0)
    params = [torch.randn(5, 3), torch.randn(7)]
    ref = [p.clone().requires_grad_() for p in params]
    grads = [torch.randn_like(p) for p in params]
    opt = _hybrid(params)
    assert "is_cuda" not in torch.Tensor.__dict__ and not params[0].is_cuda  # the device view was scoped
    copies = opt.gpu_params_map_cpu_copy
    assert set(copies) == set(params) and opt.gpu_optimizer is None and len(opt.cpu_optimizers) == 1
    assert all(copies[p].untyped_storage().data_ptr() != p.untyped_storage().data_ptr() for p in params)
    plain = torch.optim.AdamW(ref, lr=0.1, weight_decay=0.01)
    for _ in range(3):
        for p, r, g in zip(params, ref, grads):
            p.grad, r.grad = g.clone(), g.clone()
        opt.step()
        plain.step()
    for p, r in zip(params, ref):
        assert torch.equal(copies[p], p)  # copied back
        torch.testing.assert_close(p, r.detach(), rtol=1e-6, atol=1e-7)
    assert {id(k) for k in opt.cpu_optimizers[0].state} == {id(c) for c in copies.values()}


def test_hybrid_optimizer_takes_fp32_shard_views_and_reloads_their_state():
    """The distributed optimizer's fp32 shards are non-leaf views of the model parameters."""
    compat.apply_cpu_compat()
    weight = torch.nn.Parameter(torch.randn(12))
    shard = weight.view(-1)[2:9]
    assert not shard.is_leaf
    opt = _hybrid([shard])  # torch alone: "can't optimize a non-leaf Tensor"
    shard.grad = torch.randn(7)
    opt.step()
    state = {k: v.clone() for k, v in opt.state[shard].items()}
    opt.load_state_dict(opt.state_dict())  # megatron alone: KeyError (no fp32 copy of an fp32 param)
    assert torch.equal(opt.state[shard]["exp_avg"], state["exp_avg"])
    assert torch.equal(weight.detach()[2:9], opt.gpu_params_map_cpu_copy[shard])


def test_hybrid_optimizer_classes_load_weights_only(tmp_path):
    """Its param groups carry the sub-optimizer classes into every checkpoint's common.pt."""
    compat.apply_cpu_compat()
    from megatron.core import optimizer as moptim

    torch.save({"cpu_optimizer_cls": torch.optim.AdamW, "gpu_optimizer_cls": moptim.Adam}, tmp_path / "c.pt")
    assert torch.load(tmp_path / "c.pt", weights_only=True)["cpu_optimizer_cls"] is torch.optim.AdamW


def test_precision_aware_offload_config_builds_without_transformer_engine():
    compat.apply_cpu_compat()
    from megatron.core.optimizer import OptimizerConfig

    cfg = OptimizerConfig(use_distributed_optimizer=True, optimizer_cpu_offload=True,
                          use_precision_aware_optimizer=True, optimizer_offload_fraction=1.0)
    assert cfg.use_precision_aware_optimizer_no_fp8_or_ds_fp8 and not cfg.store_param_remainders


def test_backend_accepts_the_offloaded_optimizer_on_cpu(tmp_path):
    """CPU: --optimizer-cpu-offload runs (fraction 1.0); the precision-aware optimizer alone
    (TE FusedAdam) and fractions below 1 are refused before any process group exists."""
    from megatron_rl.backends.megatron.settings import check_backend_config
    from megatron_rl.config import parse_config
    from megatron_rl.errors import ConfigError
    from megatron_rl.models.hf_tiny import build_tiny_hf_model

    hf = build_tiny_hf_model("qwen2", tmp_path / "hf")
    offload = ["--hf-checkpoint", hf, "--use-distributed-optimizer", "--use-precision-aware-optimizer"]
    check_backend_config(parse_config(offload + ["--optimizer-cpu-offload"]))
    for extra, match in ((["--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.5"],
                          "--optimizer-offload-fraction 0.5: on CPU only 1.0"),
                         ([], "--use-precision-aware-optimizer without --optimizer-cpu-offload needs")):
        try:
            check_backend_config(parse_config(offload + extra))
        except ConfigError as e:
            assert match in str(e), e
        else:
            raise AssertionError(f"{extra} must be refused on CPU")
