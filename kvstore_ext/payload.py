"""Push codecs of 8, 4 and 1.6 bits per value: ``'int8'``, ``'int4'`` and ``'ternary'``.

``compression_params={'type': 'int8' | 'int4' | 'ternary', 'block_size': B}`` (B default
256) quantizes each push by blocks with error feedback (:mod:`kvstore_ext.quantize`,
docs/design.md §2.14). MXNet's native server sums a dense key's N pushes before mxdelay's
updater sees them, which rules out a scale per worker; these codecs use another wire, *one
row per worker*:

- every chunk's R slot keys are row_sparse keys of shape (N, P), N workers, P the chunk's
  payload size (:func:`kvstore_ext.quantize.payload_size`), initialised with all N rows of
  zeros (MXNet's server aborts on a row_sparse init without rows);
- worker r pushes a ``RowSparseNDArray`` holding only row r, its payload; the rows are
  disjoint, so the native server's merged array holds every worker's payload bit for bit
  (the packed words are normal float32 numbers);
- the servers decode each row, sum the N workers' values in rank order in float32 and run
  the round as for any dense chunk (``'payload'`` codec setting,
  :class:`kvstore_ext.appliers.DecodeRows`); W goes into float32 pull keys, as with float16
  pushes (:class:`kvstore_ext.wire.PullKeyDense`), which pulls read.

The worker's side (:class:`PayloadTensor`) keeps one float32 residual per tensor on the CPU
and encodes in numpy: the gradient is read (this waits for backward) and the payload pushed
from a fresh row_sparse array; what it sent, ``c``, stays in the float32 send buffer, which
the local rule reads (``sent``). A pull is ordered behind the acknowledgement of the rounds
it reads by empty row_sparse pulls of their slot keys (MXNet's row_sparse pull writes the
buffer the push was sent from: :meth:`PayloadDense._order_after_earlier_rounds`).
"""
import numbers

import numpy as np
from mxnet import nd

from . import heap, protocol, quantize
from .compression import (Codec, CompressionError, CompressionTypeError,
                          float32_only, register)
from .feedback import ResidualTensor
from .pull_codecs import PulledModel
from .wire import PullKeyDense

__all__ = ['Blockwise', 'PayloadTensor', 'PayloadDense', 'PayloadModelDense', 'parse_payload',
           'largest_chunk', 'DEFAULT_BLOCK', 'MAX_BLOCK']

#: The block size when ``compression_params`` has none.
DEFAULT_BLOCK = 256
#: The largest block size.
MAX_BLOCK = quantize.MAX_BLOCK
_EXAMPLE = "e.g. compression_params={'type': 'int8', 'block_size': 256}"


class Blockwise(Codec):
    """The codec of ``{'type': name, 'block_size': block}`` (`name` a key of
    :data:`kvstore_ext.quantize.LEVELS`): blockwise quantization with error feedback over the
    one-row-per-worker wire."""
    wire_dtype = 'float32'   # the payload's words; also gives the job float32 pull keys
    pull_keys = True
    sparse_values = False

    def __init__(self, name, block):
        self.type_name = name
        self.block = block
        self.levels = quantize.LEVELS[name]

    def describe(self):
        return {'type': self.type_name, 'block_size': self.block}

    def server_settings(self):
        return {'payload': self.describe()}

    def check_dtype(self, name, dtype):
        float32_only(name, dtype, "compression_params={'type': '%s'} needs float32 parameters, "
                                  "but %%s is %%s; cast the model to float32 "
                                  "(net.cast('float32')) or remove compression_params"
                     % self.type_name)

    def dense_keys(self, native, slots):
        return PayloadDense(native, slots, self)

    def pulled_model_keys(self, native, slots, pull_codec, schedule):
        return PayloadModelDense(native, slots, self, pull_codec, schedule)

    def for_tensor(self, size):
        return PayloadTensor(self, size)

    def payload_size(self, size):
        """Float32 elements of the payload of a chunk of `size` values."""
        return quantize.payload_size(size, self.levels, self.block)

    def chunk_limit(self, workers):
        # The (N, P) slot keys stay below MXNET_KVSTORE_BIGARRAY_BOUND (PayloadDense.place).
        return largest_chunk(self, workers, protocol.bigarray_bound())

    def push_bytes(self, size, dtype):
        # One row of floats, plus its int64 row id.
        return 4 * self.payload_size(size) + 8


