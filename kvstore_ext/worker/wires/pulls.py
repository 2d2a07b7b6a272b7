"""The pulls of a dense keys' wire: exact, or compressed at the scheduled rounds
(``pull_compression``, docs/design.md §2.12).

A wire (:mod:`kvstore_ext.worker.wires`) holds one pull strategy, chosen once at the
hand-shake, which it calls at placement, init, before each push and for a scheduled pull
(``Rounds.pull_compressed``):

- :data:`EXACT` (:class:`ExactPulls`): a scheduled pull is the wire's exact pull;
- :class:`CompressedPulls` (a :class:`~kvstore_ext.codecs.pulls.PullCodec` and the pulled
  rounds' :class:`~kvstore_ext.protocol.schedule.PullSchedule`): every chunk gets one
  float32 *model key*, whose bytes are the payload the servers write at a pulled round
  (:mod:`kvstore_ext.codecs.pulls`); the worker reads them through an NDArray of the codec's
  dtype over the same memory (:class:`Payload`), decodes them in MXNet's engine and adds
  them to its ``x̂``, bit for bit the servers' (:class:`PulledModel`, the tensor's
  ``pull_state``). Exact pulls stay the wire's own.
"""
import numpy as np
from mxnet import nd

from kvstore_ext.worker import ordering

__all__ = ['Payload', 'PulledModel', 'ExactPulls', 'CompressedPulls', 'EXACT']


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
        ordering.follow(self.alias[0:1], self.head)                 # after the pull
        dec = self.codec.decode(self.payload, self.alias, self._scratch, self.n)
        nd.elemwise_add(model, dec, out=model)
        ordering.follow(self.head, model[0:1])      # the next pull after the decode


class PulledModel(object):
    """A tensor's side of compressed pulls: its pulled model ``x̂`` (float32, flat), one
    :class:`Payload` per chunk, the last round pulled compressed (``round``) and whether a
    push must still wait for that pull (``pending``).

    Parameters
    ----------
    tensor : kvstore_ext.worker.layout.Tensor
    codec : kvstore_ext.codecs.pulls.PullCodec
    """
    __slots__ = ('model', 'payloads', 'round', 'pending')

    def __init__(self, tensor, codec):
        self.model = nd.zeros(tensor.size, dtype=np.float32)
        self.payloads = [Payload(codec, c.stop - c.start) for c in tensor.chunks]
        self.round = -1
        self.pending = False

    def state(self):
        """What a checkpoint keeps: ``(x̂, its round)``."""
        return self.model.asnumpy(), self.round

    def load(self, key, state):
        """Restore :meth:`state`'s value (of the tensor of `key`, for messages).

        Raises
        ------
        ValueError
            If the saved model has another number of elements."""
        model, model_round = state
        if np.size(model) != self.model.size:
            raise ValueError('pulled model of key %r has %d elements, the key %d'
                             % (key, np.size(model), self.model.size))
        self.model[:] = np.asarray(model, dtype=np.float32).reshape(-1)
        self.round = int(model_round)
        self.pending = False


class ExactPulls(object):
    """No compressed pulls: a scheduled pull is the wire's exact pull, and nothing else
    changes (no model key, no per-tensor state)."""

    def close(self):
        """Drop the native store (the worker leaves the job)."""

    def place(self, tensor, value):
        """A tensor was placed (initial `value`): its state."""

    def add_entries(self, tensor, keys, values):
        """Add `tensor`'s native keys and their initial values to `keys` and `values`."""

    def after_init(self, wire, tensors):
        """After the native init of `tensors` and `wire`'s own step (collective)."""

    @staticmethod
    def initial_pull(wire, tensor, value, outs, priority):
        """``broadcast``'s initial value into `outs`: `wire`'s exact one."""
        wire.exact_initial_pull(tensor, value, outs, priority)

    def before_push(self, tensor, slot):
        """Engine ordering before a push of `tensor` into `slot`: none."""

    @staticmethod
    def pull_compressed(wire, tensor, outs, priority):
        """A scheduled pull: `wire`'s exact pull."""
        wire.pull(tensor, outs, priority)

    @staticmethod
    def pull_held(wire, tensor, priority):
        """A scheduled pull into memory `wire` keeps: its exact one, in its receive buffer."""
        return wire.exact_pull_held(tensor, priority)


#: Exact pulls (one object serves every wire: it keeps nothing).
EXACT = ExactPulls()


