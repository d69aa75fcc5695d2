"""The linear-layer patch (compat.patches.patch_plain_linear): a call that asks for no communication and no
fused weight-gradient accumulation runs ``_PlainLinear``, bitwise megatron's general Function in values and
in every gradient (input, weight, bias; 3-D ``[s, b, h]`` and 2-D inputs, with and without bias, under
``no_grad`` too); any other call reaches megatron's Function. Then a whole ColumnParallelLinear ->
RowParallelLinear pair, patched vs megatron's own function."""

import pytest
import torch

from megatron_rl.compat import apply_cpu_compat


@pytest.fixture(scope="module")
def layers():
    apply_cpu_compat()
    from megatron.core.tensor_parallel import layers

    patched = layers.linear_with_grad_accumulation_and_async_allreduce
    assert getattr(patched, "_megatron_rl_compat", False), "the patch is applied on CPU hosts"
    return layers


def _run(fn, x0, w0, b0, upstream, grad=True):
    x, w = x0.clone().requires_grad_(grad), w0.clone().requires_grad_(grad)
    b = None if b0 is None else b0.clone().requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        out = fn(input=x, weight=w, bias=b, gradient_accumulation_fusion=False, allreduce_dgrad=False,
                 sequence_parallel=False, grad_output_buffer=None, wgrad_deferral_limit=None, tp_group=None)
    if not grad:
        return [out], None
    out.backward(upstream)
    return [out.detach(), x.grad, w.grad] + ([] if b is None else [b.grad]), out.grad_fn


@pytest.mark.parametrize("shape", [(7, 3, 16), (11, 16)], ids=["sbh", "2d"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("grad", [True, False])
def test_plain_linear_is_bitwise_megatrons_function(layers, shape, bias, grad):
    g = torch.Generator().manual_seed(sum(shape) + bias)
    x0 = torch.randn(*shape, generator=g)
    w0 = torch.randn(24, 16, generator=g)
    b0 = torch.randn(24, generator=g) if bias else None
    upstream = torch.randn(*shape[:-1], 24, generator=g)
    patched = layers.linear_with_grad_accumulation_and_async_allreduce
    got, node = _run(patched, x0, w0, b0, upstream, grad)
    want, want_node = _run(patched.original, x0, w0, b0, upstream, grad)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and len(got) == len(want)
    if grad:
        assert type(node).__name__ == "_PlainLinearBackward"
        assert type(want_node).__name__ == "LinearWithGradAccumulationAndAsyncCommunicationBackward"


def test_calls_asking_for_more_reach_megatrons_function(layers):
    patched = layers.linear_with_grad_accumulation_and_async_allreduce
    x, w = torch.randn(5, 2, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    out = patched(input=x, weight=w, bias=None, gradient_accumulation_fusion=False, allreduce_dgrad=False,
                  sequence_parallel=False, grad_output_buffer=[], wgrad_deferral_limit=0, tp_group=None)
    assert type(out.grad_fn).__name__ == "LinearWithGradAccumulationAndAsyncCommunicationBackward"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = patched(input=x, weight=w, bias=None, gradient_accumulation_fusion=False, allreduce_dgrad=False,
                      sequence_parallel=False, grad_output_buffer=None, wgrad_deferral_limit=None, tp_group=None)
    assert type(out.grad_fn).__name__ == "LinearWithGradAccumulationAndAsyncCommunicationBackward"


def test_linear_layers_equal_megatrons_bitwise(layers, column_row_pair, monkeypatch):
    """ColumnParallelLinear (bias) -> SiLU -> RowParallelLinear (bias) at TP1 under megatron's parallel state."""
    patched = column_row_pair()
    monkeypatch.setattr(layers, "linear_with_grad_accumulation_and_async_allreduce",
                        layers.linear_with_grad_accumulation_and_async_allreduce.original)
    assert all(torch.equal(a, b) for a, b in zip(patched, column_row_pair()))
