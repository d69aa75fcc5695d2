"""``--update-weight-verify checksum`` with SGLang: the checksums SGLang's ``/weights_checker`` reports, computed on
the trainer's side over the bytes every engine rank should hold, and the compare.

SGLang 0.5.23's ``checksum`` action (``srt/utils/weight_checker.py``) hashes every parameter and buffer of the
model it serves (rotary caches excluded), per TP rank, with ``mm_utils.tensor_hash``, as 16 hex digits:

* a CPU tensor (the CPU engine): SHA-256 of the tensor's contiguous bytes, the first 8 bytes of the digest as a
  big-endian integer (:func:`sglang_cpu_hash`);
* a CUDA tensor: ``gpu_tensor_hash``, a Triton kernel: the bytes as little-endian 32-bit words (zero-padded to a
  multiple of 4), per tile of 8192 words two sums of murmur3-finalised ``word ^ position-hash`` values, the tile's
  pair finalised with the byte count into one 64-bit value, the tiles' values summed modulo 2**64 and finalised
  with splitmix64 (:func:`sglang_cuda_hash`: the same arithmetic in torch integer ops, on the tensor's device).

Which one a server uses follows its ``/server_info`` ``device``. The engine's tensors are SGLang's own: fused
(``qkv_proj``, ``gate_up_proj``), sliced per TP rank, vocab-padded, in the engine's dtype
(``plan.sglang_weights`` says how); :class:`SGLangChecksums` builds each of them from the HF tensors as the export
streams by (holding a fused tensor's parts until its last one arrives; buckets keep them together anyway) and
hashes it, once per distinct server layout (TP size, dtype, device).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from megatron_rl.errors import SyncError
from megatron_rl.plan.sglang_weights import Piece, SGLangWeightLayout
from megatron_rl.rollout.weight_delta import WeightChecksumMismatch

_M32 = 0xFFFFFFFF
_FMIX_C1, _FMIX_C2 = 0x85EBCA6B, 0xC2B2AE35
_POS_A, _POS_B = 0x27D4EB2D, 0x165667B1
_SEED = 0x243F6A88
_TILE = 8192  # words per tile of gpu_tensor_hash
_CHUNK_TILES = 256  # tiles hashed per torch pass (bounds the int64 temporaries to ~16 MB per chunk)


def sglang_cpu_hash(t: torch.Tensor) -> str:
    """SGLang's checksum of a tensor it holds on the CPU: SHA-256 of its bytes, the first 8 as 16 hex digits."""
    return _cpu_hash_pieces([t])


def _cpu_hash_pieces(pieces: list[torch.Tensor]) -> str:
    """:func:`sglang_cpu_hash` of the dim-0 concatenation of ``pieces`` without making it: SHA-256 takes the
    pieces' bytes one after another (a fused tensor's parts need no copy)."""
    h = hashlib.sha256()
    for t in pieces:
        flat = t.detach().to("cpu").contiguous().reshape(-1)
        if flat.numel():
            h.update(flat.view(torch.uint8).numpy().data)
    return h.digest()[:8].hex()


def _cuda_hash_pieces(pieces: list[torch.Tensor]) -> str:
    """:func:`sglang_cuda_hash` of the dim-0 concatenation of ``pieces`` (the kernel hashes word positions: made)."""
    return sglang_cuda_hash(pieces[0] if len(pieces) == 1 else torch.cat([t.reshape(-1) for t in pieces]))


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for int64 ``x`` holding 32-bit values, without overflowing 64 bits."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _FMIX_C1)
    x = x ^ (x >> 13)
    x = _mul32(x, _FMIX_C2)
    return x ^ (x >> 16)


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) & _M32) | (x >> (32 - r))


def _fmix32_int(x: int) -> int:
    x ^= x >> 16
    x = (x * _FMIX_C1) & _M32
    x ^= x >> 13
    x = (x * _FMIX_C2) & _M32
    return x ^ (x >> 16)


def _splitmix64(x: int) -> int:
    mask = (1 << 64) - 1
    x &= mask
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & mask
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & mask
    return x ^ (x >> 31)


