"""Where a worker's tensors live on the servers: chunks, their placement and slot buffers.

The keys of every chunk (R slot keys, and pull, state and model keys where the job has them)
are numbered by :class:`kvstore_ext.protocol.keys.KeyLayout`, which the servers use too;
this module decides which chunk goes to which server (docs/design.md §2.5, §2.6).

A tensor of more than ``chunk_size`` elements is split into chunks, each placed on the
least-loaded server that has key room (:class:`Placement`); a worker's :class:`Tensor` holds
what every dense key has: its chunks, one send buffer per slot and the rounds it pushed and
pulled. What a data path keeps besides is an object of its own in the tensor
(``wire_state``, ``pull_state``: :mod:`kvstore_ext.worker.wires`).
"""
import numpy as np
from mxnet import nd

from kvstore_ext.protocol.keys import FEWER_KEYS, MAX_KEY
from kvstore_ext.worker.store_errors import StoreTypeError, StoreValueError

__all__ = ['Chunk', 'Tensor', 'Placement', 'num_elements', 'split']


def num_elements(shape):
    """Number of elements of an array of `shape` (1 for a scalar's ``()``)."""
    return int(np.prod(shape)) if shape else 1


def split(size, step):
    """``[(start, stop)]``: `size` elements in ranges of `step` (the last may be shorter; one
    empty range for size 0)."""
    return [(start, min(start + step, size)) for start in range(0, max(size, 1), step)]


class Chunk(object):
    """One chunk of a tensor: elements ``[start, stop)`` of the flattened tensor (rows of a
    row_sparse one); `local` is its index among its server's chunks, which numbers its keys."""
    __slots__ = ('chunk_id', 'start', 'stop', 'server', 'local', 'keys', 'pull_keys',
                 'model_key')

    def __init__(self, chunk_id, start, stop, server, local, keys, pull_keys=None,
                 model_key=None):
        self.chunk_id, self.start, self.stop, self.server = chunk_id, start, stop, server
        self.local = local
        self.keys = keys          # one native key per slot: the pushes
        self.pull_keys = pull_keys or keys   # the keys that pulls read
        self.model_key = model_key   # compressed pulls' payload (None without)


class Tensor(object):
    """A dense user key: its chunks, its slot buffers and the rounds this worker pushed and
    pulled.

    ``buffers[s]`` is slot s's send buffer (the flattened tensor, in the dtype pushes travel
    in; its chunks are views of it, so one copy fills a whole round and MXNet's engine tracks
    it as one variable); made at the first push, on the CPU (pinned memory for GPU
    gradients). Set when placed (:meth:`kvstore_ext.worker.wires.base.DenseWire.place`):
    ``codec``, its codec's per-tensor object (:class:`kvstore_ext.codecs.TensorCodec`),
    ``kind``, its data path, and that data path's per-tensor objects: ``wire_state`` (the
    wire's, e.g. the receive buffers of pull keys; None where it keeps none) and
    ``pull_state`` (compressed pulls' pulled model, else None).
    """
    __slots__ = ('key', 'shape', 'size', 'dtype', 'chunks', 'next_round', 'last_pulled',
                 'buffers', 'chunk_views', 'heads', 'views', 'zero', 'codec', 'kind',
                 'wire_state', 'pull_state')

    def __init__(self, key, shape, dtype, chunks):
        self.key, self.shape, self.dtype, self.chunks = key, shape, dtype, chunks
        self.size = num_elements(shape)
        self.next_round = 0
        self.last_pulled = -1
        self.buffers = self.chunk_views = self.heads = self.zero = None
        self.views = {}           # handle of a user array -> (array, its chunk views, flat)
        self.codec = self.kind = self.wire_state = self.pull_state = None

    def make_buffers(self, slots, ctx, dtype=None, distinct=None):
        """Make the `slots` send buffers on `ctx`, of `dtype` (None: the tensor's): `distinct`
        arrays (None: one per slot), slot s using array ``s % distinct``."""
        size = self.chunks[-1].stop
        own = [nd.zeros(size, ctx=ctx, dtype=dtype or self.dtype)
               for _ in range(distinct or slots)]
        self.buffers = [own[s % len(own)] for s in range(slots)]
        self.chunk_views = [[buf[c.start:c.stop] for c in self.chunks] for buf in self.buffers]
        self.heads = [buf[0:1] for buf in self.buffers]

    def zeros(self):
        """A zero array of the tensor's shape (made once), to fill rounds without data."""
        if self.zero is None:
            self.zero = nd.zeros(self.shape, dtype=self.dtype)
        return self.zero

    def views_of(self, array, name='value'):
        """Chunk views of a user array (cached: Gluon passes the same arrays every step).

        Returns ``(array, [view of each chunk], flat view)``.

        Raises
        ------
        ValueError
            (`name` is the argument's; :class:`~kvstore_ext.worker.store_errors.StoreValueError`)
            If the array has another number of elements than the tensor; checked once per
            array, when its views are made.
        TypeError
            (:class:`~kvstore_ext.worker.store_errors.StoreTypeError`) If it is not dense.
        """
        handle = array.handle.value
        cached = self.views.get(handle)
        if cached is None or cached[0] is not array:
            if array.stype != 'default':
                raise StoreTypeError('%s for key %r has stype %r, but the key was initialised '
                                     'dense; pass dense arrays, or init the key with a '
                                     'row_sparse value to push and row_sparse_pull rows'
                                     % (name, self.key, array.stype))
            if array.size != self.size:
                raise StoreValueError('%s for key %r has shape %s (%d elements), but the key '
                                      'was initialised with shape %s (%d elements); pass '
                                      'arrays of the initialised shape'
                                      % (name, self.key, array.shape, array.size, self.shape,
                                         self.size))
            if len(self.views) >= 8:  # a few arrays per tensor: gradients, weights, pull target
                self.views.clear()
            flat = array.reshape(-1)
            cached = (array, [flat[c.start:c.stop] for c in self.chunks], flat)
            self.views[handle] = cached
        return cached


