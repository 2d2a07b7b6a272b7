"""Row-sparse tensors on the ``'dist_delay'`` store: chunks by rows, pushes and pulls by rows.

A tensor is *row-sparse* on the store (docs/design.md §2.10) when its initial value is a
``RowSparseNDArray`` or when its Gluon Parameter has ``grad_stype='row_sparse'``. Its layout
is the one of §2 with rows in place of elements:

- it is split into chunks of whole rows, at most ``chunk_size`` elements each (at least one
  row), so that MXNet never splits a key over the servers (its ``EncodeRowSparseKey``
  partitions a key of ``MXNET_KVSTORE_BIGARRAY_BOUND`` elements or more by rows itself);
- every chunk has R slot keys on its server, initialised with a row_sparse value holding
  every row of the chunk: MXNet's server then stores a full-row row_sparse array, as it does
  for ``dist_sync``, and calls the updater with the round's row_sparse sum and that array,
  so the optimizer makes MXNet's lazy update (:mod:`kvstore_ext.server.rounds` applies the rounds in
  order as for dense chunks);
- MXNet's worker sends the rows of a row_sparse push to ps-lite keys ``master + row``, and the
  server recovers ``row = key - master`` (``kvstore_dist_server.h``, ``DecodeRowIds``, in a C
  ``int``): a chunk's rows are chunk-relative, so ``master + row`` stays below
  ``MAX_KEY + chunk_size``, far below 2**31; a row key may equal another key's master, which
  is harmless because the server reads the master from the first key of each request;
- a push gives each chunk the gradient's rows of that chunk (an empty row_sparse array when
  it has none: the round still needs this worker's push); a pull asks each chunk for rows:
  those asked for in :meth:`RowSparseKeys.row_sparse_pull`, all of them in
  :meth:`RowSparseKeys.pull`.

The native store copies a row_sparse push into a buffer of its own per key (``CommCPU``'s
merge buffer), so the slot discipline of §2.3 holds as for dense tensors: the copy of round
t waits for round t - R to be acknowledged. A pull of a slot writes that buffer (MXNet's
``PullRowSparseImpl``), so it runs after the slot's last push was acknowledged; it is ordered
after every earlier round (§2.4) by an empty row_sparse pull of each earlier round's slot,
whose result the pull's row ids depend on (:meth:`RowSparseKeys._ordered_ids`).

Limits: a tensor of several chunks reads its gradient's row ids (waiting for backward) before
pushing, and its :func:`row_sparse_pull` waits for the pulled rows; a one-chunk tensor does
neither.
"""
import numpy as np
from mxnet import nd

from kvstore_ext.protocol import commands
from kvstore_ext.codecs import TensorCodec
from kvstore_ext.worker import ordering
from kvstore_ext.worker.finite import ALL_FINITE
from kvstore_ext.worker.wires.base import KeyKind
from kvstore_ext.worker.layout import num_elements
from kvstore_ext.worker.store_errors import StoreTypeError, StoreValueError

__all__ = ['SparseTensor', 'RowSparseKeys', 'is_row_sparse', 'place_rows', 'init_values']


def is_row_sparse(value, param):
    """Whether a key initialised with `value` (its Gluon Parameter `param`, or None) is laid
    out by rows: a row_sparse value, or a Parameter with row_sparse gradients."""
    return value.stype == 'row_sparse' or getattr(param, '_grad_stype', 'default') == 'row_sparse'


