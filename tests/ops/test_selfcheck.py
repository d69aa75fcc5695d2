"""ops/selfcheck.py through ops/dispatch.py: a fused kernel set is used only after it agreed with the torch ops.

No GPU here, so "CUDA is present" is played by the dispatch itself: its ``cuda`` row is replaced by
one that runs on CPU tensors and loads the real C++ twins (the CUDA kernels' maths) with one
function made wrong, and the CPU default order becomes cuda -> cpu_ext -> torch. Everything else
(``select``, the cache, the logs, the ops) is the code a GPU run goes through.
"""

import logging
from types import SimpleNamespace

import pytest
import torch

from megatron_rl.ops import PolicyLossParams, logprobs_and_entropy, policy_loss_terms
from megatron_rl.ops import dispatch, selfcheck
from megatron_rl.ops.selfcheck import KernelCheckFailed

ENTRY_POINTS = ("logprob_fwd_partials", "logprob_bwd", "ppo_fwd", "ppo_bwd")


def _corrupted(real, which: str):
    """The twins with one entry point wrong by a little: one gradient element, the entropy partial, one PPO
    gradient element, or one KL value."""
    fns = {name: getattr(real, name) for name in ENTRY_POINTS}

    def logprob_bwd(grad, *args):
        real.logprob_bwd(grad, *args)
        grad[0, 7] += 1e-3

    def logprob_fwd_partials(x, tl, inv_t, m, s, w, tz):
        real.logprob_fwd_partials(x, tl, inv_t, m, s, w, tz)
        w.mul_(1.0 + 1e-4)

    def ppo_bwd(grad, *args):
        real.ppo_bwd(grad, *args)
        grad[11] += 1e-3

    def ppo_fwd(*args):
        real.ppo_fwd(*args)
        kl = args[-4]
        if kl is not None:
            kl[100] += 1e-3

    fns[which] = locals()[which]
    return SimpleNamespace(**fns)


@pytest.fixture
def fresh_dispatch(monkeypatch):
    monkeypatch.setattr(dispatch, "_checked", {})
    monkeypatch.setattr(dispatch, "_logged", set())
    monkeypatch.delenv("MEGATRON_RL_KERNELS", raising=False)
    return dispatch


def _fake_cuda(monkeypatch, kernels, order=("cuda", "cpu_ext", "torch")):
    monkeypatch.setitem(dispatch.KERNELS._rows, "cuda", dispatch.KernelImpl(
        "cuda", lambda: kernels, lambda device: None, "compiled CUDA extension (played by the C++ twins)"))
    monkeypatch.setitem(dispatch._DEFAULT_ORDER, "cpu", order)


def _logprob_run(x, target):
    x = x.detach().clone().requires_grad_()
    lp, h = logprobs_and_entropy(x, target, temperature=0.7, with_entropy=True)
    (lp.sum() + 0.3 * h.sum()).backward()
    return lp.detach(), h.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_twins_pass_their_self_check(cpu_ext, dtype):
    result = selfcheck.check_kernels("cpu_ext", cpu_ext, torch.device("cpu"), dtype)
    assert result.ok, result.describe()
    assert result.describe().startswith(f"cpu_ext kernels on cpu {str(dtype)[6:]}: self-check passed in ")
    print(result.describe())


