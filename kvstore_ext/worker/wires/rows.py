"""The wire of one row per worker (``Codec.wire`` ``'rows'``: the blockwise codecs,
docs/design.md §2.14).

Every chunk's R slot keys are row_sparse keys of shape (N, P), N workers, P the chunk's
payload size (the codec's ``payload_size``), initialised with all N rows of zeros (MXNet's
server aborts on a row_sparse init without rows); worker r pushes a ``RowSparseNDArray``
holding only row r, its payload, which the servers decode with the same codec. W goes into
float32 pull keys, as with float16 pushes (:class:`~kvstore_ext.worker.wires.pull_keys.PullKeyWire`,
whose receive buffers and push ordering this wire keeps), which pulls read. A pull is
ordered behind the acknowledgement of the rounds it reads by empty row_sparse pulls of their
slot keys (MXNet's row_sparse pull writes the buffer the push was sent from).
"""
import numpy as np
from mxnet import nd

from kvstore_ext.protocol import commands
from kvstore_ext.worker import ordering
from kvstore_ext.worker.finite import ALL_FINITE
from kvstore_ext.worker.wires.pulls import EXACT
from kvstore_ext.worker.wires.pull_keys import PullKeyBuffers, PullKeyWire

__all__ = ['RowWire', 'RowBuffers']


class RowBuffers(PullKeyBuffers):
    """A tensor's receive buffer (:class:`PullKeyBuffers`) and, per chunk, the row_sparse
    array that the empty pulls ordering a pull land in (``scratch``)."""
    __slots__ = ('scratch',)

    def __init__(self, tensor, shapes):
        super(RowBuffers, self).__init__(tensor)
        self.scratch = [nd.sparse.zeros('row_sparse', shape, dtype=np.float32)
                        for shape in shapes]


class RowWire(PullKeyWire):
    """Dense keys of a codec whose pushes travel as one row per worker: row_sparse (N, P)
    slot keys and float32 pull keys."""

    #: One send buffer for every slot: the native store never holds it (each push sends a
    #: row_sparse array of its own), it only keeps the values sent for the local rule,
    #: which reads them in the push's step (docs/design.md §2.3).
    send_buffers = 1

    def __init__(self, native, slots, codec, pulls=EXACT):
        super(RowWire, self).__init__(native, slots, codec, pulls)
        self._no_rows = None   # empty int64 row ids, made at the first pull

    def _chunk_limit(self, key):
        """At most ``MXDELAY_CHUNK_SIZE`` values, fewer where N x P would reach
        ``MXNET_KVSTORE_BIGARRAY_BOUND`` (MXNet would split a larger row_sparse key over the
        servers by rows). Every worker computes the same chunks (N is the job's)."""
        workers = self._native.num_workers
        limit = self._codec.chunk_limit(workers)
        if limit < 1:
            raise ValueError(
                'key %r: compression_params=%r sends each chunk as a row_sparse key of %d rows '
                '(one per worker), which reaches MXNET_KVSTORE_BIGARRAY_BOUND (%d) even for a '
                'chunk of one value; raise MXNET_KVSTORE_BIGARRAY_BOUND on every worker and '
                'server' % (key, self._codec.describe(), workers, commands.bigarray_bound()))
        return limit

    def place(self, placement, key, value):
        tensor = super(RowWire, self).place(placement, key, value)
        tensor.codec.ranges = [(c.start, c.stop) for c in tensor.chunks]
        return tensor

    def _shape(self, chunk):
        return (self._native.num_workers, self._codec.payload_size(chunk.stop - chunk.start))

    def _entries(self, tensor, value):
        """Each chunk's R row_sparse slot keys (all N rows of zeros) and P float32 pull keys
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

    def _receive_buffers(self, tensor):
        return RowBuffers(tensor, [self._shape(c) for c in tensor.chunks])

    @classmethod
    def finite_flag(cls, codec, flag):
        """Refused: a payload row cannot carry AMP's all-finite flag.

        Raises
        ------
        ValueError
            Always (the trainers refuse AMP with any compression at construction)."""
        raise ValueError('compression_params=%r cannot carry the AMP overflow flag; '
                         'train without AMP or without compression_params'
                         % (codec.describe(),))

    def push(self, tensor, grads, priority, factor=None, finite=ALL_FINITE):
        """Push round ``tensor.next_round`` of `tensor`: the sum of `grads` times `factor`,
        encoded with the tensor's codec, each chunk's payload as row `rank` of its slot key;
        the values sent stay in the send buffer (``sent``) until the next push. No all-finite flag
        (:meth:`finite_flag`)."""
        self._fill(tensor, grads, factor, finite)
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

    def order_after_pushes(self, tensor, last, targets):
        """The ordering of this wire's pulls (:meth:`PullKeyWire._order_pull
        <kvstore_ext.worker.wires.pull_keys.PullKeyWire._order_pull>`) and compressed pulls.

        Make a one-element write on each of `targets` wait in MXNet's engine until this
        worker's pushes of `last` and of the earlier rounds not yet covered are acknowledged:
        an empty row_sparse pull of each round's slot key writes the buffer MXNet's worker
        sent that push from (so it runs after it), and its (zero) norm is added to the
        targets, which are overwritten next."""
        if self._no_rows is None:
            self._no_rows = nd.array(np.zeros(0), dtype='int64')
        norms = []
        for rnd in list(self._earlier_rounds(tensor, last)) + [last]:
            for chunk, scratch in zip(tensor.chunks, tensor.wire_state.scratch):
                ordering.empty_row_pull(self._native, chunk.keys[rnd % self._slots], scratch,
                                        self._no_rows)
                norms.append(nd.norm(scratch).reshape((1,)))
        for target in targets:
            for norm in norms:
                nd.elemwise_add(target, norm, out=target)