def sglang_cuda_hash(t: torch.Tensor) -> str:
    """SGLang's checksum of a tensor it holds on a GPU (``gpu_tensor_hash``, seed 0x243F6A88, tiles of 8192 words),
    computed with torch integer ops on ``t``'s own device (module docstring)."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    nbytes = raw.numel()
    if nbytes == 0:
        return f"{0:016x}"
    if nbytes % 4:
        raw = torch.cat([raw, raw.new_zeros(4 - nbytes % 4)])
    b = raw.to(torch.int64).view(-1, 4)
    words = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16) | (b[:, 3] << 24)  # little-endian uint32, in int64
    n = words.numel()
    seed1 = _SEED & _M32
    seed2 = ((_SEED * 0x9E3779B1) ^ 0xDEADBEEF) & _M32
    size = (n * 4) & _M32
    total_hi = total_lo = 0
    step = _TILE * _CHUNK_TILES
    for begin in range(0, n, step):
        v = words[begin:begin + step]
        idx = torch.arange(begin, begin + v.numel(), device=v.device, dtype=torch.int64) & _M32
        p1 = ((_mul32(idx, _POS_A) + seed1) & _M32) ^ _rotl32(idx, 15)
        p2 = ((_mul32(idx, _POS_B) + seed2) & _M32) ^ _rotl32(idx, 13)
        k1, k2 = _fmix32(v ^ p1), _fmix32(v ^ p2)
        tiles = -(-v.numel() // _TILE)
        pad = tiles * _TILE - v.numel()
        if pad:  # the last tile's words past the tensor count 0, as the kernel's mask does
            k1 = torch.cat([k1, k1.new_zeros(pad)])
            k2 = torch.cat([k2, k2.new_zeros(pad)])
        h1 = _fmix32((k1.view(tiles, _TILE).sum(1) & _M32) ^ size)
        h2 = _fmix32((k2.view(tiles, _TILE).sum(1) & _M32) ^ size)
        total_hi += int(h1.sum().item())  # the tiles' (h1 << 32 | h2) summed mod 2**64: the halves apart, exact
        total_lo += int(h2.sum().item())
    return f"{_splitmix64((total_hi << 32) + total_lo):016x}"


# /server_info "device" -> the hash SGLang's /weights_checker uses for tensors there, of a tensor given as the pieces
# of its dim-0 concatenation
HASHES: dict[str, Callable[[list[torch.Tensor]], str]] = {"cpu": _cpu_hash_pieces, "cuda": _cuda_hash_pieces}

_DTYPES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16, "half": torch.float16,
           "bfloat16": torch.bfloat16}


def engine_dtype(server_dtype: str, hf_config: dict) -> torch.dtype:
    """The dtype an SGLang server holds the model in: its ``--dtype`` (``/server_info`` ``dtype``); ``auto`` as
    SGLang 0.5.23 resolves it (``configs/model_config.py``): config.json's dtype, float32 cast to float16 (bfloat16
    for gemma)."""
    d = str(server_dtype or "auto").lower()
    if d != "auto":
        if d not in _DTYPES:
            raise SyncError(f"--update-weight-verify checksum: the SGLang server runs --dtype {server_dtype!r}, "
                            f"which the trainer cannot reproduce (it knows {', '.join(sorted(_DTYPES))}, auto)")
        return _DTYPES[d]
    c = hf_config.get("text_config") or hf_config
    declared = c.get("dtype") or c.get("torch_dtype") or hf_config.get("dtype") or hf_config.get("torch_dtype")
    dtype = _DTYPES.get(str(declared).replace("torch.", ""), torch.float32)
    if dtype == torch.float32:
        return torch.bfloat16 if str(c.get("model_type", "")).startswith("gemma") else torch.float16
    return dtype


@dataclass(frozen=True)
class ServerLayout:
    """What decides the bytes one server holds: its layout (TP size), dtype and device (which hash)."""

    layout: SGLangWeightLayout
    dtype: torch.dtype
    device: str

    @property
    def hash_name(self) -> str:
        return "sha256[:8] (SGLang's CPU tensor_hash)" if self.device == "cpu" else "SGLang's gpu_tensor_hash"


@dataclass
class _Expected:
    """The trainer's checksum of each tensor every rank of one server layout should hold."""

    server: ServerLayout
    ranks: list[dict[str, str]] = field(default_factory=list)  # rank -> engine name -> checksum


