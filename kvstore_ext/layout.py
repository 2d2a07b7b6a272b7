"""Where a worker's tensors live on the servers: integer keys, chunks and slot buffers.

MXNet's native worker sends a key of fewer than ``MXNET_KVSTORE_BIGARRAY_BOUND`` elements to
server ``(key * 9973) % num_servers``. mxdelay chooses its integer keys so that this formula
lands every key on the server it wants (:class:`KeyLayout`):

- one *status* key per server (``status_key(s)``), a small array through which the server
  answers the hand-shake and the commands (:mod:`kvstore_ext.protocol`);
- ``R`` *slot* keys per tensor chunk (``slot_key(chunk, slot, server)``), all on the
  chunk's server; round t of a chunk goes to slot ``t mod R`` (docs/design.md §2);
- ``J`` *state* keys per chunk (``state_key(chunk, j, server)``; J = 0 unless a trainer's
  local rule fetches the servers' optimizer state, docs/design.md §2.9): a round of state
  key j carries the j-th array of the chunk's optimizer state back to the workers.

A tensor of more than ``chunk_size`` elements is split into chunks, each placed on the
least-loaded server (:class:`Placement`); a worker's :class:`Tensor` holds its chunks, one
send/receive buffer per slot and the rounds it pushed and pulled.
"""
import numpy as np
from mxnet import nd

__all__ = ['KeyLayout', 'Chunk', 'Tensor', 'Placement', 'num_elements', 'MAX_KEY']

_MXNET_KEY_MULTIPLIER = 9973  # src/kvstore/kvstore_dist.h, EncodeDefaultKey
#: The largest key MXNet places correctly: it computes ``key * 9973`` in a C int.
MAX_KEY = (2 ** 31 - 1) // _MXNET_KEY_MULTIPLIER


class KeyLayout(object):
    """The integer keys of a job with `num_servers` servers and `slots` slot keys per chunk.

    Parameters
    ----------
    num_servers : int
        Number of servers of the job.
    slots : int
        Slot keys per chunk (the slack plus one).
    state_keys : int, default 0
        State keys per chunk (J). With J = 0 every key is what it was without state keys.
    """

    def __init__(self, num_servers, slots, state_keys=0):
        if not 1 <= num_servers < _MXNET_KEY_MULTIPLIER:
            raise ValueError('num_servers=%d is outside 1..%d' % (num_servers, _MXNET_KEY_MULTIPLIER - 1))
        self.num_servers = num_servers
        self.slots = slots
        self.state_keys = state_keys
        # residue[s]: the key residue modulo num_servers that MXNet sends to server s
        self._residue = [0] * num_servers
        for r in range(num_servers):
            self._residue[(r * _MXNET_KEY_MULTIPLIER) % num_servers] = r

    def _key(self, index, server):
        key = index * self.num_servers + self._residue[server]
        if key > MAX_KEY:
            raise ValueError('key %d exceeds %d, the largest key MXNet places correctly (it '
                             'computes (key * 9973) %% num_servers in a C int): use fewer, '
                             'larger chunks (MXDELAY_CHUNK_SIZE) or a smaller slack' % (key, MAX_KEY))
        return key

    def status_key(self, server):
        """Key of server `server`'s status array."""
        return self._key(0, server)

    def slot_key(self, chunk, slot, server):
        """Key of slot `slot` of chunk `chunk`, placed on server `server`."""
        return self._key(1 + chunk * (self.slots + self.state_keys) + slot, server)

    def state_key(self, chunk, j, server):
        """Key of state key `j` (0 .. J-1) of chunk `chunk`, placed on server `server`."""
        if not 0 <= j < self.state_keys:
            raise ValueError('state key %d of chunk %d: this layout has %d state keys per chunk'
                             % (j, chunk, self.state_keys))
        return self._key(1 + chunk * (self.slots + self.state_keys) + self.slots + j, server)

    def decode(self, key):
        """Return ``('status', None, None)``, ``('slot', chunk, slot)`` or
        ``('state', chunk, j)`` for `key`."""
        index = key // self.num_servers
        if index == 0:
            return 'status', None, None
        chunk, slot = divmod(index - 1, self.slots + self.state_keys)
        if slot >= self.slots:
            return 'state', chunk, slot - self.slots
        return 'slot', chunk, slot

    def server_of(self, key):
        """The server MXNet sends `key` to."""
        return (key * _MXNET_KEY_MULTIPLIER) % self.num_servers


