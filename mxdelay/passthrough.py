"""The trainer's mode on a non-distributed kvstore (``'local'``, ``'device'``, None):
exactly ``gluon.Trainer``, and the mode of every trainer until its kvstore exists."""

__all__ = ['PassThrough']


class PassThrough(object):
    """Exactly ``gluon.Trainer``.

    Each method is the trainer's of the same name (``params_initialized``: after Gluon's
    ``_init_params``; ``row_sparse_pull``: Gluon's ``_row_sparse_pull``).

    Parameters
    ----------
    base : object
        ``gluon.Trainer``'s methods bound to the trainer, reached through the class hierarchy:
        ``super(DelayedTrainer, trainer)``. Never the module attribute ``mx.gluon.Trainer``,
        which a user may have replaced by a subclass of DelayedTrainer to run an unmodified
        script (its methods would call this mode again, without end).
    row_sparse_pull : callable
        ``base._row_sparse_pull``.
    """

    def __init__(self, base, row_sparse_pull):
        self._base = base
        self.row_sparse_pull = row_sparse_pull

    def step(self, batch_size, ignore_stale_grad):
        return self._base.step(batch_size, ignore_stale_grad)

    def join(self, before_round=None):  # pylint: disable=unused-argument
        return 0

    def sync_weights(self, aux_states):  # pylint: disable=unused-argument
        return None

    def save_states(self, fname):
        return self._base.save_states(fname)

    def load_states(self, fname, trusted=False):  # pylint: disable=unused-argument
        # gluon.Trainer's own file (a pickle, as gluon.Trainer reads it): see docs/api.md.
        return self._base.load_states(fname)

    def allreduce_grads(self):
        return self._base.allreduce_grads()

    def update(self, batch_size, ignore_stale_grad):
        return self._base.update(batch_size, ignore_stale_grad)

    @property
    def rank(self):
        return 0

    @property
    def num_workers(self):
        return 1

    def keys_per_step(self):
        return 0

    def codecs(self):
        return None

    def round_bytes(self):
        return None

    def set_learning_rate(self, lr):
        """Called after the optimizer's learning rate is set: nothing else to tell."""

    def params_initialized(self, indices):
        """Called after Gluon's ``_init_params``: nothing else to do."""
