"""infra/launch.py: the exit code and line of a failed run name the rank whose failure ended it.

torchrun's ChildFailedError lists every worker that did not exit 0, the ones torchrun itself SIGTERMed
once the first failed included. Built here from torch's own ProcessFailure records, in the order and with
the timestamps torchrun gives them (its poll records the failed worker, then terminates and records the
rest). The real launch: tests/e2e/test_signals.py::test_sigkill_mid_prune_leaves_only_whole_checkpoints.
"""

from __future__ import annotations

import signal

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from megatron_rl.infra.launch import _failure_summary


def _failure(rank: int, exitcode: int, timestamp: int) -> ProcessFailure:
    failure = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file="/nonexistent")
    failure.timestamp = timestamp
    return failure


def _summary(*failures: tuple[int, int, int]) -> tuple[int, str]:
    return _failure_summary(ChildFailedError("megatron_rl.train", {r: _failure(r, c, t) for r, c, t in failures}))


def test_a_sigkilled_rank_is_reported_as_sigkill_137_not_the_sigtermed_bystander():
    """Rank 1 SIGKILLed (the OOM killer): torchrun then SIGTERMs rank 0. Was: 'rank 0 was ended by SIGTERM', 143."""
    assert _summary((1, -signal.SIGKILL, 100), (0, -signal.SIGTERM, 100)) == (137, "rank 1 was ended by SIGKILL")


def test_within_a_second_a_signal_death_comes_before_the_crash_it_caused():
    """Rank 0's collective broke when rank 1 died in the same second; both noticed in one poll (rank order)."""
    assert _summary((0, 1, 100), (1, -signal.SIGKILL, 100)) == (137, "rank 1 was ended by SIGKILL")


def test_the_earliest_failure_wins():
    assert _summary((0, -signal.SIGKILL, 101), (1, 1, 100)) == (1, "rank 1 exited with code 1 (its traceback is "
                                                                    "above)")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSEGV, signal.SIGTERM])
def test_one_failed_rank_is_128_plus_its_signal(sig):
    assert _summary((1, -sig, 100)) == (128 + sig, f"rank 1 was ended by {sig.name}")


def test_a_crash_is_exit_1():
    assert _summary((1, 1, 100), (0, -signal.SIGTERM, 100)) == (1, "rank 1 exited with code 1 (its traceback is "
                                                                    "above)")
