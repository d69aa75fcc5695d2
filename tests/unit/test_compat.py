"""The CPU shim on its own: each patch applied, idempotent, and a no-op with CUDA."""

import torch

import megatron_rl.compat as compat
from megatron_rl.compat import cpu_torch, patches


def test_cpu_patches_applied_and_idempotent():
    first = compat.apply_cpu_compat()
    expected = {p.name for p in patches.CPU_PATCHES} | {p.name for p in patches.NO_TE_PATCHES}
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
    assert all(names == [p.name for p in patches.NO_TE_PATCHES] for names in calls)
    assert compat.cpu_config_overrides() == {}


def test_cpu_config_overrides_turn_off_cuda_paths():
    o = compat.cpu_config_overrides()
    assert o["use_cpu_initialization"] and not o["batch_p2p_comm"] and not o["gradient_accumulation_fusion"]
