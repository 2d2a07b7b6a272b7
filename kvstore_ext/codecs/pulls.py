"""Compressed pulls (``pull_compression``, docs/design.md §2.12): the codecs.

The servers keep, per chunk, the last model they broadcast, ``x̂`` (float32). At a round that
every worker pulls they send only ``q = C(W - x̂)`` and set ``x̂ += dec(q)``; every worker adds
the same ``dec(q)`` to its own copy of ``x̂`` and uses ``x̂`` as the pulled weights. What ``q``
did not carry stays in ``W - x̂`` and goes out with the next pull (error feedback).

- which rounds are pulled (every round up to the switch, then the last round of each period)
  is :class:`kvstore_ext.protocol.schedule.PullSchedule`, known to the servers from the
  hand-shake's ``delay`` and ``warmup_steps``: MXNet's server answers a pull from the key's
  stored value in C++, so the payload of a pulled round must be in the key when the round is
  applied;
- the codecs (:class:`Float16Pull` ``'fp16'``, :class:`Int8Pull` ``'int8'``; :func:`parse`):
  the servers encode synchronously, in their updater (:meth:`PullCodec.broadcast`: a fused
  kernel of :mod:`kvstore_ext.codecs.kernels` writing into the model key, with the bits of
  :meth:`PullCodec.encode`, numpy and MXNet's float16 casts), the workers decode with NDArray
  operations in MXNet's engine (:class:`kvstore_ext.worker.wires.pulls.Payload`); both
  compute ``dec(q)`` with the same float32 operations, so ``x̂`` is bit-identical
  everywhere;
- the wire: one *model key* per chunk (``KeyLayout.model_key``), a float32 key whose bytes
  are the payload. MXNet 1.9.1's server aborts on int8/uint8 keys ("only support floating
  point types"), and a float16 key's pulls depend on the native server's multi-precision
  flag, uninitialised unless set (docs/design.md §9); a float32 key is copied byte for byte.
  The worker reads the bytes through a float16 or uint8 NDArray over the same memory;
- the server's ``x̂`` of one chunk is :class:`kvstore_ext.server.rounds.ServerModel`; the
  worker's side, :mod:`kvstore_ext.worker.wires.pulls`.
"""
import numpy as np
from mxnet import nd

from kvstore_ext.checks import ArgumentTypeError, check_int
from kvstore_ext.codecs import kernels, pull_payloads

__all__ = ['PullCodec', 'Float16Pull', 'Int8Pull', 'parse', 'known_types', 'EXAMPLE',
           'payload_bytes', 'bytes_per_pull']

F32 = np.float32

#: How errors show a valid setting.
EXAMPLE = "e.g. pull_compression={'type': 'fp16'} or {'type': 'int8', 'block_size': 256}"
#: Elements of an int8 block, each block with its own float32 scale.
DEFAULT_BLOCK = 256
_MAX_BLOCK = 1 << 20


class PullCodec(object):
    """What a pull carries of ``d = W - x̂`` (a flat float32 array of one chunk).

    A payload is ``payload_size(n)`` float32 elements: element 0 is a header the workers use
    to order their reads in MXNet's engine (its value is never read), the rest the codec's
    bytes, read through an NDArray of dtype ``alias_dtype`` over the same memory.
    """
    type_name = None
    alias_dtype = None

    def describe(self):
        """The setting as JSON-able data (the hand-shake compares it between workers)."""
        return {'type': self.type_name}

    def payload_size(self, n):
        """float32 elements of the payload of a chunk of `n` elements (header included)."""
        raise NotImplementedError

    def encode(self, d):
        """Return ``(payload, dec)``: the payload (numpy float32, :meth:`payload_size`) and
        ``dec(q)`` (numpy float32, ``d``'s size), both computed from `d` on the server (the
        built-in codecs: :mod:`kvstore_ext.codecs.pull_payloads`, numpy)."""
        raise NotImplementedError

    def broadcast(self, weight, model, payload, threads=1):
        """A server's pulled round: write the payload of ``d = weight - model`` into
        `payload` and advance ``model += dec(q)``, in place (all flat float32 numpy;
        `payload` of :meth:`payload_size`, e.g. the model key's memory). This is
        :meth:`encode` and an addition; a codec with a fused kernel overrides it (the same
        bits in one pass, split over up to `threads` threads)."""
        payload[...], dec = self.encode(weight - model)
        np.add(model, dec, out=model)

    def scratch(self, n):
        """The worker's temporary arrays for decoding a chunk of `n` elements."""
        raise NotImplementedError

    def decode(self, payload, alias, scratch, n):
        """The worker's ``dec(q)`` (an NDArray of `n` float32, in MXNet's engine) from the
        payload (`payload`: its float32 view, `alias`: its ``alias_dtype`` view)."""
        raise NotImplementedError


