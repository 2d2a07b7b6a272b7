"""Blockwise uniform quantization and its packing into float32 words that survive the wire.

The push codecs ``'int8'``, ``'int4'`` and ``'ternary'`` (:mod:`kvstore_ext.codecs.blockwise`,
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
           'encode', 'decode', 'levels_to_values', 'MAX_BLOCK']

#: The largest level h of each type.
LEVELS = {'int8': 127, 'int4': 7, 'ternary': 1}

#: The largest block size (the workers' settings and the servers' check alike).
MAX_BLOCK = 2 ** 20

#: Codes below this fit a normal float32 as above: 254 exponents, 2 signs, 2**23 mantissas.
_CODES = 2 * 254 * 2 ** 23


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
    if n % block:
        padded = np.zeros(blocks * block, dtype=np.float32)
        padded[:n] = p
    else:
        padded = np.ascontiguousarray(p, dtype=np.float32)
    padded = padded.reshape(blocks, block)
    # max|p| without a temporary |p|: max(max p, -min p)
    scales = np.maximum(padded.max(axis=1), -padded.min(axis=1))
    scales /= np.float32(h)
    scales += np.float32(0)   # a block of zeros: max(0, -0) may be -0; its scale is +0
    nonzero = scales > 0
    divisor = scales if nonzero.all() else np.where(nonzero, scales, np.float32(1))
    with np.errstate(invalid='ignore', over='ignore'):
        levels = padded / divisor[:, None]
    np.rint(levels, out=levels)
    np.clip(levels, -h, h, out=levels)
    if not nonzero.all():
        levels[~nonzero] = 0
    if not np.isfinite(scales).all():
        levels[~np.isfinite(levels)] = 0
    # -0.0 (rint of a small negative value) becomes +0.0, the rest unchanged: the servers
    # decode a digit to +0.0, and c's sign bit must be the worker's.
    levels += np.float32(0)
    levels = levels.reshape(-1)[:n]
    return levels, scales, levels_to_values(levels, scales, block)


def levels_to_values(levels, scales, block):
    """``c = levels * scale`` of each value's block, in float32 (worker and servers alike)."""
    n = levels.size
    full = n // block
    out = np.empty(n, dtype=np.float32)
    with np.errstate(invalid='ignore', over='ignore'):
        np.multiply(levels[:full * block].reshape(full, block), scales[:full, None],
                    out=out[:full * block].reshape(full, block))
        if full * block < n:
            np.multiply(levels[full * block:], scales[full], out=out[full * block:])
    return out


