"""AMP dynamic loss scaling driven by the global overflow flag of each round.

``mxnet.contrib.amp.init_trainer(trainer)`` gives a trainer a
``mxnet.contrib.amp.LossScaler``; ``gluon.Trainer`` advances it in ``_update`` with the
overflow of this worker's gradients and skips the step on overflow. ``DelayedTrainer``
never runs ``_update``; this module drives the same scaler with the *global* flag of each
round instead (any worker overflowed), so that every worker's loss scale follows the same
sequence (docs/design.md §11):

- :func:`finite_flag`: this worker's all-finite flag of a step, computed in MXNet's engine;
- :func:`advance`: Gluon's rule for one round;
- :class:`GlobalOverflows`: which rounds have been applied to the scaler, and how many of
  them were skipped;
- the trainer's AMP policy, chosen once when its kvstore is created (:func:`amp_policy`):
  :class:`NoAmp` (every hook does nothing) or :class:`LossScaledAmp` (the hooks above, at
  the points of the step where docs/design.md §11 needs them).
"""
from mxnet import nd

__all__ = ['finite_flag', 'advance', 'GlobalOverflows', 'scaler_state', 'restore_scaler',
           'amp_policy', 'NoAmp', 'LossScaledAmp']

#: Arrays per ``multi_all_finite`` call (Gluon's LossScaler uses the same chunking).
_ARRAYS_PER_CALL = 200


def finite_flag(grads):
    """A one-element NDArray: 1 if every element of every array of `grads` is finite, else 0.

    Queued in MXNet's engine; nothing waits for it here.
    """
    flag = nd.ones((1,), ctx=grads[0].context)
    for first in range(0, len(grads), _ARRAYS_PER_CALL):
        part = grads[first:first + _ARRAYS_PER_CALL]
        nd.multi_all_finite(*part, num_arrays=len(part), init_output=False, out=flag)
    return flag


def advance(scaler, overflow):
    """Advance `scaler` (a ``mxnet.contrib.amp.LossScaler``) by one round, as
    ``LossScaler.has_overflow`` does once it knows whether the round overflowed.

    The scale of the next step becomes the one decided one round earlier; an overflow
    halves the one after it and restarts the count of rounds without overflow; after
    ``_scale_seq_len`` such rounds in a row the scale doubles, up to ``_max_loss_scale``.
    """
    # pylint: disable=protected-access
    scaler._loss_scale = scaler._next_loss_scale
    if overflow:
        scaler._next_loss_scale = scaler._loss_scale / 2.
        scaler._unskipped = 0
    else:
        scaler._unskipped += 1
    if scaler._unskipped == scaler._scale_seq_len:
        scaler._unskipped = 0
        scaler._next_loss_scale = min(scaler._max_loss_scale, scaler._loss_scale * 2.)


_STATE = ('_loss_scale', '_next_loss_scale', '_max_loss_scale', '_scale_seq_len', '_unskipped')


def scaler_state(scaler):
    """What a checkpoint saves of `scaler`: a dict of floats and ints."""
    return {name.lstrip('_'): getattr(scaler, name) for name in _STATE}


def restore_scaler(scaler, state):
    """Give `scaler` the saved `state` (:func:`scaler_state`)."""
    for name in _STATE:
        setattr(scaler, name, state[name.lstrip('_')])


class GlobalOverflows(object):
    """Which rounds' global overflow flags a worker's loss scaler has seen.

    Attributes
    ----------
    applied : int
        Rounds 0 .. applied - 1 have advanced the scaler.
    skipped : int
        How many of them overflowed (the servers skipped them).
    """

    def __init__(self, applied=0, skipped=0):
        self.applied = applied
        self.skipped = skipped

    def apply(self, scaler, rounds, last):
        """Advance `scaler` with the global flags of rounds ``applied .. last`` read from
        `rounds`, the store's rounds part (``Rounds.overflows``; waits for its last
        ``pull_overflows``)."""
        for count in rounds.overflows(range(self.applied, last + 1)):
            advance(scaler, count > 0)
            self.skipped += count > 0
        self.applied = max(self.applied, last + 1)

    def state_dict(self):
        """For checkpoints."""
        return {'applied': self.applied, 'skipped': self.skipped}


def amp_policy(scaler_of):
    """The AMP policy of a ``DelayedTrainer`` on ``'dist_delay'``, chosen once when its
    kvstore is created.

    Parameters
    ----------
    scaler_of : callable
        Returns the loss scaler that ``amp.init_trainer(trainer)`` set, or None.
    """
    return NoAmp(scaler_of) if scaler_of() is None else LossScaledAmp(scaler_of)


