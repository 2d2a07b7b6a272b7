"""A worker's rounds: the store's ``rounds`` part (``DistDelay.delayed.rounds``).

Every push of a trained key is this worker's next round of it (docs/design.md §2.2). This
part sends the rounds of ``DistDelay.push`` and ``pushpull``, and those of the delayed
update's synchronous steps (:meth:`Rounds.exchange`, without the store's per-call checks),
flagged on the finish counter (§5) before a round's first push, scaled by this worker's own
batch size (:meth:`Rounds.scale_gradients`) and divided by AMP's all-finite flag
(:meth:`Rounds.set_finite_flag`, §11); and it offers the delayed update what it needs of
them: compressed pulls (§2.12), the global overflow flags, what a push sent, its send
buffer, and how many rounds a key has had.
"""
from mxnet import nd

from kvstore_ext.checks import ArgumentTypeError, check_real
from kvstore_ext.worker import wires
from kvstore_ext.worker.arguments import describe, listed
from kvstore_ext.worker.finite import ALL_FINITE

__all__ = ['Rounds']


class Rounds(object):
    """This worker's rounds on `session` (:class:`kvstore_ext.worker.session.Session`)."""

    def __init__(self, session):
        self._session = session
        # Gradient scaling (scale_gradients): this worker's rescale_grad; the job's, which
        # the servers apply, is the session's.
        self._rescale_grad = None
        self._finite = {}          # {round: its all-finite flag's object} (set_finite_flag)
        # Whether this worker's last push or pushpull of a key that can be exchanged was a
        # pushpull: how a round whose first key cannot be exchanged is flagged (_next_round).
        self._asked_exchange = False

    def send_next(self, key, grads, outs, priority, exchange):
        """Send this worker's next round of `key` (the sum of `grads`, one array per device)
        and, if `outs` is given, pull the weights after it into `outs`; `exchange`: the caller
        is ``pushpull``. `key` is checked (``Session.checked_lists``)."""
        tensor, finite = self._next_round(key, exchange)
        self.send(tensor, grads, outs, priority, self._gradient_factor(), finite)

    def exchange(self, key, grad, out, priority):
        """A synchronous step's round of a trained tensor: push `grad` (one array, this
        worker's sum over its devices) and pull the weights after it into `out` (one array
        per device) in one request per chunk, as ``DistDelay.pushpull`` without its argument
        checks (the delayed update's keys and arrays are right by construction; docs/design.md
        §8)."""
        self.send_next(key, [grad], out, priority, exchange=True)

    def push_then_pull_compressed(self, key, grad, out, priority):
        """:meth:`exchange` with compressed pulls: the round as ``DistDelay.push`` (without
        its checks), then :meth:`pull_compressed` of the same round (docs/design.md §2.12)."""
        self.send_next(key, [grad], None, priority, exchange=False)
        self.pull_compressed(key, out=out, priority=priority)

    def _next_round(self, key, exchange):
        """`key`'s tensor and the all-finite flag of its next round, flagged on the finish
        counter ("this worker has data", once per round) before the round's first push.
        `exchange`: whether the caller asks for a pushpull, which flags the round as
        exchanged if this is its first key, and any later round whose first key cannot be
        exchanged (row_sparse, or with a codec).

        Raises
        ------
        ValueError
            If `key` holds aux states (``average`` them).
        """
        tensor = self._session.tensors[key]
        if not tensor.kind.trained:
            raise ValueError('key %r holds aux states (a Parameter with differentiable=False, '
                             'e.g. BatchNorm\'s running mean), which are averaged, not pushed: '
                             'use average(), or trainer.sync_weights(aux_states=True)' % (key,))
        if tensor.kind.exchanges:
            self._asked_exchange = exchange
        finite = self._finite.get(tensor.next_round, ALL_FINITE)
        finish = self._session.finish
        if finish is not None:
            finish.flag_round(tensor.next_round, finite, self._asked_exchange)
        return tensor, finite

    def send(self, tensor, grads, outs, priority, factor=None, finite=ALL_FINITE):
        """Send round ``tensor.next_round`` of `tensor` (the sum of `grads`, times `factor`,
        divided by the all-finite flag `finite`) and, if `outs` is given, pull the weights
        after it into `outs`.

        MXNet's server answers only the pushpulls of a round that has one and leaves its
        plain pushes unanswered for ever (``ApplyUpdates`` of kvstore_dist_server.h), so
        every worker sends a round alike, as this worker's round is flagged
        (:attr:`FinishCounter.exchanged <kvstore_ext.worker.finish.FinishCounter.exchanged>`,
        also after a vote, docs/design.md §5): keys that can be exchanged go as one pushpull
        per chunk (without `outs` into an array of the tensor's own, whose weights nobody
        reads) or else as a push and a pull.
        """
        tensor.kind.send(tensor, grads, outs, priority, factor, finite,
                         self._session.finish.exchanged)

    def set_finite_flag(self, flag):
        """Mark this worker's next round with its all-finite flag (AMP, docs/design.md §11).

        Every push of the round is divided by `flag`: unchanged for 1 (exact), inf or nan
        everywhere for 0, so that the servers skip the round on every chunk; the finish
        counter carries the flag to every worker (:meth:`overflows`). Call it before the
        round's first push.

        Parameters
        ----------
        flag : NDArray
            One element, 1 if every gradient of the round is finite, else 0 (e.g. from
            ``nd.multi_all_finite``, still being computed in MXNet's engine).

        Raises
        ------
        ValueError
            If the codec's pushes cannot carry the flag (one row per worker: the blockwise
            codecs; the trainers refuse AMP with any compression when they create the store).
        """
        if not isinstance(flag, nd.NDArray) or flag.size != 1:
            raise ArgumentTypeError('flag must be a one-element NDArray (1: all finite, 0: '
                                    'overflow), got %s' % describe(flag))
        finish = self._session.finish
        self._finite = {finish.flagged_rounds if finish else 0:
                        wires.finite_flag(self._session.settings.codec, flag)}

    def pull_overflows(self):
        """Issue a pull of the overflow marks of the last R rounds this worker pushed;
        returns at once (:meth:`overflows` waits for it)."""
        self._session.finish.pull_marks()

    def overflows(self, rounds):
        """How many workers overflowed (:meth:`set_finite_flag` 0) in each of `rounds`:
        rounds at most ``slack`` before the one of the last :meth:`pull_overflows`, which
        this waits for."""
        return self._session.finish.overflows(rounds)

    def scale_gradients(self, rescale_grad):
        """Scale this worker's gradients by its own `rescale_grad` (1/its batch size).

        The servers apply one ``rescale_grad`` to the sum of a round's gradients: the job's,
        worker 0's at the hand-shake. A worker whose ``rescale_grad`` differs (another batch
        size, a smaller last batch, or a worker that has not stepped yet) multiplies its
        pushes by ``rescale_grad / job's``, so that each gradient is scaled by its own batch
        size, without a command and without changing the other workers' scaling. With the
        same value (the common case) gradients are pushed unchanged.

        Parameters
        ----------
        rescale_grad : float
            This worker's ``rescale_grad`` for the following pushes.
        """
        self._rescale_grad = check_real('rescale_grad', rescale_grad, minimum=0,
                                        min_inclusive=False, fix='pass 1/batch_size')

    def _gradient_factor(self):
        job = self._session.job_rescale_grad
        if self._rescale_grad is None or not job:
            return None
        factor = self._rescale_grad / job
        return None if factor == 1.0 else factor

    def pull_compressed(self, key, out=None, priority=0):
        """Pull the weights after this worker's last pushed round t, compressed, into `out`.

        Round t must be one that every worker pulls (``settings.set_pull_compression``);
        `out` then holds this worker's x̂ after round t: the same bits on every worker, and
        W up to what the compression has not sent yet (docs/design.md §2.12). Without
        pull_compression this is ``DistDelay.pull``.

        Raises
        ------
        ValueError
            If round t is not pulled by every worker, or this worker skipped an earlier
            pulled round.
        """
        if out is None:
            raise ArgumentTypeError('pull_compressed needs out=: the NDArray (or list of '
                                    'NDArrays) to receive the weights of key %r' % (key,))
        keys, outs = self._session.checked_lists(key, out, 'out', priority)
        for k, o in zip(keys, outs):
            tensor = self._session.tensors[k]
            tensor.kind.pull_compressed(tensor, listed(o), priority)

    def pull_held(self, key, priority=0):
        """A pull at a round every worker pulls (compressed with ``pull_compression``, as
        :meth:`pull_compressed`; else exact, as ``DistDelay.pull``) of `key` after this
        worker's last pushed round t, into memory the store keeps anyway: the pulled model
        x̂, or the buffer the native store receives the pull in (docs/design.md §2.3).

        Returns an array of the key's shape that holds the weights once the pull has arrived
        (read it through MXNet's engine, never write it), valid until the key's next pull or
        its next push into the same slot (R rounds later); or None, having pulled nothing,
        for a key whose data path keeps no such memory (row_sparse and aux keys): pull into
        an array of your own then.
        """
        tensor = self._session.tensor(key)
        return tensor.kind.pull_held(tensor, priority)

    def send_buffer(self, key):
        """The buffer that this worker's last push of `key` sends from (held by the push until
        its round is acknowledged; for :mod:`mxdelay.timeline`). For a row_sparse key: the
        gradient handed to the native store, held until the store has copied it."""
        tensor = self._session.tensor(key)
        return tensor.kind.send_buffer(tensor)

    def sent_gradient(self, key, grad):
        """What this worker's last push of `key` sent, in the units of its gradient `grad`
        (the array it pushed), shaped and placed like it: the quantized values divided by the
        push's batch-size factor, if any; with float16 pushes ``float32(float16(grad))``. With
        compression this is the ``g`` of the local rule (docs/design.md §1.4).

        Where the send buffer holds exactly that (2bit, no factor, on `grad`'s device) the
        result is the buffer itself, reshaped: read it before the key's next push into the
        same slot (R rounds later), never write it. Otherwise it is an array of this store's
        own, rewritten by the next call for `key`: the send buffer cast back to float32, not
        a second cast of `grad` (a float32-to-float16 cast costs several copies, docs/design.md
        §2.11)."""
        return self._session.tensor(key).codec.sent(
            self.send_buffer(key).reshape(grad.shape), grad)

    def rounds(self, key):
        """Number of rounds of `key` this worker has pushed."""
        return self._session.tensor(key).next_round
