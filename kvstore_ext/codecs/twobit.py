"""MXNet's ``'2bit'`` compression on ``'dist_delay'``: the quantizer and its parameters.

MXNet 1.9.1 has one compression type, ``'2bit'`` (``src/kvstore/gradient_compression.cc``).
Its worker adds each push to a residual of its key, sends ``+t``, ``0`` or ``-t`` per value
(2 bits on the wire) and keeps the error in the residual; the server dequantizes and sums.
``'dist_delay'`` pushes round t of a chunk into slot key ``t mod R`` (docs/design.md §2.2),
so the native store alone would keep R residuals per tensor and split the error feedback.
The worker therefore quantizes itself (:meth:`TwoBitQuantizer.quantize`, the same float32
operations as MXNet's kernel) with one residual per tensor
(:class:`kvstore_ext.codecs.feedback.ErrorFeedback`), and the native store, given the same setting,
sends the already quantized values in 2 bits, losslessly (docs/design.md §2.8).
"""
import functools
import math
import numbers

import numpy as np
import mxnet as mx
from mxnet import nd

from kvstore_ext.codecs import (EXAMPLE, CompressionError, CompressionTypeError, float32_only,
                                register)
from kvstore_ext.codecs.feedback import ErrorFeedback, Quantizer

__all__ = ['TwoBitQuantizer', 'parse_two_bit']


