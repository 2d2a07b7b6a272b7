"""The worker's side of compressed pulls (``pull_compression``, docs/design.md §2.12).

Every chunk gets one float32 *model key*, whose bytes are the payload the servers write at a
pulled round (:mod:`kvstore_ext.codecs.pulls`); the worker reads them through an NDArray of
the codec's dtype over the same memory (:class:`Payload`), decodes them in MXNet's engine and
adds them to its ``x̂``, bit for bit the servers' (:class:`PulledModel`, mixed into a dense
keys' data path: :class:`PullModelDense` here, and the variants of
:mod:`kvstore_ext.worker.float16_keys` and :mod:`kvstore_ext.worker.row_keys`).
"""
import numpy as np
from mxnet import nd

from kvstore_ext.worker.dense import DenseKeys

__all__ = ['Payload', 'PulledModel', 'PullModelDense']


# -- the worker ------------------------------------------------------------------------------
class Payload(object):
    """One chunk's receive buffer on the worker: ``payload`` (float32, what the pull writes)
    and ``alias`` (the codec's dtype over the same memory).

    The two NDArrays are separate variables of MXNet's engine, so the reads are ordered by
    hand: after the pull, a write of the alias's first element that reads the payload's
    header (the decode then follows it); after the decode, a write of the payload's header
    that reads the decoded model (the next pull follows it)."""

    def __init__(self, codec, n):
        self.codec, self.n = codec, n
        size = codec.payload_size(n)
        self._memory = np.zeros(size * 4, dtype=np.uint8)
        self.payload = nd.from_numpy(self._memory.view(np.float32), zero_copy=True)
        self.alias = nd.from_numpy(self._memory.view(codec.alias_dtype), zero_copy=True)
        self.head = self.payload[0:1]
        self._scratch = codec.scratch(n)

    def decode_into(self, model):
        """``model += dec(q)`` for the payload just pulled (in MXNet's engine)."""
        self.head.copyto(self.alias[0:1])                 # after the pull
        dec = self.codec.decode(self.payload, self.alias, self._scratch, self.n)
        nd.elemwise_add(model, dec, out=model)
        model[0:1].copyto(self.head)                      # the next pull after the decode


