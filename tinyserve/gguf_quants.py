"""GGUF's weight formats, dequantized to float32 in plain NumPy: each format as bits, values per block, a scale and
an optional minimum.

Every quantised format cuts a row into blocks of 32 values (or super-blocks of 256) and stores per block a scale d
(and for the "_1" and K formats a minimum m) beside small integers q:

    format  bits  values/block  bytes/block  one value
    Q8_0     8        32            34       d * q                 q int8
    Q4_0     4        32            18       d * (q - 8)           q in 0..15
    Q4_1     4        32            20       d * q + m
    Q5_0     5        32            22       d * (q - 16)          the 5th bit of each q sits in a 32-bit mask qh
    Q5_1     5        32            24       d * q + m
    Q4_K     4       256           144       d*sc_j * q - dmin*m_j  8 sub-blocks j of 32, sc_j and m_j 6-bit ints
    Q5_K     5       256           176       as Q4_K, a 5th bit per value
    Q6_K     6       256           210       d * sc_j * (q - 32)   16 sub-blocks j of 16, sc_j int8

d, m and dmin are float16. Everything is little-endian. `dequantize(raw, type_name, shape)` is the readable reference
that gguf-py's `gguf.quants.dequantize` is tested against (tests/test_gguf.py).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

# type name -> (values per block, bytes per block): GGML's type table for the formats tinyserve reads
BLOCKS: dict[str, tuple[int, int]] = {
    "F32": (1, 4), "F16": (1, 2), "BF16": (1, 2),
    "Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
    "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
}
SUPPORTED = tuple(BLOCKS)


def _f16(b: np.ndarray) -> np.ndarray:  # [n, 2] uint8 -> [n, 1] float32: one float16 per block
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:  # [n, 16] uint8 -> [n, 32]: low nibbles are values 0..15, high 16..31
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:  # [n, 4] uint8 -> [n, 32] in {0, 16}: bit j of the mask is value j's
    mask = np.ascontiguousarray(qh).view("<u4")                      # [n, 1]
    return (((mask >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit minimums, [n, 8] each.

    Bytes 0-3 hold scales 0-3 (low 6 bits), bytes 4-7 minimums 0-3; scales and minimums 4-7 keep their low 4 bits
    in bytes 8-11 and their top 2 bits in the spare top bits of bytes 0-3 (scales) and 4-7 (minimums)."""
    sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)], axis=1)
    mn = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_quads(qs: np.ndarray) -> np.ndarray:  # [n, 128] -> [n, 256]: 4 chunks of 32 bytes, each 64 values (lo, hi)
    q = qs.reshape(-1, 4, 1, 32)
    return np.concatenate([q & 0x0F, q >> 4], axis=2).reshape(-1, 256)


def _blocks(raw: np.ndarray, type_name: str) -> np.ndarray:  # [n_blocks, bytes per block] uint8
    return raw.reshape(-1, BLOCKS[type_name][1])