@pytest.mark.parametrize("which,output", [
    ("logprob_bwd", "logprob V=5003 grad(logprobs+entropy)"),
    ("logprob_fwd_partials", "logprob V=5003 entropy"),
    ("ppo_bwd", "ppo kl=k3 dual tis grad"),
    ("ppo_fwd", "ppo kl=k3 dual tis kl"),
])
def test_a_disagreeing_kernel_is_logged_and_the_next_one_runs(cpu_ext, fresh_dispatch, monkeypatch, caplog,
                                                               use_kernels, which, output):
    _fake_cuda(monkeypatch, _corrupted(cpu_ext, which))
    g = torch.Generator().manual_seed(0)
    x, target = torch.randn(6, 301, generator=g) * 3, torch.randint(0, 301, (6,), generator=g)
    with caplog.at_level(logging.INFO, logger="megatron_rl"):
        got = _logprob_run(x, target)
        assert dispatch.select(torch.device("cpu"), torch.float32)[0] == "cpu_ext"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "cuda kernels on cpu float32: self-check FAILED" in warnings[0] and f"{output}: max |diff| " in warnings[0]
    assert "> bound " in warnings[0]
    chosen = [r.getMessage() for r in caplog.records if "for cpu tensors" in r.getMessage()]
    assert chosen == [chosen[0]] and chosen[0].startswith("megatron_rl.ops: cpu_ext kernels") and \
        "skipped cuda: self-check failed on float32" in chosen[0]
    # the next implementation served the op: bitwise what forcing it gives
    use_kernels("cpu_ext")
    assert all(torch.equal(a, b) for a, b in zip(got, _logprob_run(x, target)))
    # the loss op too, without a second check (the verdict is cached per implementation, device and dtype)
    monkeypatch.delenv("MEGATRON_RL_KERNELS")
    monkeypatch.setattr(dispatch, "check_kernels", None)  # would raise if called again
    terms = policy_loss_terms(torch.zeros(4), torch.zeros(4), torch.ones(4), PolicyLossParams(True, 0.2, 0.2))
    assert torch.equal(terms.pg, -torch.ones(4))


def test_fallback_reaches_torch_and_a_raising_kernel_fails_its_check(cpu_ext, fresh_dispatch, monkeypatch, caplog):
    def broken(*args):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    _fake_cuda(monkeypatch, SimpleNamespace(**{**{n: getattr(cpu_ext, n) for n in ENTRY_POINTS},
                                               "logprob_fwd_partials": broken}), order=("cuda", "torch"))
    with caplog.at_level(logging.WARNING, logger="megatron_rl"):
        assert dispatch.select(torch.device("cpu"), torch.bfloat16) == ("torch", None)
    assert "cuda kernels on cpu bfloat16: self-check FAILED (RuntimeError: CUDA error: an illegal memory access" \
        in caplog.text
    # another dtype is checked on its own: the same kernel set fails again there
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megatron_rl"):
        assert dispatch.select(torch.device("cpu"), torch.float32) == ("torch", None)
    assert "on cpu float32: self-check FAILED" in caplog.text


@pytest.mark.parametrize("which", ["logprob_bwd", "ppo_fwd"])
def test_a_forced_implementation_that_disagrees_raises(cpu_ext, fresh_dispatch, monkeypatch, use_kernels, which):
    _fake_cuda(monkeypatch, _corrupted(cpu_ext, which))
    use_kernels("cuda")
    with pytest.raises(KernelCheckFailed, match=r"MEGATRON_RL_KERNELS=cuda forces .* disagrees with the torch ops "
                                                r"here: cuda kernels on cpu float32: self-check FAILED \(.*max \|diff\|"
                                                r".*Unset MEGATRON_RL_KERNELS to fall back"):
        logprobs_and_entropy(torch.randn(2, 9), torch.zeros(2, dtype=torch.long))
    with pytest.raises(KernelCheckFailed):  # cached: raises again, no second check
        monkeypatch.setattr(dispatch, "check_kernels", None)
        dispatch.select(torch.device("cpu"), torch.float32)


def test_forced_twins_are_checked_once_per_dtype(cpu_ext, fresh_dispatch, monkeypatch, use_kernels, caplog):
    calls = []
    real = selfcheck.check_kernels
    monkeypatch.setattr(dispatch, "check_kernels", lambda *a: calls.append(a[3]) or real(*a))
    use_kernels("cpu_ext")
    with caplog.at_level(logging.INFO, logger="megatron_rl"):
        for dtype in (torch.float32, torch.float32, torch.bfloat16, torch.float32):
            assert dispatch.select(torch.device("cpu"), dtype)[0] == "cpu_ext"
    assert calls == [torch.float32, torch.bfloat16]
    assert sum("self-check passed in" in r.getMessage() for r in caplog.records) == 2
