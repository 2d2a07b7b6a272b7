"""The patent's literal local SGD step and its delay-compensated variants (``'sgd'``,
``'dc'``, ``'dc_adaptive'``: :mod:`mxdelay.rules`)."""
from mxnet import nd

from kvstore_ext.checks import check_bool, check_real

from ..gradients import DENSE
from .base import LocalRule

__all__ = ['LocalSGDRule']


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
        # With a row_sparse g, a lazy update: the step on the rows g holds (weights and MS).
        ctx.gradient.on_rows(self._update_dense, weight, grad, grad_sync, state, ctx)

    def _update_dense(self, weight, grad, grad_sync, state, ctx):
        lam = None
        if self.adaptive:
            g = grad * ctx.rescale_grad
            m = self.ms_momentum
            state[:] = m * state + (1 - m) * g * g + 1e-7
            lam = self.dc_lambda / nd.sqrt(state)
        g, rescale = self._compensated(DENSE, grad, grad_sync, ctx, lam)
        # The servers' kernel for plain SGD (kvstore_ext.server.rounds.sgd_step), so that with one
        # worker and plain SGD on the servers the local step is the server's, bit for bit.
        nd.multi_sgd_update(weight, g, out=weight, num_weights=1, lrs=(ctx.lr,), wds=(ctx.wd,),
                            rescale_grad=rescale, clip_gradient=ctx.clip_gradient)

    def __repr__(self):
        return 'LocalSGDRule(dc_lambda=%g, adaptive=%s)' % (self.dc_lambda, self.adaptive)
