"""Checksummed small files (infra/checksum.py) and resume_state.json, the pointer a resume trusts.

What is proven: one flipped byte in a checked file is refused naming the file and both hashes,
whatever the byte (a value, a key, the recorded hash itself); re-indenting a JSON record is not
damage; a file written before checksums existed loads, logged once per file.
"""

import json
import logging
import os

import pytest

from megatron_rl.errors import CheckpointError
from megatron_rl.infra import checkpoint_root as cr
from megatron_rl.infra import checksum


def _flip(path, offset, mask=0x01):
    data = bytearray(open(path, "rb").read())
    data[offset] ^= mask
    open(path, "wb").write(bytes(data))


def _legacy_logs(caplog, path):
    return [r for r in caplog.records if str(path) in r.getMessage() and "has no checksum" in r.getMessage()]


# ---- the module -----------------------------------------------------------------------------------


def test_json_record_round_trips_and_any_flipped_value_byte_is_refused(tmp_path):
    path = str(tmp_path / "state.json")
    record = {"rollout_id": 12, "elapsed_s": 3600.25, "names": ["a", "b"], "nested": {"k": 1}}
    checksum.write_json(path, record)
    assert checksum.read_json(path, fix="FIX") == record
    raw = open(path, "rb").read()
    on_disk = json.loads(raw)
    assert set(on_disk) == set(record) | {checksum.SHA256_KEY}  # a plain object: its fields stay readable
    # every digit of every value ('2' <-> '3', '0' <-> '1' ...): a flip that keeps the JSON valid must
    # fail the checksum (one that does not, e.g. "12" -> "02", fails the parse)
    digits = [i for i, b in enumerate(raw) if chr(b).isdigit() and i < raw.index(b'"sha256"')]
    mismatches = 0
    for i in digits:
        _flip(path, i, 0x01)
        try:
            json.loads(open(path, "rb").read())
        except ValueError:
            with pytest.raises(ValueError):
                checksum.read_json(path, fix="FIX")
        else:
            with pytest.raises(checksum.ChecksumMismatch) as e:
                checksum.read_json(path, fix="FIX")
            assert path in str(e.value) and e.value.recorded in str(e.value) and e.value.actual in str(e.value)
            assert e.value.recorded != e.value.actual and str(e.value).endswith("FIX")
            mismatches += 1
        _flip(path, i, 0x01)
    assert mismatches >= len(digits) - 2  # only the leading digits of "12" and "1" may break the parse
    assert checksum.read_json(path, fix="FIX") == record


def test_reindented_json_is_not_damage_and_a_damaged_hash_is(tmp_path):
    path = tmp_path / "state.json"
    checksum.write_json(str(path), {"b": 1, "a": [1.5, None, True]})
    sealed = json.loads(path.read_text())
    path.write_text(json.dumps(sealed, indent=7))  # another tool re-wrote the layout, not the content
    assert checksum.read_json(str(path), fix="") == {"b": 1, "a": [1.5, None, True]}
    sealed[checksum.SHA256_KEY] = "0" * 64
    path.write_text(json.dumps(sealed))
    with pytest.raises(checksum.ChecksumMismatch, match="0" * 64):
        checksum.read_json(str(path), fix="")
    with pytest.raises(ValueError, match="sha256"):
        checksum.seal_json({"sha256": "mine"})


def test_bytes_round_trip_flip_anywhere_in_the_payload_is_refused(tmp_path):
    path = str(tmp_path / "blob.bin")
    payload = bytes(range(256)) * 4
    checksum.write_bytes(path, payload)
    assert checksum.read_bytes(path, fix="") == payload
    header = len(open(path, "rb").read()) - len(payload)
    for offset in (header, header + 500, header + len(payload) - 1, header - 2):  # payload bytes, the hash
        _flip(path, offset)
        with pytest.raises(checksum.ChecksumMismatch):
            checksum.read_bytes(path, fix="")
        _flip(path, offset)


def test_files_without_a_checksum_load_and_are_logged_once(tmp_path, caplog):
    jpath, bpath = tmp_path / "old.json", tmp_path / "old.bin"
    jpath.write_text('{"rollout_id": 3}')
    bpath.write_bytes(b"PK\x03\x04 an older torch.save zip")
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert checksum.read_json(str(jpath), fix="") == {"rollout_id": 3}
            assert checksum.read_bytes(str(bpath), fix="") == b"PK\x03\x04 an older torch.save zip"
    assert len(_legacy_logs(caplog, jpath)) == 1 and len(_legacy_logs(caplog, bpath)) == 1


# ---- resume_state.json ----------------------------------------------------------------------------


def test_resume_state_with_a_flipped_byte_is_refused_naming_the_file_and_the_fix(tmp_path):
    root = str(tmp_path)
    state = {"rollout_id": 40, "checkpoint": cr.iter_dir(root, 40), "elapsed_s": 7200.5, "wandb_run_id": "r1"}
    cr.write_resume_state(root, state)
    assert cr.read_resume_state(root) == state
    path = os.path.join(root, cr.RESUME_STATE_NAME)
    raw = open(path, "rb").read()
    _flip(path, raw.index(b"7200.5"), 0x02)  # elapsed_s 7200.5 -> 5200.5: valid JSON, wrong wall time
    assert json.loads(open(path).read())["elapsed_s"] == 5200.5
    with pytest.raises(CheckpointError) as e:
        cr.read_resume_state(root)
    assert isinstance(e.value, checksum.ChecksumMismatch)
    msg = str(e.value)
    assert path in msg and "fails its checksum" in msg and "delete it to resume from the newest complete" in msg
    assert "--wandb-resume-id" in msg
    # the resume paths that read it refuse too (none of them silently drops the pointer)
    with pytest.raises(checksum.ChecksumMismatch):
        cr.resume_candidates(root)
    # the fix it names works: without the file the newest complete checkpoint is resumed
    os.remove(path)
    assert cr.read_resume_state(root) is None


def test_resume_state_written_before_checksums_loads_with_one_log_line(tmp_path, caplog):
    root = tmp_path
    (root / cr.RESUME_STATE_NAME).write_text(json.dumps({"rollout_id": 4, "checkpoint": "x/iter_0000004",
                                                         "elapsed_s": 12.0}, indent=2))
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            assert cr.read_resume_state(str(root)) == {"rollout_id": 4, "checkpoint": "x/iter_0000004",
                                                       "elapsed_s": 12.0}
    assert len(_legacy_logs(caplog, root / cr.RESUME_STATE_NAME)) == 1
    cr.write_resume_state(str(root), {"rollout_id": 5})  # the next save seals it
    assert checksum.SHA256_KEY in json.loads((root / cr.RESUME_STATE_NAME).read_text())
    (root / cr.RESUME_STATE_NAME).write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="holds a JSON list, not an object"):
        cr.read_resume_state(str(root))
