"""How :class:`~mxdelay.rules.mirror.MirrorRule` hands a step to its local copy of the
servers' optimizer: a :class:`Feed`, chosen once per optimizer class (:func:`feed_for`), and
the local copy's ``param_dict`` (:class:`UnitMultipliers`)."""

__all__ = ['Feed', 'LarsMomentumCorrection', 'RawGradientNorms', 'feed_for', 'UnitMultipliers']


class Feed(object):
    """How the mirror hands a step to its local optimizer, beyond lr, wd, the update count
    and ``rescale_grad``; chosen once per optimizer class (:func:`feed_for`). The default
    feed gives ``(g_dc, N * rescale)``: ``rescale_grad * g`` is then ``N * g`` wherever the
    optimizer reads it."""

    def gradient(self, grad, rescale, num_workers):
        """The gradient and ``rescale_grad`` to give the local optimizer."""
        return grad, rescale * num_workers

    def before_update(self, local, ctx):
        """Set what else the local optimizer reads, just before its update call."""


class LarsMomentumCorrection(Feed):
    """LARS with ``momentum_correction=True``: it multiplies the momentum by
    ``cur_lr / last_lr``, the base rates of this update call and of the previous one, kept
    once for the optimizer. A server's rate is the optimizer's (the multipliers apply after)
    and, without a schedule, the same at every call: the ratio is 1. The local copy is given
    each Parameter's rate with lr_mult folded in (:class:`UnitMultipliers`), so its ratio
    would be ``lr_mult / lr_mult of the previous Parameter``; setting the previous rate to
    this call's makes it 1, the servers' ratio (exactly: ``x / x``)."""

    def before_update(self, local, ctx):
        local.cur_lr = ctx.lr   # LARS._get_lrs moves it to last_lr, then sets it to local.lr


class RawGradientNorms(Feed):
    """LBSGD with ``warmup_strategy='lars'``: its ratio reads the norm of the raw gradient,
    before ``rescale_grad``, which on the servers is the sum of N workers' gradients. The
    worker's gradient, standing in for each of the N, is given as ``N * g`` with the
    worker's ``rescale_grad`` (with one worker ``1 * g``, the same values)."""

    def gradient(self, grad, rescale, num_workers):
        return grad * num_workers, rescale


def feed_for(optimizer):
    """The :class:`Feed` of `optimizer` (chosen once, when the mirror starts)."""
    mro = [cls.__name__ for cls in type(optimizer).__mro__
           if cls.__module__.startswith('mxnet.')]
    if 'LARS' in mro and optimizer.momentum_correction and optimizer.momentum:
        return LarsMomentumCorrection()
    if 'LBSGD' in mro and optimizer.warmup_strategy == 'lars':
        return RawGradientNorms()
    return Feed()


class UnitMultipliers(dict):
    """A local optimizer's ``param_dict``: every index has ``lr_mult = wd_mult = 1``, because
    the :data:`~mxdelay.rules.base.RuleContext` lr and wd already hold the Parameter's
    multipliers."""

    class _Unit(object):
        lr_mult = wd_mult = 1.0

    _UNIT = _Unit()

    def __contains__(self, index):
        return True

    def __missing__(self, index):
        return self._UNIT
