"""The data path of dense keys: slot buffers, pushes through the tensor's codec, exact pulls.

A dense key's round t goes to slot ``t mod R`` of each of its chunks (docs/design.md §2.2):
the round's gradient (summed over the devices) is encoded by the tensor's codec
(:class:`kvstore_ext.codecs.TensorCodec`) into the slot's send buffer, and the native
store pushes the buffer's chunk views. Pulls read the slot keys and are ordered behind every
earlier round (§2.4); a codec with pull keys of its own (float16 pushes) uses the variant of
:mod:`kvstore_ext.codecs.fp16`.

:class:`DenseKeys` is chosen once per key, at ``init`` (:mod:`kvstore_ext.worker.dist_delay`), and
holds no per-key state: that lives in the key's :class:`kvstore_ext.worker.layout.Tensor`.
"""
import mxnet as mx
from mxnet import nd

from kvstore_ext.worker.store_errors import StoreTypeError

__all__ = ['KeyKind', 'DenseKeys']


class KeyKind(object):
    """A kind of key's data path (dense: :class:`DenseKeys`, row_sparse:
    :class:`kvstore_ext.worker.sparse.RowSparseKeys`), chosen once per key at ``init``.

    Every kind has ``place(placement, key, value)`` (returns the key's tensor),
    ``init_entries(tensor, value)``, ``after_init(tensors)``, ``server_settings()``,
    ``push(tensor, grads, priority, factor=None, finite=None)``, ``pull(tensor, outs,
    priority, ignore_sparse=True)``, ``initial_pull(tensor, value, outs, priority)``,
    ``row_sparse_pull(tensor, outs, row_ids, priority)``, ``send_buffer(tensor)`` and
    ``element_range(tensor, chunk)``. Where :attr:`exchanges`,
    also ``exchange(tensor, grads, outs, priority, factor=None, finite=None)``: the push and
    the pull of one round in one request (:class:`DenseKeys`).

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
    #: Whether rounds of these keys can go as one native ``pushpull`` (``exchange``).
    exchanges = False

    def __init__(self, native, slots, codec):
        self._native = native
        self._slots = slots
        self._codec = codec

    def close(self):
        """Drop the native store (the worker leaves the job)."""
        self._native = None

    def initial_pull(self, tensor, value, outs, priority):
        """Right after the init of `tensor` with this worker's `value` (``broadcast``): the
        initial value into `outs`. Here a pull."""
        self.pull(tensor, outs, priority)


class DenseKeys(KeyKind):
    """The data path of dense keys whose pulls read the slot keys.

    Without compression, :meth:`exchange` sends each chunk's round and receives its new
    weights in one native request (MXNet's ``pushpull``): :attr:`exchanges`, chosen once,
    here. With a codec a round is a push and a pull (MXNet refuses ``pushpull`` with its
    compression, and float16 pushes are pulled from other keys). Which rounds go as
    exchanges, on every worker alike, :class:`kvstore_ext.worker.dist_delay.DistDelay` decides.
    """

    def __init__(self, native, slots, codec):
        super(DenseKeys, self).__init__(native, slots, codec)
        self.exchanges = codec.type_name is None

    # -- init ----------------------------------------------------------------------------
    def place(self, placement, key, value):
        """Place `key` (initial `value`) with `placement`; its tensor gets the codec's
        per-tensor object and this data path."""
        tensor = placement.place(key, value.shape, value.dtype, self._codec.wire_dtype)
        tensor.codec = self._codec.for_tensor(tensor.size)
        tensor.kind = self
        return tensor

    def server_settings(self):
        """What the servers do with these keys' chunks (the codec's, in REGISTER)."""
        return self._codec.server_settings()

    def init_entries(self, tensor, value):
        """The native keys and initial values of `tensor` (initial `value`), and the size
        of each chunk: ``(keys, values, sizes)``."""
        flat = value.reshape(-1)
        keys, values, sizes = [], [], []
        for chunk in tensor.chunks:
            chunk_value = flat[chunk.start:chunk.stop]
            keys.extend(chunk.keys)
            values.extend([chunk_value] * len(chunk.keys))
            sizes.append(int(chunk_value.size))
        return keys, values, sizes

    def after_init(self, tensors):
        """After the native init of `tensors` (collective): nothing for these keys."""

    def initial_pull(self, tensor, value, outs, priority):
        """Right after the init of `tensor` (``broadcast``): its initial value into `outs`.

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
    def push(self, tensor, grads, priority, factor=None, finite=None):
        """Push round ``tensor.next_round`` of `tensor`: the sum of `grads` (one array per
        device), times `factor` if given, encoded into the round's slot buffer, divided by
        the one-element NDArray `finite` if given (``DistDelay.set_finite_flag``)."""
        slot = self._fill(tensor, grads, factor, finite)
        self._native.push([c.keys[slot] for c in tensor.chunks], tensor.chunk_views[slot],
                          priority=priority)
        tensor.next_round += 1

    def _fill(self, tensor, grads, factor, finite, ordered=False):
        """Encode the sum of `grads` (times `factor`, divided by `finite`) into the slot
        buffer of round ``tensor.next_round``; return the slot. `ordered`: first queue the
        buffer behind the completion of every earlier round (:meth:`exchange`)."""
        rnd = tensor.next_round
        slot = rnd % self._slots
        if tensor.buffers is None:
            tensor.make_buffers(self._slots, mx.cpu() if grads[0].context.device_type == 'cpu'
                                else mx.cpu_pinned())
        buf = tensor.buffers[slot]
        self._before_push(tensor, slot)
        if ordered:
            # Writes the buffer's first element, which the encode below then overwrites.
            self._order_after_earlier_rounds(tensor, rnd)
        if len(grads) == 1:
            source = tensor.views_of(grads[0])[2]
        else:
            # Sum on the first device (a GPU stays a GPU), then one copy to the buffer.
            first = grads[0].context
            source = nd.add_n(*[tensor.views_of(g)[2].as_in_context(first) for g in grads])
        tensor.codec.encode(source, buf, factor)
        if finite is not None:
            # In place, after the copy: x / 1 is x bit for bit; x / 0 is inf or nan for
            # every x (docs/design.md §11). The push waits in MXNet's engine for the flag,
            # i.e. for the end of backward.
            nd.broadcast_div(buf, finite.as_in_context(buf.context), out=buf)
        return slot

    def exchange(self, tensor, grads, outs, priority, factor=None, finite=None):
        """Push round t = ``tensor.next_round`` of `tensor` and receive ``W_{t+1}`` into
        `outs` with one native ``pushpull`` per chunk (the server answers the push with the
        chunk's weights once it has applied the round).

        A separate pull is a request that travels behind this worker's later pushes on its
        link to the server; the answer of a pushpull leaves as soon as the round is applied,
        while other chunks' pushes still arrive: on full-duplex links the pulls of early
        chunks overlap the pushes of later ones, as stock ``dist_sync`` does
        (docs/design.md §8).

        The server's answer is the slot's stored value when the round completes, exactly
        ``W_{t+1}`` only if no earlier round is still missing then (a held round's slot is
        written later, §3.2). So the push is sent only once this worker's earlier rounds are
        acknowledged (:meth:`_order_after_earlier_rounds`, queued before the encode): the
        round then completes after every earlier one and is applied at once.

        MXNet's engine serialises operations that write one variable, and a pushpull
        writes its buffer: chunks 1.. of a split tensor are sent from buffers of their own
        (``tensor.exchange``, one copy of the chunk each), so that its chunks travel side by
        side as separate pushes do. The next round's copy into them waits for their
        pushpull; every later pull or pushpull also orders behind them
        (:meth:`_order_after_earlier_rounds`).
        """
        rnd = tensor.next_round
        slot = self._fill(tensor, grads, factor, finite, ordered=True)
        views = tensor.chunk_views[slot]
        if len(views) > 1 and tensor.exchange is None:
            tensor.exchange = [nd.zeros_like(v) for v in views[1:]]
        sends = list(views[:1])
        for view, own in zip(views[1:], tensor.exchange or ()):
            view.copyto(own)
            sends.append(own)
        per_chunk = list(zip(*[tensor.views_of(o)[1] for o in outs]))
        self._native.pushpull([c.keys[slot] for c in tensor.chunks], sends,
                              out=[list(v) for v in per_chunk], priority=priority)
        tensor.next_round = rnd + 1
        tensor.last_pulled = rnd

    def _before_push(self, tensor, slot):
        """Engine ordering before a push into `slot` (none here: the pull of the slot's
        previous round wrote the same buffer)."""

    def send_buffer(self, tensor):
        """The buffer that the last push of `tensor` sends from."""
        return tensor.buffers[(tensor.next_round - 1) % self._slots]

    # -- pull ----------------------------------------------------------------------------
    def pull(self, tensor, outs, priority, ignore_sparse=True):
        """Pull into `outs` the weights of `tensor` after this worker's last pushed round."""
        last = tensor.next_round - 1
        slot = max(last, 0) % self._slots
        if last >= 0:
            self._order_after_earlier_rounds(tensor, last)
        per_chunk = list(zip(*[tensor.views_of(o)[1] for o in outs]))
        self._native.pull([c.pull_keys[slot] for c in tensor.chunks],
                          out=[list(views) for views in per_chunk], priority=priority)
        tensor.last_pulled = last
        if last < 0:
            # Before the first push the native store pulls into a buffer of its own, which no
            # later push waits for: without this wait the request could reach the server after
            # this worker's round 0 completed, and return W_1 instead of the initial value.
            for out in outs:
                out.wait_to_read()

    def _order_after_earlier_rounds(self, tensor, last):
        """Queue the pull of round `last` behind the completion of every earlier round.

        A one-element write on another slot's buffer runs only after that slot's push is
        acknowledged (its round complete); the following write on this slot's buffer then
        orders the pull (which writes the same buffer) after it. Rounds up to the previous
        pull are covered by that pull (touching its slot waits for it), rounds more than a
        slack back by the reuse of their slot. The touched elements hold pushed data that is
        no longer needed, and the pull overwrites this slot's buffer.
        """
        target = tensor.heads[last % self._slots]
        heads = [tensor.heads[rnd % self._slots] for rnd in self._earlier_rounds(tensor, last)]
        # Chunks 1.. of exchanged rounds travelled in buffers of their own (exchange); each
        # holds its last round. Ordered here, once that round is (nearly always) complete:
        # a write queued right behind a pushpull in flight held back the next tensor's
        # pushpulls until it ended (measured at 100 Mbit/s: 2.1 instead of 1.9 s/step).
        heads += [own[0:1] for own in tensor.exchange or ()]
        for head in heads:
            nd._internal._plus_scalar(head, scalar=0.0, out=head)  # pylint: disable=protected-access
            nd.elemwise_add(target, head, out=target)

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
