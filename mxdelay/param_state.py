"""What :class:`mxdelay.DelayedTrainer` keeps per parameter: one :class:`ParamState` each.

Created once with the trainer, in the order of Gluon's parameter index; the delayed mode
(:mod:`mxdelay.modes`) fills the fields as the phases need them (docs/design.md §1.3).
"""
import numpy as np

from mxnet import autograd, nd

from kvstore_ext.worker.aux_states import is_aux

__all__ = ['ParamState']


class ParamState(object):
    """The worker's state of one parameter (arrays on the trainer's first context).

    Attributes
    ----------
    index : int
        The parameter's index in the trainer (its key in the kvstore).
    param : Parameter
        The parameter.
    priority : int
        Push and pull priority: the parameter the forward reads first gets the highest
        (docs/design.md §8); 0 until the first step decides it.
    pre_weight : NDArray or None
        The weights of the last applied pull (set at the switch).
    rule_state : object
        The local rule's state (set at the switch; None before, or the rule's own None).
    pulled : NDArray or None
        Target of the period's pull, applied at the next step.
    grad_sum : NDArray or None
        The gradient summed over the worker's devices (more than one device only).
    full : NDArray or None
        w' of a row_sparse weight: every row, dense (docs/design.md §2.10).
    """

    __slots__ = ('index', 'param', 'priority', 'pre_weight', 'rule_state', 'pulled',
                 'grad_sum', 'full')

    def __init__(self, index, param):
        self.index = index
        self.param = param
        self.priority = 0
        self.pre_weight = None
        self.rule_state = None
        self.pulled = None
        self.grad_sum = None
        self.full = None

    @property
    def trained(self):
        """Whether the parameter has a gradient (``grad_req != 'null'``)."""
        return self.param.grad_req != 'null'

    @property
    def aux(self):
        """Whether the parameter is an aux state (``differentiable=False``: BatchNorm's
        running mean and variance), averaged by ``sync_weights(aux_states=True)``."""
        return is_aux(self.param)

    @property
    def started(self):
        """Whether the switch gave it ``pre_weight`` and a rule state."""
        return self.pre_weight is not None

    def weights(self):
        """The arrays that hold w': the parameter's data on every device, or for a
        row_sparse weight the dense copy of every row (docs/design.md §2.10)."""
        if self.param._stype == 'default':  # pylint: disable=protected-access
            return self.param.list_data()
        return [self.full]

    def reduced_grad(self):
        """This worker's gradient summed over its devices, on the first device (row_sparse
        gradients: the union of the devices' rows)."""
        grads = self.param.list_grad()
        if len(grads) == 1:
            return grads[0]
        if self.grad_sum is None:
            first = grads[0]
            self.grad_sum = (nd.zeros_like(first) if first.stype == 'default' else
                             nd.sparse.zeros(first.stype, first.shape, ctx=first.context,
                                             dtype=first.dtype))
        first = grads[0].context
        nd.add_n(*[g.as_in_context(first) for g in grads], out=self.grad_sum)
        return self.grad_sum

    def row_sparse_data(self, row_id, out):
        """Copy the rows `row_id` of a row_sparse weight's dense copy into `out` (one
        row_sparse NDArray or a list), as ``row_sparse_pull`` would, without communication."""
        full = self.full
        rows = np.unique(row_id.asnumpy()).astype(np.int64)  # as row_sparse_pull: once each
        if rows.size and (rows[0] < 0 or rows[-1] >= full.shape[0]):
            raise ValueError('row_sparse_data of Parameter %s: row ids must be in [0, %d), got '
                             '%s' % (self.param.name, full.shape[0],
                                     rows[(rows < 0) | (rows >= full.shape[0])]))
        with autograd.pause():
            if rows.size:
                ids = nd.array(rows, ctx=full.context, dtype='int64')
                value = nd.sparse.row_sparse_array((nd.take(full, ids), ids), shape=full.shape,
                                                   ctx=full.context, dtype=full.dtype)
            else:
                value = nd.sparse.zeros('row_sparse', full.shape, ctx=full.context,
                                        dtype=full.dtype)
            for target in (out if isinstance(out, (list, tuple)) else [out]):
                value.copyto(target)
