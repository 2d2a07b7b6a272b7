"""The finish counter's layout, which workers push and servers store (docs/design.md §5).

A key of ``HEAD + R`` elements: the sums of (finished, leaving, exchanged), then a ring of R
overflow marks. The worker's side is :class:`kvstore_ext.worker.finish.FinishCounter`; the
server stores each round's sums (:func:`kvstore_ext.server.appliers.store_counter`).
"""
import numpy as np

__all__ = ['FLAG_PRIORITY', 'HEAD', 'counter_size', 'upgrade_saved']


#: The flag needs no gradient: let it go first.
FLAG_PRIORITY = 1 << 20


#: Elements before the ring of overflow marks: the sums of (finished, leaving, exchanged).
HEAD = 3


def counter_size(slots):
    """Elements of the finish counter of a store with `slots` slots per chunk."""
    return HEAD + slots


def upgrade_saved(saved, size):
    """The finish counter's chunk `saved` (from a server's checkpoint file) for a counter now
    registered with `size` elements.

    mxdelay before the ``exchanged`` element saved ``2 + R`` elements: (finished, leaving)
    and the ring. Its workers sent no round as pushpulls by this flag, so the exact
    conversion inserts ``exchanged = 0`` before the ring, which moves the ring's element
    ``2 + t mod R`` to ``3 + t mod R`` as today's workers read it. Any other chunk is returned
    as it is (the registry then compares it with the registration).
    """
    weight = saved.get('weight')
    if saved.get('size') != size - 1 or not isinstance(weight, np.ndarray) \
            or weight.shape != (size - 1,):
        return saved
    return dict(saved, size=size, weight=np.insert(weight, HEAD - 1, 0).astype(weight.dtype))
