"""Gradient compression on ``'dist_delay'``: parameters, the worker's quantizer, exact flags.

MXNet 1.9.1 has one compression type, ``'2bit'`` (``src/kvstore/gradient_compression.cc``).
Its worker adds each push to a residual of its key, sends ``+t``, ``0`` or ``-t`` per value
(2 bits on the wire) and keeps the error in the residual; the server dequantizes and sums.
``'dist_delay'`` pushes round t of a chunk into slot key ``t mod R`` (docs/design.md §2.2),
so the native store alone would keep R residuals per tensor and split the error feedback.
The worker therefore quantizes itself, with one residual per tensor (:meth:`TwoBit.quantize`,
the same float32 operations as MXNet's kernel), and the native store, given the same
setting, sends the already quantized values in 2 bits, losslessly (docs/design.md §2.8).

:func:`parse` validates ``compression_params`` once; every type has an entry in a registry
(:func:`register`): ``'2bit'`` (:class:`TwoBit`) and mxdelay's float16 pushes
(``'fp16'``, :class:`Float16`, whose data path is :mod:`kvstore_ext.wire`). Errors carry MXNet 1.9.1's message for the same input and are
both ``mxnet.base.MXNetError`` (what MXNet raises) and ``ValueError`` (or ``TypeError``).
"""
import functools
import math
import numbers

import numpy as np
import mxnet as mx
from mxnet import nd
from mxnet.base import MXNetError

from .checks import ArgumentTypeError

__all__ = ['Compression', 'TwoBit', 'Float16', 'CompressionError', 'CompressionTypeError', 'parse',
           'register', 'known_types']

_EXAMPLE = "e.g. compression_params={'type': '2bit', 'threshold': 0.5}"


class CompressionError(MXNetError, ValueError):
    """Invalid ``compression_params``: an ``MXNetError`` as MXNet raises, and a ``ValueError``."""


class CompressionTypeError(MXNetError, ArgumentTypeError):
    """``compression_params`` (or a value in it) of the wrong type; also a ``ValueError``."""


class Compression(object):
    """What the store needs of a compression type (subclass it and :func:`register` it).

    Attributes
    ----------
    type_name : str
        The ``'type'`` of ``compression_params``.
    flag_unit : float
        A value that survives the wire exactly, with every multiple of it up to the number
        of workers in a sum: the finish counter sends its flags in this unit (§5).
    wire_dtype : str or None
        The dtype pushes travel in when it is not the tensor's (``'float16'``), else None.
    """
    type_name = None
    flag_unit = 1.0
    wire_dtype = None

    def describe(self):
        """The setting as JSON-able data: the hand-shake compares it between workers."""
        raise NotImplementedError

    def native_params(self):
        """The ``compression_params`` to give the native store (None: leave it alone)."""
        raise NotImplementedError

    def make_residual(self, size):
        """This worker's state for a tensor of `size` elements (None if stateless)."""
        return None

    def quantize(self, buf, residual, source=None):
        """Replace `buf` (a flat float32 send buffer) by what the wire carries, in place; with
        `source` (a flat float32 array on `buf`'s device), quantize `source` instead of
        `buf`'s present contents (the same values without first copying them into `buf`)."""
        raise NotImplementedError

    def check_dtype(self, name, dtype):
        """Raise ``ValueError`` if a tensor (`name`: e.g. "key 3", "parameter w1") of `dtype`
        cannot be compressed."""


class TwoBit(Compression):
    """MXNet's ``'2bit'``: each value becomes ``+t``, ``0`` or ``-t``, the error is kept.

    Parameters
    ----------
    threshold : numpy.float32
        t, as MXNet's worker parsed it (:func:`_mxnet_threshold`).
    text : str
        The threshold as given to MXNet (``str`` of the user's value).
    """
    type_name = '2bit'

    def __init__(self, threshold, text):
        self.threshold = np.float32(threshold)
        self._text = text
        # The finish counter's flag 1 is t: quantizing t with a zero residual gives t and
        # leaves the residual 0, and the server dequantizes it to t again.
        self.flag_unit = float(self.threshold)

    def describe(self):
        return {'type': self.type_name, 'threshold': float(self.threshold)}

    def native_params(self):
        return {'type': self.type_name, 'threshold': self._text}

    def make_residual(self, size):
        # On the CPU, like the send buffers (pinned buffers are CPU for MXNet's kernels):
        # MXNet's worker quantizes in its CPU send buffer too.
        return nd.zeros(size, ctx=mx.cpu(), dtype=np.float32)

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

    def check_dtype(self, name, dtype):
        if np.dtype(dtype) != np.float32:
            # MXNet: "Gradient compression is only supported for float32 type of parameters"
            raise ValueError("Gradient compression is only supported for float32 type of "
                             "parameters: %s is %s; train it in float32 or remove "
                             "compression_params" % (name, np.dtype(dtype).name))