class PayloadTensor(ResidualTensor):
    """One tensor's residual (float32, numpy, on the CPU), its last push's payloads (one per
    chunk) and batch-size factor."""

    def __init__(self, codec, size):
        super(PayloadTensor, self).__init__()
        self._codec = codec
        heap.keep_large_blocks()   # the encode's temporaries: no page faults per round
        self.residual = np.zeros(size, dtype=np.float32)
        self.payloads = None
        self._factor = None
        self.ranges = [(0, size)]   # the chunks' element ranges (PayloadDense.place sets them)

    def encode(self, source, buf, factor):
        """p = g * factor + r; per chunk, quantize p by blocks into its payload; the values
        sent, c, go into `buf`; r := p - c."""
        if factor is None and source.context.device_type == 'cpu':
            # Straight from the gradient, once the slot's ordering writes into `buf` (its
            # last pull, §2.11) are done: no copy into `buf` first.
            buf.wait_to_read()
            p = source.asnumpy()          # waits for backward
        else:
            super(PayloadTensor, self).encode(source, buf, factor)   # g * factor, in MXNet
            p = buf.asnumpy()             # waits for backward and the slot's last pull
        p += self.residual                # p = g * factor + r (a sum: either order)
        sent = np.empty_like(p)
        payloads = []
        for start, stop in self.ranges:
            payload, values = quantize.encode(p[start:stop], self._codec.levels,
                                              self._codec.block)
            payloads.append(payload)
            sent[start:stop] = values
        np.subtract(p, sent, out=self.residual)
        # An engine copy (no wait here for the buffer's readers); `sent` lives on in it.
        nd.from_numpy(sent.reshape(buf.shape), zero_copy=True).copyto(buf)
        self.payloads = payloads
        self._factor = factor

    def state(self):
        return self.residual.copy()


class PayloadDense(PullKeyDense):
    """The data path of dense keys of a :class:`Blockwise` codec: row_sparse (N, P) slot
    keys, one row per worker, and float32 pull keys."""

    def __init__(self, native, slots, codec):
        super(PayloadDense, self).__init__(native, slots, codec)
        self._no_rows = None   # empty int64 row ids, made at the first pull

    def place(self, placement, key, value):
        """Place `key` in chunks whose (N, P) slot keys stay below
        ``MXNET_KVSTORE_BIGARRAY_BOUND`` (MXNet would split a larger row_sparse key over the
        servers by rows): at most ``MXDELAY_CHUNK_SIZE`` values, fewer where N x P would
        reach the bound. Every worker computes the same chunks (N is the job's)."""
        workers = self._native.num_workers
        limit = self._codec.chunk_limit(workers)
        if limit < 1:
            raise ValueError(
                'key %r: compression_params=%r sends each chunk as a row_sparse key of %d rows '
                '(one per worker), which reaches MXNET_KVSTORE_BIGARRAY_BOUND (%d) even for a '
                'chunk of one value; raise MXNET_KVSTORE_BIGARRAY_BOUND on every worker and '
                'server' % (key, self._codec.describe(), workers, protocol.bigarray_bound()))
        tensor = placement.place(key, value.shape, value.dtype, self._codec.wire_dtype,
                                 chunk_size=limit)
        tensor.codec = self._codec.for_tensor(tensor.size)
        tensor.codec.ranges = [(c.start, c.stop) for c in tensor.chunks]
        tensor.kind = self
        return tensor

    def _shape(self, chunk):
        return (self._native.num_workers, self._codec.payload_size(chunk.stop - chunk.start))

    def init_entries(self, tensor, value):
        """Each chunk's R row_sparse slot keys (all N rows of zeros) and R float32 pull keys
        (the chunk's initial value); the sizes registered are the chunks' values."""
        flat = value.reshape(-1)
        workers = self._native.num_workers
        keys, values, sizes = [], [], []
        for chunk in tensor.chunks:
            chunk_value = flat[chunk.start:chunk.stop]
            shape = self._shape(chunk)
            # Every row given explicitly: MXNet's server refuses a row_sparse init without.
            zeros = nd.sparse.row_sparse_array(
                (np.zeros(shape, dtype=np.float32), np.arange(workers, dtype=np.int64)),
                shape=shape, dtype=np.float32)
            keys.extend(chunk.keys + chunk.pull_keys)
            values.extend([zeros] * len(chunk.keys) + [chunk_value] * len(chunk.pull_keys))
            sizes.append(int(chunk_value.size))
        return keys, values, sizes

    def after_init(self, tensors):
        super(PayloadDense, self).after_init(tensors)
        for tensor in tensors:
            tensor.scratch = [nd.sparse.zeros('row_sparse', self._shape(c), dtype=np.float32)
                              for c in tensor.chunks]

    def push(self, tensor, grads, priority, factor=None, finite=None):
        """Push round ``tensor.next_round`` of `tensor`: the sum of `grads` times `factor`,
        quantized with the tensor's residual, each chunk's payload as row `rank` of its
        slot key; `c` stays in the slot's send buffer (``sent``).

        Raises
        ------
        ValueError
            If `finite` (AMP's overflow flag) is given: the payload cannot carry it (the
            trainers refuse AMP with any compression at construction).
        """
        if finite is not None:
            raise ValueError('compression_params=%r cannot carry the AMP overflow flag; '
                             'train without AMP or without compression_params'
                             % (self._codec.describe(),))
        self._fill(tensor, grads, factor, None)
        # Row `rank` of an (N, P) array of zeros, made row_sparse by MXNet's engine (the
        # payload's words are never zero, so exactly that row is kept, bit for bit): an
        # asynchronous operation, where nd.sparse.row_sparse_array copies synchronously, so
        # waiting in the engine's queue behind backward (docs/design.md §2.14, "CPU").
        rank = self._native.rank
        values = []
        for chunk, payload in zip(tensor.chunks, tensor.codec.payloads):
            rows = np.zeros(self._shape(chunk), dtype=np.float32)
            rows[rank] = payload
            values.append(nd.from_numpy(rows, zero_copy=True).tostype('row_sparse'))
        slot = tensor.next_round % self._slots
        self._native.push([c.keys[slot] for c in tensor.chunks], values, priority=priority)
        tensor.next_round += 1

    def _acknowledged(self, tensor, rounds, targets):
        """Make a one-element write on each of `targets` wait in MXNet's engine until this
        worker's pushes of `rounds` are acknowledged: an empty row_sparse pull of each
        round's slot key writes the buffer MXNet's worker sent that push from (so it runs
        after it), and its (zero) norm is added to the targets, which are overwritten next."""
        norms = []
        if self._no_rows is None:
            self._no_rows = nd.array(np.zeros(0), dtype='int64')
        for rnd in rounds:
            for chunk, scratch in zip(tensor.chunks, tensor.scratch):
                self._native.row_sparse_pull(chunk.keys[rnd % self._slots], out=scratch,
                                              row_ids=self._no_rows)
                norms.append(nd.norm(scratch).reshape((1,)))
        for target in targets:
            for norm in norms:
                nd.elemwise_add(target, norm, out=target)

    def _order_after_earlier_rounds(self, tensor, last):
        # The pull of round `last` reads its pull key, which the server writes when the
        # round is applied: after this worker's pushes of `last` and of the earlier rounds
        # not yet covered are acknowledged (docs/design.md §2.4).
        self._acknowledged(tensor, list(self._earlier_rounds(tensor, last)) + [last],
                           [tensor.pull_heads[last % self._slots]])
        tensor.pulled_slots.add(last % self._slots)


