"""Local update rules of the delayed phase ("global-gradient-based local update", claim 1).

A rule is an object with :meth:`LocalRule.update` (and optionally ``create_state``). At
every delayed step the trainer calls it per parameter with the worker's own gradient g
(summed over its devices, not yet multiplied by ``rescale_grad``) and
``grad_sync = w' - pre_weight`` (docs/design.md §1, step 2).

Every built-in rule uses the delay-compensated gradient of DC-ASGD,
``g_dc = g + lam * g * g * grad_sync`` (g rescaled); ``lam = 0`` gives g.

- ``'mirror'`` (default, :class:`MirrorRule`): a local copy of the servers' optimizer
  applied to ``N * g_dc`` (the worker's gradient standing in for the sum of all N), its
  state the servers' after round W, kept across pulls. For plain SGD:
  ``v := mu*v - lr*(N*g_dc + wd*w')``, ``w' := w' + v``; v persists across pulls and starts at
  the server's last step ``W_{W+1} - W_W``. Matches ``dist_sync``'s accuracy at k = 4 and 8
  with server momentum 0.9, where the literal rules collapse (docs/design.md §1).
- ``'sgd'``, ``'dc'`` (:class:`LocalSGDRule`): the patent's literal rule
  ``w' := w' - lr*(g_dc + wd*w')`` with lam 0 and 0.04.
- ``'dc_adaptive'``: ``'dc'`` with lam scaled by ``1/sqrt(MS)``,
  ``MS := m*MS + (1-m)*g*g + 1e-7``.
- ``'drift'`` (:class:`DriftCorrected` around ``'mirror'``): the mirror plus a per-step
  correction learnt at each pull, the difference between the global change and the rule's
  own change over the last period, divided by k (no bytes on the wire).

A row_sparse g (a Parameter with ``grad_stype='row_sparse'``) is a lazy update, as MXNet's
optimizers make it (docs/design.md §1.4): the built-in rules change only the rows g holds,
the weights and the rule's state alike; ``grad_sync`` is read on those rows only. The
trainer tells the rule which kind each Parameter's g is, once (``RuleContext.gradient``,
:mod:`mxdelay.gradients`).

The rules live in one module per family, all importable from here (``mxdelay.rules.<Name>``):
:mod:`~mxdelay.rules.base` (:class:`LocalRule`, :data:`RuleContext`),
:mod:`~mxdelay.rules.local_sgd` (:class:`LocalSGDRule`), :mod:`~mxdelay.rules.mirror`
(:class:`MirrorRule`, the optimizers it follows; how it feeds them,
:mod:`~mxdelay.rules.feeds`) and :mod:`~mxdelay.rules.drift` (:class:`DriftCorrected`).
"""
from kvstore_ext.checks import ArgumentTypeError, check_real

from .base import LocalRule, RuleContext
from .drift import DriftCorrected
from .local_sgd import LocalSGDRule
from .mirror import MIRRORED, SPARSE_MIRRORED, MirrorRule

__all__ = ['LocalRule', 'LocalSGDRule', 'MirrorRule', 'DriftCorrected', 'RuleContext',
           'create_rule', 'BUILTIN_RULES', 'MIRRORED', 'SPARSE_MIRRORED']


#: name -> (factory taking dc_lambda or None, default lam)
BUILTIN_RULES = {
    'mirror': lambda lam: MirrorRule(0.0 if lam is None else lam),
    'sgd': lambda lam: LocalSGDRule(0.0 if lam is None else lam),
    'dc': lambda lam: LocalSGDRule(0.04 if lam is None else lam),
    'dc_adaptive': lambda lam: LocalSGDRule(0.04 if lam is None else lam, adaptive=True),
    'drift': lambda lam: DriftCorrected(MirrorRule(0.0 if lam is None else lam)),
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
