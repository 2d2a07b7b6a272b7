"""The compressed pulls' payloads in numpy (and MXNet's float16 cast): what
:class:`~kvstore_ext.codecs.pulls.Int8Pull` and :class:`~kvstore_ext.codecs.pulls.Float16Pull`
encode, the reference of the fused kernels (:mod:`kvstore_ext.codecs.kernels`, which the
servers run) and their fallback where no C compiler is found.

A payload is float32 elements: element 0 a header (its value never read), then the codec's
bytes (docs/design.md §2.12).
"""
import numpy as np
from mxnet import nd

__all__ = ['fp16_size', 'fp16_encode', 'int8_blocks', 'int8_size', 'int8_encode']

F32 = np.float32


def fp16_size(n):
    """Float32 elements of an fp16 payload of `n` values."""
    return 1 + (n + 1) // 2


def fp16_encode(d):
    """``(payload, dec)`` of the flat float32 `d`: ``q = float16(d)`` (nearest even) after the
    header, and ``dec = float32(q)``."""
    # MXNet's casts, not numpy's: the same bits (round to nearest even; checked on every
    # float16 midpoint), but numpy converts one element at a time in software, about ten
    # times slower on a 2^19-element chunk (docs/benchmarks/pull-cpu).
    q = nd.array(d, dtype=F32).astype(np.float16)
    payload = np.zeros(fp16_size(d.size), dtype=F32)
    payload.view(np.float16)[2:2 + d.size] = q.asnumpy()
    return payload, q.astype(F32).asnumpy()


def int8_blocks(n, block):
    """Blocks of an int8 payload of `n` values (at least one)."""
    return max(1, -(-n // block))


def int8_size(n, block):
    """Float32 elements of an int8 payload of `n` values: header, scales, bytes."""
    blocks = int8_blocks(n, block)
    return 1 + blocks + -(-blocks * block // 4)


def int8_encode(d, block):
    """``(payload, dec)`` of the flat float32 `d` in blocks of `block` values: per block
    ``s = max|d| / 127`` and ``l = clip(rint(d / s), -127, 127)`` (0 where s is 0), the
    scales then the bytes ``l + 128`` after the header; ``dec = l * s`` (float32)."""
    n = d.size
    blocks = int8_blocks(n, block)
    padded = np.zeros(blocks * block, dtype=F32)
    padded[:n] = d
    padded = padded.reshape(blocks, block)
    scale = (np.abs(padded).max(axis=1) / F32(127)).astype(F32)
    safe = np.where(scale > 0, scale, F32(1)).astype(F32)
    # In place: each fresh array of a chunk costs page faults (numpy returns big ones to
    # the system).
    levels = np.divide(padded, safe[:, None])
    np.rint(levels, out=levels)                  # to nearest even
    np.clip(levels, -127, 127, out=levels)
    levels[scale == 0] = 0
    levels += F32(0)   # -0 becomes +0: the workers' (code - 128) is +0
    # The workers' float32 operations: (code - 128) * scale, where code - 128 is the level.
    dec = (levels * scale[:, None]).reshape(-1)[:n]
    levels += F32(128)
    payload = np.zeros(int8_size(n, block), dtype=F32)
    payload[1:1 + blocks] = scale
    start = 4 * (1 + blocks)   # bytes: the header, then the scales
    payload.view(np.uint8)[start:start + blocks * block] = levels.reshape(-1)  # 1 .. 255
    return payload, dec
