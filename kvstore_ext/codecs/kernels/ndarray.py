"""The worker's push encode in MXNet NDArray operations, on the gradient's own context: a GPU
gradient is quantized on the GPU and only the packed codes and scales are copied to the host
(about 2 bytes a value for ``'int8'``, 0.4 for ``'ternary'``, where ``asnumpy()`` of the
gradient copies 4).

The same float32 operations as :mod:`kvstore_ext.codecs.quantize`, so the same bits (checked on the
CPU, ``tests/test_codec_kernels.py``; but a NaN scale, of a block holding a NaN, is a positive
NaN: MXNet's ``abs``), with a true division by the block's scale, rounding to
nearest even by adding and subtracting 1.5 * 2**23 (MXNet's ``rint`` rounds ties down; a level
is below 2**22), and the codes as a float64 product of the digits with the powers of the base
(every partial sum an integer below 2**32: exact in any order). On a GPU this also needs
MXNet's CUDA build to divide in IEEE float32 and keep subnormals (no ``--use_fast_math``),
which is not checked here (no GPU). On the CPU it is much slower than the compiled kernel
(docs/design.md §2.15): use :func:`kvstore_ext.codecs.kernels.encode_with_feedback` there.
"""
import numpy as np
from mxnet import nd

from ._dispatch import F32, check_codec

__all__ = ['encode_with_feedback_nd']

#: 1.5 * 2**23: adding and subtracting it rounds a float32 below 2**22 to nearest even.
_ROUND = 12582912.0
_POWERS = {}


def encode_with_feedback_nd(grad, residual, h, block, chunks=None):
    """:func:`kvstore_ext.codecs.kernels.encode_with_feedback` on NDArrays: ``p = grad +
    residual``, each chunk quantized by blocks, ``residual := p - c``.

    Parameters
    ----------
    grad : mxnet.nd.NDArray
        g (float32, any shape, flat order); read only.
    residual : mxnet.nd.NDArray
        r: float32 of g's size on g's context, updated in place (in MXNet's engine).
    h, block : int
        The codec's largest level (127, 7 or 1) and block size.
    chunks : list of (int, int), optional
        The chunks' ``(start, stop)`` ranges, in order and covering g (default: one).

    Returns
    -------
    (list of numpy.ndarray, mxnet.nd.NDArray)
        Each chunk's payload (float32, on the host) and c (flat float32, on g's context).
    """
    digits = check_codec(h, block)[1]
    grad, residual = grad.reshape((-1,)), residual.reshape((-1,))
    n = grad.size
    if residual.size != n or residual.context != grad.context or residual.dtype != F32:
        raise ValueError('residual must be a float32 NDArray of %d elements on %s, got %s of %d '
                         'on %s' % (n, grad.context, np.dtype(residual.dtype).name,
                                    residual.size, residual.context))
    sent = nd.empty((n,), ctx=grad.context, dtype=F32)
    nd.elemwise_add(grad, residual, out=residual)          # p = g + r, kept in r
    payloads = []
    for start, stop in [(0, n)] if chunks is None else chunks:
        scales, levels = _quantize(residual[start:stop], sent[start:stop], h, block)
        payloads.append(np.concatenate([scales, _pack(levels, h, digits)]))
    nd.elemwise_sub(residual, sent, out=residual)          # r := p - c
    return payloads, sent


def _quantize(p, sent, h, block):
    """Each block's scale (numpy) and the levels (an NDArray); c into `sent`."""
    n = p.size
    full = n // block
    parts = [(0, full * block, full)] if full else []
    if n % block:
        parts.append((full * block, n, 1))
    scales, levels = [], []
    for start, stop, rows in parts:
        x = p[start:stop].reshape((rows, -1))
        s = nd.max(nd.abs(x), axis=1) / h + 0.0             # +0: a block of -0 gets +0
        valid = (s > 0) * (s < np.inf)
        safe = nd.where(valid, s, nd.ones_like(s)).reshape((-1, 1))
        q = nd.clip((nd.broadcast_div(x, safe) + _ROUND) - _ROUND, -h, h)
        q = nd.where(valid, q, nd.zeros_like(q)) + 0.0     # level 0 where s is 0, inf or NaN
        nd.broadcast_mul(q, s.reshape((-1, 1)), out=sent[start:stop].reshape((rows, -1)))
        scales.append(s.asnumpy())
        levels.append(q.reshape((-1,)))
    scales = np.concatenate(scales) if scales else np.zeros(0, dtype=F32)
    return scales, levels


def _pack(levels, h, digits):
    """The packed float32 words (numpy) of the levels: codes on the device, bits on the host."""
    n = sum(part.size for part in levels)
    if not n:
        return np.zeros(0, dtype=F32)
    context = levels[0].context
    words = -(-n // digits)
    parts = [part.astype('float64') + h for part in levels]   # digits: level + h, exact
    if words * digits > n:   # the last word's missing digits are level 0
        parts.append(nd.full((words * digits - n,), h, ctx=context, dtype='float64'))
    codes = nd.dot(nd.concat(*parts, dim=0).reshape((words, digits)), _powers(h, digits, context))
    code = codes.asnumpy().astype(np.uint32)
    high = code >> np.uint32(23)
    sign = (high >= 254).astype(np.uint32)
    exponent = high - np.uint32(254) * sign + np.uint32(1)
    bits = (sign << np.uint32(31)) | (exponent << np.uint32(23)) | (code & np.uint32(0x7fffff))
    return bits.view(F32)


def _powers(h, digits, context):
    key = (h, str(context))
    if key not in _POWERS:
        _POWERS[key] = nd.array(float(2 * h + 1) ** np.arange(digits), ctx=context,
                                dtype='float64')
    return _POWERS[key]