class Placement(object):
    """Places chunks: chunk ids in placement order, each chunk on the least-loaded server
    that has key room (:meth:`KeyLayout.max_chunks`).

    Every worker places the same keys in the same order, so chunk ids, servers and local
    indexes agree.

    Parameters
    ----------
    layout : KeyLayout
        The job's keys.
    chunk_size : int
        Largest number of elements per chunk.
    whole_below : int, optional
        Keep a tensor of fewer elements than this in one chunk, whatever `chunk_size`
        (an optimizer that reads whole-tensor norms; `chunk_size` still applies to larger
        tensors and where a codec asks for smaller chunks).
    """

    def __init__(self, layout, chunk_size, whole_below=None):
        self.layout = layout
        self.chunk_size = chunk_size
        self.whole_below = whole_below
        self.next_chunk_id = 0
        self.server_load = [0] * layout.num_servers     # elements placed on each server
        self.server_chunks = [0] * layout.num_servers   # chunks placed on each server
        self.capacity = [layout.max_chunks(s) for s in range(layout.num_servers)]

    def place(self, key, shape, dtype, pull_keys=False, chunk_size=None):
        """Return a new :class:`Tensor` for `key`, its chunks placed, with pull keys if
        `pull_keys`. `chunk_size`: a smaller largest chunk for this tensor (a codec whose
        keys are larger than their chunk, :mod:`kvstore_ext.codecs.blockwise`)."""
        chunks = [self.add_chunk(start, stop, stop - start, pull_keys)
                  for start, stop in self.spans(num_elements(shape), chunk_size)]
        return Tensor(key, shape, dtype, chunks)

    def spans(self, size, chunk_size=None):
        """``[(start, stop)]``: the element ranges of the chunks :meth:`place` gives a tensor
        of `size` elements (`chunk_size` as there); places nothing."""
        step = min(self.chunk_size, chunk_size or self.chunk_size)
        if chunk_size is None and self.whole_below and size < self.whole_below:
            step = max(size, 1)
        return split(size, step)

    def add_chunk(self, start, stop, load, pull_keys=False):
        """Place the next chunk, ``[start, stop)`` of its tensor, holding `load` elements;
        with `pull_keys`, give it pull keys.

        Raises
        ------
        ValueError
            If every server holds as many chunks as its keys allow.
        """
        server = self._server_with_room()
        local = self.server_chunks[server]
        layout = self.layout
        keys = [layout.slot_key(local, s, server) for s in range(layout.slots)]
        pull = [layout.pull_key(local, p, server) for p in range(layout.pull_keys)] \
            if pull_keys else None
        model_key = layout.model_key(local, server) if layout.model_keys else None
        chunk = Chunk(self.next_chunk_id, start, stop, server, local, keys, pull, model_key)
        self.next_chunk_id += 1
        self.server_load[server] += load
        self.server_chunks[server] += 1
        return chunk

    def _server_with_room(self):
        server = int(np.argmin(self.server_load))
        if self.server_chunks[server] < self.capacity[server]:
            return server
        # A server whose keys are used up takes no more chunks; the others take them, so the
        # job's cap is the sum of the servers' (docs/design.md §2.6).
        room = [s for s, cap in enumerate(self.capacity) if self.server_chunks[s] < cap]
        if not room:
            layout = self.layout
            raise ValueError(
                'too many chunks for MXNet\'s keys: the %d server(s) hold %d chunks, the most '
                'they can (at most %d per server, %d keys per chunk: %d slots (slack + 1), %d '
                'pull keys, %d state keys%s; MXNet places a key with (key * 9973) %% '
                'num_servers in a C int, so keys stay at or below %d); %s'
                % (layout.num_servers, sum(self.server_chunks), max(self.capacity),
                   layout.slots + layout.pull_keys + layout.state_keys + layout.model_keys,
                   layout.slots, layout.pull_keys, layout.state_keys,
                   ', 1 model key' if layout.model_keys else '', MAX_KEY, FEWER_KEYS))
        return min(room, key=self.server_load.__getitem__)
