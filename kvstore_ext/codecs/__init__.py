"""Codecs: what travels on the wire for a push, and the one registry of ``compression_params``.

A *codec* (docs/design.md §2.8) is chosen once, when :meth:`DistDelay.set_gradient_compression
<kvstore_ext.worker.dist_delay.DistDelay.set_gradient_compression>` parses ``compression_params``
(:func:`parse`). It is an object of two levels, after BytePS's compressor registry and
Horovod's ``Compression.none/fp16``:

- the job's :class:`Codec`: its wire dtype, how its pushes travel (:attr:`Codec.wire`, the
  worker's data path: :mod:`kvstore_ext.worker.wires`), the extra keys it needs
  (``pull_keys``), whether it carries row_sparse values, the unit of the finish counter's
  flags, what the servers must do (:meth:`Codec.server_settings`, data sent in the REGISTER
  command), what the native store must be told, and the bytes of a push;
- one :class:`TensorCodec` per dense tensor (:meth:`Codec.for_tensor`): it encodes a round
  into the tensor's send buffer, says what was sent in the gradient's units (the local
  rule's g, docs/design.md §1.4) and keeps, saves and loads the tensor's state.

One module per codec holds all of that, its settings' parsing and, where the servers decode
its pushes, their decode: :data:`NONE` (no ``compression_params``: pushes as they are, here),
``'fp16'`` (:mod:`kvstore_ext.codecs.fp16`), ``'2bit'`` (:mod:`kvstore_ext.codecs.twobit`, a
quantizer inside :class:`kvstore_ext.codecs.feedback.ErrorFeedback`) and ``'int8'``,
``'int4'``, ``'ternary'`` (:mod:`kvstore_ext.codecs.blockwise`: one row per worker, decoded
by the servers, which find the codec here from its ``server_settings``, :func:`decoder`).
A codec module calls :func:`register` when imported; the registry imports every module of
this package at its first use, so a new built-in codec is one new file and nothing else
changes (a codec outside the package, as tests/scripts/toy_codec.py, is imported by the
workers that use it). Compressed pulls are the other direction and a setting of their own
(``pull_compression``, :mod:`kvstore_ext.codecs.pulls`, docs/design.md §2.12): they send
``C(W - x̂)`` from the servers at pulled rounds, with any push codec.

Workers and servers both import this package: it imports neither of their rooms.

Errors carry MXNet 1.9.1's message for the same input and are both ``mxnet.base.MXNetError``
(what MXNet raises) and ``ValueError`` (or ``TypeError``).
"""
import importlib
import pkgutil

import numpy as np
from mxnet import nd
from mxnet.base import MXNetError

from kvstore_ext.checks import ArgumentTypeError

__all__ = ['Codec', 'TensorCodec', 'NONE', 'CompressionError', 'CompressionTypeError', 'parse',
           'register', 'known_types', 'defaults', 'decoder', 'float32_only', 'EXAMPLE']

#: How errors show a valid setting.
EXAMPLE = "e.g. compression_params={'type': '2bit', 'threshold': 0.5}"


class CompressionError(MXNetError, ValueError):
    """Invalid ``compression_params``: an ``MXNetError`` as MXNet raises, and a ``ValueError``."""


class CompressionTypeError(MXNetError, ArgumentTypeError):
    """``compression_params`` (or a value in it) of the wrong type; also a ``ValueError``."""