class PulledModel(object):
    """The worker's side of compressed pulls, mixed into a dense keys' data path (before it in
    the bases): a model key per chunk, whose scheduled pulls (:meth:`pull_compressed`) bring
    ``x̂``; :meth:`pull` stays the data path's own, exact (the slot keys, or with float16
    pushes the pull keys, hold W).

    The data path's hooks are extended, not replaced: every method calls the next class's
    (:class:`PullModelDense` over :class:`kvstore_ext.worker.dense.DenseKeys`,
    :class:`kvstore_ext.worker.float16_keys.PullKeyModelDense` over float16 pushes' pull keys).

    Parameters
    ----------
    native, slots, codec
        As :class:`kvstore_ext.worker.dense.DenseKeys`.
    pull_codec : PullCodec
    schedule : PullSchedule
    """

    def __init__(self, native, slots, codec, pull_codec, schedule):
        super(PulledModel, self).__init__(native, slots, codec)
        self.pull_codec = pull_codec
        self.schedule = schedule

    def place(self, placement, key, value):
        tensor = super(PulledModel, self).place(placement, key, value)
        tensor.model = nd.zeros(tensor.size, dtype=np.float32)
        if self._native.rank == 0:
            # x̂ = W_0, which is rank 0's value bit for bit (MXNet's init pushes rank 0's):
            # rank 0 keeps a copy instead of pulling it back (after_init).
            value.reshape(-1).copyto(tensor.model)
        tensor.payloads = [Payload(self.pull_codec, c.stop - c.start) for c in tensor.chunks]
        tensor.model_round = -1
        tensor.model_pending = False
        return tensor

    def init_entries(self, tensor, value):
        keys, values, sizes = super(PulledModel, self).init_entries(tensor, value)
        for chunk, payload in zip(tensor.chunks, tensor.payloads):
            keys.append(chunk.model_key)
            values.append(nd.zeros(payload.payload.size, dtype=np.float32))
        return keys, values, sizes

    def after_init(self, tensors):
        """Collective: the data path's own (float16 pushes: the pull keys' round of zeros),
        then one round of zeros into the model keys (the servers keep their stored arrays
        from it), waited for; then each tensor's ``x̂`` := W_0, an exact pull on every
        worker but rank 0, which copied its own value at :meth:`place`."""
        super(PulledModel, self).after_init(tensors)
        keys, views = [], []
        for tensor in tensors:
            for chunk, payload in zip(tensor.chunks, tensor.payloads):
                keys.append(chunk.model_key)
                views.append(payload.payload)
        if keys:
            self._native.push(keys, views)
            for tensor in tensors:
                for payload in tensor.payloads:
                    # A write waits for the push that reads the buffer to be acknowledged.
                    nd._internal._plus_scalar(payload.head, scalar=0.0, out=payload.head)  # pylint: disable=protected-access
                    payload.head.wait_to_read()
        if self._native.rank != 0:
            for tensor in tensors:
                self.pull(tensor, [tensor.model], 0)   # before any push: W_0, waited for

    def initial_pull(self, tensor, value, outs, priority):
        """``broadcast``'s initial value: ``x̂``, which is W_0 (:meth:`after_init`), copied
        into `outs`; no second transfer."""
        if any(out.dtype != tensor.model.dtype for out in outs):
            super(PulledModel, self).initial_pull(tensor, value, outs, priority)
            return
        for out in outs:
            tensor.model.copyto(tensor.views_of(out)[2])

    def _before_push(self, tensor, slot):
        if tensor.model_pending:
            # The server overwrites the model key at the next pulled round; that round needs
            # this push, which must therefore wait for the last compressed pull to return.
            for payload in tensor.payloads:
                payload.head.copyto(tensor.heads[slot])   # float16 send buffers: a cast
            tensor.model_pending = False
        super(PulledModel, self)._before_push(tensor, slot)

    def pull_compressed(self, tensor, outs, priority):
        """Pull round ``tensor.next_round - 1``'s payload, advance ``x̂`` and copy it into
        `outs` (the worker's pulled weights).

        Raises
        ------
        ValueError
            If that round is not pulled by every worker, or an earlier pulled round was not
            pulled through here (``x̂`` would differ from the servers').
        """
        last = tensor.next_round - 1
        schedule = self.schedule
        if not schedule.pulled(last):
            raise ValueError(
                'pull_compressed of key %r after round %d: with pull_compression the servers '
                'send a compressed pull only at rounds every worker pulls (every round up to '
                'warmup_steps=%d, then every delay=%d-th); use pull() for the exact weights'
                % (tensor.key, last, schedule.warmup_steps, schedule.delay))
        if tensor.model_round != schedule.previous(last):
            raise ValueError(
                'pull_compressed of key %r after round %d: the compressed pull of round %d was '
                'skipped (this worker last pulled round %d compressed), so its pulled model '
                'differs from the servers\'; pull every pulled round through pull_compressed'
                % (tensor.key, last, schedule.previous(last), tensor.model_round))
        self._order_payloads(tensor, last)
        self._native.pull([c.model_key for c in tensor.chunks],
                          out=[p.payload for p in tensor.payloads], priority=priority)
        for chunk, payload in zip(tensor.chunks, tensor.payloads):
            payload.decode_into(tensor.model[chunk.start:chunk.stop])
        for out in outs:
            tensor.model.copyto(tensor.views_of(out)[2])
        tensor.last_pulled = tensor.model_round = last
        tensor.model_pending = True

    def _order_payloads(self, tensor, last):
        # As DenseKeys._order_after_earlier_rounds, into the payloads: each send buffer of
        # round `last` and of the earlier rounds not yet covered is touched (a write, which
        # waits for its push's acknowledgement) and read into every payload's header.
        for rnd in list(self._earlier_rounds(tensor, last)) + [last]:
            head = tensor.heads[rnd % self._slots]
            nd._internal._plus_scalar(head, scalar=0.0, out=head)  # pylint: disable=protected-access
            for payload in tensor.payloads:
                head.copyto(payload.head)

    @staticmethod
    def state(tensor):
        """What a checkpoint keeps of `tensor`'s pulled model: ``(x̂, its round)``."""
        return tensor.model.asnumpy(), tensor.model_round

    @staticmethod
    def load_state(tensor, state):
        """Restore :meth:`state`'s value."""
        model, model_round = state
        if np.size(model) != tensor.size:
            raise ValueError('pulled model of key %r has %d elements, the key %d'
                             % (tensor.key, np.size(model), tensor.size))
        tensor.model[:] = np.asarray(model, dtype=np.float32).reshape(-1)
        tensor.model_round = int(model_round)
        tensor.model_pending = False


class PullModelDense(PulledModel, DenseKeys):
    """Dense keys whose pulls read the slot keys, with compressed pulls (:class:`PulledModel`;
    float16 pushes: :class:`kvstore_ext.worker.float16_keys.PullKeyModelDense`)."""
