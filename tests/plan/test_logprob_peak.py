"""The memory planner's count of the chunked log-prob op (``plan/activations.py::chunked_logprob_peak``) against what
``ops/linear_logprob.py`` really allocates in a training step's forward and backward.

How it is measured: a ``TorchDispatchMode`` sees every aten op the step runs (the op's forward, then autograd's
backward on this thread: CPU), takes note of each output storage that no argument already held (a new
allocation; views and in-place results share their input's storage), and after each op adds up the noted
storages still alive (a weak reference per storage). The maximum is the op's peak in bytes, exact at op
granularity and independent of the allocator or the machine (what ``benchmarks/long_trace_logits.py`` reads as
peak RSS of a whole backend). The inputs (hidden rows, weight, targets) are not counted, as the planner counts
the output layer's input as a term of its own.

Tolerance: 2% (measured within 0.1%: the planner counts the per-row statistics as 20 bytes a row and leaves out
the per-chunk vectors and scalars). Was: the planner counted the rows' logits whole, 2 x rows x V x b + 2 fp32
chunks, several times the op's peak on these shapes.
"""

from __future__ import annotations

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megatron_rl.ops.linear_logprob import linear_logprobs
from megatron_rl.plan.activations import chunked_logprob_peak, logprob_chunk_rows

TOLERANCE = 0.02


class LiveBytes(TorchDispatchMode):
    """The peak of the bytes of storages allocated by the ops run under it and still alive (module docstring)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """Never under torch.compile: torch would otherwise wrap ``__torch_dispatch__`` to skip dynamo and import
        ``torch._dynamo`` on its first call (seconds, for nothing)."""
        return False

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        held = {StorageWeakRef(t.untyped_storage()).cdata for t in tree_flatten((args, kwargs))[0]
                if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                ref = StorageWeakRef(t.untyped_storage())
                if ref.cdata not in held and ref.cdata not in self.live:
                    self.live[ref.cdata] = (ref, t.untyped_storage().nbytes())
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            del self.live[key]
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def _step_peak(rows: int, hidden: int, vocab: int, dtype: torch.dtype, chunk: int | None) -> int:
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(rows, hidden, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=gen) * 0.1).to(dtype).requires_grad_()
    target = torch.randint(0, vocab, (rows,), generator=gen)
    meter = LiveBytes()
    with meter:
        logprobs, entropy = linear_logprobs(h, w, target, chunk_size=chunk, with_entropy=True)
        (logprobs.sum() + 0.1 * entropy.sum()).backward()
    return meter.peak


@pytest.mark.parametrize("rows,hidden,vocab,dtype,chunk", [
    (512, 32, 4096, torch.float32, 128),  # the chunk's working set dominates
    (518, 32, 4096, torch.bfloat16, 128),  # bf16; a 6-row tail joins the last chunk (134 rows)
    (256, 256, 2048, torch.bfloat16, 32),  # a wide hidden: the [V, h] weight-gradient buffers dominate
    (200, 32, 2048, torch.float32, None),  # the auto chunk (64 MiB of fp32) is more than the rows: one chunk
])
def test_the_planner_counts_what_the_chunked_logprob_op_holds(rows, hidden, vocab, dtype, chunk):
    measured = _step_peak(rows, hidden, vocab, dtype, chunk)
    planned = chunked_logprob_peak(rows, vocab, hidden, torch.finfo(dtype).bits // 8, chunk)
    print(f"rows {rows} h {hidden} V {vocab} {dtype} chunk {chunk}: planned {planned:,.0f} measured {measured:,} B "
          f"({planned / measured - 1:+.2%})")
    assert abs(planned - measured) <= TOLERANCE * measured, (planned, measured)
    whole = 2 * rows * vocab * (torch.finfo(dtype).bits // 8) + 2 * min(64 * 2 ** 20, rows * vocab * 4)
    if chunk is not None and rows > chunk:  # what the planner counted before: the rows' logits whole
        assert measured < whole


def test_the_chunk_rows_follow_the_flag_or_the_ops_auto_size():
    from megatron_rl.ops.logprob import _auto_chunk

    for vocab in (4096, 151936 // 8, 262144):
        assert logprob_chunk_rows(vocab) == _auto_chunk(vocab)
    assert logprob_chunk_rows(151936, 512) == 512
