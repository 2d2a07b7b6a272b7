"""The wire of dense keys pushed in the codec's wire dtype and pulled from float32 pull keys
(``Codec.wire`` ``'pull_keys'``: ``'fp16'``, docs/design.md §2.11).

Every chunk keeps its R slot keys for the pushes, now keys of the wire dtype (float16), and
gets P float32 *pull keys* (R, or 1 with compressed pulls,
:func:`kvstore_ext.protocol.keys.pull_keys_per_chunk`): round t's ``W_{t+1}`` is written into
pull key ``t mod P`` (:class:`kvstore_ext.server.rounds.RoundKeeper`), and pulls read it. The
native server hands its updater only the stored value of the key whose round completed, so each
worker pushes one round of zeros into the pull keys at ``init``; the server keeps their stored
arrays from that round on (:func:`push_handle_round`).

A pull key's pulls land in a float32 receive buffer of its own (:class:`PullKeyBuffers`,
the tensor's ``wire_state``), not in the send buffer, so MXNet's engine no longer orders a
pull and the pushes by itself: :class:`PullKeyWire` orders the pull of round t behind the
pushes of round t and the earlier rounds, and the next push of a round that writes the same
pull key (round t + P) behind that pull.
"""
from mxnet import nd

from kvstore_ext.worker import ordering
from kvstore_ext.worker.wires.base import DenseWire

__all__ = ['PullKeyWire', 'PullKeyBuffers', 'push_handle_round']


class PullKeyBuffers(object):
    """A tensor's float32 receive buffers (on the CPU), one per pull key (P), which its pulls
    land in, their heads, and the pull keys pulled since a push last waited for them."""
    __slots__ = ('buffers', 'heads', 'pulled')

    def __init__(self, tensor):
        size = tensor.chunks[-1].stop
        self.buffers = [nd.zeros(size, dtype=tensor.dtype)
                        for _ in tensor.chunks[0].pull_keys]
        self.heads = [buf[0:1] for buf in self.buffers]
        self.pulled = set()

    def index(self, rnd):
        """The pull key (and receive buffer) of round `rnd`: ``rnd mod P``."""
        return rnd % len(self.buffers)


def push_handle_round(native, tensors):
    """Push one round of zeros into the pull keys of `tensors` and wait for it (collective:
    every worker does it at ``init``). The server keeps each pull key's stored array from
    this round and writes ``W`` into it from then on; the zeros change nothing (the updater
    leaves the key's initial value). Waiting makes every worker's first push of a slot
    key come after the server holds the handles."""
    keys, views = [], []
    for tensor in tensors:
        for chunk in tensor.chunks:
            for index, key in enumerate(chunk.pull_keys):
                keys.append(key)
                views.append(tensor.wire_state.buffers[index][chunk.start:chunk.stop])
    if keys:
        native.push(keys, views)
        for tensor in tensors:
            ordering.wait_for_pushes(tensor.wire_state.heads)


class PullKeyWire(DenseWire):
    """Dense keys pushed in the codec's wire dtype whose pulls read float32 pull keys of
    their own."""

    pull_keys = True

    def _entries(self, tensor, value):
        # Slot keys of the wire dtype (their value is never read: pulls read the pull keys,
        # which start at the tensor's float32 value).
        flat = value.reshape(-1)
        keys, values, sizes = [], [], []
        for chunk in tensor.chunks:
            chunk_value = flat[chunk.start:chunk.stop]
            zeros = nd.zeros(chunk.stop - chunk.start, dtype=self._codec.wire_dtype)
            keys.extend(chunk.keys + chunk.pull_keys)
            values.extend([zeros] * len(chunk.keys) + [chunk_value] * len(chunk.pull_keys))
            sizes.append(int(chunk_value.size))
        return keys, values, sizes

    def _after_init(self, tensors):
        for tensor in tensors:
            tensor.wire_state = self._receive_buffers(tensor)
        push_handle_round(self._native, tensors)

    def _receive_buffers(self, tensor):
        """`tensor`'s per-tensor state: its receive buffers."""
        return PullKeyBuffers(tensor)

    def _before_push(self, tensor, slot):
        """Before the next push into `slot` (round t): wait in MXNet's engine for the last
        pull of round t's pull key (``t mod P``; P divides R) to return (a one-element write
        on the send buffer that reads the receive buffer). Otherwise the push could complete
        round t, and the server overwrite the pull key, before that pull was served. With
        one pull key (compressed pulls) every push after an exact pull waits for it."""
        state = tensor.wire_state
        index = state.index(slot)
        if index in state.pulled:
            ordering.follow(tensor.heads[slot], state.heads[index])
            state.pulled.discard(index)

    def _order_pull(self, tensor, last):
        """Before the pull of round `last`: wait in MXNet's engine for the push of round
        `last` and of each earlier round not yet covered to be acknowledged (complete on its
        server).

        The pull writes the receive buffer of slot ``last mod R``, not the send buffer that
        the push of `last` reads, so this touches every send buffer concerned (a write,
        which waits for its push) and then writes the receive buffer's first element from
        it; the pull (another write on that buffer) then follows. The elements touched are
        overwritten by the next copy and by the pull.
        """
        state = tensor.wire_state
        index = state.index(last)
        self.order_after_pushes(tensor, last, [state.heads[index]])
        state.pulled.add(index)
