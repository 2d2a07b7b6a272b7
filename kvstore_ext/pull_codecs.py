"""Compressed pulls (``pull_compression``, docs/design.md §2.12): the codecs, the pull
schedule, the servers' pulled model and the workers' data path.

The servers keep, per chunk, the last model they broadcast, ``x̂`` (float32). At a round that
every worker pulls they send only ``q = C(W - x̂)`` and set ``x̂ += dec(q)``; every worker adds
the same ``dec(q)`` to its own copy of ``x̂`` and uses ``x̂`` as the pulled weights. What ``q``
did not carry stays in ``W - x̂`` and goes out with the next pull (error feedback).

- :class:`PullSchedule`: which rounds are pulled (every round up to the switch, then the last
  round of each period), known to the servers from the hand-shake's ``delay`` and
  ``warmup_steps``: MXNet's server answers a pull from the key's stored value in C++, so the
  payload of a pulled round must be in the key when the round is applied;
- the codecs (:class:`Float16Pull` ``'fp16'``, :class:`Int8Pull` ``'int8'``; :func:`parse`):
  the servers encode synchronously, in their updater (:meth:`PullCodec.encode`: numpy, and
  MXNet's float16 casts), the workers decode with NDArray operations in MXNet's engine
  (:class:`Payload`); both compute ``dec(q)`` with the same float32 operations, so ``x̂``
  is bit-identical everywhere;
- the wire: one *model key* per chunk (``KeyLayout.model_key``), a float32 key whose bytes
  are the payload. MXNet 1.9.1's server aborts on int8/uint8 keys ("only support floating
  point types"), and a float16 key's pulls depend on the native server's multi-precision
  flag, uninitialised unless set (docs/design.md §9); a float32 key is copied byte for byte.
  The worker reads the bytes through a float16 or uint8 NDArray over the same memory;
- :class:`ServerModel`: a server's ``x̂`` of one chunk; :class:`PulledModel`: the worker's
  model key per chunk, over any dense keys' data path (:class:`PullModelDense`: float32 or
  2bit pushes; :class:`kvstore_ext.wire.PullKeyModelDense`: float16 pushes, whose exact
  pulls read the pull keys while the compressed ones read the model key).
"""
import numpy as np
from mxnet import nd

from .checks import ArgumentTypeError, check_int
from .dense import DenseKeys

__all__ = ['PullSchedule', 'PullCodec', 'Float16Pull', 'Int8Pull', 'parse', 'EXAMPLE',
           'Payload', 'ServerModel', 'PulledModel', 'PullModelDense', 'payload_bytes',
           'bytes_per_pull']

F32 = np.float32

#: How errors show a valid setting.
EXAMPLE = "e.g. pull_compression={'type': 'fp16'} or {'type': 'int8', 'block_size': 256}"
#: Elements of an int8 block, each block with its own float32 scale.
DEFAULT_BLOCK = 256
_MAX_BLOCK = 1 << 20


