"""A user-defined optimizer, registered with MXNet, that fails on row_sparse weights as MXNet's
own ``Test`` optimizer does (tests/test_updater_errors.py).

``update`` adds ``rescale_grad * grad`` to the weight (``Test``'s arithmetic), then raises a
``TypeError`` if the weight is row_sparse: the failing round's update has already been
written, as with ``Test``'s ``state[:] = weight`` on MXNet's server. Servers import this module
through ``MXDELAY_SERVER_IMPORTS`` (mxdelay's) or when they unpickle the optimizer (MXNet's).
"""
import mxnet as mx


@mx.optimizer.register
class FailsOnRowSparse(mx.optimizer.Optimizer):
    """``w += rescale_grad * g``; raises on row_sparse weights, after the update."""

    def create_state(self, index, weight):
        return None

    def update(self, index, weight, grad, state):
        weight[:] += grad * self.rescale_grad
        if weight.stype == 'row_sparse':
            raise TypeError('FailsOnRowSparse does not take row_sparse weights (key %s)' % index)
