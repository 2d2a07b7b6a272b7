"""The data path of dense keys pushed as float16 (``'fp16'``, docs/design.md §2.11).

Every chunk keeps its R slot keys for the pushes, now float16 keys, and gets R float32 *pull
keys*: round t's ``W_{t+1}`` is written into pull key ``t mod R``
(:class:`kvstore_ext.server.rounds.RoundKeeper`), and pulls read it. The native server hands
its updater only the stored value of the key whose round completed, so each worker pushes one
round of zeros into the pull keys at ``init``; the server keeps their stored arrays from that
round on (:func:`push_handle_round`). :class:`PullKeyDense` orders a slot's float16 send
buffer and its float32 receive buffer in MXNet's engine; :class:`PullKeyModelDense` adds
compressed pulls (the scheduled pulls read the model key, the exact ones the pull keys).
"""
from mxnet import nd

from kvstore_ext.worker.dense import DenseKeys
from kvstore_ext.worker.pulled_model import PulledModel

__all__ = ['PullKeyDense', 'PullKeyModelDense', 'order_pull', 'order_push',
           'push_handle_round']


def order_push(tensor, slot):
    """Before the next push into `slot`: wait in MXNet's engine for the pull of the slot's
    previous round to return (a one-element write on the send buffer that reads the
    receive buffer). Otherwise the push could complete the next round, and the server
    overwrite the pull key, before that pull was served."""
    if slot in tensor.pulled_slots:
        tensor.pull_heads[slot].copyto(tensor.heads[slot])
        tensor.pulled_slots.discard(slot)


def order_pull(tensor, rounds, last):
    """Before the pull of round `last`: wait in MXNet's engine for the push of round `last`
    and of each round in `rounds` to be acknowledged (complete on its server).

    The pull writes the receive buffer of slot ``last mod R``, not the send buffer that the
    push of `last` reads, so this touches every send buffer concerned (a write, which waits
    for its push) and then writes the receive buffer's first element from it; the pull
    (another write on that buffer) then follows. The elements touched are overwritten by
    the next copy and by the pull.
    """
    slots = len(tensor.buffers)
    target = tensor.pull_heads[last % slots]
    for rnd in list(rounds) + [last]:
        head = tensor.heads[rnd % slots]
        nd._internal._plus_scalar(head, scalar=0.0, out=head)  # pylint: disable=protected-access
        head.copyto(target)
    tensor.pulled_slots.add(last % slots)


def push_handle_round(native, tensors):
    """Push one round of zeros into the pull keys of `tensors` and wait for it (collective:
    every worker does it at ``init``). The server keeps each pull key's stored array from
    this round and writes ``W`` into it from then on; the zeros change nothing (the updater
    leaves the key's initial value). Waiting makes every worker's first push of a slot
    key come after the server holds the handles."""
    keys, views = [], []
    for tensor in tensors:
        for chunk in tensor.chunks:
            for slot, key in enumerate(chunk.pull_keys):
                keys.append(key)
                views.append(tensor.pull_buffers[slot][chunk.start:chunk.stop])
    if keys:
        native.push(keys, views)
        for tensor in tensors:
            for head in tensor.pull_heads:
                # A write waits for the push that reads the buffer to be acknowledged.
                nd._internal._plus_scalar(head, scalar=0.0, out=head)  # pylint: disable=protected-access
                head.wait_to_read()


class PullKeyDense(DenseKeys):
    """Dense keys pushed in the codec's wire dtype whose pulls read float32 pull keys of
    their own."""

    def init_entries(self, tensor, value):
        # float16 slot keys (their value is never read: pulls read the pull keys, which
        # start at the tensor's float32 value).
        flat = value.reshape(-1)
        keys, values, sizes = [], [], []
        for chunk in tensor.chunks:
            chunk_value = flat[chunk.start:chunk.stop]
            zeros = nd.zeros(chunk.stop - chunk.start, dtype=self._codec.wire_dtype)
            keys.extend(chunk.keys + chunk.pull_keys)
            values.extend([zeros] * len(chunk.keys) + [chunk_value] * len(chunk.pull_keys))
            sizes.append(int(chunk_value.size))
        return keys, values, sizes

    def after_init(self, tensors):
        for tensor in tensors:
            tensor.make_pull_buffers(self._slots)
        push_handle_round(self._native, tensors)

    def _before_push(self, tensor, slot):
        order_push(tensor, slot)

    def _order_after_earlier_rounds(self, tensor, last):
        # The pull lands in a buffer of its own.
        order_pull(tensor, self._earlier_rounds(tensor, last), last)


class PullKeyModelDense(PulledModel, PullKeyDense):
    """:class:`PullKeyDense` with compressed pulls (:class:`kvstore_ext.worker.pulled_model.PulledModel`):
    the servers write W into the pull keys and, at pulled rounds, ``C(W - x̂)`` into the
    model key; :meth:`pull` (``sync_weights``, the initial ``x̂``) reads the pull keys, the
    scheduled pulls the model key. The compressed pull orders itself behind the float16 send
    buffers' pushes as the exact one does, and the next push into a slot waits for both
    (the model key's wait first, then the pull key's)."""
