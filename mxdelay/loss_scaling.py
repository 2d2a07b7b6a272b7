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
  them were skipped.
"""
from mxnet import nd

__all__ = ['finite_flag', 'advance', 'GlobalOverflows', 'scaler_state', 'restore_scaler']

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

    def apply(self, scaler, kvstore, last):
        """Advance `scaler` with the global flags of rounds ``applied .. last`` read from
        `kvstore` (``DistDelay.overflows``; waits for its last ``pull_overflows``)."""
        rounds = range(self.applied, last + 1)
        for count in kvstore.overflows(rounds):
            advance(scaler, count > 0)
            self.skipped += count > 0
        self.applied = max(self.applied, last + 1)

    def state_dict(self):
        """For checkpoints."""
        return {'applied': self.applied, 'skipped': self.skipped}
