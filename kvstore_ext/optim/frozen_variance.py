"""Adam with a frozen second moment, an optimizer mxdelay adds to MXNet's registry.

:class:`FrozenVarianceAdam` is Adam whose second moment stops moving after a given number of
updates (docs/design.md §1.4). Importing this module registers it with MXNet as
``'frozenvarianceadam'``, so ``DelayedTrainer(params, 'frozenvarianceadam', ...)``,
``gluon.Trainer`` and ``mx.optimizer.create`` accept it by name, and a checkpoint can name it.
mxdelay's servers import it (they build the workers' optimizer by name) and so do
:class:`mxdelay.DelayedTrainer` and ``mxdelay.FrozenVarianceAdam``.
"""
import math

import mxnet as mx
from mxnet import nd

from kvstore_ext.checks import check_int

__all__ = ['FrozenVarianceAdam']


@mx.optimizer.register
class FrozenVarianceAdam(mx.optimizer.Adam):
    """Adam whose second moment is frozen after `freeze_after` updates of each weight.

    Updates 1 to `freeze_after` are MXNet's :class:`mxnet.optimizer.Adam`, bit for bit.
    From update ``freeze_after + 1`` on, the second moment ``v`` and its bias correction stay
    as they were after update `freeze_after`, except that ``v`` never falls below
    ``(1 - beta2) * g**2``, the bound every Adam update keeps; the first moment and the
    weights move as in Adam::

        g = clip(grad * rescale_grad + wd * weight, clip_gradient)
        v = max(v, (1 - beta2) * g**2)                            (elementwise)
        m = beta1 * m + (1 - beta1) * g
        lr_t = learning_rate * sqrt(1 - beta2**T) / (1 - beta1**t),  T = min(t, freeze_after)
        w = w - lr_t * m / (sqrt(v) + epsilon)

    The bound is what keeps a step near the learning rate: Adam's own ``v`` is at least
    ``(1 - beta2) * g**2`` after each update, so ``|g| / sqrt(v)`` stays below
    ``1 / sqrt(1 - beta2)``. A frozen ``v`` that the warm-up measured as 0 or nearly 0 (a
    unit that was inactive then, an input that was almost always 0, a value a ternary
    compressor sent as 0) would otherwise divide a later, larger gradient by almost
    nothing: on the benchmark's MLP (Adam lr 1e-3) the unbounded rule went to inf some 30
    steps after the freeze in every seed (docs/benchmarks/mlp-adam-fv). The bound moves
    ``v`` only for a gradient more than ``1 / sqrt(1 - beta2)`` (32 at the default) times
    ``sqrt(v)``; elsewhere ``v`` is kept bit for bit.

    After the freeze the step is linear in the gradients wherever the bound does not move
    ``v``: momentum SGD with a fixed per-coordinate preconditioner. With a delayed update
    (docs/design.md §1.4) the workers' local steps between pulls and the servers' steps then
    divide by the same ``v``, where Adam's local copy would learn its own ``v`` from one
    worker's noisier gradient; and a compressed push's error feedback, which makes the sum
    over a few steps right but not each value, passes through a linear step as a sum. With
    :class:`mxdelay.DelayedTrainer`, `freeze_after` equal to ``warmup_steps`` freezes ``v``
    at the switch to delayed updates: round t is the servers' update t + 1, so ``v`` holds
    the gradients of the warm-up's rounds.

    Parameters
    ----------
    freeze_after : int
        The number of updates of each weight that move the second moment (>= 1; at 0 there
        would be no second moment to divide by).
    learning_rate, beta1, beta2, epsilon, lazy_update
        As in :class:`mxnet.optimizer.Adam`.
    **kwargs
        As in :class:`mxnet.optimizer.Optimizer`.

    Raises
    ------
    TypeError
        If `freeze_after` is not an int (:class:`mxdelay.ArgumentTypeError`).
    ValueError
        If `freeze_after` is below 1; at an update, if the gradient is not dense (row_sparse
        gradients: use ``'adam'``, whose lazy update needs no such bound).
    """

    def __init__(self, freeze_after, learning_rate=0.001, beta1=0.9, beta2=0.999, epsilon=1e-8,
                 lazy_update=True, **kwargs):
        freeze_after = check_int(
            'freeze_after', freeze_after, minimum=1,
            fix="the number of updates whose gradients move the second moment, e.g. "
                "DelayedTrainer's warmup_steps")
        super(FrozenVarianceAdam, self).__init__(
            learning_rate=learning_rate, beta1=beta1, beta2=beta2, epsilon=epsilon,
            lazy_update=lazy_update, **kwargs)
        self.freeze_after = freeze_after

    def update(self, index, weight, grad, state):
        if grad.stype != 'default':
            raise ValueError(
                "FrozenVarianceAdam takes dense gradients only, got a %s gradient for the "
                "weight of index %r; use optimizer 'adam' for Parameters with sparse "
                "gradients" % (grad.stype, index))
        self._update_count(index)
        lr = self._get_lr(index)
        wd = self._get_wd(index)
        t = self._index_update_count[index]
        frozen = t > self.freeze_after
        lr *= (math.sqrt(1. - self.beta2 ** min(t, self.freeze_after)) /
               (1. - self.beta1 ** t))
        # beta2 = 1 makes MXNet's kernel keep v as it is: v := 1 * v + 0 * g^2.
        kwargs = {'beta1': self.beta1, 'beta2': 1.0 if frozen else self.beta2,
                  'epsilon': self.epsilon, 'rescale_grad': self.rescale_grad}
        if self.clip_gradient:
            kwargs['clip_gradient'] = self.clip_gradient
        mean, var = state
        if frozen:
            # Adam's bound v >= (1 - β2) g^2, which the kernel below (β2 = 1) does not keep.
            scaled = grad * self.rescale_grad + weight * wd
            if self.clip_gradient:
                scaled = nd.clip(scaled, -self.clip_gradient, self.clip_gradient)
            nd.broadcast_maximum(var, (1. - self.beta2) * nd.square(scaled), out=var)
        nd.adam_update(weight, grad, mean, var, out=weight, lazy_update=self.lazy_update,
                       lr=lr, wd=wd, **kwargs)
