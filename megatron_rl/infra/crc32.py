"""CRC-32 (zlib's, the checksum ``COMPLETE.json`` and zip records carry) at memory speed, and its combination.

Why not ``zlib.crc32`` alone: CPython's zlib computes it table-driven at ~2 GB/s on the 2-core VM the
benchmarks run on, so checking a checkpoint's files, or checksumming a converter's output as it is
written, cost about as long as copying the bytes. ISA-L (the ``isal`` package) computes the same
CRC-32 with carry-less multiplication at ~11 GB/s there; it is used when installed (``setup.py``
lists it), ``zlib`` otherwise: same values either way.

:func:`crc32_combine` gives the CRC-32 of ``A + B`` from the CRC-32s of ``A`` and ``B`` and the length
of ``B`` (zlib's ``crc32_combine``, which Python does not expose), so bytes hashed once can be
accounted for in two checksums: a zip record's own and the file's that holds it.
"""

from __future__ import annotations

import zlib
from typing import Callable

def _pick() -> tuple[Callable[..., int], str]:
    try:  # ISA-L: the same polynomial, SIMD
        from isal.isal_zlib import crc32 as fast
    except ImportError:  # pragma: no cover - the package is a dependency; zlib gives the same values
        return zlib.crc32, "zlib"
    return fast, "isal"


crc32, BACKEND = _pick()
"""``crc32(data, value=0)``: zlib's CRC-32 of ``data`` continued from ``value`` (``BACKEND``: which computes it)."""

_POLY = 0xEDB88320  # the reflected CRC-32 polynomial


def _multmodp(a: int, b: int) -> int:
    """``a * b`` modulo the CRC polynomial (reflected bit order: bit 31 is x^0)."""
    m = 1 << 31
    p = 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                break
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


def _powers() -> list[int]:
    table = [1 << 30]  # x^1
    for _ in range(31):
        table.append(_multmodp(table[-1], table[-1]))  # x^(2^k)
    return table


_X2N = _powers()


def _x8nmodp(n: int) -> int:
    """x^(8 n) modulo the polynomial: what appending ``n`` zero bytes multiplies a CRC by."""
    p = 1 << 31  # x^0
    k = 3
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of ``A + B`` given ``crc32(A)``, ``crc32(B)`` and ``len(B)``."""
    return _multmodp(_x8nmodp(len2), crc1) ^ crc2
