"""The wire of dense keys whose pushes and pulls use the slot keys (``Codec.wire`` ``'slots'``).

Without a codec or with ``'2bit'`` (whose values the native store packs), a round's push
and its pull use the chunk's slot key ``t mod R`` (docs/design.md §2.2-2.4); aux keys and
the finish counter travel so too. MXNet's native worker pulls a key into the buffer its last
push was sent from, so the pull of round t follows that push in MXNet's engine by itself,
and :meth:`SlotWire._order_pull` only orders it behind the earlier rounds.

Without a codec a round and its weights can travel in one request per chunk, MXNet's
``pushpull`` (:class:`ExchangeWire`; MXNet refuses ``pushpull`` with its compression), with
the send buffers of its chunks 1.. of its own (:class:`ExchangeBuffers`).
"""
from mxnet import nd

from kvstore_ext.worker import ordering
from kvstore_ext.worker.finite import ALL_FINITE
from kvstore_ext.worker.wires.base import DenseWire

__all__ = ['SlotWire', 'ExchangeWire', 'ExchangeBuffers']


class SlotWire(DenseWire):
    """Dense keys whose pushes and pulls use the slot keys."""

    def _order_pull(self, tensor, last):
        """Queue the pull of round `last` behind the completion of every earlier round.

        A one-element write on another slot's buffer runs only after that slot's push is
        acknowledged (its round complete); the following write on this slot's buffer then
        orders the pull (which writes the same buffer) after it. Rounds up to the previous
        pull are covered by that pull (touching its slot waits for it), rounds more than a
        slack back by the reuse of their slot. The touched elements hold pushed data that is
        no longer needed, and the pull overwrites this slot's buffer.
        """
        ordering.add_after_pushes(tensor.heads[last % self._slots],
                                  self._earlier_heads(tensor, last))

    def _earlier_heads(self, tensor, last):
        """The heads of the buffers of the rounds before `last` that a pull must wait for."""
        return [tensor.heads[rnd % self._slots] for rnd in self._earlier_rounds(tensor, last)]


class ExchangeBuffers(object):
    """What an exchanged tensor keeps: the send buffers of its chunks 1.. (``own``, one copy
    of the chunk each; empty for a tensor of one chunk), the round they last carried
    (``round``) and an array of its shape that receives weights nobody reads
    (:meth:`unread`)."""
    __slots__ = ('own', 'round', '_unread')

    def __init__(self, views):
        self.own = [nd.zeros_like(v) for v in views[1:]]
        self.round = None
        self._unread = None

    def unread(self, tensor):
        """An array of `tensor`'s shape (made once) for the answers of pushpulls sent only
        because the other workers send the round so."""
        if self._unread is None:
            self._unread = nd.zeros(tensor.shape, dtype=tensor.dtype)
        return self._unread