class TwoBitQuantizer(Quantizer):
    """MXNet's ``'2bit'``: each value becomes ``+t``, ``0`` or ``-t``.

    Parameters
    ----------
    threshold : numpy.float32
        t, as MXNet's worker parsed it (:func:`_mxnet_threshold`).
    text : str
        The threshold as given to MXNet (``str`` of the user's value).
    """
    type_name = '2bit'
    #: The native store is told to quantize: every push travels as +t, 0 or -t.
    exact_pushes = False

    def __init__(self, threshold, text):
        self.threshold = np.float32(threshold)
        self._text = text
        # The finish counter's flag 1 is t: quantizing t with a zero residual gives t and
        # leaves the residual 0, and the server dequantizes it to t again.
        self.flag_unit = float(self.threshold)

    def describe(self):
        return {'type': self.type_name, 'threshold': float(self.threshold)}

    def native_params(self):
        """The ``compression_params`` given to the native store."""
        return {'type': self.type_name, 'threshold': self._text}

    def configure_native(self, native):
        # After the hand-shake, which pushed the status keys uncompressed (and refused
        # workers that disagree before any compressed push could reach a server that was
        # never told), before the first init. Rank 0 sends it to the servers and waits
        # for them; the other workers push only after the init's barrier, behind it.
        native.set_gradient_compression(self.native_params())

    def quantize(self, buf, residual, source=None):
        """MXNet's ``quantize_2bit`` kernel (``gradient_compression-inl.h``) in NDArray ops:
        ``r += g``; ``q = +t where r >= t, -t where r <= -t, else 0``; ``r -= q``. The same
        float32 operations in the same order: ``r + g``, compare with ``t`` and ``-t``, and
        ``r - t`` or ``r - (-t)`` (``r - 0`` is r), so residual and q are MXNet's bits.
        ``(r >= t) - (r <= -t)`` is 1, 0 or -1 (not both: t > 0); times t it is exact.

        g is `source` if given, else `buf`. The comparisons write into `buf` (one temporary
        array, not three): on a 2-core machine each fresh array of a 1.9M-element tensor
        cost page faults, and the copy of g into `buf` one more pass (docs/design.md §2.8)."""
        t = float(self.threshold)
        nd.elemwise_add(residual, buf if source is None else source, out=residual)
        nd._internal._greater_equal_scalar(residual, scalar=t, out=buf)
        nd.elemwise_sub(buf, nd._internal._lesser_equal_scalar(residual, scalar=-t), out=buf)
        nd._internal._mul_scalar(buf, scalar=t, out=buf)
        nd.elemwise_sub(residual, buf, out=residual)

    def push_bytes(self, size, dtype):
        # MXNet's native store packs 16 values of 2 bits into each float32
        # (GradientCompression::GetCompressedSize).
        return 4 * -(-size // 16)

    def check_dtype(self, name, dtype):
        # MXNet: "Gradient compression is only supported for float32 type of parameters"
        float32_only(name, dtype, "Gradient compression is only supported for float32 type of "
                                  "parameters: %s is %s; train it in float32 or remove "
                                  "compression_params")


def parse_two_bit(params):
    """The codec of ``{'type': '2bit', 'threshold': t}``: error feedback around
    :class:`TwoBitQuantizer`, with MXNet 1.9.1's checks of `t` and stricter ones."""
    unknown = sorted(set(params) - {'type', 'threshold'}, key=str)
    if unknown:
        # MXNet ignores unknown keys (InitAllowUnknown): a misspelt 'treshold' would
        # silently train with the default 0.5.
        raise CompressionError("compression_params has unknown keys %s for type '2bit', which "
                               "takes only 'threshold'; %s" % (unknown, EXAMPLE))
    value = params.get('threshold', 0.5)  # MXNet's default (GradientCompressionParam)
    number = None
    if not isinstance(value, (bool, np.bool_)):
        if isinstance(value, numbers.Real):
            number = float(value)
        elif isinstance(value, str):  # MXNet parses the text: '0.5' is valid
            try:
                number = float(value)
            except ValueError:
                pass
    if number is None:
        raise CompressionTypeError(
            "Invalid Parameter format for threshold expect float but value='%s': "
            "compression_params['threshold'] must be a number > 0, got %r (%s); %s"
            % (value, value, type(value).__name__, EXAMPLE))
    if not number > 0:  # NaN included, as MXNet's CHECK_GT
        raise CompressionError(
            "Check failed: params.threshold > 0 (%g vs. 0) : threshold must be greater than "
            "0: compression_params['threshold'] must be a number > 0, got %r; %s"
            % (number, value, EXAMPLE))
    if not math.isfinite(number):
        raise CompressionError("compression_params['threshold'] must be finite, got %r (no "
                               "value would ever be sent); %s" % (value, EXAMPLE))
    text = str(value)
    threshold = _mxnet_threshold(text)
    # MXNet's worker sends the threshold to the servers as std::to_string (6 decimals),
    # which they parse back: a threshold that does not survive that makes the servers add
    # other values than the workers take from their residuals (stock dist_sync does so
    # silently; 1e-7 arrives as 0). Refused here, naming what would arrive.
    on_servers = np.float32('%f' % threshold)
    if on_servers != threshold:
        raise CompressionError(
            "compression_params['threshold']=%r cannot be sent exactly: MXNet 1.9.1 parses it "
            "as %s on the workers and sends it to the servers with 6 decimals (%r), so "
            "the servers would dequantize pushes to another value than the workers quantize "
            "to; use a threshold with at most 6 decimals that MXNet parses exactly, "
            "e.g. 0.5, 0.25 or 0.01" % (value, threshold, '%f' % threshold))
    return ErrorFeedback(TwoBitQuantizer(threshold, text))


@functools.lru_cache(maxsize=32)
def _mxnet_threshold(text):
    """The float32 threshold MXNet's worker kernel uses for `text`.

    MXNet parses it with dmlc-core's own float parser, which is not always correctly
    rounded (``'1.481409'`` gives 1.4814091, numpy 1.481409), and every worker-side bit
    depends on it; so ask MXNet: a local ``'device'`` store with the same setting
    quantizes a huge value to exactly +t (its residual starts at 0)."""
    probe = mx.kv.create('device')
    probe.set_gradient_compression({'type': '2bit', 'threshold': text})
    probe.init(0, nd.zeros(1))
    probe.push(0, nd.array([np.finfo(np.float32).max]))
    out = nd.zeros(1)
    probe.pull(0, out=out)
    return np.float32(out.asnumpy()[0])


register('2bit', parse_two_bit)
