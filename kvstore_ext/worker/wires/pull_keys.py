"""The wire of dense keys pushed in the codec's wire dtype and pulled from float32 pull keys
(``Codec.wire`` ``'pull_keys'``: ``'fp16'``, docs/design.md §2.11).

Every chunk keeps its R slot keys for the pushes, now keys of the wire dtype (float16), and
gets P float32 *pull keys* (R, or 1 with compressed pulls,
:func:`kvstore_ext.protocol.keys.pull_keys_per_chunk`): round t's ``W_{t+1}`` is written into
pull key ``t mod P`` (:class:`kvstore_ext.server.rounds.RoundKeeper`), and pulls read it. The
native server hands its updater only the stored value of the key whose round completed, so each
worker pushes one round of zeros into the pull keys at ``init``; the server keeps their stored
arrays from that round on (:func:`push_handle_round`).

Pulls land in a float32 receive buffer (:class:`PullKeyBuffers`, the tensor's
``wire_state``: one for all its pull keys, which pulls write one after the other in MXNet's
engine), not in the send buffer, so MXNet's engine no longer orders a pull and the pushes by
itself: :class:`PullKeyWire` orders the pull of round t behind the pushes of round t and the
earlier rounds, and the next push into a slot behind the last pull of its pull key (through
a one-element mark per pull key, written right after that pull).
"""
from mxnet import nd

from kvstore_ext.worker import ordering
from kvstore_ext.worker.wires.base import DenseWire

__all__ = ['PullKeyWire', 'PullKeyBuffers', 'push_handle_round']


class PullKeyBuffers(object):
    """A tensor's float32 receive buffer (on the CPU), which the pulls of every pull key land
    in (the native store receives a key's pulls in the array its last push sent: here every
    pull key's, pushed once, :func:`push_handle_round`), its head, one mark per pull key (a
    one-element array written right after the key's last pull) and the pull keys pulled
    since a push last waited for them.

    One buffer serves all pull keys: a tensor's pulls are ordered behind one another anyway
    (each after every earlier round), and what orders a push behind the last pull of its pull
    key is the key's mark, not the buffer, which later pulls write."""
    __slots__ = ('buffer', 'head', 'marks', 'pulled')

    def __init__(self, tensor):
        self.buffer = nd.zeros(tensor.chunks[-1].stop, dtype=tensor.dtype)
        self.head = self.buffer[0:1]
        self.marks = [nd.zeros(1, dtype=tensor.dtype) for _ in tensor.chunks[0].pull_keys]
        self.pulled = set()

    def index(self, rnd):
        """The pull key (and mark) of round `rnd`."""
        return rnd % len(self.marks)


def push_handle_round(native, tensors):
    """Push one round of zeros into the pull keys of `tensors` and wait for it (collective:
    every worker does it at ``init``). The server keeps each pull key's stored array from
    this round and writes ``W`` into it from then on; the zeros change nothing (the updater
    leaves the key's initial value). Waiting makes every worker's first push of a slot
    key come after the server holds the handles."""
    keys, views = [], []
    for tensor in tensors:
        for chunk in tensor.chunks:
            for key in chunk.pull_keys:
                keys.append(key)
                views.append(tensor.wire_state.buffer[chunk.start:chunk.stop])
    if keys:
        native.push(keys, views)
        for tensor in tensors:
            ordering.wait_for_pushes([tensor.wire_state.head])


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
        """Before the next push into `slot`: wait in MXNet's engine for the last pull of its
        pull key to return (a one-element write on the send buffer that reads the key's
        mark). Otherwise the push could complete the next round, and the server overwrite the
        pull key, before that pull was served. With one pull key (compressed pulls) every push
        after an exact pull waits for it."""
        state = tensor.wire_state
        index = state.index(slot)
        if index in state.pulled:
            ordering.follow(tensor.heads[slot], state.marks[index])
            state.pulled.discard(index)

    def _after_pull(self, tensor, last):
        """Right after the pull of round `last`: its pull key's mark reads the receive buffer,
        so it is written once that pull (and every earlier one) has returned, and not later
        pulls."""
        state = tensor.wire_state
        ordering.follow(state.marks[state.index(last)], state.head)

    def _received_in(self, tensor, slot):
        return tensor.wire_state.buffer

    def _order_pull(self, tensor, last):
        """Before the pull of round `last`: wait in MXNet's engine for the push of round
        `last` and of each earlier round not yet covered to be acknowledged (complete on its
        server).

        The pull writes the receive buffer, not the send buffer that
        the push of `last` reads, so this touches every send buffer concerned (a write,
        which waits for its push) and then writes the receive buffer's first element from
        it; the pull (another write on that buffer) then follows. The elements touched are
        overwritten by the next copy and by the pull.
        """
        state = tensor.wire_state
        self.order_after_pushes(tensor, last, [state.head])
        state.pulled.add(state.index(last))