class ExchangeWire(SlotWire):
    """:class:`SlotWire` whose rounds go as one native ``pushpull`` per chunk when the workers
    send them so (``exchanged``; which rounds, on every worker alike,
    :class:`kvstore_ext.worker.dist_delay.DistDelay` decides)."""

    exchanges = True

    def send(self, tensor, grads, outs, priority, factor=None, finite=ALL_FINITE,
             exchanged=False):
        """As :meth:`KeyKind.send <kvstore_ext.worker.wires.base.KeyKind.send>`, or one
        :meth:`exchange` if `exchanged` (without `outs` into an array of the tensor's own)."""
        if exchanged:
            self.exchange(tensor, grads, outs, priority, factor, finite)
        else:
            if tensor.wire_state is not None:
                tensor.wire_state.round = None   # a push reads its slot buffer: touch again
            super(ExchangeWire, self).send(tensor, grads, outs, priority, factor, finite)

    def exchange(self, tensor, grads, outs, priority, factor=None, finite=ALL_FINITE):
        """Push round t = ``tensor.next_round`` of `tensor` and receive ``W_{t+1}`` into
        `outs` (None: an array nobody reads) with one native ``pushpull`` per chunk (the
        server answers the push with the chunk's weights once it has applied the round).

        A separate pull is a request that travels behind this worker's later pushes on its
        link to the server; the answer of a pushpull leaves as soon as the round is applied,
        while other chunks' pushes still arrive: on full-duplex links the pulls of early
        chunks overlap the pushes of later ones, as stock ``dist_sync`` does
        (docs/design.md §8).

        The server's answer is the slot's stored value when the round completes, exactly
        ``W_{t+1}`` only if no earlier round is still missing then (a held round's slot is
        written later, §3.2). So the push is sent only once this worker's earlier rounds are
        acknowledged (:meth:`_order_pull`, queued before the encode): the round then
        completes after every earlier one and is applied at once.

        MXNet's engine serialises operations that write one variable, and a pushpull
        writes its buffer: chunks 1.. of a split tensor are sent from buffers of their own
        (:class:`ExchangeBuffers`), so that its chunks travel side by side as separate pushes
        do. The next round's copy into them waits for their pushpull; every later pull or
        pushpull also orders behind them (:meth:`_earlier_heads`).
        """
        rnd = tensor.next_round
        slot = self._fill(tensor, grads, factor, finite, ordered=True)
        views = tensor.chunk_views[slot]
        if tensor.wire_state is None:
            tensor.wire_state = ExchangeBuffers(views)
        sends = list(views[:1])
        for view, own in zip(views[1:], tensor.wire_state.own):
            view.copyto(own)
            sends.append(own)
        per_chunk = list(zip(*[tensor.views_of(o)[1]
                               for o in outs or [tensor.wire_state.unread(tensor)]]))
        self._native.pushpull([c.keys[slot] for c in tensor.chunks], sends,
                              out=[list(v) for v in per_chunk], priority=priority)
        tensor.next_round = rnd + 1
        tensor.last_pulled = tensor.wire_state.round = rnd

    def _order_pull(self, tensor, last):
        """:meth:`SlotWire._order_pull`; after an exchanged round ``last - 1`` (the common
        case: a synchronous step after a synchronous step) without touching: the round's
        pushpulls write their send buffers until their answers arrive, so reading the
        buffers orders as well (one engine operation less per chunk and round)."""
        state = tensor.wire_state
        if state is not None and state.round == last - 1 == tensor.last_pulled:
            ordering.add_after_writes(tensor.heads[last % self._slots],
                                      self._earlier_heads(tensor, last))
        else:
            super(ExchangeWire, self)._order_pull(tensor, last)

    def pull(self, tensor, outs, priority, ignore_sparse=True):
        """:meth:`DenseWire.pull <kvstore_ext.worker.wires.base.DenseWire.pull>`, then, once
        a pull is ordered behind the exchanged rounds (:meth:`_earlier_heads`), their
        buffers of chunks 1.. go: every later pull is ordered behind this one, and the
        native store lets go of each at its slot key's next push, R rounds on (the delayed
        phase keeps no copy of them, docs/design.md §2.3). A later exchange makes new ones."""
        super(ExchangeWire, self).pull(tensor, outs, priority, ignore_sparse)
        if tensor.last_pulled >= 0:
            tensor.wire_state = None

    def _earlier_heads(self, tensor, last):
        # Chunks 1.. of exchanged rounds travelled in buffers of their own; each holds its
        # last round. Ordered here, once that round is (nearly always) complete: a write
        # queued right behind a pushpull in flight held back the next tensor's pushpulls
        # until it ended (measured at 100 Mbit/s: 2.1 instead of 1.9 s/step).
        heads = super(ExchangeWire, self)._earlier_heads(tensor, last)
        state = tensor.wire_state   # made at the tensor's first exchange
        return heads + ([own[0:1] for own in state.own] if state is not None else [])