# Codes are below 2**32, so float64 holds them, their products with the base and their
# quotients' floors exactly (a quotient's rounding error, below 2**-21, cannot reach the
# next integer, 1/L away): float64 arithmetic is faster than numpy's uint64 division.
def pack(levels, h):
    """Pack float32 `levels` (integral in [-h, h]) into normal float32 words."""
    count = digits_per_word(h)
    words = np.empty(-(-levels.size // count), dtype=np.float32)
    step = _WORDS * count
    for start in range(0, levels.size, step):
        piece = levels[start:start + step]
        words[start // count:start // count + -(-piece.size // count)] = _pack(piece, h, count)
    return words


def _pack(levels, h, count):
    base = 2 * h + 1
    words = -(-levels.size // count)
    digits = np.empty(words * count, dtype=np.float64)
    np.add(levels, h, out=digits[:levels.size])
    digits[levels.size:] = h   # padding: level 0
    digits = digits.reshape(words, count)
    if count < _TABLE_DIGITS:
        code = digits[:, count - 1].copy()
        for j in range(count - 2, -1, -1):
            code *= base
            code += digits[:, j]
    else:
        # Many digits: sum_j d_j L**j as one matrix-vector product (every product and
        # partial sum is an integer below 2**32, exact in float64 in any order).
        code = digits @ (float(base) ** np.arange(count))
    high = np.floor(code / 2.0 ** 23)
    code -= high * 2.0 ** 23                   # the mantissa
    sign = np.floor(high / 254.0)
    high -= sign * 254.0                       # the exponent field - 1
    code += (high + 1.0) * 2.0 ** 23 + sign * 2.0 ** 31
    return code.astype(np.uint32).view(np.float32)


#: Words per piece of :func:`pack` and :func:`unpack`: their temporaries (float64, a few per
#: word) stay small, in cache and off the allocator's mmap path.
_WORDS = 8192


def unpack(words, h, n):
    """The `n` float32 levels packed in `words` (:func:`pack`'s inverse).

    Raises
    ------
    ValueError
        If a word is not one :func:`pack` makes (zero, subnormal, inf or NaN exponent, or a
        code of no digits): the payload was damaged or is of another type.
    """
    count = digits_per_word(h)
    words = np.ascontiguousarray(words, dtype=np.float32)
    if words.size != -(-n // count):
        raise ValueError('%d packed words for %d levels: expected %d' % (words.size, n,
                                                                        -(-n // count)))
    levels = np.empty(words.size * count, dtype=np.float32)
    for start in range(0, words.size, _WORDS):
        piece = words[start:start + _WORDS]
        levels[start * count:(start + piece.size) * count] = _unpack(piece, h, count)
    return levels[:n]


def _unpack(words, h, count):
    base = 2 * h + 1
    bits = words.view(np.uint32)
    exponent = (bits >> np.uint32(23)) & np.uint32(0xFF)
    if np.any((exponent == 0) | (exponent == 255)):
        raise ValueError('a packed word is zero, subnormal, inf or NaN: not a payload of %d '
                         'levels' % h)
    code = (bits >> np.uint32(31)).astype(np.float64) * 254.0 + exponent - 1.0
    code *= 2.0 ** 23
    code += bits & np.uint32(2 ** 23 - 1)
    if np.any(code >= float(base ** count)):
        raise ValueError('a packed word holds a code of more than %d base-%d digits'
                         % (count, base))
    levels = np.empty((code.size, count), dtype=np.float32)
    if count < _TABLE_DIGITS:
        for j in range(count):
            quotient = np.floor(code / base)
            code -= quotient * base                # digit j
            np.subtract(code, h, out=levels[:, j], casting='same_kind')
            code = quotient
        return levels.reshape(-1)
    # Many digits ('ternary': 20): a table maps the code of g digits (half a word's) to
    # their g levels, one gather per group instead of a division per digit.
    table, group = _digit_table(h)
    radix = float(base ** group)
    for start in range(0, count, group):
        width = min(group, count - start)
        if start + width < count:
            quotient = np.floor(code / radix)
            code -= quotient * radix             # digits start .. start + group - 1
        else:
            quotient = None
        rows = np.take(table, code.astype(np.intp), axis=0)
        levels[:, start:start + width] = rows if width == group else rows[:, :width]
        code = quotient
    return levels.reshape(-1)


#: Words of at least this many digits ('ternary') are packed by a matrix-vector product and
#: unpacked by :func:`_digit_table` (measured: for 'int8' and 'int4' the loop per digit is
#: as fast or faster).
_TABLE_DIGITS = 16
_TABLES = {}


def _digit_table(h):
    """``(table, g)``: row x of `table` holds the levels (float32) of the g base-(2h+1)
    digits of x, least significant first, for every x below (2h+1)**g; g is half the digits
    of a word, rounded up (at most 2**16 rows for the three types)."""
    if h not in _TABLES:
        base, count = 2 * h + 1, digits_per_word(h)
        group = -(-count // 2)
        x = np.arange(base ** group)
        table = np.empty((x.size, group), dtype=np.float32)
        for j in range(group):
            table[:, j] = x % base - h
            x = x // base
        _TABLES[h] = table, group
    return _TABLES[h]


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