class CompressedPulls(ExactPulls):
    """Compressed pulls: a model key per chunk, whose scheduled pulls (:meth:`pull_compressed`)
    bring ``x̂``; the wire's exact pulls read the keys that hold W (the slot keys, or the pull
    keys).

    Parameters
    ----------
    native : mxnet.kvstore.KVStore
        The worker's native distributed store.
    codec : kvstore_ext.codecs.pulls.PullCodec
    schedule : kvstore_ext.protocol.schedule.PullSchedule
    """

    def __init__(self, native, codec, schedule):
        self._native = native
        self.codec = codec
        self.schedule = schedule

    def close(self):
        self._native = None

    def place(self, tensor, value):
        tensor.pull_state = PulledModel(tensor, self.codec)
        if self._native.rank == 0:
            # x̂ = W_0, which is rank 0's value bit for bit (MXNet's init pushes rank 0's):
            # rank 0 keeps a copy instead of pulling it back (after_init).
            value.reshape(-1).copyto(tensor.pull_state.model)

    def add_entries(self, tensor, keys, values):
        for chunk, payload in zip(tensor.chunks, tensor.pull_state.payloads):
            keys.append(chunk.model_key)
            values.append(nd.zeros(payload.payload.size, dtype=np.float32))

    def after_init(self, wire, tensors):
        """One round of zeros into the model keys (the servers keep their stored arrays from
        it), waited for; then each tensor's ``x̂`` := W_0, an exact pull on every worker but
        rank 0, which copied its own value at :meth:`place`."""
        keys, views = [], []
        for tensor in tensors:
            for chunk, payload in zip(tensor.chunks, tensor.pull_state.payloads):
                keys.append(chunk.model_key)
                views.append(payload.payload)
        if keys:
            self._native.push(keys, views)
            for tensor in tensors:
                ordering.wait_for_pushes([p.head for p in tensor.pull_state.payloads])
        if self._native.rank != 0:
            for tensor in tensors:
                wire.pull(tensor, [tensor.pull_state.model], 0)   # before any push: W_0

    @staticmethod
    def initial_pull(wire, tensor, value, outs, priority):
        """``broadcast``'s initial value: ``x̂``, which is W_0 (:meth:`after_init`), copied
        into `outs`; no second transfer."""
        model = tensor.pull_state.model
        if any(out.dtype != model.dtype for out in outs):
            wire.exact_initial_pull(tensor, value, outs, priority)
            return
        for out in outs:
            model.copyto(tensor.views_of(out)[2])

    def before_push(self, tensor, slot):
        state = tensor.pull_state
        if state.pending:
            # The server overwrites the model key at the next pulled round; that round needs
            # this push, which must therefore wait for the last compressed pull to return.
            for payload in state.payloads:
                ordering.follow(tensor.heads[slot], payload.head)   # float16 buffers: a cast
            state.pending = False

    def pull_compressed(self, wire, tensor, outs, priority):
        """Pull round ``tensor.next_round - 1``'s payload, advance ``x̂`` and copy it into
        `outs` (the worker's pulled weights).

        Raises
        ------
        ValueError
            If that round is not pulled by every worker, or an earlier pulled round was not
            pulled through here (``x̂`` would differ from the servers').
        """
        last = tensor.next_round - 1
        schedule, state = self.schedule, tensor.pull_state
        if not schedule.pulled(last):
            raise ValueError(
                'pull_compressed of key %r after round %d: with pull_compression the servers '
                'send a compressed pull only at rounds every worker pulls (every round up to '
                'warmup_steps=%d, then every delay=%d-th); use pull() for the exact weights'
                % (tensor.key, last, schedule.warmup_steps, schedule.delay))
        if state.round != schedule.previous(last):
            raise ValueError(
                'pull_compressed of key %r after round %d: the compressed pull of round %d was '
                'skipped (this worker last pulled round %d compressed), so its pulled model '
                'differs from the servers\'; pull every pulled round through pull_compressed'
                % (tensor.key, last, schedule.previous(last), state.round))
        # Behind the pushes of round `last` and the earlier rounds not yet covered, as an
        # exact pull is, into every payload's header.
        wire.order_after_pushes(tensor, last, [payload.head for payload in state.payloads])
        self._native.pull([c.model_key for c in tensor.chunks],
                          out=[p.payload for p in state.payloads], priority=priority)
        for chunk, payload in zip(tensor.chunks, state.payloads):
            payload.decode_into(state.model[chunk.start:chunk.stop])
        for out in outs:
            state.model.copyto(tensor.views_of(out)[2])
        tensor.last_pulled = state.round = last
        state.pending = True

    def pull_held(self, wire, tensor, priority):
        """A scheduled pull (:meth:`pull_compressed`) without a copy: returns ``x̂``, shaped
        as `tensor`, which holds the pulled weights until the next compressed pull."""
        self.pull_compressed(wire, tensor, [], priority)
        return tensor.pull_state.model.reshape(tensor.shape)