def num_elements(shape):
    """Number of elements of an array of `shape` (1 for a scalar's ``()``)."""
    return int(np.prod(shape)) if shape else 1


class Chunk(object):
    """One chunk of a tensor: elements ``[start, stop)`` of the flattened tensor."""
    __slots__ = ('chunk_id', 'start', 'stop', 'server', 'keys')

    def __init__(self, chunk_id, start, stop, server, keys):
        self.chunk_id, self.start, self.stop, self.server = chunk_id, start, stop, server
        self.keys = keys          # one native key per slot


class Tensor(object):
    """A user key: its chunks, its slot buffers and the rounds this worker pushed and pulled.

    ``buffers[s]`` is slot s's send/receive buffer (the flattened tensor; its chunks are
    views of it, so one copy fills a whole round and MXNet's engine tracks it as one
    variable); made at the first push, on the CPU (pinned memory for GPU gradients).
    """
    __slots__ = ('key', 'shape', 'size', 'dtype', 'chunks', 'next_round', 'last_pulled',
                 'buffers', 'chunk_views', 'heads', 'views', 'zero')

    def __init__(self, key, shape, dtype, chunks):
        self.key, self.shape, self.dtype, self.chunks = key, shape, dtype, chunks
        self.size = num_elements(shape)
        self.next_round = 0
        self.last_pulled = -1
        self.buffers = self.chunk_views = self.heads = self.zero = None
        self.views = {}           # handle of a user array -> (array, its chunk views, flat)

    def make_buffers(self, slots, ctx):
        """Make the `slots` send/receive buffers on `ctx`."""
        size = self.chunks[-1].stop
        self.buffers = [nd.zeros(size, ctx=ctx, dtype=self.dtype) for _ in range(slots)]
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
            (`name` is the argument's) If the array has another number of elements than
            the tensor; checked once per array, when its views are made.
        """
        handle = array.handle.value
        cached = self.views.get(handle)
        if cached is None or cached[0] is not array:
            if array.size != self.size:
                raise ValueError('%s for key %r has shape %s (%d elements), but the key was '
                                 'initialised with shape %s (%d elements); pass arrays of the '
                                 'initialised shape' % (name, self.key, array.shape, array.size,
                                                        self.shape, self.size))
            if len(self.views) >= 8:  # a few arrays per tensor: gradients, weights, pull target
                self.views.clear()
            flat = array.reshape(-1)
            cached = (array, [flat[c.start:c.stop] for c in self.chunks], flat)
            self.views[handle] = cached
        return cached


class Placement(object):
    """Places tensors: chunk ids in placement order, each chunk on the least-loaded server.

    Every worker places the same keys in the same order, so chunk ids and servers agree.

    Parameters
    ----------
    layout : KeyLayout
        The job's keys.
    chunk_size : int
        Largest number of elements per chunk.
    """

    def __init__(self, layout, chunk_size):
        self.layout = layout
        self.chunk_size = chunk_size
        self.next_chunk_id = 0
        self.server_load = [0] * layout.num_servers

    def place(self, key, shape, dtype):
        """Return a new :class:`Tensor` for `key`, its chunks placed."""
        size = num_elements(shape)
        chunks = []
        for start in range(0, max(size, 1), self.chunk_size):
            stop = min(start + self.chunk_size, size)
            server = int(np.argmin(self.server_load))
            self.server_load[server] += stop - start
            chunk_id = self.next_chunk_id
            self.next_chunk_id += 1
            keys = [self.layout.slot_key(chunk_id, s, server) for s in range(self.layout.slots)]
            chunks.append(Chunk(chunk_id, start, stop, server, keys))
        return Tensor(key, shape, dtype, chunks)