def dequantize_blocks(raw: np.ndarray, type_name: str) -> np.ndarray:
    """Flat uint8 bytes of one tensor -> flat float32 values, in the file's order."""
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    if type_name == "F32":
        return raw.view("<f4").astype(np.float32)
    if type_name == "F16":
        return raw.view("<f2").astype(np.float32)
    if type_name == "BF16":  # the top half of a float32: shift the 16 bits back into place
        return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    b = _blocks(raw, type_name)
    if type_name == "Q8_0":
        return (_f16(b[:, :2]) * b[:, 2:].view(np.int8)).reshape(-1)
    if type_name == "Q4_0":
        return (_f16(b[:, :2]) * (_nibbles(b[:, 2:]).astype(np.float32) - 8)).reshape(-1)
    if type_name == "Q4_1":
        return (_f16(b[:, :2]) * _nibbles(b[:, 4:]) + _f16(b[:, 2:4])).reshape(-1)
    if type_name == "Q5_0":
        q = _nibbles(b[:, 6:]) | _fifth_bits(b[:, 2:6])
        return (_f16(b[:, :2]) * (q.astype(np.float32) - 16)).reshape(-1)
    if type_name == "Q5_1":
        q = _nibbles(b[:, 8:]) | _fifth_bits(b[:, 4:8])
        return (_f16(b[:, :2]) * q + _f16(b[:, 2:4])).reshape(-1)
    if type_name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])                  # [n, 1] each
        sc, mn = _k_scales(b[:, 4:16])                              # [n, 8] each
        if type_name == "Q4_K":
            q = _k_quads(b[:, 16:144])                              # [n, 256]
        else:   # qh[l] bit 2j is value l's 5th bit in chunk j's low half, bit 2j+1 in its high half
            qh = b[:, 16:48]                                        # [n, 32]
            hi = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1   # [n, 8 halves, 32]
            q = _k_quads(b[:, 48:176]) | (hi.reshape(-1, 256) << 4)
        q = q.reshape(-1, 8, 32).astype(np.float32)                 # [n, 8 sub-blocks, 32]
        return (d[:, :, None] * sc[:, :, None] * q - dmin[:, :, None] * mn[:, :, None]).reshape(-1)
    if type_name == "Q6_K":
        ql, qh = b[:, 0:128].reshape(-1, 2, 64), b[:, 128:192].reshape(-1, 2, 1, 32)    # two halves of 128 values
        sc, d = b[:, 192:208].view(np.int8).astype(np.float32), _f16(b[:, 208:210])    # [n, 16], [n, 1]
        low = np.concatenate([ql & 0x0F, ql >> 4], axis=2)                              # [n, 2, 128]
        high = (qh >> np.array([0, 2, 4, 6], np.uint8)[None, None, :, None]) & 3        # [n, 2, 4, 32]
        q = (low | (high.reshape(-1, 2, 128) << 4)).astype(np.float32) - 32             # [n, 2, 128]
        return (d[:, :, None] * sc.reshape(-1, 16, 1) * q.reshape(-1, 16, 16)).reshape(-1)
    raise ValueError(f"no dequantizer for GGML type {type_name}")


