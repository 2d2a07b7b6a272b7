"""The data path of blockwise pushes: one row per worker (docs/design.md §2.14).

Every chunk's R slot keys are row_sparse keys of shape (N, P), N workers, P the chunk's
payload size (:meth:`kvstore_ext.codecs.blockwise.Blockwise.payload_size`), initialised with
all N rows of zeros (MXNet's server aborts on a row_sparse init without rows); worker r
pushes a ``RowSparseNDArray`` holding only row r, its payload. W goes into float32 pull keys,
as with float16 pushes (:class:`kvstore_ext.worker.float16_keys.PullKeyDense`), which pulls
read. A pull is ordered behind the acknowledgement of the rounds it reads by empty row_sparse
pulls of their slot keys (MXNet's row_sparse pull writes the buffer the push was sent from).
"""
import numpy as np
from mxnet import nd

from kvstore_ext.protocol import commands
from kvstore_ext.worker.float16_keys import PullKeyDense
from kvstore_ext.worker.pulled_model import PulledModel

__all__ = ['PayloadDense', 'PayloadModelDense']


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
                'server' % (key, self._codec.describe(), workers, commands.bigarray_bound()))
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


class PayloadModelDense(PulledModel, PayloadDense):
    """:class:`PayloadDense` with compressed pulls (:class:`kvstore_ext.worker.pulled_model.PulledModel`):
    the scheduled pulls read the model key, ordered as the exact pulls are."""

    def _order_payloads(self, tensor, last):
        self._acknowledged(tensor, list(self._earlier_rounds(tensor, last)) + [last],
                           [payload.head for payload in tensor.payloads])