def largest_chunk(codec, workers, bound):
    """The most values a chunk of `codec` can hold with `workers` rows below `bound`
    elements (0 if none)."""
    low, high = 0, bound
    while low < high:   # the largest n with workers * payload_size(n) < bound
        middle = (low + high + 1) // 2
        if workers * codec.payload_size(middle) < bound:
            low = middle
        else:
            high = middle - 1
    return low


class PayloadModelDense(PulledModel, PayloadDense):
    """:class:`PayloadDense` with compressed pulls (:class:`kvstore_ext.pull_codecs.PulledModel`):
    the scheduled pulls read the model key, ordered as the exact pulls are."""

    def _order_payloads(self, tensor, last):
        self._acknowledged(tensor, list(self._earlier_rounds(tensor, last)) + [last],
                           [payload.head for payload in tensor.payloads])


def parse_payload(params):
    """The codec of ``{'type': 'int8' | 'int4' | 'ternary', 'block_size': B}``.

    Raises
    ------
    CompressionError
        For unknown keys or a block size outside 1 .. 2**20.
    CompressionTypeError
        For a block size that is not an integer.
    """
    name = params['type']
    unknown = sorted(set(params) - {'type', 'block_size'}, key=str)
    if unknown:
        raise CompressionError("compression_params has unknown keys %s for type %r, which takes "
                               "only 'block_size'; %s" % (unknown, name, _EXAMPLE))
    block = params.get('block_size', DEFAULT_BLOCK)
    if isinstance(block, (bool, np.bool_)) or not isinstance(block, numbers.Integral):
        raise CompressionTypeError("compression_params['block_size'] must be an integer in "
                                   "1..%d, got %r (%s); %s" % (MAX_BLOCK, block,
                                                               type(block).__name__, _EXAMPLE))
    if not 1 <= block <= MAX_BLOCK:
        raise CompressionError("compression_params['block_size'] must be an integer in 1..%d, "
                               "got %r; %s" % (MAX_BLOCK, block, _EXAMPLE))
    return Blockwise(name, int(block))


for _name in quantize.LEVELS:
    register(_name, parse_payload)
