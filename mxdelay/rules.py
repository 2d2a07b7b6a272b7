"""Local update rules of the delayed phase ("global-gradient-based local update", claim 1).

A rule is an object with :meth:`LocalRule.update` (and optionally ``create_state``). At
every delayed step the trainer calls it per parameter with the worker's own gradient g
(summed over its devices, not yet multiplied by ``rescale_grad``) and
``grad_sync = w' - pre_weight`` (docs/design.md §1, step 2).

Every built-in rule uses the delay-compensated gradient of DC-ASGD,
``g_dc = g + lam * g * g * grad_sync`` (g rescaled); ``lam = 0`` gives g.

- ``'mirror'`` (default, :class:`MirrorRule`): a local copy of the server's SGD with
  momentum applied to ``N * g_dc`` (the worker's gradient standing in for the sum of all N):
  ``v := mu*v - lr*(N*g_dc + wd*w')``, ``w' := w' + v``; v persists across pulls and starts at
  the server's last step ``W_{W+1} - W_W``. Matches ``dist_sync``'s accuracy at k = 4 and 8
  with server momentum 0.9, where the literal rules collapse (docs/design.md §1).
- ``'sgd'``, ``'dc'`` (:class:`LocalSGDRule`): the patent's literal rule
  ``w' := w' - lr*(g_dc + wd*w')`` with lam 0 and 0.04.
- ``'dc_adaptive'``: ``'dc'`` with lam scaled by ``1/sqrt(MS)``,
  ``MS := m*MS + (1-m)*g*g + 1e-7``.
"""
import collections

import mxnet as mx
from mxnet import nd

from kvstore_ext.checks import ArgumentTypeError, check_bool, check_real

__all__ = ['LocalRule', 'LocalSGDRule', 'MirrorRule', 'RuleContext', 'create_rule',
           'BUILTIN_RULES']

#: Hyper-parameters of one call: local lr and wd (with the Parameter's multipliers), the
#: optimizer's momentum and clip_gradient, rescale_grad (1/batch size) and N workers.
RuleContext = collections.namedtuple(
    'RuleContext', ['lr', 'wd', 'momentum', 'clip_gradient', 'rescale_grad', 'num_workers'])


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

    def check_optimizer(self, optimizer):
        """Raise ValueError if this rule cannot follow the servers' `optimizer`.

        Called once, when a trainer on ``'dist_delay'`` is created. The base rule accepts
        every optimizer (a rule that only reads lr and wd, as the literal ``'sgd'`` rule).
        """

    def update(self, weight, grad, grad_sync, state, ctx):
        """Update `weight` in place from raw gradient `grad` (see :data:`RuleContext`)."""
        raise NotImplementedError()

    def _compensated(self, grad, grad_sync, ctx, lam=None):
        """Return ``(gradient, rescale)`` for a fused operator: ``(g_dc, 1)``, or
        ``(grad, rescale_grad)`` when there is no compensation term (`grad_sync` is None)."""
        if grad_sync is None:
            return grad, ctx.rescale_grad
        lam = self.dc_lambda if lam is None else lam
        g = grad * ctx.rescale_grad
        return g + lam * g * g * grad_sync, 1.0

    def __repr__(self):
        return '%s(dc_lambda=%g)' % (type(self).__name__, self.dc_lambda)


class LocalSGDRule(LocalRule):
    """The patent's literal local SGD step ``w' := w' - lr*(g_dc + wd*w')``.

    Parameters
    ----------
    dc_lambda : float, default 0
        lam of the delay-compensation term; ``'dc'`` is this rule with 0.04.
    adaptive : bool, default False
        Scale lam by ``1/sqrt(MS)``, ``MS := ms_momentum*MS + (1-ms_momentum)*g*g + 1e-7``
        (DC-ASGD-a); ``'dc_adaptive'`` is this rule with lam 0.04.
    ms_momentum : float, default 0.95
        m of the mean square.
    """

    def __init__(self, dc_lambda=0.0, adaptive=False, ms_momentum=0.95):
        super(LocalSGDRule, self).__init__(dc_lambda)
        self.adaptive = check_bool('adaptive', adaptive)
        self.ms_momentum = check_real('ms_momentum', ms_momentum, minimum=0, maximum=1,
                                      max_inclusive=False, fix='e.g. ms_momentum=0.95')

    def create_state(self, weight, last_global_step):
        return nd.zeros_like(weight) if self.adaptive else None

    def update(self, weight, grad, grad_sync, state, ctx):
        lam = None
        if self.adaptive:
            g = grad * ctx.rescale_grad
            m = self.ms_momentum
            state[:] = m * state + (1 - m) * g * g + 1e-7
            lam = self.dc_lambda / nd.sqrt(state)
        g, rescale = self._compensated(grad, grad_sync, ctx, lam)
        # The servers' kernel for plain SGD (kvstore_ext.rounds.sgd_step), so that with one
        # worker and plain SGD on the servers the local step is the server's, bit for bit.
        nd.multi_sgd_update(weight, g, out=weight, num_weights=1, lrs=(ctx.lr,), wds=(ctx.wd,),
                            rescale_grad=rescale, clip_gradient=ctx.clip_gradient)

    def __repr__(self):
        return 'LocalSGDRule(dc_lambda=%g, adaptive=%s)' % (self.dc_lambda, self.adaptive)