class TensorCodec(object):
    """One dense tensor's side of a codec: pushes copied as they are (the base), no state.

    Subclasses override :meth:`encode` and :meth:`sent`, and :meth:`state`/:meth:`load_state`
    if they keep state across rounds.
    """

    def __init__(self):
        self._out = None    # sent()'s array where it cannot be the send buffer

    def encode(self, source, buf, factor):
        """Fill the send buffer `buf` (flat) with what the wire carries for the gradient
        `source` (flat, float32, on any device) times `factor` (None: 1)."""
        if factor is None:
            source.copyto(buf)
        elif source.context == buf.context:
            nd._internal._mul_scalar(source, scalar=factor, out=buf)  # in the copy's pass
        else:
            (source * factor).copyto(buf)  # scaled on the device, then one copy

    def sent(self, buf, grad):
        """What the last :meth:`encode` sent, shaped and placed like `grad`, in its units.

        `buf` is the send buffer, reshaped to `grad`'s shape. Where it holds exactly that
        (same dtype and device) it is returned itself; otherwise an array of this object,
        rewritten by the next call."""
        if buf.dtype == grad.dtype and buf.context == grad.context:
            return buf
        return self._copy_of(buf, grad)

    def _copy_of(self, buf, grad):
        if self._out is None:
            self._out = nd.zeros(grad.shape, ctx=grad.context, dtype=grad.dtype)
        buf.copyto(self._out)   # to the gradient's device; float16 to float32 is exact
        return self._out

    def state(self):
        """The state to checkpoint (a flat numpy array), or None if stateless."""
        return None

    def state_size(self):
        """Elements of :meth:`state` (0 if stateless)."""
        return 0

    def load_state(self, value):
        """Restore what :meth:`state` returned (`value`: an array of :meth:`state_size`
        elements)."""


class Codec(object):
    """What the store needs of a compression type; the base is the no-compression codec.

    Attributes
    ----------
    type_name : str or None
        The ``'type'`` of ``compression_params`` (None: no compression).
    flag_unit : float
        A value that survives the wire exactly, with every multiple of it up to the number
        of workers in a sum: the finish counter and the non-finite flags travel in this
        unit (docs/design.md §5).
    wire_dtype : str or None
        The dtype pushes travel in when it is not the tensor's (``'float16'``), else None.
    pull_keys : bool
        Whether pulls read float32 pull keys of their own (R per chunk, docs/design.md
        §2.11) instead of the slot keys that pushes write.
    sparse_values : bool
        Whether row_sparse keys can be pushed with this codec.
    exact_pushes : bool
        Whether a float32 key that bypasses the codec (aux states, docs/design.md §2.13)
        still reaches the servers exactly: False where the native store quantizes every
        push (``'2bit'``).
    """
    type_name = None
    flag_unit = 1.0
    wire_dtype = None
    pull_keys = False
    sparse_values = True
    exact_pushes = True
    #: How the worker's pushes of dense keys travel (:mod:`kvstore_ext.worker.wires`):
    #: ``'slots'`` (the slot keys, in the tensor's dtype or the wire dtype), ``'pull_keys'``
    #: (float16 slot keys, pulls from float32 pull keys of their own) or ``'rows'`` (one
    #: row per worker in row_sparse slot keys, pulls from float32 pull keys).
    wire = 'slots'

    def describe(self):
        """The setting as JSON-able data: the hand-shake compares it between workers."""
        return None

    def server_settings(self):
        """What the servers must do with every chunk of this codec, as JSON-able data in the
        REGISTER command: ``{}`` (nothing), ``{'sum_scale': s}`` (multiply the round's
        float32 sum by `s` before the optimizer), or, for a codec of wire ``'rows'``,
        ``{'payload': self.describe()}`` (decode each worker's row with this codec, found
        again on the servers by :func:`decoder`, and sum in rank order)."""
        return {}

    def prepare_servers(self, native, rank):
        """Before the hand-shake, before any key exists: tell the native servers what they
        need (`rank` is this worker's; one worker is enough)."""

    def configure_native(self, native):
        """After the hand-shake, before the first key: configure this worker's native store."""

    def check_dtype(self, name, dtype):
        """Raise ``ValueError`` if a tensor (`name`: e.g. "key 3", "parameter w1") of `dtype`
        cannot be compressed."""

    def check_row_sparse(self, key):
        """Raise ``ValueError`` if row_sparse `key` cannot be pushed with this codec."""
        if not self.sparse_values:
            raise ValueError('key %r is row_sparse: compression_params=%r pushes dense float32 '
                             'gradients only; remove the compression or use a dense parameter'
                             % (key, self.describe()))

    def for_tensor(self, size):
        """A new :class:`TensorCodec` for a dense tensor of `size` elements."""
        return TensorCodec()

    def chunk_limit(self, workers):
        """The most values a dense chunk of this codec may hold in a job of `workers`
        workers, where its keys are larger than the chunk; None: the job's chunk size."""
        return None

    def push_bytes(self, size, dtype):
        """Bytes of the values a push of a chunk of `size` elements of `dtype` carries."""
        return size * np.dtype(self.wire_dtype or dtype).itemsize

    # -- a codec of wire 'rows' (one row per worker, decoded by the servers) -------------
    # Its TensorCodec's encode also sets ``payloads``: one float32 numpy row per chunk.
    def payload_size(self, size):
        """Float32 elements of one worker's row for a chunk of `size` values."""
        raise NotImplementedError

    def decode(self, payload, size):
        """On the servers: the float32 values (numpy) that one worker's row `payload` stands
        for, for a chunk of `size` values; the worker's own, bit for bit.

        Raises
        ------
        ValueError
            If `payload` is not a row of this codec for `size` values."""
        raise NotImplementedError

    def decode_sum(self, rows, order, size, threads=1):
        """On the servers: the float32 sum ``c_a + c_b + ...`` (left to right) of the values
        that rows ``rows[a]``, ``rows[b]``, ... stand for, ``order = [a, b, ...]`` (the
        workers' rows in rank order); each :meth:`decode` of a row, added in numpy. A codec
        with a fused kernel overrides it (the same bits), splitting it over up to `threads`
        threads.

        Parameters
        ----------
        rows : numpy.ndarray
            (workers, :meth:`payload_size`) float32, one worker's row each.
        order : sequence of int
            Indices of `rows`, in the order of the sum.
        size : int
            Values of the chunk.
        threads : int
            Threads a kernel may use (this loop uses one).
        """
        total = None
        for index in order:
            values = self.decode(rows[index], size)
            total = values if total is None else total + values
        return total