class SGLangChecksums:
    """Fed the export as it streams by (:meth:`add`), builds each engine tensor of every server layout and hashes
    it; :meth:`compare` checks a server's ``/weights_checker`` reply against it."""

    def __init__(self, servers: list[ServerLayout]):
        self._expected = {s: _Expected(s, [dict() for _ in range(s.layout.tp_size)]) for s in dict.fromkeys(servers)}
        self._pending: dict[str, dict[str, torch.Tensor]] = {}  # fused engine name -> its parts so far
        self.buckets: dict[str, int] = {}  # engine name -> the bucket its (last) part came in
        self.tensors = 0

    def add(self, hf_name: str, tensor: Any, bucket: int) -> None:
        """One exported HF tensor (bucket ``bucket``, 1-based)."""
        layout = next(iter(self._expected)).layout  # names and parts are the same for every TP size
        name, part = layout.engine_name(hf_name)
        if name is None:
            return
        self.tensors += 1
        self.buckets[name] = bucket
        if part is None:
            self._hash(name, {"": tensor})
            return
        parts = self._pending.setdefault(name, {})
        parts[part] = tensor
        if len(parts) == len(layout.parts(name)):
            del self._pending[name]
            self._hash(name, parts)

    def _hash(self, name: str, parts: dict[str, Any]) -> None:
        for server, expected in self._expected.items():
            layout, order = server.layout, (server.layout.parts(name) or ("",))
            for rank in range(layout.tp_size):
                pieces = []
                for part in order:
                    full = parts[part]
                    problem = layout.shape_problem(name, part or None, tuple(full.shape))
                    if problem:
                        raise SyncError(f"--update-weight-verify checksum: cannot build SGLang's {name} for tp_size "
                                        f"{layout.tp_size}: {problem}")
                    pieces += _cut(full, layout.piece(name, part or None, tuple(full.shape), rank), server.dtype)
                expected.ranks[rank][name] = HASHES[server.device](pieces)

    def unfinished(self) -> list[str]:
        """Fused tensors some of whose parts never came (named with the parts that did)."""
        return [f"{name} (got {', '.join(sorted(parts))})" for name, parts in self._pending.items()]

    def compare(self, server: ServerLayout, url: str, reply: dict, version: int) -> int:
        """``reply`` (a server's ``/weights_checker`` checksum answer) against the expectation for its layout;
        the number of (rank, tensor) checksums compared. A difference, a rank missing or a tensor on one side only
        raises ``WeightChecksumMismatch`` naming the tensors, the engine rank and the version."""
        expected = self._expected[server].ranks
        ranks = reply.get("ranks")
        if not isinstance(ranks, list):
            raise SyncError(f"--update-weight-verify checksum: SGLang server {url} answered /weights_checker checksum "
                            f"without per-rank checksums ({str(reply)[:200]}); it needs SGLang >= 0.5.23")
        got: dict[int, dict[str, str]] = {}
        for i, entry in enumerate(ranks):
            infos = entry.get("parallelism_info")
            info = (infos[0] if isinstance(infos, list) and infos else infos) or {}
            got[int(info.get("tp_rank", i))] = dict(entry.get("checksums") or {})
        problems, checked = [], 0
        for rank, want in enumerate(expected):
            if rank not in got:
                problems.append(f"engine rank {rank}: no checksums reported")
                continue
            have = got[rank]
            differ = [n for n in want if n in have and have[n] != want[n]]
            missing = [n for n in want if n not in have]
            extra = sorted(set(have) - set(want))
            checked += len(want) - len(missing)
            for what, names in (("differs", differ), ("is not held by the engine", missing),
                                ("is held by the engine but was not sent", extra)):
                if names:
                    shown = ", ".join(f"{n} (bucket {self.buckets[n]})" if n in self.buckets else n for n in names[:8])
                    problems.append(f"engine rank {rank}: {len(names)} tensor(s) {what}: {shown}"
                                    f"{' ...' if len(names) > 8 else ''}")
        if problems:
            raise WeightChecksumMismatch(
                f"--update-weight-verify: after the weight sync to version {version} SGLang server {url} holds other "
                f"bytes than the trainer sent ({server.hash_name} of each tensor as the engine holds it: fused, per "
                f"TP rank, {str(server.dtype).replace('torch.', '')}): " + "; ".join(problems)
                + "; the engine's weights diverged from the trainer's")
        return checked


def _cut(full: Any, piece: Piece, dtype: torch.dtype) -> list[torch.Tensor]:
    """A rank's slice of an HF tensor in the engine's dtype, then the zero rows of vocab padding: the pieces whose
    dim-0 concatenation the rank holds (no copy where the slice is rows of a tensor already in that dtype)."""
    t = full.detach()
    if piece.dim is not None:
        t = t.narrow(piece.dim, piece.start, piece.length)
    t = t.to(dtype)
    return [t, t.new_zeros((piece.pad, *t.shape[1:]))] if piece.pad else [t]