class MirrorRule(LocalRule):
    """A local copy of the server's SGD with momentum, applied to ``N * g_dc``.

    It mirrors ``mx.optimizer.SGD`` only (with or without momentum): any other optimizer on
    the servers is refused, because the local steps would silently follow SGD's arithmetic
    instead of the servers' (docs/design.md §1).
    """

    def check_optimizer(self, optimizer):
        if type(optimizer) is not mx.optimizer.SGD:  # noqa: E721  (subclasses change the step)
            raise ValueError(
                "local_rule='mirror' mirrors the servers' optimizer in the delayed phase, and "
                'mirrors SGD (with or without momentum) only; the servers apply %s. Use '
                "optimizer='sgd' (momentum included), or local_rule='sgd' (the literal "
                "local SGD step, which reads only the optimizer's learning rate and wd), or "
                "gluon.Trainer on kvstore='dist_delay' (synchronous, any optimizer)"
                % type(optimizer).__name__)

    def create_state(self, weight, last_global_step):
        return last_global_step.copy()

    def update(self, weight, grad, grad_sync, state, ctx):
        g, rescale = self._compensated(grad, grad_sync, ctx)
        nd.sgd_mom_update(weight, g, state, out=weight, lr=ctx.lr, wd=ctx.wd,
                          momentum=ctx.momentum, rescale_grad=rescale * ctx.num_workers,
                          clip_gradient=ctx.clip_gradient)


#: name -> (factory taking dc_lambda or None, default lam)
BUILTIN_RULES = {
    'mirror': lambda lam: MirrorRule(0.0 if lam is None else lam),
    'sgd': lambda lam: LocalSGDRule(0.0 if lam is None else lam),
    'dc': lambda lam: LocalSGDRule(0.04 if lam is None else lam),
    'dc_adaptive': lambda lam: LocalSGDRule(0.04 if lam is None else lam, adaptive=True),
}


def create_rule(local_rule, dc_lambda=None):
    """Return a rule object for a built-in name or a :class:`LocalRule` instance.

    Parameters
    ----------
    local_rule : str or LocalRule
        A name of :data:`BUILTIN_RULES` or a rule object.
    dc_lambda : float, optional
        lam of a built-in rule (>= 0); None: the rule's default.

    Raises
    ------
    TypeError
        (:class:`mxdelay.ArgumentTypeError`) If `local_rule` is neither a str nor a
        LocalRule instance (a LocalRule class, say), or `dc_lambda` is not a number.
    ValueError
        For an unknown name, a negative or non-finite `dc_lambda`, or `dc_lambda` given
        with a rule object.
    """
    names = ', '.join(repr(n) for n in BUILTIN_RULES)
    if isinstance(local_rule, LocalRule):
        if dc_lambda is not None:
            raise ValueError('dc_lambda=%r applies to built-in rules; set it on the rule '
                             'object %r instead' % (dc_lambda, local_rule))
        return local_rule
    if not isinstance(local_rule, str):
        raise ArgumentTypeError('local_rule=%r is not a rule: use one of %s or an instance of '
                                'mxdelay.rules.LocalRule (e.g. MirrorRule(), not MirrorRule)'
                                % (local_rule, names))
    if local_rule not in BUILTIN_RULES:
        raise ValueError('local_rule=%r is not a rule: use one of %s or a '
                         'mxdelay.rules.LocalRule instance' % (local_rule, names))
    if dc_lambda is not None:
        check_real('dc_lambda', dc_lambda, minimum=0, fix='0 disables delay compensation')
    return BUILTIN_RULES[local_rule](dc_lambda)