class SparseTensor(object):
    """A row-sparse user key: chunks of rows and the rounds this worker pushed and pulled.

    ``chunks[i].start``/``stop`` are row numbers. Per chunk, ``all_rows`` holds the int64 row
    ids of all its rows (chunk-relative) and ``pulled`` a row_sparse array of the chunk's
    shape that pulls of whole chunks land in.
    """
    __slots__ = ('key', 'shape', 'dtype', 'stype', 'row_size', 'chunks', 'next_round',
                 'last_pulled', 'all_rows', 'pulled', 'scratch', 'empty_ids', 'zero', 'sent',
                 'codec', 'kind')

    def __init__(self, key, shape, dtype, stype, chunks):
        self.key, self.shape, self.dtype, self.stype, self.chunks = key, shape, dtype, stype, chunks
        self.row_size = num_elements(shape[1:])
        self.next_round = 0
        self.last_pulled = -1
        self.all_rows = [nd.arange(c.start, c.stop, dtype='int64') - c.start for c in chunks]
        self.pulled = [nd.sparse.zeros('row_sparse', self.chunk_shape(c), dtype=dtype)
                       for c in chunks]
        self.scratch = [nd.sparse.zeros('row_sparse', self.chunk_shape(c), dtype=dtype)
                        for c in chunks]
        self.empty_ids = nd.array(np.zeros(0), dtype='int64')
        self.zero = None
        self.sent = None   # the first array the last push handed to the native store
        self.codec = self.kind = None   # set when placed (RowSparseKeys.place)

    @property
    def size(self):
        """Number of elements."""
        return num_elements(self.shape)

    def chunk_shape(self, chunk):
        """Shape of `chunk`'s keys: its rows."""
        return (chunk.stop - chunk.start,) + tuple(self.shape[1:])

    def zeros(self):
        """An all-zero row_sparse gradient (no rows), to fill rounds without data."""
        if self.zero is None:
            self.zero = nd.sparse.zeros('row_sparse', self.shape, dtype=self.dtype)
        return self.zero

    def views_of(self, array, name='value'):
        """Check that `array` fits the key (the dense tensors' hook of the same name).

        Raises
        ------
        ValueError
            If its shape differs from the key's.
        """
        if tuple(array.shape) != tuple(self.shape):
            raise StoreValueError('%s for row_sparse key %r has shape %s, but the key was '
                                  'initialised with shape %s; pass arrays of the initialised '
                                  'shape' % (name, self.key, array.shape, self.shape))