class Float16(Compression):
    """float16 pushes (``{'type': 'fp16'}``, mxdelay's own: Horovod and BytePS offer it, MXNet
    1.9.1 does not): gradients travel as float16 and are summed in float32 on the servers,
    which keep float32 weights; pulls return float32 (:mod:`kvstore_ext.wire`, docs/design.md
    §2.11). Stateless; the finish counter's flags (0, 1, ... N) are exact in float16."""
    type_name = 'fp16'
    wire_dtype = 'float16'

    def describe(self):
        return {'type': self.type_name}

    def native_params(self):
        return None   # the native store pushes float16 keys as they are

    def quantize(self, buf, residual, source=None):
        pass          # the cast happens in the copy into the float16 send buffer

    def check_dtype(self, name, dtype):
        if np.dtype(dtype) != np.float32:
            # A float16 parameter already pushes float16 (no saving); its server keys would
            # run in MXNet's multi-precision mode, which float16 pushes switch on for the whole
            # job, with pulls of float16 values (docs/design.md §2.11).
            raise ValueError("compression_params={'type': 'fp16'} needs float32 parameters, but "
                             "%s is %s; cast the model to float32 (net.cast('float32')) or "
                             'remove compression_params' % (name, np.dtype(dtype).name))


def _two_bit(params):
    unknown = sorted(set(params) - {'type', 'threshold'}, key=str)
    if unknown:
        # MXNet ignores unknown keys (InitAllowUnknown): a misspelt 'treshold' would
        # silently train with the default 0.5.
        raise CompressionError("compression_params has unknown keys %s for type '2bit', which "
                               "takes only 'threshold'; %s" % (unknown, _EXAMPLE))
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
            % (value, value, type(value).__name__, _EXAMPLE))
    if not number > 0:  # NaN included, as MXNet's CHECK_GT
        raise CompressionError(
            "Check failed: params.threshold > 0 (%g vs. 0) : threshold must be greater than "
            "0: compression_params['threshold'] must be a number > 0, got %r; %s"
            % (number, value, _EXAMPLE))
    if not math.isfinite(number):
        raise CompressionError("compression_params['threshold'] must be finite, got %r (no "
                               "value would ever be sent); %s" % (value, _EXAMPLE))
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
    return TwoBit(threshold, text)


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


def _float16(params):
    extra = sorted(set(params) - {'type'}, key=str)
    if extra:
        raise CompressionError("compression_params=%r: fp16 compression takes no other setting, "
                               "got %s; pass {'type': 'fp16'}" % (params, extra))
    return Float16()


#: type name -> factory(compression_params dict) -> Compression
_REGISTRY = {'2bit': _two_bit, 'fp16': _float16}


def register(type_name, factory):
    """Make ``compression_params={'type': type_name, ...}`` call ``factory(params)``, which
    validates the dict and returns a :class:`Compression` (raising
    :class:`CompressionError` for bad values)."""
    _REGISTRY[type_name] = factory


def known_types():
    """The compression types :func:`parse` knows, sorted."""
    return sorted(_REGISTRY)


def parse(compression_params):
    """Validate `compression_params` and return its :class:`Compression`, or None for None.

    Raises
    ------
    CompressionTypeError
        If `compression_params` is not a dict, or a value has the wrong type.
    CompressionError
        For a missing or unknown type or a bad value, with MXNet 1.9.1's message.
    """
    if compression_params is None:
        return None
    if not isinstance(compression_params, dict):
        raise CompressionTypeError('compression_params must be a dict or None, got %.80r (%s); '
                                   '%s' % (compression_params, type(compression_params).__name__,
                                           _EXAMPLE))
    if 'type' not in compression_params:
        raise CompressionError("Required parameter type of string is not presented: "
                               "compression_params needs a 'type'; %s" % _EXAMPLE)
    name = compression_params['type']
    factory = _REGISTRY.get(name) if isinstance(name, str) else None
    if factory is None:
        raise CompressionError("Unknown type for gradient compression %s: compression_params"
                               "['type'] must be one of %s (MXNet 1.9.1 itself has only '2bit'); %s"
                               % (name, known_types(), _EXAMPLE))
    return factory(compression_params)