class NoAmp(object):
    """No loss scaling: the servers apply every round, every hook does nothing."""

    #: Told to the servers at the hand-shake: whether they skip non-finite rounds.
    enabled = False

    def __init__(self, scaler_of):
        self._scaler_of = scaler_of

    @property
    def skipped(self):
        """Rounds the servers skipped for overflow, as far as this worker knows."""
        return 0

    def check_unchanged(self):
        """Raise ValueError if ``amp.init_trainer`` ran (or was undone) after the choice."""
        if (self._scaler_of() is not None) != self.enabled:
            raise ValueError(
                'amp.init_trainer(trainer) was called after the trainer created its kvstore '
                "(at the first step, or trainer.rank / num_workers): with 'dist_delay' the "
                'servers must know at the hand-shake that rounds may overflow. Call '
                'amp.init_trainer(trainer) right after creating the DelayedTrainer')

    def refuse(self, sparse, compression):
        """Raise ValueError for what this policy cannot train: `sparse`, the names of the
        parameters with row_sparse gradients, and `compression` (the store's codec or None)."""

    # The hooks below get `rounds`, the store's rounds part (DistDelay.delayed.rounds).
    def before_pushes(self, grads, rounds):
        """Called with the step's gradients (push order) before their pushes are queued."""

    def after_synchronous_step(self, rounds, t):
        """Called after the pulls of synchronous step `t` are queued."""

    def skips_local_step(self, rounds, t, applies):
        """Whether delayed step `t` skips its local update; `applies`: it applies a pull."""
        return False

    def after_pulls(self, rounds):
        """Called after the pulls that end a period are queued."""

    def state_dict(self):
        """What a checkpoint saves (None: no AMP)."""
        return None

    def check_saved(self, saved, fname):
        """Raise ValueError unless `saved` (a checkpoint's :meth:`state_dict`) was saved
        with the same policy."""
        if (saved is not None) != self.enabled:
            raise ValueError('%s was saved %s AMP, this trainer runs %s it: %s'
                             % ((fname,) + (('with', 'without', 'call amp.init_trainer('
                                             'trainer) before loading') if saved
                                            else ('without', 'with', 'resume without AMP'))))

    def load_state_dict(self, saved):
        """Restore what :meth:`state_dict` returned (checked by :meth:`check_saved`)."""


class LossScaledAmp(NoAmp):
    """Dynamic loss scaling driven by each round's global overflow flag (docs/design.md §11):
    the servers skip an overflowed round, every worker's scaler sees the same flags."""

    enabled = True

    def __init__(self, scaler_of):
        super(LossScaledAmp, self).__init__(scaler_of)
        self.overflows = GlobalOverflows()
        self._finite = None   # this step's all-finite flag

    @property
    def skipped(self):
        return self.overflows.skipped

    def refuse(self, sparse, compression):
        if sparse:
            # The store's row_sparse pushes carry no all-finite flag: an overflowed round
            # would be applied on their rows.
            raise ValueError(
                "AMP's dynamic loss scaling cannot be combined with row_sparse gradients "
                "(Parameter %s) on 'dist_delay' yet: an overflowed round would reach the "
                'servers\' row_sparse keys unmarked; train without AMP, or with dense '
                'gradients (e.g. nn.Embedding without sparse_grad)' % ', '.join(sparse))
        if compression is not None:
            # 2bit quantizes inf to +t (and nan to 0, with a nan residual from then on): an
            # overflowed round would reach the servers finite and be applied. fp16: a
            # loss-scaled gradient that is finite in float32 can overflow float16's range in
            # the push's cast, and the servers would skip a round that no worker's overflow
            # flag (computed before the cast) reported: measured, the loss scales then leave
            # Gluon's sequence. Refused until the flag covers the cast.
            raise ValueError(
                "AMP's dynamic loss scaling cannot be combined with compression_params=%r yet: "
                'an overflowed gradient would be quantized to finite values (2bit), or a '
                'loss-scaled gradient could overflow in the float16 cast without the workers\' '
                'overflow flags seeing it (fp16); use compression_params=None with AMP'
                % (compression.describe(),))

    def before_pushes(self, grads, rounds):
        # Every push of the step waits for this flag, i.e. for the whole backward
        # (docs/design.md §11.1): an overflowed round reaches every chunk as inf/nan.
        self._finite = finite_flag(grads)
        rounds.set_finite_flag(self._finite)

    def after_synchronous_step(self, rounds, t):
        # Round t's global overflow flag drives the loss scale of step t + 1, as
        # gluon.Trainer's local one does (docs/design.md §11.2); waits for round t.
        rounds.pull_overflows()
        self.overflows.apply(self._scaler_of(), rounds, t)

    def skips_local_step(self, rounds, t, applies):
        # docs/design.md §11.2-3: the period's global flags reach the loss scale with its
        # pull; this worker skips its own local step only on its own overflow.
        if applies:
            self.overflows.apply(self._scaler_of(), rounds, t - 1)
        return not self._finite.asscalar()

    def after_pulls(self, rounds):
        rounds.pull_overflows()

    def state_dict(self):
        # The loss scaler and the rounds it has seen (docs/design.md §11.4); the overflow
        # marks of rounds not seen yet are restored on the counter's server.
        return {'scaler': scaler_state(self._scaler_of()),
                'overflows': self.overflows.state_dict()}

    def load_state_dict(self, saved):
        restore_scaler(self._scaler_of(), saved['scaler'])
        self.overflows = GlobalOverflows(**saved['overflows'])
