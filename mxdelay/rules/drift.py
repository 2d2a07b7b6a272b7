"""The drift correction (``'drift'``): :class:`DriftCorrected`, any rule plus a per-step
correction learnt from the pulls."""
from mxnet import nd

from kvstore_ext.checks import ArgumentTypeError

from .base import LocalRule, sparse_grad_params

__all__ = ['DriftCorrected']


class DriftCorrected(LocalRule):
    """A rule plus a drift correction learnt from the pulls (docs/design.md §1.4).

    Between two applied pulls a worker's weights move by its own `rule` steps, the global
    weights by the servers' rounds on every worker's gradients. The difference, known at the
    pull, is this worker's drift from the global trajectory over the last period. Every
    local step adds it back, one k-th per step::

        at a step that applies a pull:  d := d + (W_t - w'_before) / k
        every local step:               w' := rule(w', g, grad_sync) + d

    where ``w'_before`` is the worker's weights just before the pull replaced them (the
    rule keeps a copy, made after every local step) and d starts at 0 at the switch. d is
    the per-step difference between the global change and the rule's own change over the
    last period, ``(sum of global steps - sum of the rule's steps) / k``: a control variate
    in the spirit of SCAFFOLD, in weight space. It adds no bytes on the wire; it costs two
    arrays per parameter on the worker (d and the copy) and one copy per step. With one
    worker the rule's steps are the servers' (``'mirror'``), so d stays exactly 0 and the
    trajectory is the wrapped rule's.

    Parameters
    ----------
    rule : LocalRule
        The rule to correct (``local_rule='drift'`` is ``DriftCorrected(MirrorRule())``).

    Raises
    ------
    TypeError
        If `rule` is not a :class:`LocalRule` instance.
    """

    def __init__(self, rule):
        if not isinstance(rule, LocalRule) or isinstance(rule, DriftCorrected):
            raise ArgumentTypeError('rule must be a LocalRule instance (not DriftCorrected), '
                                    'e.g. DriftCorrected(MirrorRule()), got %r' % (rule,))
        super(DriftCorrected, self).__init__(rule.dc_lambda)
        self.rule = rule
        self.needs_grad_sync = rule.needs_grad_sync

    def check_optimizer(self, optimizer):
        self.rule.check_optimizer(optimizer)
        sparse = [p.name for p in sparse_grad_params(optimizer).values()]
        if sparse:
            raise ValueError(
                'local_rule=%r adds a dense correction to every row at every step, which '
                'would undo the lazy updates of Parameter %s (row_sparse gradients); use '
                "local_rule='mirror' for models with sparse gradients" % (self, ', '.join(sparse)))

    def start(self, optimizer):
        self.rule.start(optimizer)

    def server_state_count(self, optimizer, dtypes):
        return self.rule.server_state_count(optimizer, dtypes)

    def create_state_for(self, index, weight, last_global_step):
        inner = self.rule.create_state_for(index, weight, last_global_step)
        return (inner, nd.zeros_like(weight), weight.copy())

    def server_state(self, weight, state, index=None):
        return self.rule.server_state(weight, state[0], index)

    def update(self, weight, grad, grad_sync, state, ctx):
        inner, drift, before = state
        if ctx.pulled:
            # `weight` is W_t, `before` the weights the pull replaced (after the last local
            # step this worker made: a step skipped for an overflow leaves both as they were).
            nd.elemwise_add(drift, (weight - before) / ctx.delay, out=drift)
        self.rule.update(weight, grad, grad_sync, inner, ctx)
        nd.elemwise_add(weight, drift, out=weight)
        weight.copyto(before)

    def __repr__(self):
        return 'DriftCorrected(%r)' % (self.rule,)
