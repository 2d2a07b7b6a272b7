"""What every local update rule shares: :class:`LocalRule`, the base class, and
:data:`RuleContext`, the hyper-parameters of one call (:mod:`mxdelay.rules`)."""
import collections

from kvstore_ext.checks import check_real

from ..gradients import BY_STYPE

__all__ = ['LocalRule', 'RuleContext', 'sparse_grad_params']

#: Hyper-parameters of one call: local lr and wd (with the Parameter's multipliers), the
#: optimizer's momentum and clip_gradient, rescale_grad (1/batch size), N workers, the
#: trainer's index of the Parameter and the step (= round) t, less the rounds the servers
#: skipped for an AMP overflow as far as this worker knows (docs/design.md §11).
#: ``pulled``: step 1 applied a pull at this step (the weights are ``W_t``); ``issues_pull``:
#: this step issues a pull; ``delay``: k, the local steps between two applied pulls;
#: ``gradient``: how the Parameter's gradient is stored, chosen once per Parameter
#: (:data:`mxdelay.gradients.DENSE` or ``ROW_SPARSE``; by default each call's g decides).
RuleContext = collections.namedtuple(
    'RuleContext', ['lr', 'wd', 'momentum', 'clip_gradient', 'rescale_grad', 'num_workers',
                    'index', 'step', 'pulled', 'issues_pull', 'delay', 'gradient'],
    defaults=(None, None, False, False, None, BY_STYPE))


class LocalRule(object):
    """Base class of local update rules.

    Parameters
    ----------
    dc_lambda : float, default 0
        Weight of the delay-compensation term ``lam * g * g * grad_sync`` (>= 0).

    Raises
    ------
    TypeError
        If an argument has the wrong type (:class:`mxdelay.ArgumentTypeError`).
    ValueError
        If an argument is out of range (here and in subclasses).
    """
    #: Whether :meth:`update` reads ``grad_sync``; the trainer skips computing it otherwise.
    needs_grad_sync = False
    dc_lambda = 0.0

    def __init__(self, dc_lambda=0.0):
        self.dc_lambda = check_real('dc_lambda', dc_lambda, minimum=0,
                                    fix='0 disables delay compensation')
        self.needs_grad_sync = self.dc_lambda > 0

    def create_state(self, weight, last_global_step):
        """Return this rule's state for one parameter, made at the switch (step W).

        Parameters
        ----------
        weight : NDArray
            ``W_{W+1}``, the worker's weights after the switch.
        last_global_step : NDArray
            ``W_{W+1} - W_W``, the server's last update.
        """
        return None

    def start(self, optimizer):
        """Called at the switch (and after a load in the delayed phase), before
        :meth:`create_state_for`, with the trainer's `optimizer`. The base rule ignores it."""

    def server_state_count(self, optimizer, dtypes):
        """J: how many arrays of the servers' optimizer state per tensor this rule fetches
        at the switch (:meth:`server_state`), for weights of `dtypes`; called before the
        kvstore places its keys. The base rule fetches none (0)."""
        return 0

    def create_state_for(self, index, weight, last_global_step):
        """The state of Parameter `index` (the trainer calls this; the base rule returns
        :meth:`create_state`)."""
        return self.create_state(weight, last_global_step)

    def server_state(self, weight, state, index=None):
        """The arrays of `state` (of Parameter `index`) to fill with the servers' optimizer
        state after round W (fetched once, collectively, at the switch), or None (the base
        rule)."""
        return None

    def check_optimizer(self, optimizer):
        """Raise ValueError if this rule cannot follow the servers' `optimizer`.

        Called once, when a trainer on ``'dist_delay'`` is created. The base rule accepts
        every optimizer (a rule that only reads lr and wd, as the literal ``'sgd'`` rule).
        """

    def update(self, weight, grad, grad_sync, state, ctx):
        """Update `weight` in place from raw gradient `grad` (see :data:`RuleContext`).

        For a Parameter with row_sparse gradients `grad` is row_sparse and `weight` dense:
        the update should be lazy, changing only the rows `grad` holds (docs/design.md
        §1.4), as the built-in rules do."""
        raise NotImplementedError()

    def _compensated(self, gradient, grad, grad_sync, ctx, lam=None):
        """Return ``(gradient, rescale)`` for a fused operator: ``(g_dc, 1)``, or
        ``(grad, rescale_grad)`` when there is no compensation term (`grad_sync` is None).
        `gradient`: the kind of `grad` (:mod:`mxdelay.gradients`)."""
        if grad_sync is None:
            return grad, ctx.rescale_grad
        lam = self.dc_lambda if lam is None else lam
        return gradient.compensated(grad, grad_sync, ctx.rescale_grad, lam)

    def __repr__(self):
        return '%s(dc_lambda=%g)' % (type(self).__name__, self.dc_lambda)


def sparse_grad_params(optimizer):
    """{index: Parameter} of the optimizer's Parameters with row_sparse gradients."""
    return {i: p for i, p in (getattr(optimizer, 'param_dict', None) or {}).items()
            if getattr(p, '_grad_stype', 'default') == 'row_sparse'}
