"""What the delayed update keeps per parameter: one :class:`ParamState` each.

Created once with the trainer, in the order of Gluon's parameter index, by :func:`create`,
which chooses the variants of the parameter once: the class by the weight's storage (a
row_sparse weight keeps a dense copy of every row, docs/design.md §2.10) and the gradient's
kind (:mod:`mxdelay.gradients`). The delayed update (:mod:`mxdelay.delayed`) fills the
fields as the phases need them (docs/design.md §1.3).
"""
import numpy as np

from mxnet import autograd, nd

from kvstore_ext.worker.aux_states import is_aux
from . import gradients

__all__ = ['ParamState', 'RowSparseWeightState', 'create']


def create(index, param, row_sparse_weight, row_sparse_grad):
    """The state of Parameter `param` (index `index`), with its variants chosen.

    Parameters
    ----------
    row_sparse_weight, row_sparse_grad : bool
        The Parameter's ``stype`` and ``grad_stype`` are ``'row_sparse'``.
    """
    gradient = gradients.ROW_SPARSE if row_sparse_grad else gradients.DENSE
    cls = RowSparseWeightState if row_sparse_weight else ParamState
    return cls(index, param, gradient)


class ParamState(object):
    """The worker's state of one parameter with a dense weight (arrays on the trainer's
    first context).

    Attributes
    ----------
    index : int
        The parameter's index in the trainer (its key in the kvstore).
    param : Parameter
        The parameter.
    gradient : object
        The kind of its gradient, :data:`mxdelay.gradients.DENSE` or ``ROW_SPARSE``.
    priority : int
        Push and pull priority: the parameter the forward reads first gets the highest
        (docs/design.md §8); 0 until the first step decides it.
    started : bool
        Whether the switch has given it a rule state (and a ``pre_weight``, if the rule
        reads ``grad_sync``).
    pre_weight : NDArray or None
        The weights of the last applied pull (set at the switch), kept only for a rule that
        reads ``grad_sync`` (docs/design.md §2.3).
    rule_state : object
        The local rule's state (set at the switch; None before, or the rule's own None).
    pulled : NDArray or None
        Where the period's pull lands, applied at the next step: for a dense key memory the
        store keeps anyway (``Rounds.pull_held``), else an array of its own.
    grad_sum : NDArray or None
        The gradient summed over the worker's devices (more than one device only).
    """

    __slots__ = ('index', 'param', 'gradient', 'priority', 'started', 'pre_weight',
                 'rule_state', 'pulled', 'grad_sum')

    def __init__(self, index, param, gradient):
        self.index = index
        self.param = param
        self.gradient = gradient
        self.priority = 0
        self.started = False
        self.pre_weight = None
        self.rule_state = None
        self.pulled = None
        self.grad_sum = None

    @property
    def trained(self):
        """Whether the parameter has a gradient (``grad_req != 'null'``)."""
        return self.param.grad_req != 'null'

    @property
    def aux(self):
        """Whether the parameter is an aux state (``differentiable=False``: BatchNorm's
        running mean and variance), averaged by ``sync_weights(aux_states=True)``."""
        return is_aux(self.param)

    def weights(self):
        """The arrays that hold w': the parameter's data on every device."""
        return self.param.list_data()

    def initialized(self, kv, ctx):
        """Called once the store holds the parameter's initial value ``W_0`` (`kv`, the
        trainer's store; `ctx`, its first context): a dense weight needs nothing more."""

    def reduced_grad(self):
        """This worker's gradient summed over its devices, on the first device (row_sparse
        gradients: the union of the devices' rows)."""
        grads = self.param.list_grad()
        if len(grads) == 1:
            return grads[0]
        if self.grad_sum is None:
            self.grad_sum = self.gradient.zeros_like(grads[0])
        first = grads[0].context
        nd.add_n(*[g.as_in_context(first) for g in grads], out=self.grad_sum)
        return self.grad_sum


class RowSparseWeightState(ParamState):
    """The state of a row_sparse weight: w' is a dense copy of every row, which pulls
    replace and ``row_sparse_data(ids)`` reads (docs/design.md §2.10).

    Attributes
    ----------
    full : NDArray or None
        w': every row, dense (from :meth:`initialized` on).
    """

    __slots__ = ('full',)

    def __init__(self, index, param, gradient):
        super(RowSparseWeightState, self).__init__(index, param, gradient)
        self.full = None

    def weights(self):
        """The array that holds w': the dense copy of every row."""
        return [self.full]

    def initialized(self, kv, ctx):
        # The worker's copy of every row starts at the servers' W_0 (rank 0's value: the
        # workers' own initial values may differ).
        self.full = nd.zeros(self.param.shape, ctx=ctx, dtype=self.param.dtype)
        kv.pull(self.index, out=self.full, priority=self.priority)

    def row_sparse_data(self, row_id, out):
        """Copy the rows `row_id` of the dense copy into `out` (one row_sparse NDArray or a
        list), as ``row_sparse_pull`` would, without communication."""
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
