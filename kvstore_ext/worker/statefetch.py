"""The optimizer-state fetch: the store's ``state_fetch`` part
(``DistDelay.delayed.state_fetch``), the servers' optimizer state of some keys, to every
worker.

A chunk has J *state keys* (``settings.configure(state_keys=J)``, docs/design.md §2.9). A
fetch waits for the rounds this worker pushed, initialises the chunks' state keys (once
each), pushes one round of zeros into them (the server writes array j of the chunk's
optimizer state, :func:`kvstore_ext.optim.optimizers.flatten_state`, into state key j's
stored value in that round) and pulls them.
"""
import mxnet as mx
from mxnet import nd

__all__ = ['StateFetch']


class StateFetch(object):
    """One worker's state keys on `session` (:class:`kvstore_ext.worker.session.Session`)."""

    def __init__(self, session):
        self._session = session
        self._made = set()   # state keys initialised on the servers

    def fetch_optimizer_states(self, states):
        """Fill arrays with the servers' optimizer state of their keys; collective.

        Every worker calls it at the same point (a trainer: at its switch step), with the
        same keys. For each key, ``states[key][j]`` (an array of the key's shape) receives
        array j of the servers' optimizer state of that key
        (:func:`kvstore_ext.optim.optimizers.flatten_state` of ``Updater.states``, chunk by
        chunk), as it is after every round this worker has pushed (docs/design.md §2.9). It
        waits for those rounds, then initialises the chunks' state keys, pushes one round of
        zeros into them (the server writes the state into the keys' stored values in that
        round) and pulls them; it returns when the arrays are filled.

        Parameters
        ----------
        states : dict
            key -> list of at most J (``settings.configure(state_keys=J)``) NDArrays.

        Raises
        ------
        ValueError
            If a key has more arrays than J, or an array another number of elements than
            its key.
        KeyError
            If a key was not initialised (:class:`UnknownKeyError
            <kvstore_ext.worker.store_errors.UnknownKeyError>`).
        """
        self._session.ensure_started()
        self._fetch(self._plan(states))

    def _plan(self, states):
        """Check `states` (key -> list of arrays) against the keys' tensors; return
        ``[(tensor, j, array)]``.

        Raises
        ------
        ValueError
            If a key has more arrays than J, or an array another number of elements than
            its key.
        """
        plan = []
        layout = self._session.placement.layout
        for key in sorted(states, key=str):
            tensor = self._session.tensor(key)
            arrays = list(states[key])
            if len(arrays) > layout.state_keys:
                raise ValueError('fetch_optimizer_states: key %r asks for %d state arrays, but '
                                 'the store was configured with state_keys=%d'
                                 % (key, len(arrays), layout.state_keys))
            for j, array in enumerate(arrays):
                if array.size != tensor.size:
                    raise ValueError('fetch_optimizer_states: state array %d of key %r has %d '
                                     'elements, the key %d' % (j, key, array.size, tensor.size))
                plan.append((tensor, j, array))
        return plan

    def _fetch(self, plan):
        """Fill the arrays of `plan` (:meth:`_plan`); collective (every worker fetches the
        same keys at the same point); returns when they are filled."""
        if not plan:
            return
        native, layout = self._session.native, self._session.placement.layout
        # Every round pushed so far is applied on the servers (a push completes when its
        # round is applied), and this worker pushes no later round before the pulls below
        # have returned: the state is exactly the one after this worker's last round.
        nd.waitall()
        keys, buffers, views = [], [], []
        for tensor, j, array in plan:
            buf = nd.zeros(tensor.size, ctx=mx.cpu(), dtype=array.dtype)
            for chunk in tensor.chunks:
                keys.append(layout.state_key(chunk.local, j, chunk.server))
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
