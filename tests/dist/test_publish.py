"""``publish_collectively`` over real gloo ranks: a dir every rank writes into, published whole or not at all.

One 2-rank launch (scripts/publish_worker.py) runs every case, each publishing its own
``final/``: success (both ranks' files plus a COMPLETE.json listing them with sizes and
CRC-32s, no temp dir left), a write failing on one rank, a seal failing on rank 0, a
verify failing on every rank (each: every rank raises, nothing hangs, no ``final/``),
and replacing an existing ``final/`` (only the new files after a success; the old dir
untouched after a failure).
"""

import json

import pytest

from megatron_rl.infra.checkpoint_root import MARKER_NAME, read_complete_marker

pytestmark = pytest.mark.dist

FIXES = {k: "" for k in ("missing", "temp", "root", "unmarked", "json", "format", "files")}
TMP = ".final.tmp/"  # temp_dir_for(final), as it appears in a case dir's listing


def shared_launch(ctx):
    """One 2-rank job in the group's launch (tests/_launches.py); its output dir and every rank's record."""
    out = ctx.tmp_path_factory.mktemp("publish")
    yield {2: [("publish", [out])]}
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def run(shared_launch_state):
    return shared_launch_state


def case_dir(out, case):
    return out / "cases" / case


def marker_of(out, case):
    """The published dir's COMPLETE.json, checked as every loader checks it (files, sizes, CRC-32s)."""
    return read_complete_marker(str(case_dir(out, case) / "final"), ("publish_test",), "test dir", FIXES)


def test_success_publishes_every_ranks_files(run):
    out, results = run
    want = ["final/", f"final/{MARKER_NAME}", "final/config.json", "final/rank0.bin", "final/rank1.bin"]
    for r in range(2):
        res = results[r]["success"]
        assert res["type"] == "ok", (r, res)
        assert res["listing"] == want, r  # no temp dir beside it
        assert not res["temp_dir_exists"], r
    marker = marker_of(out, "success")
    assert marker == results[0]["success"]["marker"]
    assert marker["format"] == "publish_test" and marker["case"] == "success"  # seal's dict, written as is
    final = case_dir(out, "success") / "final"
    files = {e["path"]: e for e in marker["files"]}
    assert sorted(files) == ["config.json", "rank0.bin", "rank1.bin"]  # the marker does not list itself
    for name, e in files.items():
        assert e["bytes"] == (final / name).stat().st_size > 0, name
        assert len(e["crc32"]) == 8, name
    assert (final / "rank1.bin").read_bytes().startswith(b"case success, rank 1\n")


def test_write_failure_on_one_rank_raises_on_every_rank(run):
    out, results = run
    own, other = results[1]["write_fail"], results[0]["write_fail"]
    assert (own["type"], own["message"]) == ("ValueError", "boom on rank 1")  # its own exception, as is
    assert other["type"] == "CheckpointError" and "boom on rank 1" in other["message"]
    for r in range(2):
        listing = results[r]["write_fail"]["listing"]
        assert "final/" not in listing, r
        assert listing == [TMP, TMP + "rank0.bin"], r  # only the temp dir, which loaders refuse
    # (on disk, final/ exists by now: the retry below published it into the same dir)


def test_retry_after_failed_write_clears_the_stale_temp_dir(run):
    out, results = run
    for r in range(2):
        res = results[r]["retry_after_write_fail"]
        assert res["type"] == "ok", (r, res)
        assert not res["temp_dir_exists"], r
        assert res["listing"] == ["final/", f"final/{MARKER_NAME}", "final/config.json", "final/retry0.bin",
                                  "final/retry1.bin"], r  # no rank0.bin from the failed attempt
    assert [e["path"] for e in marker_of(out, "write_fail")["files"]] == ["config.json", "retry0.bin", "retry1.bin"]


def test_seal_failure_on_rank0_raises_on_every_rank(run):
    out, results = run
    for r in range(2):
        res = results[r]["seal_fail"]
        assert res["type"] == "CheckpointError", (r, res)
        assert "ValueError: seal broke" in res["message"] and "publishing" in res["message"], r
        assert not any(p.startswith("final") for p in res["listing"]), (r, res["listing"])
    assert not (case_dir(out, "seal_fail") / "final").exists()


def test_verify_failure_raises_on_every_rank(run):
    out, results = run
    for r in range(2):
        res = results[r]["verify_fail"]
        assert (res["type"], res["message"]) == ("RuntimeError", f"verify mismatch on rank {r}"), r
        assert not any(p.startswith("final") for p in res["listing"]), (r, res["listing"])
        assert f"{TMP}{MARKER_NAME}" not in res["listing"], r  # seal never ran
    assert not (case_dir(out, "verify_fail") / "final").exists()


def test_replacing_final_keeps_only_the_new_files(run):
    out, results = run
    for r in range(2):
        res = results[r]["replace_ok"]
        assert res["type"] == "ok", (r, res)
        assert res["listing"] == ["final/", f"final/{MARKER_NAME}", "final/config.json", "final/rank0.bin",
                                  "final/rank1.bin"], r  # old.bin is gone, and so is the swapped-out dir
        assert not res["temp_dir_exists"], r
    assert results[0]["replace_ok"]["marker"]["case"] == "replace"


def test_failed_write_leaves_a_published_final_untouched(run):
    out, results = run
    assert results[1]["replace_ok_then_fail"]["type"] == "ValueError"
    assert results[0]["replace_ok_then_fail"]["type"] == "CheckpointError"
    for r in range(2):
        listing = results[r]["replace_ok_then_fail"]["listing"]
        assert [p for p in listing if p.startswith("final")] == [
            "final/", f"final/{MARKER_NAME}", "final/config.json", "final/rank0.bin", "final/rank1.bin"], r
    marker = marker_of(out, "replace")  # still the earlier publish, every file intact
    assert marker == results[0]["replace_ok"]["marker"]


def test_failed_write_leaves_the_old_final_untouched(run):
    out, results = run
    own, other = results[1]["replace_fail"], results[0]["replace_fail"]
    assert (own["type"], own["message"]) == ("ValueError", "boom on rank 1")
    assert other["type"] == "CheckpointError" and "boom on rank 1" in other["message"]
    for r in range(2):
        listing = results[r]["replace_fail"]["listing"]
        assert [p for p in listing if p.startswith("final")] == ["final/", "final/old.bin"], r
    assert (case_dir(out, "replace_fail") / "final" / "old.bin").read_bytes() == b"old content\n"