#: No compression: pushes in the tensor's dtype, unchanged.
NONE = Codec()

#: type name -> factory(compression_params dict) -> Codec
_REGISTRY = {}


def register(type_name, factory):
    """Make ``compression_params={'type': type_name, ...}`` call ``factory(params)``, which
    validates the dict and returns a :class:`Codec` (raising :class:`CompressionError` for
    bad values)."""
    _REGISTRY[type_name] = factory


_LOADED = []


def _registry():
    """The registry, with the built-in codecs: each module of this package registers its
    own when imported, and the first call imports them all (in name order)."""
    if not _LOADED:
        for module in pkgutil.iter_modules(__path__):
            importlib.import_module('%s.%s' % (__name__, module.name))
        _LOADED.append(True)
    return _REGISTRY


def known_types():
    """The compression types :func:`parse` knows, sorted."""
    return sorted(_registry())


def defaults():
    """``{type: codec}`` of each known type that has default settings (``{'type': type}``
    alone is valid), in :func:`known_types`' order: what a byte estimate compares."""
    found = {}
    for name in known_types():
        try:
            found[name] = parse({'type': name})
        except (ValueError, TypeError):
            pass   # a codec without defaults (e.g. one that needs a scale)
    return found


def decoder(settings):
    """The codec whose servers decode its pushes (wire ``'rows'``) that `settings`, a
    chunk's ``'payload'`` setting in REGISTER, describes; None if it describes none.

    `settings` must be the codec's :meth:`Codec.describe` exactly (every setting given),
    as the workers send it."""
    if not isinstance(settings, dict) or not isinstance(settings.get('type'), str):
        return None
    factory = _registry().get(settings['type'])
    try:
        codec = factory and factory(dict(settings))
    except (ValueError, TypeError):
        return None
    if not codec or codec.wire != 'rows' or codec.describe() != settings:
        return None
    return codec


def parse(compression_params):
    """Validate `compression_params` and return its :class:`Codec`, or None for None.

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
                                           EXAMPLE))
    if 'type' not in compression_params:
        raise CompressionError("Required parameter type of string is not presented: "
                               "compression_params needs a 'type'; %s" % EXAMPLE)
    name = compression_params['type']
    factory = _registry().get(name) if isinstance(name, str) else None
    if factory is None:
        raise CompressionError("Unknown type for gradient compression %s: compression_params"
                               "['type'] must be one of %s (MXNet 1.9.1 itself has only '2bit'); %s"
                               % (name, known_types(), EXAMPLE))
    return factory(compression_params)


def float32_only(name, dtype, message):
    """Raise ``ValueError(message % (name, dtype name))`` unless `dtype` is float32."""
    if np.dtype(dtype) != np.float32:
        raise ValueError(message % (name, np.dtype(dtype).name))
