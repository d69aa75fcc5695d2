"""The TP-region patch (compat.patches.patch_tp1_region_identity): at a 1-rank tensor-parallel group
the linear layers' copy-to / reduce-from regions return their input with no autograd node, and the
layer's outputs and gradients are bitwise those through megatron's own Functions; at more ranks
megatron's functions are what runs.

A 1-rank group object stands in for the process group (only ``size()`` is read at one rank);
the multi-rank path is megatron's unchanged code, exercised by every TP2 layout in tests/dist.
"""

import pytest
import torch

from megatron_rl.compat import apply_cpu_compat


class _Group:
    def __init__(self, size):
        self._size = size

    def size(self):
        return self._size

    def rank(self):
        return 0


@pytest.fixture(scope="module")
def layers(tp1_world):
    apply_cpu_compat()
    from megatron.core.tensor_parallel import layers

    for name in ("copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region"):
        assert getattr(getattr(layers, name), "_megatron_rl_compat", False), f"{name} is patched on CPU hosts"
    return layers


@pytest.mark.parametrize("name", ["copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region"])
def test_one_rank_regions_are_the_identity_without_a_node(layers, name):
    patched = getattr(layers, name)
    x = torch.randn(5, 1, 8, requires_grad=True)
    y = x * 2.0
    out = patched(y, group=_Group(1))
    assert out is y  # no autograd node in between
    want = patched.original(y, group=_Group(1))  # megatron's Function: a new node, the same values
    assert want is not y and torch.equal(want, out)
    g = torch.randn(5, 1, 8, generator=torch.Generator().manual_seed(0))
    (got_grad,) = torch.autograd.grad(out, x, g, retain_graph=True)
    (want_grad,) = torch.autograd.grad(want, x, g)
    assert torch.equal(got_grad, want_grad)


def test_more_ranks_reach_megatrons_function(layers, monkeypatch):
    patched = layers.copy_to_tensor_model_parallel_region
    seen = []
    monkeypatch.setattr(patched, "original", None)  # the wrapper binds its original at patch time, not here
    from megatron.core.tensor_parallel import mappings

    monkeypatch.setattr(mappings._CopyToModelParallelRegion, "apply",
                        staticmethod(lambda input_, group: seen.append(group.size()) or input_))
    x = torch.randn(3, 4)
    assert patched(x, group=_Group(2)) is x and seen == [2]
    assert patched(x, group=_Group(1)) is x and seen == [2]  # one rank: megatron's Function not called


def test_linear_layers_equal_megatrons_bitwise(layers, column_row_pair, monkeypatch):
    """ColumnParallelLinear -> RowParallelLinear at TP1 (megatron's parallel state, world size 1): forward
    values, input gradient and weight/bias gradients are identical with and without the patch."""
    patched = column_row_pair()
    for name in ("copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region"):
        monkeypatch.setattr(layers, name, getattr(layers, name).original)
    assert all(torch.equal(a, b) for a, b in zip(patched, column_row_pair()))
