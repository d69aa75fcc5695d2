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


def _summary(*failures: tuple[int, int, int], run_dir: str = "") -> tuple[int, str]:
    code, line, _ = _failure_summary(ChildFailedError("megatron_rl.train", {r: _failure(r, c, t) for r, c, t in
                                                                            failures}), run_dir)
    return code, line


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


def test_a_rank_that_ended_quietly_is_named_with_its_traceback_file(tmp_path):
    """A rank whose collective broke under a dead peer keeps its traceback in RUN_DIR/rank<R>_traceback.txt
    (train.peer_gone_report); when it is the failure named, the line points there, not "above"."""
    (tmp_path / "rank1_traceback.txt").write_text("Traceback ...")
    assert _summary((1, 1, 100), run_dir=str(tmp_path)) == (1, f"rank 1 exited with code 1 (its traceback: "
                                                                f"{tmp_path / 'rank1_traceback.txt'})")


def test_a_collective_broken_by_a_dead_peer_is_one_line_under_the_launcher(tmp_path, monkeypatch):
    """train.peer_gone_report: under the launcher, gloo's "Connection closed by peer" (also as the cause of
    another error) is one line naming the traceback file; anything else, or outside the launcher, is None
    (the traceback is printed as before)."""
    from megatron_rl.infra.wall_time import STATUS_ENV
    from megatron_rl.train import peer_gone_report

    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                        "[127.0.0.1]:41234")
    assert peer_gone_report(gloo) is None  # plain torchrun or one process: no launcher to name the rank
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv(STATUS_ENV, str(tmp_path / "run_status.json"))
    monkeypatch.setenv("RANK", "0")
    try:
        raise ValueError("the step failed") from gloo
    except ValueError as exc:
        line = peer_gone_report(exc)
    path = tmp_path / "rank0_traceback.txt"
    assert line == (f"a collective failed (ValueError: the step failed): another rank of this launch ended first; "
                    f"the launcher names it below. This rank's traceback: {path}")
    assert "Connection closed by peer" in path.read_text() and "the step failed" in path.read_text()
    assert peer_gone_report(KeyError("a bug")) is None