class PullSchedule(object):
    """The rounds every worker pulls: ``t <= W`` (warm-up and switch) and, from t0 = W + 1,
    ``(t - t0) % k == k - 1`` (the last step of each period; mxdelay.schedule's
    ``is_synchronous(t) or issues_pull(t)``).

    Parameters
    ----------
    delay : int
        k (at least 1).
    warmup_steps : int
        W (at least 0).
    """

    def __init__(self, delay, warmup_steps):
        self.delay = check_int('delay', delay, 1, 'the pull period of the delayed phase')
        self.warmup_steps = check_int('warmup_steps', warmup_steps, 0,
                                      'the number of synchronous steps')

    def pulled(self, t):
        """Whether round `t` is pulled by every worker."""
        first = self.warmup_steps + 1
        return t >= 0 and (t < first or (t - first) % self.delay == self.delay - 1)

    def previous(self, t):
        """The last pulled round before round `t` (-1: none)."""
        first = self.warmup_steps + 1
        if t <= first:
            return min(t, first) - 1
        # Pulled rounds from t0 on: t0 + k - 1 + j*k.
        j = (t - first - self.delay) // self.delay
        return first + self.delay - 1 + j * self.delay if j >= 0 else first - 1

    def describe(self):
        return {'delay': self.delay, 'warmup_steps': self.warmup_steps}


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
        ``dec(q)`` (numpy float32, ``d``'s size), both computed from `d` on the server."""
        raise NotImplementedError

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
        return 1 + (n + 1) // 2

    def encode(self, d):
        # MXNet's casts, not numpy's: the same bits (round to nearest even; checked on every
        # float16 midpoint), but numpy converts one element at a time in software, about ten
        # times slower on a 2^19-element chunk (docs/benchmarks/pull-cpu).
        q = nd.array(d, dtype=F32).astype(np.float16)
        payload = np.zeros(self.payload_size(d.size), dtype=F32)
        payload.view(np.float16)[2:2 + d.size] = q.asnumpy()
        return payload, q.astype(F32).asnumpy()

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
        return max(1, -(-n // self.block_size))

    def payload_size(self, n):
        blocks = self._blocks(n)
        return 1 + blocks + -(-blocks * self.block_size // 4)

    def encode(self, d):
        n, size = d.size, self.block_size
        blocks = self._blocks(n)
        padded = np.zeros(blocks * size, dtype=F32)
        padded[:n] = d
        padded = padded.reshape(blocks, size)
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
        payload = np.zeros(self.payload_size(n), dtype=F32)
        payload[1:1 + blocks] = scale
        start = 4 * (1 + blocks)   # bytes: the header, then the scales
        payload.view(np.uint8)[start:start + blocks * size] = levels.reshape(-1)  # 1 .. 255
        return payload, dec

    def scratch(self, n):
        blocks = self._blocks(n)
        return (nd.zeros(blocks * self.block_size, dtype=F32),
                nd.zeros(blocks * self.block_size, dtype=F32))

    def decode(self, payload, alias, scratch, n):
        levels, dec = scratch
        blocks, size = self._blocks(n), self.block_size
        start = 4 * (1 + blocks)
        alias[start:start + blocks * size].copyto(levels)    # uint8 to float32: exact
        nd._internal._minus_scalar(levels, scalar=128.0, out=levels)  # pylint: disable=protected-access
        nd.broadcast_mul(levels.reshape((blocks, size)),
                         payload[1:1 + blocks].reshape((blocks, 1)),
                         out=dec.reshape((blocks, size)))
        return dec[0:n]


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
                         % (argument, params, sorted(_TYPES), EXAMPLE))
    return _TYPES[kind](params, argument)


def payload_bytes(codec, n):
    """Bytes a pull of a chunk of `n` elements carries with `codec` (None: float32)."""
    return 4 * (n if codec is None else codec.payload_size(n))


# -- the server ------------------------------------------------------------------------------
class ServerModel(object):
    """A server's ``x̂`` of one chunk and the stored array of its model key.

    Parameters
    ----------
    codec : PullCodec
    initial : numpy.ndarray
        W_0 (flat float32): the workers start from it too.
    """

    def __init__(self, codec, initial):
        self.codec = codec
        self.model = np.array(initial, dtype=F32).reshape(-1)
        self.store = None   # the model key's stored NDArray, from the workers' zero round

    def broadcast(self, weight):
        """Round applied, pulled by every worker: write ``C(W - x̂)`` into the model key and
        advance ``x̂`` by what it carries. `weight` is W (an NDArray)."""
        d = weight.asnumpy().reshape(-1) - self.model
        payload, dec = self.codec.encode(d)
        self.model = self.model + dec
        self.store[:] = payload   # a synchronous copy: pulls read the bytes at once


# -- the worker ------------------------------------------------------------------------------
class Payload(object):
    """One chunk's receive buffer on the worker: ``payload`` (float32, what the pull writes)
    and ``alias`` (the codec's dtype over the same memory).

    The two NDArrays are separate variables of MXNet's engine, so the reads are ordered by
    hand: after the pull, a write of the alias's first element that reads the payload's
    header (the decode then follows it); after the decode, a write of the payload's header
    that reads the decoded model (the next pull follows it)."""

    def __init__(self, codec, n):
        self.codec, self.n = codec, n
        size = codec.payload_size(n)
        self._memory = np.zeros(size * 4, dtype=np.uint8)
        self.payload = nd.from_numpy(self._memory.view(np.float32), zero_copy=True)
        self.alias = nd.from_numpy(self._memory.view(codec.alias_dtype), zero_copy=True)
        self.head = self.payload[0:1]
        self._scratch = codec.scratch(n)

    def decode_into(self, model):
        """``model += dec(q)`` for the payload just pulled (in MXNet's engine)."""
        self.head.copyto(self.alias[0:1])                 # after the pull
        dec = self.codec.decode(self.payload, self.alias, self._scratch, self.n)
        nd.elemwise_add(model, dec, out=model)
        model[0:1].copyto(self.head)                      # the next pull after the decode


class PulledModel(object):
    """The worker's side of compressed pulls, mixed into a dense keys' data path (before it in
    the bases): a model key per chunk, whose scheduled pulls (:meth:`pull_compressed`) bring
    ``x̂``; :meth:`pull` stays the data path's own, exact (the slot keys, or with float16
    pushes the pull keys, hold W).

    The data path's hooks are extended, not replaced: every method calls the next class's
    (:class:`PullModelDense` over :class:`kvstore_ext.dense.DenseKeys`,
    :class:`kvstore_ext.wire.PullKeyModelDense` over float16 pushes' pull keys).

    Parameters
    ----------
    native, slots, codec
        As :class:`kvstore_ext.dense.DenseKeys`.
    pull_codec : PullCodec
    schedule : PullSchedule
    """

    def __init__(self, native, slots, codec, pull_codec, schedule):
        super(PulledModel, self).__init__(native, slots, codec)
        self.pull_codec = pull_codec
        self.schedule = schedule

    def place(self, placement, key, value):
        tensor = super(PulledModel, self).place(placement, key, value)
        tensor.model = nd.zeros(tensor.size, dtype=np.float32)
        if self._native.rank == 0:
            # x̂ = W_0, which is rank 0's value bit for bit (MXNet's init pushes rank 0's):
            # rank 0 keeps a copy instead of pulling it back (after_init).
            value.reshape(-1).copyto(tensor.model)
        tensor.payloads = [Payload(self.pull_codec, c.stop - c.start) for c in tensor.chunks]
        tensor.model_round = -1
        tensor.model_pending = False
        return tensor

    def init_entries(self, tensor, value):
        keys, values, sizes = super(PulledModel, self).init_entries(tensor, value)
        for chunk, payload in zip(tensor.chunks, tensor.payloads):
            keys.append(chunk.model_key)
            values.append(nd.zeros(payload.payload.size, dtype=np.float32))
        return keys, values, sizes

    def after_init(self, tensors):
        """Collective: the data path's own (float16 pushes: the pull keys' round of zeros),
        then one round of zeros into the model keys (the servers keep their stored arrays
        from it), waited for; then each tensor's ``x̂`` := W_0, an exact pull on every
        worker but rank 0, which copied its own value at :meth:`place`."""
        super(PulledModel, self).after_init(tensors)
        keys, views = [], []
        for tensor in tensors:
            for chunk, payload in zip(tensor.chunks, tensor.payloads):
                keys.append(chunk.model_key)
                views.append(payload.payload)
        if keys:
            self._native.push(keys, views)
            for tensor in tensors:
                for payload in tensor.payloads:
                    # A write waits for the push that reads the buffer to be acknowledged.
                    nd._internal._plus_scalar(payload.head, scalar=0.0, out=payload.head)  # pylint: disable=protected-access
                    payload.head.wait_to_read()
        if self._native.rank != 0:
            for tensor in tensors:
                self.pull(tensor, [tensor.model], 0)   # before any push: W_0, waited for

    def initial_pull(self, tensor, value, outs, priority):
        """``broadcast``'s initial value: ``x̂``, which is W_0 (:meth:`after_init`), copied
        into `outs`; no second transfer."""
        if any(out.dtype != tensor.model.dtype for out in outs):
            super(PulledModel, self).initial_pull(tensor, value, outs, priority)
            return
        for out in outs:
            tensor.model.copyto(tensor.views_of(out)[2])

    def _before_push(self, tensor, slot):
        if tensor.model_pending:
            # The server overwrites the model key at the next pulled round; that round needs
            # this push, which must therefore wait for the last compressed pull to return.
            for payload in tensor.payloads:
                payload.head.copyto(tensor.heads[slot])   # float16 send buffers: a cast
            tensor.model_pending = False
        super(PulledModel, self)._before_push(tensor, slot)

    def pull_compressed(self, tensor, outs, priority):
        """Pull round ``tensor.next_round - 1``'s payload, advance ``x̂`` and copy it into
        `outs` (the worker's pulled weights).

        Raises
        ------
        ValueError
            If that round is not pulled by every worker, or an earlier pulled round was not
            pulled through here (``x̂`` would differ from the servers').
        """
        last = tensor.next_round - 1
        schedule = self.schedule
        if not schedule.pulled(last):
            raise ValueError(
                'pull_compressed of key %r after round %d: with pull_compression the servers '
                'send a compressed pull only at rounds every worker pulls (every round up to '
                'warmup_steps=%d, then every delay=%d-th); use pull() for the exact weights'
                % (tensor.key, last, schedule.warmup_steps, schedule.delay))
        if tensor.model_round != schedule.previous(last):
            raise ValueError(
                'pull_compressed of key %r after round %d: the compressed pull of round %d was '
                'skipped (this worker last pulled round %d compressed), so its pulled model '
                'differs from the servers\'; pull every pulled round through pull_compressed'
                % (tensor.key, last, schedule.previous(last), tensor.model_round))
        self._order_payloads(tensor, last)
        self._native.pull([c.model_key for c in tensor.chunks],
                          out=[p.payload for p in tensor.payloads], priority=priority)
        for chunk, payload in zip(tensor.chunks, tensor.payloads):
            payload.decode_into(tensor.model[chunk.start:chunk.stop])
        for out in outs:
            tensor.model.copyto(tensor.views_of(out)[2])
        tensor.last_pulled = tensor.model_round = last
        tensor.model_pending = True

    def _order_payloads(self, tensor, last):
        # As DenseKeys._order_after_earlier_rounds, into the payloads: each send buffer of
        # round `last` and of the earlier rounds not yet covered is touched (a write, which
        # waits for its push's acknowledgement) and read into every payload's header.
        for rnd in list(self._earlier_rounds(tensor, last)) + [last]:
            head = tensor.heads[rnd % self._slots]
            nd._internal._plus_scalar(head, scalar=0.0, out=head)  # pylint: disable=protected-access
            for payload in tensor.payloads:
                head.copyto(payload.head)

    @staticmethod
    def state(tensor):
        """What a checkpoint keeps of `tensor`'s pulled model: ``(x̂, its round)``."""
        return tensor.model.asnumpy(), tensor.model_round

    @staticmethod
    def load_state(tensor, state):
        """Restore :meth:`state`'s value."""
        model, model_round = state
        if np.size(model) != tensor.size:
            raise ValueError('pulled model of key %r has %d elements, the key %d'
                             % (tensor.key, np.size(model), tensor.size))
        tensor.model[:] = np.asarray(model, dtype=np.float32).reshape(-1)
        tensor.model_round = int(model_round)
        tensor.model_pending = False


class PullModelDense(PulledModel, DenseKeys):
    """Dense keys whose pulls read the slot keys, with compressed pulls (:class:`PulledModel`;
    float16 pushes: :class:`kvstore_ext.wire.PullKeyModelDense`)."""


def bytes_per_pull(codec, sizes):
    """Bytes of one pull of chunks of `sizes` elements (payloads, not headers of ps-lite)."""
    return sum(payload_bytes(codec, n) for n in sizes)

