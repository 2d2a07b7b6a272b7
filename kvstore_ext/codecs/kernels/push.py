"""The push codecs' kernels (``'int8'``, ``'int4'``, ``'ternary'``, :mod:`kvstore_ext.codecs.quantize`):
the worker's encode with error feedback and the servers' decode-and-sum of the workers' rows.
"""
import math

import numpy as np

from . import _reference
from ._dispatch import (F32, address, check_codec, flat, in_place, library, payload_size,
                        ranges, run)

__all__ = ['encode', 'decode', 'decode_sum', 'encode_with_feedback']


def _encoder(h, block):
    """(the compiled encode of codec h, the alignment of a thread's part) or (None, None)."""
    name, digits = check_codec(h, block)
    compiled = library()
    if compiled is None:
        return None, None
    return getattr(compiled, 'mxd_%s_encode' % name), block * digits // math.gcd(block, digits)


def encode(p, h, block, threads=1):
    """Quantize and pack `p` (flat float32): ``(payload, c)``, as
    :func:`kvstore_ext.codecs.quantize.encode` (largest level `h`: 127, 7 or 1; `block` values per
    float32 scale)."""
    p = flat(p)
    function, align = _encoder(h, block)
    if function is None:
        return _reference.encode(p, h, block)
    n = p.size
    payload = np.empty(payload_size(n, h, block), dtype=F32)
    values = np.empty(n, dtype=F32)
    run(function, [(address(p), None, address(values), address(payload), n, block, lo, hi)
                   for lo, hi in ranges(n, align, threads)], threads)
    return payload, values


def encode_with_feedback(grad, residual, h, block, chunks=None, out=None, threads=1):
    """The worker's step of :class:`kvstore_ext.codecs.blockwise.PayloadTensor`: ``p = grad +
    residual``; each chunk of p quantized by blocks into its payload; the values sent ``c``
    into `out`; ``residual := p - c``. One pass to read g and r and find each block's scale,
    one to quantize, write c and r and pack (each block's second pass reads it from cache).

    Parameters
    ----------
    grad : array of float32
        g (any shape; flat order), read only.
    residual : numpy.ndarray
        r: contiguous float32 of g's size, updated in place.
    h, block : int
        The codec's largest level (127, 7 or 1) and its block size.
    chunks : list of (int, int), optional
        The chunks' ``(start, stop)`` element ranges, in order and covering g (default: one).
    out : numpy.ndarray, optional
        Where c goes (contiguous float32 of g's size; default a new array). Neither `out`
        nor `residual` may share memory with `grad` or each other.
    threads : int
        Threads to split the work over.

    Returns
    -------
    (list of numpy.ndarray, numpy.ndarray)
        Each chunk's payload (float32) and c.
    """
    grad = flat(grad)
    n = grad.size
    residual = in_place(residual, 'residual', n)
    sent = np.empty(n, dtype=F32) if out is None else in_place(out, 'out', n)
    if (np.may_share_memory(grad, residual) or np.may_share_memory(grad, sent)
            or np.may_share_memory(residual, sent)):
        raise ValueError('encode_with_feedback: grad, residual and out must be separate '
                         'arrays (residual is updated while grad is read)')
    chunks = _check_chunks(chunks, n)
    function, align = _encoder(h, block)
    if function is None:
        return _reference.encode_with_feedback(grad, residual, h, block, chunks, sent)
    payloads, calls = [], []
    for start, stop in chunks:
        payload = np.empty(payload_size(stop - start, h, block), dtype=F32)
        payloads.append(payload)
        offset = 4 * start
        calls.extend((address(grad) + offset, address(residual) + offset, address(sent) + offset,
                      address(payload), stop - start, block, lo, hi)
                     for lo, hi in ranges(stop - start, align, threads))
    run(function, calls, threads)
    return payloads, sent


def _check_chunks(chunks, n):
    """`chunks` as int pairs, if they follow each other from 0 to `n` (None: one chunk)."""
    if chunks is None:
        return [(0, n)]
    chunks = [(int(start), int(stop)) for start, stop in chunks]
    ends = [0] + [stop for _, stop in chunks]
    if (not chunks or [start for start, _ in chunks] != ends[:-1] or ends[-1] != n
            or any(stop < start for start, stop in chunks)):
        raise ValueError('chunks=%r must be (start, stop) ranges that follow each other from 0 '
                         'to the gradient\'s size %d' % (chunks, n))
    return chunks


def decode(payload, h, block, n, threads=1):
    """The float32 values ``c`` of a chunk of `n` values that `payload` stands for, as
    :func:`kvstore_ext.codecs.quantize.decode` (the same errors for a bad size or word)."""
    return decode_sum(flat(payload).reshape(1, -1), [0], h, block, n, threads=threads)


def decode_sum(rows, order, h, block, n, out=None, threads=1):
    """The servers' :class:`kvstore_ext.server.appliers.DecodeRows`: the float32 sum, rank by rank in
    `order` (``c_0 + c_1 + ...`` left to right), of the values that rows ``rows[order[0]]``,
    ``rows[order[1]]``, ... stand for; each row is a payload of a chunk of `n` values.
    Every payload is read once and the sum written once (tiles of a few thousand values),
    into `out` if given (contiguous float32 of `n`), else into a new array.

    Raises
    ------
    ValueError
        As :func:`kvstore_ext.codecs.quantize.decode`, for a row of another size or a bad word; or
        for an `order` that is not indices of rows.
    """
    name, digits = check_codec(h, block)
    rows = np.ascontiguousarray(rows, dtype=F32)
    order = np.ascontiguousarray(order, dtype=np.int64).reshape(-1)
    if rows.ndim != 2 or not order.size or order.min() < 0 or order.max() >= rows.shape[0]:
        raise ValueError('decode_sum: rows must be a 2-d array of payloads and order indices of '
                         'its rows (at least one), got rows of shape %s and order %s'
                         % (rows.shape, order.tolist()))
    size = payload_size(n, h, block)
    if rows.shape[1] != size:
        raise ValueError('a payload of %d floats for a chunk of %d values: expected %d (h=%d, '
                         'block %d)' % (rows.shape[1], n, size, h, block))
    out = np.empty(n, dtype=F32) if out is None else in_place(out, 'out', n)
    compiled = library()
    if compiled is None:
        out[...] = _reference.decode_sum(rows, order, h, block, n)
        return out
    function = getattr(compiled, 'mxd_%s_decode_sum' % name)
    results = run(function, [(address(rows), size, address(order), order.size, address(out), n,
                              block, lo, hi) for lo, hi in ranges(n, digits, threads)], threads)
    if any(result < 0 for result in results):
        # A bad word: the numpy decode, row by row in rank order, raises its error.
        for index in order:
            _reference.decode(rows[index], h, block, n)
        raise RuntimeError('the codec kernels found a bad word that numpy accepts')
    return out
