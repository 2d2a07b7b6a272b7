"""What every key's data path offers, and the part of it that every wire of dense keys shares.

A key's *kind* is its data path, chosen once per key at ``init``
(:mod:`kvstore_ext.worker.dist_delay`): a wire of this package for dense keys,
:class:`kvstore_ext.worker.sparse.RowSparseKeys` for row_sparse keys,
:class:`kvstore_ext.worker.aux_states.AuxKeys` for aux states. :class:`KeyKind` is what all
of them offer.

A dense key's round t goes to slot ``t mod R`` of each of its chunks (docs/design.md §2.2):
the round's gradient (summed over the devices) is encoded by the tensor's codec
(:class:`kvstore_ext.codecs.TensorCodec`) into the slot's send buffer, and the wire sends it;
pulls are ordered behind every earlier round (§2.4). :class:`DenseWire` is what the wires
share; each wire (:mod:`~kvstore_ext.worker.wires.slots`,
:mod:`~kvstore_ext.worker.wires.pull_keys`, :mod:`~kvstore_ext.worker.wires.rows`) says
which keys pushes and pulls use, and owns their ordering in MXNet's engine and its per-tensor
state. A wire holds a pull strategy (:mod:`kvstore_ext.worker.wires.pulls`: exact pulls, or
compressed pulls at the scheduled rounds), which it calls at placement, init, before each
push and for a scheduled pull.
"""
import mxnet as mx
from mxnet import nd

from kvstore_ext.worker import ordering
from kvstore_ext.worker.finite import ALL_FINITE, FiniteFlag
from kvstore_ext.worker.wires.pulls import EXACT
from kvstore_ext.worker.store_errors import StoreTypeError

__all__ = ['KeyKind', 'DenseWire']


class KeyKind(object):
    """A kind of key's data path, chosen once per key at ``init``.

    Every kind has ``place(placement, key, value)`` (returns the key's tensor),
    ``init_entries(tensor, value)``, ``after_init(tensors)``, ``server_settings()``,
    ``push(tensor, grads, priority, factor=None, finite=ALL_FINITE)``, ``pull(tensor, outs,
    priority, ignore_sparse=True)``, ``row_sparse_pull(tensor, outs, row_ids, priority)``,
    ``send_buffer(tensor)`` and ``element_range(tensor, chunk)``; :meth:`send`,
    :meth:`initial_pull` and :meth:`pull_compressed` are defined here from them.

    Parameters
    ----------
    native : mxnet.kvstore.KVStore
        The worker's native distributed store.
    slots : int
        R, slot keys per chunk.
    codec : kvstore_ext.codecs.Codec
        The job's codec.
    """

    #: Whether the keys' rounds are the job's training rounds (flagged on the finish counter,
    #: padded at exit); not for aux keys (:class:`kvstore_ext.worker.aux_states.AuxKeys`).
    trained = True
    #: Whether :meth:`send` can send a round as one native ``pushpull`` per chunk
    #: (:class:`kvstore_ext.worker.wires.slots.ExchangeWire`).
    exchanges = False

    def __init__(self, native, slots, codec):
        self._native = native
        self._slots = slots
        self._codec = codec

    def close(self):
        """Drop the native store (the worker leaves the job)."""
        self._native = None

    def send(self, tensor, grads, outs, priority, factor=None, finite=ALL_FINITE,
             exchanged=False):  # pylint: disable=unused-argument
        """Send round ``tensor.next_round`` of `tensor` (the sum of `grads`, times `factor`,
        with the round's all-finite flag `finite`) and, if `outs` is given, pull the weights
        after it into `outs`: a push and a pull. `exchanged`: whether the workers send the
        round as pushpulls (a kind that :attr:`exchanges` does so)."""
        self.push(tensor, grads, priority, factor, finite)
        if outs is not None:
            self.pull(tensor, outs, priority)

    def initial_pull(self, tensor, value, outs, priority):
        """Right after the init of `tensor` with this worker's `value` (``broadcast``): the
        initial value into `outs`. Here a pull."""
        self.pull(tensor, outs, priority)

    def pull_compressed(self, tensor, outs, priority):
        """A pull at a round every worker pulls (``Rounds.pull_compressed``): here the
        exact :meth:`pull`, as without ``pull_compression``."""
        self.pull(tensor, outs, priority)

    def pull_held(self, tensor, priority):  # pylint: disable=unused-argument
        """A pull at a round every worker pulls into memory of the data path's own
        (``Rounds.pull_held``): returns the array of `tensor`'s shape that holds the weights
        once the pull has arrived, or None (here: this kind keeps no such memory; nothing
        is pulled)."""
        return None


