"""The optimizer-state fetch: the servers' optimizer state of some keys, to every worker.

A chunk has J *state keys* (``configure(state_keys=J)``, docs/design.md §2.9). A fetch waits
for the rounds this worker pushed, initialises the chunks' state keys (once each), pushes one
round of zeros into them (the server writes array j of the chunk's optimizer state,
:func:`kvstore_ext.optim.optimizers.flatten_state`, into state key j's stored value in that round)
and pulls them.
"""
import mxnet as mx
from mxnet import nd

__all__ = ['StateFetch']


class StateFetch(object):
    """One worker's state keys.

    Parameters
    ----------
    layout : kvstore_ext.protocol.keys.KeyLayout
        The job's keys.
    """

    def __init__(self, layout):
        self._layout = layout
        self._made = set()   # state keys initialised on the servers

    def plan(self, states, tensor_of):
        """Check `states` (key -> list of arrays) against the keys' tensors (`tensor_of(key)`,
        which raises for an unknown key); return ``[(tensor, j, array)]``.

        Raises
        ------
        ValueError
            If a key has more arrays than J, or an array another number of elements than
            its key.
        """
        plan = []
        for key in sorted(states, key=str):
            tensor = tensor_of(key)
            arrays = list(states[key])
            if len(arrays) > self._layout.state_keys:
                raise ValueError('fetch_optimizer_states: key %r asks for %d state arrays, but '
                                 'the store was configured with state_keys=%d'
                                 % (key, len(arrays), self._layout.state_keys))
            for j, array in enumerate(arrays):
                if array.size != tensor.size:
                    raise ValueError('fetch_optimizer_states: state array %d of key %r has %d '
                                     'elements, the key %d' % (j, key, array.size, tensor.size))
                plan.append((tensor, j, array))
        return plan

    def fetch(self, native, plan):
        """Fill the arrays of `plan` (:meth:`plan`) through `native`; collective (every
        worker fetches the same keys at the same point); returns when they are filled."""
        if not plan:
            return
        # Every round pushed so far is applied on the servers (a push completes when its
        # round is applied), and this worker pushes no later round before the pulls below
        # have returned: the state is exactly the one after this worker's last round.
        nd.waitall()
        keys, buffers, views = [], [], []
        for tensor, j, array in plan:
            buf = nd.zeros(tensor.size, ctx=mx.cpu(), dtype=array.dtype)
            for chunk in tensor.chunks:
                keys.append(self._layout.state_key(chunk.local, j, chunk.server))
                start, stop = tensor.kind.element_range(tensor, chunk)  # rows: §2.10
                views.append(buf[start:stop])
            buffers.append(buf)
        new = [(k, v) for k, v in zip(keys, views) if k not in self._made]
        if new:   # collective: a barrier of all workers (every worker fetches alike)
            native.init([k for k, _ in new], [v for _, v in new])
            self._made.update(k for k, _ in new)
        native.push(keys, views)
        # Into the pushed buffers: MXNet's engine runs the pull after the push is
        # acknowledged, i.e. after the server wrote the state (docs/design.md §2.4).
        native.pull(keys, out=views)
        for (tensor, j, array), buf in zip(plan, buffers):
            buf.reshape(array.shape).copyto(array)
        for _, _, array in plan:
            array.wait_to_read()
