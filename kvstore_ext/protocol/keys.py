"""The integer keys of a job: which key is which, on which server (workers and servers alike).

MXNet's native worker sends a key of fewer than ``MXNET_KVSTORE_BIGARRAY_BOUND`` elements to
server ``(key * 9973) % num_servers``. mxdelay chooses its integer keys so that this formula
lands every key on the server it wants (:class:`KeyLayout`):

- one *status* key per server (``status_key(s)``), a small array through which the server
  answers the hand-shake and the commands (:mod:`kvstore_ext.protocol.commands`);
- ``R`` *slot* keys per tensor chunk (``slot_key(local, slot, server)``), all on the
  chunk's server; round t of a chunk goes to slot ``t mod R`` (docs/design.md §2);
- with float16 or blockwise pushes, ``P`` float32 *pull* keys per chunk (``pull_key(local,
  p, server)``; P = R, or 1 with compressed pulls, :func:`pull_keys_per_chunk`): the servers
  write round t's weights into pull key ``t mod P``, which pulls read (docs/design.md §2.11);
- ``J`` *state* keys per chunk (``state_key(local, j, server)``; J = 0 unless a trainer's
  local rule fetches the servers' optimizer state, docs/design.md §2.9): a round of state
  key j carries the j-th array of the chunk's optimizer state back to the workers;
- with compressed pulls, one *model* key per chunk (``model_key(local, server)``, M = 1,
  else 0): the payload of a compressed pull (docs/design.md §2.12).

A chunk's keys are numbered by its *local* index, its number among its own server's chunks,
not by its job-wide chunk id: each server's keys are dense, so the job's chunks share the
whole key range below :data:`MAX_KEY` instead of each server's keys using 1/S of it
(docs/design.md §2.6). The worker places chunks (:mod:`kvstore_ext.worker.layout`); the
server decodes the keys it receives with the same layout.
"""
__all__ = ['KeyLayout', 'MAX_KEY', 'FEWER_KEYS', 'pull_keys_per_chunk']


_MXNET_KEY_MULTIPLIER = 9973  # src/kvstore/kvstore_dist.h, EncodeDefaultKey


#: The largest key MXNet places correctly: it computes ``key * 9973`` in a C int.
MAX_KEY = (2 ** 31 - 1) // _MXNET_KEY_MULTIPLIER


FEWER_KEYS = ('use larger chunks (MXDELAY_CHUNK_SIZE, below MXNET_KVSTORE_BIGARRAY_BOUND), '
               'fewer tensors or a smaller slack')


def pull_keys_per_chunk(slots, pull_keys, compressed_pulls):
    """P, the float32 pull keys of a chunk (docs/design.md §2.11): none unless the codec's
    pulls read `pull_keys` of their own; one with `compressed_pulls` (the scheduled pulls read
    the model key, so the pull keys serve only exact pulls, each of which the next push waits
    for); else `slots` (R), so that an exact pull of round t is not overwritten by the rounds
    a worker pushes before it returns."""
    if not pull_keys:
        return 0
    return 1 if compressed_pulls else slots


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
    pull_keys : int, default 0
        Pull keys per chunk (P, :func:`pull_keys_per_chunk`): R or 1 with float16 or
        blockwise pushes, else 0 (then every key is what it was without them).
    model_keys : int, default 0
        Model keys per chunk (M): 1 with compressed pulls, else 0 (then every key is what
        it was without them). They follow the state keys.
    """

    def __init__(self, num_servers, slots, state_keys=0, pull_keys=0, model_keys=0):
        if not 1 <= num_servers < _MXNET_KEY_MULTIPLIER:
            raise ValueError('num_servers=%d is outside 1..%d' % (num_servers, _MXNET_KEY_MULTIPLIER - 1))
        self.num_servers = num_servers
        self.slots = slots
        self.state_keys = state_keys
        self.pull_keys = pull_keys
        self.model_keys = model_keys
        self._stride = slots + pull_keys + state_keys + model_keys   # keys per chunk
        # residue[s]: the key residue modulo num_servers that MXNet sends to server s
        self._residue = [0] * num_servers
        for r in range(num_servers):
            self._residue[(r * _MXNET_KEY_MULTIPLIER) % num_servers] = r

    def _key(self, index, server):
        key = index * self.num_servers + self._residue[server]
        if key > MAX_KEY:
            raise ValueError('key %d exceeds %d, the largest key MXNet places correctly (it '
                             'computes (key * 9973) %% num_servers in a C int): server %d holds '
                             'at most %d chunks of %d keys; %s'
                             % (key, MAX_KEY, server, self.max_chunks(server), self._stride,
                                FEWER_KEYS))
        return key

    def max_chunks(self, server):
        """The most chunks server `server` can hold: the last key of its last chunk, index
        ``chunks * (R + P + J)``, must stay at or below :data:`MAX_KEY`."""
        return (MAX_KEY - self._residue[server]) // self.num_servers // self._stride

    def status_key(self, server):
        """Key of server `server`'s status array."""
        return self._key(0, server)

    def slot_key(self, local, slot, server):
        """Key of slot `slot` of the chunk with local index `local` on server `server`."""
        return self._key(1 + local * self._stride + slot, server)

    def pull_key(self, local, slot, server):
        """Key of pull key `slot` (0 .. P-1; float16 or blockwise pushes) of the chunk with
        local index `local` on server `server`."""
        if not 0 <= slot < self.pull_keys:
            raise ValueError('pull key %d of chunk %d: this layout has %d pull keys per chunk'
                             % (slot, local, self.pull_keys))
        return self._key(1 + local * self._stride + self.slots + slot, server)

    def state_key(self, local, j, server):
        """Key of state key `j` (0 .. J-1) of the chunk with local index `local` on server
        `server`."""
        if not 0 <= j < self.state_keys:
            raise ValueError('state key %d of chunk %d: this layout has %d state keys per chunk'
                             % (j, local, self.state_keys))
        return self._key(1 + local * self._stride + self.slots + self.pull_keys + j, server)

    def model_key(self, local, server):
        """Key of the model key (compressed pulls) of the chunk with local index `local` on
        server `server`."""
        if not self.model_keys:
            raise ValueError('model key of chunk %d: this layout has no model keys' % local)
        return self._key(1 + local * self._stride + self.slots + self.pull_keys
                         + self.state_keys, server)

    def decode(self, key):
        """Return ``('status', None, None)``, ``('slot', local, slot)``,
        ``('pull', local, slot)``, ``('state', local, j)`` or ``('model', local, 0)`` for
        `key` (`local`: the chunk's index among its server's chunks)."""
        index = key // self.num_servers
        if index == 0:
            return 'status', None, None
        local, slot = divmod(index - 1, self._stride)
        if slot >= self.slots + self.pull_keys + self.state_keys:
            return 'model', local, 0
        if slot >= self.slots + self.pull_keys:
            return 'state', local, slot - self.slots - self.pull_keys
        if slot >= self.slots:
            return 'pull', local, slot - self.slots
        return 'slot', local, slot

    def server_of(self, key):
        """The server MXNet sends `key` to."""
        return (key * _MXNET_KEY_MULTIPLIER) % self.num_servers
