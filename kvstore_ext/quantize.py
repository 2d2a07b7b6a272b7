"""Blockwise uniform quantization and its packing into float32 words that survive the wire.

The push codecs ``'int8'``, ``'int4'`` and ``'ternary'`` (:mod:`kvstore_ext.payload`,
docs/design.md §2.14) send, per chunk of n values and per block of B values (flat order
within the chunk), a float32 scale ``s = max|p_block| / h`` and one level
``l = clip(rint(p / s), -h, h)`` per value (0 where s == 0); the value sent is ``c = l * s``
in float32. h is 127, 7 or 1.

Levels travel packed: digits ``d = l + h`` in base ``L = 2h + 1``, D of them per float32 word,
D the largest with ``L**D <= 2 * 254 * 2**23`` (int8: 4, int4: 8, ternary: 20). A group's code
``X = sum d_j L**j`` becomes a *normal* float32 (never zero, subnormal, inf or NaN, so that
MXNet's row_sparse merge keeps its bits): mantissa ``X & (2**23 - 1)``, and with
``hi = X >> 23``, sign bit ``hi // 254`` and exponent field ``1 + hi % 254``.

A chunk's payload is ``[ceil(n/B) scales] + [ceil(n/D) words]`` (float32): exactly n digits
are packed, the last word's missing digits are level 0. This module is numpy only: the
worker encodes with it (:func:`encode`) and the servers decode with it (:func:`decode`),
with the same float32 operations, so that the servers' ``c`` is the worker's bit for bit.
"""
import numpy as np

__all__ = ['LEVELS', 'digits_per_word', 'payload_size', 'quantize', 'pack', 'unpack',
           'encode', 'decode', 'levels_to_values']

#: The largest level h of each type.
LEVELS = {'int8': 127, 'int4': 7, 'ternary': 1}

#: Codes below this fit a normal float32 as above: 254 exponents, 2 signs, 2**23 mantissas.
_CODES = 2 * 254 * 2 ** 23
_MANTISSA = np.uint64(2 ** 23 - 1)


def digits_per_word(h):
    """D, the number of base-(2h+1) digits packed into one float32 word."""
    base, count = 2 * h + 1, 0
    while base ** (count + 1) <= _CODES:
        count += 1
    return count


def payload_size(n, h, block):
    """Float32 elements of the payload of a chunk of `n` values: scales, then words."""
    return -(-n // block) + -(-n // digits_per_word(h))


def quantize(p, h, block):
    """Quantize the flat float32 array `p` by blocks of `block` values.

    Returns ``(levels, scales, c)``: levels (float32, integral in [-h, h]), one float32
    scale per block, and the values sent ``c = levels * scale`` (float32, `p`'s size).
    Non-finite values of `p` get level 0 (their block's scale is then not finite)."""
    n = p.size
    blocks = -(-n // block)
    padded = np.zeros(blocks * block, dtype=np.float32)
    padded[:n] = p
    padded = padded.reshape(blocks, block)
    scales = (np.abs(padded).max(axis=1) / np.float32(h)).astype(np.float32)
    nonzero = scales > 0
    divisor = np.where(nonzero, scales, np.float32(1))[:, None]
    with np.errstate(invalid='ignore', over='ignore'):
        levels = np.clip(np.rint(padded / divisor), -h, h).astype(np.float32)
    levels[~nonzero] = 0
    # Non-finite values get 0, and -0.0 (rint of a small negative value) +0.0: the servers
    # decode a digit to +0.0, and c's sign bit must be the worker's.
    levels[~np.isfinite(levels) | (levels == 0)] = 0
    levels = levels.reshape(-1)[:n]
    return levels, scales, levels_to_values(levels, scales, block)


def levels_to_values(levels, scales, block):
    """``c = levels * scale`` of each value's block, in float32 (worker and servers alike)."""
    n = levels.size
    per_value = np.repeat(scales, block)[:n]
    with np.errstate(invalid='ignore', over='ignore'):
        return (levels * per_value).astype(np.float32)


def pack(levels, h):
    """Pack float32 `levels` (integral in [-h, h]) into normal float32 words."""
    base, count = 2 * h + 1, digits_per_word(h)
    words = -(-levels.size // count)
    digits = np.full(words * count, h, dtype=np.uint64)   # padding: level 0
    digits[:levels.size] = (levels.astype(np.int64) + h).astype(np.uint64)
    digits = digits.reshape(words, count)
    code = digits[:, count - 1].copy()
    big = np.uint64(base)
    for j in range(count - 2, -1, -1):
        code *= big
        code += digits[:, j]
    mantissa = code & _MANTISSA
    high = code >> np.uint64(23)
    sign = high // np.uint64(254)
    exponent = np.uint64(1) + high % np.uint64(254)
    bits = (sign << np.uint64(31)) | (exponent << np.uint64(23)) | mantissa
    return bits.astype(np.uint32).view(np.float32)


def unpack(words, h, n):
    """The `n` float32 levels packed in `words` (:func:`pack`'s inverse).

    Raises
    ------
    ValueError
        If a word is not one :func:`pack` makes (zero, subnormal, inf or NaN exponent, or a
        code of no digits): the payload was damaged or is of another type.
    """
    base, count = 2 * h + 1, digits_per_word(h)
    bits = np.ascontiguousarray(words, dtype=np.float32).view(np.uint32).astype(np.uint64)
    exponent = (bits >> np.uint64(23)) & np.uint64(0xFF)
    if np.any((exponent == 0) | (exponent == 255)):
        raise ValueError('a packed word is zero, subnormal, inf or NaN: not a payload of %d '
                         'levels' % h)
    high = (bits >> np.uint64(31)) * np.uint64(254) + exponent - np.uint64(1)
    code = (high << np.uint64(23)) | (bits & _MANTISSA)
    if np.any(code >= np.uint64(base ** count)):
        raise ValueError('a packed word holds a code of more than %d base-%d digits'
                         % (count, base))
    digits = np.empty((code.size, count), dtype=np.int64)
    big = np.uint64(base)
    for j in range(count):
        digits[:, j] = (code % big).astype(np.int64)
        code //= big
    return (digits.reshape(-1)[:n] - h).astype(np.float32)


def encode(p, h, block):
    """Quantize and pack `p` (flat float32): ``(payload, c)``, the chunk's float32 payload
    and the float32 values it stands for."""
    levels, scales, values = quantize(p, h, block)
    return np.concatenate([scales, pack(levels, h)]), values


def decode(payload, h, block, n):
    """The float32 values ``c`` of a chunk of `n` values that `payload` stands for (the
    worker's :func:`encode` values, bit for bit).

    Raises
    ------
    ValueError
        If `payload` has another size than :func:`payload_size`, or bad words."""
    blocks = -(-n // block)
    if payload.size != payload_size(n, h, block):
        raise ValueError('a payload of %d floats for a chunk of %d values: expected %d (h=%d, '
                         'block %d)' % (payload.size, n, payload_size(n, h, block), h, block))
    scales = np.ascontiguousarray(payload[:blocks], dtype=np.float32)
    levels = unpack(payload[blocks:], h, n)
    return levels_to_values(levels, scales, block)