class Float16Pull(PullCodec):
    """``q = float16(d)`` (round to nearest even), ``dec(q) = float32(q)``: 2 bytes a value.

    A difference beyond float16's range (65504) becomes inf, as for float16 pushes; below
    6e-8 it becomes 0 and stays in ``W - x̂``."""
    type_name = 'fp16'
    alias_dtype = np.float16

    def payload_size(self, n):
        return pull_payloads.fp16_size(n)

    def encode(self, d):
        return pull_payloads.fp16_encode(d)

    def broadcast(self, weight, model, payload, threads=1):
        kernels.fp16_pull_broadcast(weight, model, payload=payload, threads=threads)

    def scratch(self, n):
        return nd.zeros(n, dtype=F32)

    def decode(self, payload, alias, scratch, n):
        alias[2:2 + n].copyto(scratch)   # float16 to float32: exact
        return scratch


class Int8Pull(PullCodec):
    """Blocks of `block_size` values, each with a float32 scale ``s = max|d| / 127`` and a
    level ``l = clip(rint(d / s), -127, 127)`` per value (0 where s is 0);
    ``dec = l * s`` (float32): 1 byte a value plus 4 bytes a block.

    The levels travel as ``l + 128`` in uint8 (MXNet's DLPack conversion has no int8)."""
    type_name = 'int8'
    alias_dtype = np.uint8

    def __init__(self, block_size=DEFAULT_BLOCK):
        self.block_size = block_size

    def describe(self):
        return {'type': self.type_name, 'block_size': self.block_size}

    def _blocks(self, n):
        return pull_payloads.int8_blocks(n, self.block_size)

    def payload_size(self, n):
        return pull_payloads.int8_size(n, self.block_size)

    def encode(self, d):
        return pull_payloads.int8_encode(d, self.block_size)

    def broadcast(self, weight, model, payload, threads=1):
        kernels.int8_pull_broadcast(weight, model, self.block_size, payload=payload,
                                    threads=threads)

    def scratch(self, n):
        # One array: the levels, then (in place, the same float32 products) dec.
        return nd.zeros(self._blocks(n) * self.block_size, dtype=F32)

    def decode(self, payload, alias, scratch, n):
        blocks, size = self._blocks(n), self.block_size
        start = 4 * (1 + blocks)
        alias[start:start + blocks * size].copyto(scratch)    # uint8 to float32: exact
        nd._internal._minus_scalar(scratch, scalar=128.0, out=scratch)  # pylint: disable=protected-access
        levels = scratch.reshape((blocks, size))
        nd.broadcast_mul(levels, payload[1:1 + blocks].reshape((blocks, 1)), out=levels)
        return scratch[0:n]


def _parse_fp16(params, argument):
    extra = sorted(set(params) - {'type'}, key=str)
    if extra:
        raise ValueError("%s=%r: 'fp16' takes no other setting, got %s; pass {'type': 'fp16'}"
                         % (argument, params, extra))
    return Float16Pull()


def _parse_int8(params, argument):
    extra = sorted(set(params) - {'type', 'block_size'}, key=str)
    if extra:
        raise ValueError("%s=%r: 'int8' takes only 'block_size', got %s; %s"
                         % (argument, params, extra, EXAMPLE))
    block = params.get('block_size', DEFAULT_BLOCK)
    block = check_int("%s['block_size']" % argument, block, 1,
                      'it is the number of values that share one float32 scale, e.g. 256')
    if block > _MAX_BLOCK:
        raise ValueError("%s['block_size']=%d is above %d; use e.g. 256"
                         % (argument, block, _MAX_BLOCK))
    return Int8Pull(block)


_TYPES = {'fp16': _parse_fp16, 'int8': _parse_int8}


def known_types():
    """The pull compression types :func:`parse` knows, sorted."""
    return sorted(_TYPES)


def parse(params, argument='pull_compression'):
    """The codec of `params` (None: no compression).

    Raises
    ------
    TypeError
        (:class:`kvstore_ext.checks.ArgumentTypeError`) If `params` is not a dict or None.
    ValueError
        For an unknown type or setting, naming `argument`, the value and the fix.
    """
    if params is None:
        return None
    if isinstance(params, PullCodec):
        return params
    if not isinstance(params, dict):
        raise ArgumentTypeError('%s must be a dict or None, got %r (%s); %s'
                                % (argument, params, type(params).__name__, EXAMPLE))
    kind = params.get('type')
    if kind not in _TYPES:
        raise ValueError("%s=%r: 'type' must be one of %s; %s"
                         % (argument, params, known_types(), EXAMPLE))
    return _TYPES[kind](params, argument)


def payload_bytes(codec, n):
    """Bytes a pull of a chunk of `n` elements carries with `codec` (None: float32)."""
    return 4 * (n if codec is None else codec.payload_size(n))


def bytes_per_pull(codec, sizes):
    """Bytes of one pull of chunks of `sizes` elements (payloads, not headers of ps-lite)."""
    return sum(payload_bytes(codec, n) for n in sizes)

