"""SHA-256 for the small files a resume trusts outside the checkpoint dirs (``resume_state.json``,
``rollout_ckpts/rollout_N.pt``): one format, checked on every load.

Why: an ``iter_*`` dir's files are covered by its ``COMPLETE.json`` (size + CRC-32 of each,
:mod:`megatron_rl.infra.checkpoint_root`), but the files beside it were trusted as read. A
rollout file with one flipped bit (a reward 0.25 -> 1.0) still unpickles, was loaded as "not
regenerated" and trained on. Atomic writes stop torn files, not damage after the write (disk,
copy, sync tool); only a checksum recorded at write time and compared at read time does.

The format, one per kind of file, each written in the same single atomic write as the data (no
sidecar that a crash or a copy could leave out of step):

* a JSON object: a ``"sha256"`` key inside the object, the SHA-256 of the canonical JSON of
  every other key (:func:`canonical_json`: sorted keys, no spaces, ASCII). The file stays a plain
  JSON object with its usual keys, so anything that reads one field keeps working, and
  re-indenting the file does not break the check (the hash is of the content, not the bytes);
* bytes (a ``torch.save`` payload): one header line ``megatron_rl-sha256 <hex>\\n`` before the
  payload, the SHA-256 of the payload.

SHA-256 and not the CRC-32 of the checkpoint shards: these files are small (bytes to a few MB),
so the cost is nothing next to the rollout or resume they gate, and a collision cannot hide a
damaged record.

A file without a checksum was written before this format existed: it is accepted unchecked (so a
job resumes across the upgrade) with one log line per file and process; the next save writes the
checksum. A mismatch raises :class:`ChecksumMismatch` (a ``CheckpointError``) naming the file and
both hashes; each caller decides what it means, and documents it (docs/checkpoints.md,
"Checksummed files"): a stored rollout is generated again, ``resume_state.json`` is refused.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Any

from megatron_rl.errors import CheckpointError
from megatron_rl.infra.atomic import atomic_write_bytes, atomic_write_json

log = logging.getLogger(__name__)

SHA256_KEY = "sha256"
BYTES_MAGIC = b"megatron_rl-sha256 "
_HEX_LEN = 64
_unchecked_logged: set[str] = set()


class ChecksumMismatch(CheckpointError):
    """A file's content differs from the SHA-256 recorded when it was written: it was damaged after
    the (atomic) write. ``recorded`` and ``actual`` are the two hex digests."""

    def __init__(self, path: str, recorded: str, actual: str, fix: str):
        self.path, self.recorded, self.actual = path, recorded, actual
        super().__init__(f"{path} fails its checksum: its content hashes to sha256 {actual}, the file records "
                         f"{recorded} (written atomically, so it was damaged afterwards: disk, copy or sync). {fix}")


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def canonical_json(obj: Any) -> bytes:
    """The bytes a JSON record's checksum covers: independent of indentation and key order."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True).encode()


def _log_unchecked(path: str) -> None:
    key = os.path.abspath(path)
    if key not in _unchecked_logged:
        _unchecked_logged.add(key)
        log.warning("%s has no checksum (written before megatron_rl recorded one): loaded unchecked; the next "
                    "save writes it with one", path)


# ---- JSON objects ----------------------------------------------------------------------------------


def seal_json(record: dict) -> dict:
    """``record`` (JSON-serialisable, without a ``"sha256"`` key) plus its checksum under ``"sha256"``.

    The checksum is of the record as JSON will give it back (tuples as lists, int keys as strings),
    so the reader's re-serialisation matches."""
    if not isinstance(record, dict):
        raise TypeError(f"a checksummed JSON record is an object, got {type(record).__name__}")
    if SHA256_KEY in record:
        raise ValueError(f"{SHA256_KEY!r} is the checksum's key in a checksummed JSON record; rename that field")
    payload = json.loads(json.dumps(record))
    return {**payload, SHA256_KEY: sha256_hex(canonical_json(payload))}


def verify_json(record: Any, path: str, fix: str) -> Any:
    """``record`` as parsed from ``path``, without its checksum key, after checking it.

    A record without the key (an older file) is returned as is, logged once; a mismatch raises
    :class:`ChecksumMismatch` with ``fix`` (what the caller's user should do)."""
    if not isinstance(record, dict) or SHA256_KEY not in record:
        _log_unchecked(path)
        return record
    payload = {k: v for k, v in record.items() if k != SHA256_KEY}
    recorded, actual = str(record[SHA256_KEY]), sha256_hex(canonical_json(payload))
    if recorded != actual:
        raise ChecksumMismatch(path, recorded, actual, fix)
    return payload


def write_json(path: str, record: dict) -> None:
    """Atomically write ``record`` with its checksum (:func:`seal_json`)."""
    atomic_write_json(path, seal_json(record))


def read_json(path: str, fix: str) -> Any:
    """Parse and check ``path`` (:func:`verify_json`). Unparseable JSON raises ``ValueError``
    (``json.JSONDecodeError``) for the caller to word; a mismatch raises :class:`ChecksumMismatch`."""
    with open(path, "rb") as f:
        record = json.loads(f.read())
    return verify_json(record, path, fix)


# ---- bytes -----------------------------------------------------------------------------------------


def seal_bytes(payload: bytes) -> bytes:
    """The header line with ``payload``'s SHA-256, then ``payload``."""
    return BYTES_MAGIC + sha256_hex(payload).encode() + b"\n" + payload


def verify_bytes(data: bytes, path: str, fix: str) -> bytes:
    """The payload of ``data`` (read from ``path``) after checking its header.

    Data without the header line (an older file, or one whose header was itself damaged) is
    returned whole, logged once: a damaged header then fails in the caller's own parse, not
    silently. A mismatch raises :class:`ChecksumMismatch` with ``fix``."""
    if not data.startswith(BYTES_MAGIC):
        _log_unchecked(path)
        return data
    start = len(BYTES_MAGIC)
    recorded = data[start:start + _HEX_LEN].decode("ascii", errors="replace")
    payload = data[start + _HEX_LEN + 1:]
    actual = sha256_hex(payload)
    if data[start + _HEX_LEN:start + _HEX_LEN + 1] != b"\n" or recorded != actual:
        raise ChecksumMismatch(path, recorded, actual, fix)
    return payload


def write_bytes(path: str, payload: bytes) -> None:
    """Atomically write ``payload`` behind its checksum header (:func:`seal_bytes`)."""
    atomic_write_bytes(path, seal_bytes(payload))


def read_bytes(path: str, fix: str) -> bytes:
    """The checked payload of ``path`` (:func:`verify_bytes`)."""
    with open(path, "rb") as f:
        return verify_bytes(f.read(), path, fix)
