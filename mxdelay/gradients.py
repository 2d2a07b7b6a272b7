"""How a parameter's gradient is stored, chosen once per parameter: :data:`DENSE` or
:data:`ROW_SPARSE` (a Parameter with ``grad_stype='row_sparse'``).

The trainer gives each parameter its kind when it creates the parameter's state
(:mod:`mxdelay.param_state`) and passes it to the local rule in ``RuleContext.gradient``:
the built-in rules compute the delay-compensated gradient and make a lazy update through it
(docs/design.md §1.4), without looking at the gradient's stype at each step. A rule called
directly, with a ``RuleContext`` made without ``gradient``, gets :data:`BY_STYPE`, which
picks the kind of each call's gradient.
"""
from mxnet import nd

__all__ = ['DENSE', 'ROW_SPARSE', 'BY_STYPE']


class _Dense(object):
    """A dense g: every row of the weight steps."""

    sparse = False

    @staticmethod
    def compensated(grad, grad_sync, rescale_grad, lam):
        """``(g_dc, 1)`` with ``g = rescale_grad * grad``, ``g_dc = g + lam * g * g *
        grad_sync``: the gradient and ``rescale_grad`` for a fused operator."""
        g = grad * rescale_grad
        return g + lam * g * g * grad_sync, 1.0

    @staticmethod
    def on_rows(step, weight, grad, grad_sync, state, ctx):
        """Apply ``step(weight, g, grad_sync, state, ctx)``, a rule's step on dense arrays,
        to the rows `grad` holds (here: the whole tensor)."""
        step(weight, grad, grad_sync, state, ctx)

    @staticmethod
    def zeros_like(grad):
        """An array for the sum of the devices' gradients."""
        return nd.zeros_like(grad)

    def __repr__(self):
        return 'DENSE'


class _RowSparse(object):
    """A row_sparse g: a lazy update, only the rows g holds change (the weights and the
    rule's state alike); ``grad_sync`` is read on those rows only."""

    sparse = True

    @staticmethod
    def compensated(grad, grad_sync, rescale_grad, lam):
        # The term on g's rows only: g_dc keeps g's rows (a lazy update stays lazy).
        rows = grad.indices
        if rows.shape[0] == 0:
            return grad, rescale_grad
        g = grad.data * rescale_grad
        g = g + lam * g * g * nd.take(grad_sync, rows)
        return nd.sparse.row_sparse_array((g, rows), shape=grad.shape,
                                          ctx=grad.context, dtype=grad.dtype), 1.0

    @staticmethod
    def on_rows(step, weight, grad, grad_sync, state, ctx):
        # The rule on the rows g holds, gathered, then written back (weights and state);
        # the other rows keep their values.
        rows = grad.indices
        if rows.shape[0] == 0:
            return
        block = nd.take(weight, rows)
        sync = None if grad_sync is None else nd.take(grad_sync, rows)
        part = None if state is None else nd.take(state, rows)
        step(block, grad.data, sync, part, ctx)
        nd.contrib.index_copy(weight, rows, block, out=weight)
        if part is not None:
            nd.contrib.index_copy(state, rows, part, out=state)

    @staticmethod
    def zeros_like(grad):
        return nd.sparse.zeros(grad.stype, grad.shape, ctx=grad.context, dtype=grad.dtype)

    def __repr__(self):
        return 'ROW_SPARSE'


class _ByStype(object):
    """The kind of each call's gradient, for a rule called without a chosen kind."""

    @staticmethod
    def _of(grad):
        return ROW_SPARSE if grad.stype == 'row_sparse' else DENSE

    def compensated(self, grad, grad_sync, rescale_grad, lam):
        return self._of(grad).compensated(grad, grad_sync, rescale_grad, lam)

    def on_rows(self, step, weight, grad, grad_sync, state, ctx):
        self._of(grad).on_rows(step, weight, grad, grad_sync, state, ctx)

    def __repr__(self):
        return 'BY_STYPE'


#: A dense gradient.
DENSE = _Dense()
#: A row_sparse gradient (lazy updates).
ROW_SPARSE = _RowSparse()
#: The kind of each call's gradient (``RuleContext``'s default).
BY_STYPE = _ByStype()