class DenseWire(KeyKind):
    """What every wire of dense keys does: place a key with its codec's per-tensor object,
    encode a round into its slot buffer, pull the keys that pulls read, and call its pull
    strategy.

    A wire sets :attr:`pull_keys` and implements :meth:`_order_pull`; it may extend
    :meth:`_entries`, :meth:`_after_init`, :meth:`_before_push` and
    :meth:`order_after_pushes`.

    Parameters
    ----------
    native, slots, codec
        As :class:`KeyKind`.
    pulls : kvstore_ext.worker.wires.pulls.ExactPulls, optional
        The pull strategy: exact pulls (the default) or
        :class:`~kvstore_ext.worker.wires.pulls.CompressedPulls`.
    """

    #: Whether the chunks get float32 pull keys, which pulls read (else the slot keys).
    pull_keys = False
    #: Distinct send buffers of a tensor (None: one per slot, R; the native store holds a
    #: pushed buffer until the slot's next push, docs/design.md §2.3).
    send_buffers = None

    def __init__(self, native, slots, codec, pulls=EXACT):
        super(DenseWire, self).__init__(native, slots, codec)
        self._pulls = pulls

    def close(self):
        super(DenseWire, self).close()
        self._pulls.close()

    # -- init ----------------------------------------------------------------------------
    def place(self, placement, key, value):
        """Place `key` (initial `value`) with `placement`; its tensor gets the codec's
        per-tensor object, this data path and the pull strategy's state."""
        tensor = placement.place(key, value.shape, value.dtype, self.pull_keys,
                                 self._chunk_limit(key))
        tensor.codec = self._codec.for_tensor(tensor.size)
        tensor.kind = self
        self._pulls.place(tensor, value)
        return tensor

    def _chunk_limit(self, key):  # pylint: disable=unused-argument
        """A smaller largest chunk for `key`'s tensor, or None (the job's chunk size)."""
        return None

    def server_settings(self):
        """What the servers do with these keys' chunks (the codec's, in REGISTER)."""
        return self._codec.server_settings()

    def init_entries(self, tensor, value):
        """The native keys and initial values of `tensor` (initial `value`), the pull
        strategy's included, and the size of each chunk: ``(keys, values, sizes)``."""
        keys, values, sizes = self._entries(tensor, value)
        self._pulls.add_entries(tensor, keys, values)
        return keys, values, sizes

    def _entries(self, tensor, value):
        """The wire's own native keys and initial values: here each chunk's slot keys, with
        the chunk's initial value."""
        flat = value.reshape(-1)
        keys, values, sizes = [], [], []
        for chunk in tensor.chunks:
            chunk_value = flat[chunk.start:chunk.stop]
            keys.extend(chunk.keys)
            values.extend([chunk_value] * len(chunk.keys))
            sizes.append(int(chunk_value.size))
        return keys, values, sizes

    def after_init(self, tensors):
        """After the native init of `tensors` (collective): the wire's own step, then the
        pull strategy's."""
        self._after_init(tensors)
        self._pulls.after_init(self, tensors)

    def _after_init(self, tensors):
        """The wire's own step after the native init: nothing here."""

    def initial_pull(self, tensor, value, outs, priority):
        """Right after the init of `tensor` (``broadcast``): its initial value into `outs`,
        as the pull strategy gives it."""
        self._pulls.initial_pull(self, tensor, value, outs, priority)

    def exact_initial_pull(self, tensor, value, outs, priority):
        """The initial value of `tensor` into `outs`, exactly.

        The servers hold rank 0's `value` bit for bit (MXNet's native init pushes rank 0's
        value and no other), so rank 0 copies it instead of pulling it back: the first step
        then moves one copy of the model to each other worker, as stock ``dist_sync``'s
        broadcast does to every worker. An out of another dtype is pulled (the pull's own
        refusal or cast)."""
        if self._native.rank != 0 or any(o.dtype != value.dtype for o in outs):
            self.pull(tensor, outs, priority)
            return
        source = tensor.views_of(value)[2]
        for out in outs:
            if out.handle.value != value.handle.value:   # Gluon passes the value as an out
                source.copyto(tensor.views_of(out)[2])

    # -- push ----------------------------------------------------------------------------
    @classmethod
    def finite_flag(cls, codec, flag):  # pylint: disable=unused-argument
        """The object that carries AMP's all-finite `flag` (a one-element NDArray) in the
        pushes of this wire with `codec` (:class:`kvstore_ext.worker.finite.FiniteFlag`)."""
        return FiniteFlag(flag)

    def push(self, tensor, grads, priority, factor=None, finite=ALL_FINITE):
        """Push round ``tensor.next_round`` of `tensor`: the sum of `grads` (one array per
        device), times `factor` if given, encoded into the round's slot buffer, divided by
        the round's all-finite flag `finite` (:mod:`kvstore_ext.worker.finite`)."""
        slot = self._fill(tensor, grads, factor, finite)
        self._native.push([c.keys[slot] for c in tensor.chunks], tensor.chunk_views[slot],
                          priority=priority)
        tensor.next_round += 1

    def _fill(self, tensor, grads, factor, finite, ordered=False):
        """Encode the sum of `grads` (times `factor`, divided by `finite`) into the slot
        buffer of round ``tensor.next_round``; return the slot. `ordered`: first queue the
        buffer behind the completion of every earlier round (an exchange)."""
        rnd = tensor.next_round
        slot = rnd % self._slots
        if tensor.buffers is None:
            tensor.make_buffers(self._slots, mx.cpu() if grads[0].context.device_type == 'cpu'
                                else mx.cpu_pinned(), self._codec.wire_dtype,
                                self.send_buffers)
        buf = tensor.buffers[slot]
        self._pulls.before_push(tensor, slot)
        self._before_push(tensor, slot)
        if ordered:
            # Writes the buffer's first element, which the encode below then overwrites.
            self._order_pull(tensor, rnd)
        if len(grads) == 1:
            source = tensor.views_of(grads[0])[2]
        else:
            # Sum on the first device (a GPU stays a GPU), then one copy to the buffer.
            first = grads[0].context
            source = nd.add_n(*[tensor.views_of(g)[2].as_in_context(first) for g in grads])
        tensor.codec.encode(source, buf, factor)
        finite.divide(buf)
        return slot

    def _before_push(self, tensor, slot):
        """The wire's engine ordering before a push into `slot`: none here."""

    def send_buffer(self, tensor):
        """The buffer that the last push of `tensor` sends from."""
        return tensor.buffers[(tensor.next_round - 1) % self._slots]

    # -- pull ----------------------------------------------------------------------------
    def pull(self, tensor, outs, priority, ignore_sparse=True):  # pylint: disable=unused-argument
        """Pull into `outs` the weights of `tensor` after this worker's last pushed round."""
        last = tensor.next_round - 1
        if last >= 0:
            self._order_pull(tensor, last)
        per_chunk = list(zip(*[tensor.views_of(o)[1] for o in outs]))
        # The key that holds W_{last+1}: slot key last mod R, or pull key last mod P.
        self._native.pull([c.pull_keys[max(last, 0) % len(c.pull_keys)] for c in tensor.chunks],
                          out=[list(views) for views in per_chunk], priority=priority)
        if last >= 0:
            self._after_pull(tensor, last)
        tensor.last_pulled = last
        if last < 0:
            # Before the first push the native store pulls into a buffer of its own, which no
            # later push waits for: without this wait the request could reach the server after
            # this worker's round 0 completed, and return W_1 instead of the initial value.
            for out in outs:
                out.wait_to_read()

    def pull_compressed(self, tensor, outs, priority):
        """A pull at a round every worker pulls, as the pull strategy makes it."""
        self._pulls.pull_compressed(self, tensor, outs, priority)

    def pull_held(self, tensor, priority):
        """A pull at a round every worker pulls, as the pull strategy makes it, into memory
        the wire keeps anyway (no pull buffer of the caller's, docs/design.md §2.3): the
        pulled model ``x̂`` with compressed pulls, else :meth:`exact_pull_held`'s."""
        return self._pulls.pull_held(self, tensor, priority)

    def exact_pull_held(self, tensor, priority):
        """The exact :meth:`pull` of `tensor` after this worker's last pushed round t into
        the buffer the native store receives it in anyway (:meth:`_received_in`): MXNet's
        worker pulls a key into the array its last push of the key was sent from and then
        copies it into the outs, a copy it skips when an out is that array. Returns that
        buffer, shaped as `tensor`: it holds ``W_{t+1}`` until the next write on it, which
        MXNet's engine queues after every read issued before (the next push into the slot,
        R rounds later, or the tensor's next pull)."""
        held = self._received_in(tensor, max(tensor.next_round - 1, 0) % self._slots)
        held = held.reshape(tensor.shape)
        self.pull(tensor, [held], priority)
        return held

    def _received_in(self, tensor, slot):
        """The flat buffer the native store receives the pulls of `slot` in: here the slot's
        send buffer."""
        return tensor.buffers[slot]

    def _order_pull(self, tensor, last):
        """Queue the pull of round `last` behind the completion of every earlier round."""
        raise NotImplementedError

    def _after_pull(self, tensor, last):
        """The wire's engine ordering right after the pull of round `last` was queued: none
        here."""

    def order_after_pushes(self, tensor, last, targets):
        """Make the next write on each of `targets` (one-element arrays) wait until this
        worker's pushes of round `last` and of the earlier rounds no pull covers yet are
        acknowledged (a compressed pull's payloads): their send buffers are touched and read
        into each target."""
        rounds = list(self._earlier_rounds(tensor, last)) + [last]
        ordering.copy_after_pushes(targets, [tensor.heads[rnd % self._slots] for rnd in rounds])

    def _earlier_rounds(self, tensor, last):
        """The rounds before `last` that neither the previous pull nor the slot reuse orders."""
        return range(max(tensor.last_pulled, last - self._slots + 1, 0), last)

    def row_sparse_pull(self, tensor, outs, row_ids, priority):
        """Refused: `tensor` is dense."""
        raise StoreTypeError('row_sparse_pull of key %r, which was initialised dense; use '
                             'pull, or init the key with a row_sparse value' % (tensor.key,))

    # -- optimizer state -----------------------------------------------------------------
    @staticmethod
    def element_range(tensor, chunk):
        """Elements ``(start, stop)`` of the flattened `tensor` that `chunk` holds."""
        return chunk.start, chunk.stop
