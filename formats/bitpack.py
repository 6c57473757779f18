"""Packing of b-bit two's-complement codes and of bit masks (little endian, LSB first)."""

from __future__ import annotations

import numpy as np

from .errors import FormatError

SUPPORTED_BITS = (2, 4, 8)


def code_range(bits: int) -> tuple[int, int]:
    """Inclusive range of a signed b-bit code: (-2^(b-1), 2^(b-1) - 1)."""
    check_bits(bits)
    return -(1 << (bits - 1)), (1 << (bits - 1)) - 1


def check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise FormatError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")


def pack_codes(codes: np.ndarray, bits: int, xp=np) -> np.ndarray:
    """Pack int8 codes into bytes: code v sits in byte v*b//8 at bit offset (v*b) % 8.

    The number of codes must fill whole bytes (callers pad to 16-byte alignment anyway). ``xp``: the array
    module of ``codes`` (numpy, or cupy for the GPU encoder of the benchmarks).
    """
    check_bits(bits)
    codes = xp.ascontiguousarray(codes, dtype=xp.int8).ravel()
    if bits == 8:
        return codes.view(xp.uint8).copy()
    per_byte = 8 // bits
    if codes.size % per_byte:
        raise FormatError(f"{codes.size} codes of {bits} bits do not fill whole bytes")
    mask = (1 << bits) - 1
    u = (codes.view(xp.uint8) & mask).reshape(-1, per_byte)
    out = xp.zeros(u.shape[0], dtype=xp.uint8)
    for i in range(per_byte):
        out |= u[:, i] << xp.uint8(bits * i)
    return out


def unpack_codes(packed: np.ndarray, bits: int, count: int | None = None) -> np.ndarray:
    """Inverse of :func:`pack_codes`: sign-extended int8 codes (the first ``count`` of them)."""
    check_bits(bits)
    packed = np.ascontiguousarray(packed, dtype=np.uint8).ravel()
    if bits == 8:
        out = packed.view(np.int8)
    else:
        per_byte = 8 // bits
        mask = np.uint8((1 << bits) - 1)
        fields = np.empty((packed.size, per_byte), dtype=np.uint8)
        for i in range(per_byte):
            fields[:, i] = (packed >> np.uint8(bits * i)) & mask
        # sign-extend: shift the field to the top of the byte, then arithmetic shift back
        out = ((fields << np.uint8(8 - bits)).view(np.int8) >> np.int8(8 - bits)).ravel()
    if count is not None:
        if count > out.size:
            raise FormatError(f"asked for {count} codes but only {out.size} are stored")
        out = out[:count]
    return out.copy()


def pack_bits_u64(bits_2d: np.ndarray, words_per_row: int) -> np.ndarray:
    """Pack each row of a bool array LSB first into ``words_per_row`` uint64 words.

    Bit p of the row becomes bit p % 64 of word p // 64. Rows shorter than the words are
    zero-padded. Returns an array of shape [rows, words_per_row].
    """
    rows, nbits = bits_2d.shape
    total = words_per_row * 64
    if nbits > total:
        raise FormatError("row longer than its words")
    if nbits < total:
        padded = np.zeros((rows, total), dtype=bool)
        padded[:, :nbits] = bits_2d
        bits_2d = padded
    packed = np.packbits(np.ascontiguousarray(bits_2d), axis=1, bitorder="little")
    return packed.view("<u8").reshape(rows, words_per_row).astype(np.uint64, copy=False)


def unpack_bits_u64(words: np.ndarray, nbits: int) -> np.ndarray:
    """Inverse of :func:`pack_bits_u64`: bool array [rows, nbits] from uint64 words [rows, W]."""
    words = np.ascontiguousarray(words, dtype="<u8")
    rows = words.shape[0]
    as_bytes = words.view(np.uint8).reshape(rows, -1)
    return np.unpackbits(as_bytes, axis=1, bitorder="little")[:, :nbits].astype(bool)


def popcount_u64(words: np.ndarray) -> np.ndarray:
    """Population count of every uint64 word (vectorised)."""
    w = np.ascontiguousarray(words, dtype="<u8")
    return np.unpackbits(w.view(np.uint8).reshape(*w.shape, 8), axis=-1).sum(axis=(-1), dtype=np.int64)


def round_up(x: np.ndarray | int, multiple: int) -> np.ndarray | int:
    """Round x up to a multiple of ``multiple``."""
    return -(-x // multiple) * multiple