def place_rows(placement, key, shape, dtype, stype):
    """Place a row-sparse tensor: chunks of whole rows, each on the least-loaded server.

    Raises
    ------
    ValueError
        If the value is a scalar or one row reaches ``MXNET_KVSTORE_BIGARRAY_BOUND``.
    """
    if len(shape) < 1 or shape[0] < 1:
        raise ValueError('row_sparse key %r has shape %s: a row_sparse value needs at least one '
                         'row' % (key, shape))
    row_size = num_elements(shape[1:])
    if row_size >= commands.bigarray_bound():
        raise ValueError('row_sparse key %r has rows of %d elements, at least '
                         'MXNET_KVSTORE_BIGARRAY_BOUND (%d): MXNet would split one row over '
                         'the servers; raise the bound on every worker and server'
                         % (key, row_size, commands.bigarray_bound()))
    rows_per_chunk = max(1, placement.chunk_size // row_size)
    chunks = []
    for start in range(0, shape[0], rows_per_chunk):
        stop = min(start + rows_per_chunk, shape[0])
        chunk = placement.add_chunk(start, stop, (stop - start) * row_size)
        if max(chunk.keys) + chunk.stop - chunk.start > 2 ** 31:
            # MXNet's server recovers a row as (master + row) - master in a C int.
            raise ValueError('row_sparse key %r: a chunk of %d rows from key %d reaches 2**31 '
                             'in MXNet\'s row keys (key + row); use a smaller MXDELAY_CHUNK_SIZE'
                             % (key, chunk.stop - chunk.start, max(chunk.keys)))
        chunks.append(chunk)
    return SparseTensor(key, tuple(shape), np.dtype(dtype), stype, chunks)


def init_values(tensor, value):
    """The initial value of each chunk: a row_sparse array holding every row of the chunk
    (the server's stored value is then a full-row row_sparse array, as MXNet's)."""
    dense = value.asnumpy()
    return [nd.sparse.row_sparse_array((dense[c.start:c.stop], np.arange(c.stop - c.start)),
                                       shape=tensor.chunk_shape(c), dtype=tensor.dtype)
            for c in tensor.chunks]


class RowSparseKeys(KeyKind):
    """The data path of row_sparse keys (chosen at ``init`` by :func:`is_row_sparse`); they
    are pushed as they are, the codec only says whether it allows them."""

    def place(self, placement, key, value):
        """Place row_sparse `key` (initial `value`) by rows."""
        self._codec.check_row_sparse(key)
        tensor = place_rows(placement, key, value.shape, value.dtype, value.stype)
        tensor.codec = TensorCodec()   # pushed as they are: sent() reads the sent rows
        tensor.kind = self
        return tensor

    @staticmethod
    def init_entries(tensor, value):
        """The native keys and initial values of `tensor`, and each chunk's size."""
        keys, values, sizes = [], [], []
        for chunk, chunk_value in zip(tensor.chunks, init_values(tensor, value)):
            keys.extend(chunk.keys)
            values.extend([chunk_value] * len(chunk.keys))
            sizes.append(int(np.prod(chunk_value.shape)))
        return keys, values, sizes

    def after_init(self, tensors):
        """After the native init of `tensors`: nothing for row_sparse keys."""

    @staticmethod
    def server_settings():
        """Nothing for the servers: row_sparse pushes are not encoded."""
        return {}

    @staticmethod
    def send_buffer(tensor):
        """The gradient the last push handed to the native store (held until it is copied)."""
        return tensor.sent

    @staticmethod
    def element_range(tensor, chunk):
        """Elements ``(start, stop)`` of the flattened `tensor` that `chunk` (rows) holds."""
        return chunk.start * tensor.row_size, chunk.stop * tensor.row_size

    def push(self, tensor, grads, priority, factor=None, finite=ALL_FINITE):
        """Push round ``tensor.next_round`` of `tensor`: the row_sparse `grads` (one per device),
        each chunk its rows (the native store sums the devices), times `factor` if given
        (`finite` is not applied: row_sparse rounds are not skipped under AMP)."""
        for grad in grads:
            _check_gradient(tensor, grad)
        if factor is not None:
            grads = [grad * factor for grad in grads]
        slot = tensor.next_round % self._slots
        if len(tensor.chunks) == 1:
            values = [list(grads)]
        else:
            # Which rows go to which chunk is known only from the row ids: read them (this
            # waits for backward to write the gradient).
            per_device = [_split_rows(tensor, grad) for grad in grads]
            values = [list(parts) for parts in zip(*per_device)]
        self._native.push([c.keys[slot] for c in tensor.chunks], values, priority=priority)
        tensor.sent = values[0][0]
        tensor.next_round += 1


    def _ordered_ids(self, tensor, chunk_index, ids, priority):
        """Row ids `ids` (int64 NDArray) of chunk `chunk_index`, as an array that MXNet's engine
        writes only after every round of the chunk up to the last pushed one is acknowledged
        (docs/design.md §2.4): a pull issued with them waits for those rounds.

        The last round's own slot needs nothing: the pull writes the native buffer its push
        reads. Each earlier round that neither the previous pull covers nor the slot reuse
        orders gets an empty row_sparse pull of its slot (the native pull waits for that slot's
        push), whose result the returned ids are computed from (``ids + norm(empty) = ids``).
        Empty `ids` need no order (MXNet computes nothing on zero-size arrays): the pull then
        orders nothing, and the caller must not count it as covering the earlier rounds.
        """
        last = tensor.next_round - 1
        slots = self._slots
        chunk = tensor.chunks[chunk_index]
        scratch = tensor.scratch[chunk_index]
        earlier = range(max(tensor.last_pulled, last - slots + 1, 0), last)
        if not earlier or ids.shape[0] == 0:
            return ids
        for rnd in earlier:
            ordering.empty_row_pull(self._native, chunk.keys[rnd % slots], scratch,
                                    tensor.empty_ids, priority)
        return nd.broadcast_add(ids, nd.cast(nd.norm(scratch), dtype='int64'))


    def pull(self, tensor, outs, priority, ignore_sparse=True):
        """Pull every row of `tensor` after this worker's last pushed round into the dense
        `outs` (row_sparse ones are skipped, as MXNet's ``pull`` does with ``ignore_sparse``)."""
        if any(out.stype != 'default' for out in outs) and not ignore_sparse:
            raise StoreValueError('pull(ignore_sparse=False) is not supported on distributed '
                                  'kvstores (nor by MXNet\'s dist_sync); use row_sparse_pull '
                                  'for row_sparse outs')
        outs = [out for out in outs if out.stype == 'default']
        if not outs:
            return
        slot = _pull_slot(tensor) % self._slots
        for i, chunk in enumerate(tensor.chunks):
            ids = self._ordered_ids(tensor, i, tensor.all_rows[i], priority)
            self._native.row_sparse_pull(chunk.keys[slot], out=tensor.pulled[i], row_ids=ids,
                                          priority=priority)
            dense = nd.cast_storage(tensor.pulled[i], stype='default')
            for out in outs:
                target = out if len(tensor.chunks) == 1 else out[chunk.start:chunk.stop]
                dense.copyto(target)
        _finish_pull(tensor, outs)


    def row_sparse_pull(self, tensor, outs, row_ids, priority):
        """Pull rows `row_ids` (one int array per out, or one for all) of `tensor` after this
        worker's last pushed round into the row_sparse `outs`: each out then holds exactly
        those rows (repeated ids count once, their order does not matter), as in MXNet."""
        if len(row_ids) not in (1, len(outs)):
            raise ValueError('row_sparse_pull of key %r: pass one row_ids array, or one per out '
                             '(%d), got %d' % (tensor.key, len(outs), len(row_ids)))
        for out in outs:
            if out.stype != 'row_sparse':
                raise StoreTypeError('row_sparse_pull of key %r needs row_sparse outs, got stype '
                                     '%r; use pull for dense arrays' % (tensor.key, out.stype))
        pairs = list(zip(outs, row_ids)) if len(row_ids) == len(outs) else [(outs[0], row_ids[0])]
        slot = _pull_slot(tensor) % self._slots
        ordered = True
        for out, ids in pairs:
            # MXNet 1.9.1 cannot cast an empty array (its _copyto fails to infer the shape),
            # and stock row_sparse_pull accepts nd.array([]), a float32 one.
            ids = ids.astype('int64', copy=False) if ids.size else tensor.empty_ids
            if len(tensor.chunks) == 1:
                ordered &= ids.shape[0] > 0
                self._native.row_sparse_pull(tensor.chunks[0].keys[slot], out=out,
                                              row_ids=self._ordered_ids(tensor, 0, ids, priority),
                                              priority=priority)
            else:
                ordered &= self._pull_rows_of_chunks(tensor, out, ids, slot, priority)
        if len(pairs) < len(outs):
            for out in outs[1:]:
                outs[0].copyto(out)
        _finish_pull(tensor, outs, ordered)


    def _pull_rows_of_chunks(self, tensor, out, ids, slot, priority):
        # Several chunks: each is asked for its rows (chunk-relative), then the rows are put
        # together, with global row ids, in `out` (this waits for the pulls). A chunk without
        # wanted rows is not asked; returns whether every chunk was (see _ordered_ids).
        wanted = np.unique(ids.asnumpy())
        if wanted.size and (wanted[0] < 0 or wanted[-1] >= tensor.shape[0]):
            raise ValueError('row_sparse_pull of key %r: row ids must be in [0, %d), got %s'
                             % (tensor.key, tensor.shape[0], wanted[(wanted < 0) |
                                                                   (wanted >= tensor.shape[0])]))
        datas = [np.zeros((0,) + tuple(tensor.shape[1:]), dtype=tensor.dtype)]
        indices = [np.zeros(0, dtype=np.int64)]
        for i, chunk in enumerate(tensor.chunks):
            lo, hi = np.searchsorted(wanted, [chunk.start, chunk.stop])
            if lo == hi:
                continue
            rows = nd.array(wanted[lo:hi] - chunk.start, dtype='int64')
            ordered = self._ordered_ids(tensor, i, rows, priority)
            self._native.row_sparse_pull(chunk.keys[slot], out=tensor.pulled[i], row_ids=ordered,
                                          priority=priority)
            pulled = tensor.pulled[i]
            indices.append(pulled.indices.asnumpy() + chunk.start)
            datas.append(pulled.data.asnumpy())
        whole = nd.sparse.row_sparse_array((np.concatenate(datas), np.concatenate(indices)),
                                           shape=tensor.shape, dtype=tensor.dtype)
        whole.copyto(out)
        return len(datas) == len(tensor.chunks) + 1


def _check_gradient(tensor, grad):
    if grad.stype != 'row_sparse':
        raise StoreTypeError('key %r is row_sparse on the dist_delay kvstore (its servers make '
                             'lazy row_sparse updates), so its gradients must be row_sparse, '
                             'got stype %r; convert with .tostype("row_sparse")'
                             % (tensor.key, grad.stype))


def _split_rows(tensor, grad):
    """`grad`'s rows per chunk, as row_sparse arrays of the chunks' shapes (chunk-relative
    row ids, still sorted)."""
    ids = grad.indices.asnumpy()
    data = grad.data.asnumpy()
    parts = []
    for chunk in tensor.chunks:
        lo, hi = np.searchsorted(ids, [chunk.start, chunk.stop])
        parts.append(nd.sparse.row_sparse_array((data[lo:hi], ids[lo:hi] - chunk.start),
                                                shape=tensor.chunk_shape(chunk),
                                                dtype=tensor.dtype))
    return parts


def _pull_slot(tensor):
    return max(tensor.next_round - 1, 0)


def _finish_pull(tensor, outs, ordered=True):
    if tensor.next_round == 0:
        # Before the first push, as for dense keys (DenseWire.pull): the request could
        # otherwise reach the server after round 0 and return W_1.
        for out in outs:
            out.wait_to_read()
    if ordered:  # every chunk's pull waited for every earlier round (_ordered_ids)
        tensor.last_pulled = tensor.next_round - 1