def check_size(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> None:
    """ValueError unless `raw` holds exactly a tensor of `shape` in whole blocks of the format."""
    n_per_block, n_bytes = BLOCKS[type_name]
    n = int(np.prod(shape))
    if shape[-1] % n_per_block:
        raise ValueError(f"{type_name} rows hold whole blocks of {n_per_block} values, got rows of {shape[-1]}")
    if raw.size != n // n_per_block * n_bytes:
        raise ValueError(f"{type_name} tensor of shape {tuple(shape)} needs {n // n_per_block * n_bytes} bytes, "
                         f"got {raw.size}")


def dequantize(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> np.ndarray:
    """A tensor's bytes -> float32 array of `shape` (NumPy order: the last axis is GGUF's ne[0], the row)."""
    check_size(raw, type_name, shape)
    return dequantize_blocks(raw, type_name).reshape(shape)


# --- the blocks themselves: what the fast path multiplies (quant.py's "gguf" mode) ----------------------------------

class Blocks(NamedTuple):
    """A quantised tensor as unsigned integers with a scale and a minimum per group of inputs of a row:
    w[r, i] = d[r, i // g] * q[r, i] + m[r, i // g], float32 operations giving dequantize's values bit for bit.
    The signed formats carry their offset in m (Q8_0: q + 128 with m = -128 d; Q4_0: m = -8 d; Q5_0: m = -16 d)."""
    q: np.ndarray        # [rows, n] uint8: 0..15 (Q4_0, Q4_1, Q4_K), 0..31 (Q5_*), 0..63 (Q6_K), 0..255 (Q8_0)
    d: np.ndarray        # [rows, n / g] float32
    m: np.ndarray        # [rows, n / g] float32
    group: int           # g: 32, or 16 for Q6_K (its scales are per 16)
    bits: int            # the widest q: 4, 5, 6 or 8


BLOCK_FORMATS = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")   # the float ones have no blocks


def split_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> Blocks:
    """A quantised tensor's bytes -> its Blocks (shape: [rows, row length], as dequantize takes it)."""
    if type_name not in BLOCK_FORMATS:
        raise ValueError(f"{type_name} has no integer blocks (formats with blocks: {', '.join(BLOCK_FORMATS)})")
    rows, n = shape
    check_size(raw, type_name, shape)
    b = _blocks(np.ascontiguousarray(raw).view(np.uint8).reshape(-1), type_name)
    group, bits = 32, {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q4_K": 4, "Q5_K": 5,
                       "Q6_K": 6}[type_name]
    if type_name == "Q8_0":
        d = _f16(b[:, :2])
        q, m = (b[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8), -128 * d
    elif type_name == "Q4_0":
        d = _f16(b[:, :2])
        q, m = _nibbles(b[:, 2:]), -8 * d
    elif type_name == "Q4_1":
        d, m, q = _f16(b[:, :2]), _f16(b[:, 2:4]), _nibbles(b[:, 4:])
    elif type_name == "Q5_0":
        d = _f16(b[:, :2])
        q, m = _nibbles(b[:, 6:]) | _fifth_bits(b[:, 2:6]), -16 * d
    elif type_name == "Q5_1":
        d, m, q = _f16(b[:, :2]), _f16(b[:, 2:4]), _nibbles(b[:, 8:]) | _fifth_bits(b[:, 4:8])
    elif type_name in ("Q4_K", "Q5_K"):          # (as dequantize_blocks: d*sc_j and dmin*m_j, exact in float32)
        sc, mn = _k_scales(b[:, 4:16])
        d, m = _f16(b[:, 0:2]) * sc, -(_f16(b[:, 2:4]) * mn)          # [n, 8] each
        if type_name == "Q4_K":
            q = _k_quads(b[:, 16:144])
        else:
            qh = b[:, 16:48]
            hi = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
            q = _k_quads(b[:, 48:176]) | (hi.reshape(-1, 256) << 4)
    else:                                        # Q6_K: d * sc_j per 16 values, q - 32 as q with m = -32 d sc_j
        ql, qh = b[:, 0:128].reshape(-1, 2, 64), b[:, 128:192].reshape(-1, 2, 1, 32)
        d = _f16(b[:, 208:210]) * b[:, 192:208].view(np.int8).astype(np.float32)        # [n, 16]
        low = np.concatenate([ql & 0x0F, ql >> 4], axis=2)
        high = (qh >> np.array([0, 2, 4, 6], np.uint8)[None, None, :, None]) & 3
        q, m, group = (low | (high.reshape(-1, 2, 128) << 4)).reshape(-1, 256), -32 * d, 16
    as_rows = lambda a: np.ascontiguousarray(a.reshape(rows, -1))      # noqa: E731
    return Blocks(as_rows(q.astype(np.uint8)), as_rows(d.astype(np.float32)), as_rows(m.astype(np.float32)), group,
                  bits)


class Q6Blocks(NamedTuple):
    """A Q6_K tensor as its own integers: w[r, i] = d[r, i // 256] * sc[r, i // 16] * (q[r, i] - 32), float32
    operations in that order giving dequantize's values bit for bit (the 6-bit tile's weights, quant.Q6Linear)."""
    q: np.ndarray        # [rows, n] uint8: 0..63
    sc: np.ndarray       # [rows, n / 16] int8
    d: np.ndarray        # [rows, n / 256] float32 (float16 values)


def split_q6_k(raw: np.ndarray, shape: tuple[int, int]) -> Q6Blocks:
    """A Q6_K tensor's bytes -> its Q6Blocks (shape: [rows, row length])."""
    rows, n = shape
    check_size(raw, "Q6_K", shape)
    b = _blocks(np.ascontiguousarray(raw).view(np.uint8).reshape(-1), "Q6_K")
    ql, qh = b[:, 0:128].reshape(-1, 2, 64), b[:, 128:192].reshape(-1, 2, 1, 32)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2)
    high = (qh >> np.array([0, 2, 4, 6], np.uint8)[None, None, :, None]) & 3
    q = (low | (high.reshape(-1, 2, 128) << 4)).reshape(rows, n)
    sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8).reshape(rows, n // 16)
    return Q6Blocks(np.ascontiguousarray(q, np.uint8), np.ascontiguousarray(sc), _f16(b[:, 208:210]).reshape(rows, -1))
