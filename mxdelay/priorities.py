"""Push and pull priorities from the order of the first forward (docs/design.md §8).

Every Block reads its weights through ``Parameter.data``, hybridized or not: the order of
those reads in the first forward, not Gluon's name-sorted index (``'dense10'`` sorts before
``'dense2'``), is what the next forward needs first. :class:`ForwardOrder` records it until
the first step, then gives each parameter its priority and the step its push order.
"""
import logging

__all__ = ['ForwardOrder']

# The trainer's log (see mxdelay.delayed).
_LOG = logging.getLogger('mxdelay.trainer')


class ForwardOrder(object):
    """The order of the first forward's reads, and the priorities decided from it.

    Parameters
    ----------
    states : list of ParamState
        The trainer's per-parameter state, in index order; their parameters are watched.
    registration_order : list of str
        The parameters' names in the order the user gave them (for those the first forward
        did not read).
    """

    def __init__(self, states, registration_order):
        self._states = states
        self._registration_order = registration_order
        self._first_use = []      # param indices in the order the first forward used them
        #: Indices of the trained parameters, last-used first; None until :meth:`decide`.
        self.push_order = None
        for s in states:
            original = s.param.data

            def data(ctx=None, _i=s.index, _original=original):
                if _i not in self._first_use:
                    self._first_use.append(_i)
                return _original(ctx)
            s.param.data = data

    def decide(self):
        """Stop watching; give each parameter its priority (first used: highest)."""
        states = self._states
        for s in states:
            s.param.__dict__.pop('data', None)
        position = {name: n for n, name in enumerate(self._registration_order)}
        unseen = sorted((s.index for s in states if s.index not in self._first_use),
                        key=lambda i: position.get(states[i].param.name, len(position)))
        order = self._first_use + unseen
        for rank, i in enumerate(order):
            states[i].priority = -rank
        self.push_order = [i for i in reversed(order) if states[i].trained]
        _LOG.debug('DelayedTrainer: forward order %s', [states[i].param.name for i in order])

    def names(self):
        """Parameter names from the highest priority to the lowest; before :meth:`decide`,
        registration order."""
        if self.push_order is None:
            return list(self._registration_order)
        return [s.param.name for s in sorted(self._states, key=lambda s: s.priority,
                                             reverse=True)]
