"""Gluon's private state, read and written here only: what mxdelay's modes ask of the
``gluon.Trainer`` they run in (:class:`GluonState`), and the store's creation for the Module
API (:func:`init_store`). Gluon's privates move between MXNet versions; mxdelay requires
MXNet 1.9.1 (:mod:`kvstore_ext.bootstrap`).
"""
# pylint: disable=protected-access

__all__ = ['GluonState', 'init_store']


class GluonState(object):
    """What the delayed update asks of the Gluon trainer it runs in (`trainer`, a
    :class:`mxdelay.DelayedTrainer`).

    Attributes
    ----------
    optimizer : Optimizer
        The trainer's (a load replaces it: :meth:`adopt_optimizer`).
    scale : float
        The gradients' scale before the batch size (``amp.scale_loss`` changes it).
    context : Context
        The trainer's first context.
    """

    def __init__(self, trainer):
        self._trainer = trainer

    optimizer = property(lambda self: self._trainer._optimizer)
    scale = property(lambda self: self._trainer._scale)
    context = property(lambda self: self._trainer._contexts[0])

    def adopt_optimizer(self, optimizer):
        """Make the loaded `optimizer` the trainer's, as ``gluon.Trainer.load_states`` does."""
        self._trainer._optimizer = optimizer
        optimizer.param_dict = dict(enumerate(self._trainer._params))

    def init_params(self):
        """Gluon's lazy initialisation: send the parameters not in the kvstore yet, if any."""
        if self._trainer._params_to_init:
            self._trainer._init_params()

    def check_fresh(self, ignore_stale_grad):
        """Raise UserWarning for a stale gradient, as ``gluon.Trainer`` does (unless
        `ignore_stale_grad`); mark every trained gradient as used."""
        for param in self._trainer._params:
            if param.grad_req == 'null':
                continue
            for data in param._check_and_get(param._data, list):
                if not data._fresh_grad and not ignore_stale_grad:
                    raise UserWarning(
                        'Gradient of Parameter `%s` on context %s has not been updated by '
                        'backward since last `step`. Call step with ignore_stale_grad=True '
                        'to push it anyway.' % (param.name, data.context))
                data._fresh_grad = False

    def push_all(self):
        """The trainer's seam ``_push_all`` (a subclass may wait before the pushes)."""
        self._trainer._push_all()

    def loss_scaler(self):
        """The AMP loss scaler that ``amp.init_trainer(trainer)`` set, or None."""
        return getattr(self._trainer, '_amp_loss_scaler', None)


def init_store(trainer):
    """Create `trainer`'s kvstore and send the initial weights now, as ``Module.init_optimizer``
    does before the first batch (:class:`mxdelay.DelayedModule`; a trainer does it at its first
    step). Returns the kvstore (None where Gluon uses none: one device, no kvstore)."""
    trainer._init_kvstore()
    trainer._init_params()
    return trainer._kvstore
