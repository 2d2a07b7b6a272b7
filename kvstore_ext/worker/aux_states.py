"""The data path of aux keys: states that are averaged over the workers, never trained.

A Gluon Parameter with ``differentiable=False`` (BatchNorm's running mean and variance) is
an *aux state*: each worker updates its own in its forward passes, and no gradient exists.
Gluon's trainer initialises it on the store like a weight (rank 0's value, broadcast), so
its key is placed at ``init`` like any dense key, but with this kind (docs/design.md §2.13):

- it registers with ``{'aux': True}`` (:data:`kvstore_ext.protocol.commands.AUX_SETTINGS`): the servers keep
  the round's sum, with no optimizer;
- its pushes are not encoded by the job's codec (no float16 copy, no residual, no batch-size
  factor) and its pulls read its slot keys (no pull keys, no model key);
- its rounds are not the job's training rounds: they are not flagged on the finish counter,
  padded at exit or counted in a checkpoint's flagged rounds. One round is one
  :meth:`Averaging.average` (the store's ``aux`` part, ``DistDelay.delayed.aux``), which
  every worker calls at the same point (collective);
- where MXNet's native store quantizes every push (``'2bit'``), the values go to the servers
  in a command (:meth:`AuxKeys.command_body`) and the round's pushes are zeros, which
  survive the quantization exactly.
"""
import numpy as np
from mxnet import nd

from kvstore_ext import codecs
from kvstore_ext.protocol.commands import AUX_SETTINGS, Command
from kvstore_ext.worker.arguments import listed
from kvstore_ext.worker.wires.slots import SlotWire

__all__ = ['AuxKeys', 'Averaging', 'is_aux']


def is_aux(param):
    """Whether Gluon Parameter `param` (or None: a key that is no Parameter) is an aux state:
    ``differentiable=False``, not a frozen weight (``grad_req='null'`` on a differentiable
    Parameter is a weight that is not trained now, and keeps its value)."""
    return param is not None and getattr(param, '_differentiable', True) is False


class AuxKeys(SlotWire):
    """The data path of aux keys, chosen at ``init`` for an aux state's key.

    Parameters
    ----------
    native : mxnet.kvstore.KVStore
        The worker's native distributed store.
    slots : int
        R, slot keys per chunk.
    """

    #: Its rounds are not training rounds (:class:`kvstore_ext.worker.wires.base.KeyKind`).
    trained = False

    def __init__(self, native, slots):
        # No codec: pushed in their own dtype, placed without pull keys, no residual; a
        # push and a pull of their own (average), never a pushpull in a training round.
        super(AuxKeys, self).__init__(native, slots, codecs.NONE)

    def server_settings(self):
        """``{'aux': True}``: the servers keep the sum of each round."""
        return dict(AUX_SETTINGS)

    @staticmethod
    def contribution(arrays):
        """This worker's value of an aux state held in `arrays` (one per device): their
        mean (float32 sum in device order, divided by float32(D)); the array for D = 1."""
        if len(arrays) == 1:
            return arrays[0]
        first = arrays[0].context
        return nd.add_n(*[a.as_in_context(first) for a in arrays]) / np.float32(len(arrays))

    @staticmethod
    def command_body(tensors, contributions):
        """The ``AUX`` command's ``chunks`` for `tensors` and this worker's `contributions`
        (one NDArray each): chunk id -> its float32 values, as JSON numbers."""
        chunks = {}
        for tensor, mine in zip(tensors, contributions):
            flat = mine.asnumpy().reshape(-1).astype(np.float32)
            for chunk in tensor.chunks:
                # float32 -> Python float (float64) -> JSON -> float32: exact
                chunks[str(chunk.chunk_id)] = flat[chunk.start:chunk.stop].tolist()
        return chunks

    def average(self, tensors, arrays, pushed, num_workers, priority):
        """Replace each of `arrays` (per tensor, one array per device) by the mean over the
        workers; collective. Waits for the result.

        For each tensor the worker pushes its `pushed` array (its :meth:`contribution`, or
        zeros when the values went by command) as round ``tensor.next_round`` and pulls the
        round's sum, all issued before any wait; then it divides each sum by
        ``float32(num_workers)`` and copies it into the tensor's arrays.
        """
        totals = []
        for tensor, mine in zip(tensors, pushed):
            self.push(tensor, [mine], priority)
            totals.append(nd.zeros(tensor.shape, dtype=tensor.dtype))
            self.pull(tensor, [totals[-1]], priority)
        for total, copies in zip(totals, arrays):
            mean = total / np.float32(num_workers)
            for array in copies:
                mean.copyto(array)
        for copies in arrays:
            for array in copies:
                array.wait_to_read()


class Averaging(object):
    """The aux states of `session` (:class:`kvstore_ext.worker.session.Session`), averaged
    over the workers."""

    def __init__(self, session):
        self._session = session

    def average(self, key, value, priority=0):
        """Replace aux states `value` by their mean over the workers; collective.

        Every worker calls it at the same point, with the same keys: for each key it pushes
        its own value (the mean over its devices when `value` lists one array per device) in
        a round of the key's own, pulls the round's sum and writes ``sum / float32(N)`` into
        every array (docs/design.md §2.13). Not compressed; not a training round (the finish
        counter and the other keys' rounds are untouched). Returns when `value` is written.

        Parameters
        ----------
        key : int or str, or list of them
            Keys initialised for Parameters with ``differentiable=False`` (their optimizer's
            ``param_dict`` says so when the key is placed).
        value : NDArray, or list of them (one per device; a list per key)

        Where MXNet's native store quantizes every push (``'2bit'``), the values go to the
        servers in one command (JSON), and the rounds push zeros, which survive that exactly.

        Raises
        ------
        ValueError
            If a key is not an aux key.
        """
        session = self._session
        keys, values = session.checked_lists(key, value, 'value', priority)
        for k in keys:
            if session.tensors[k].kind is not session.aux:
                raise ValueError('key %r does not hold aux states: average() takes the keys of '
                                 'Parameters with differentiable=False (BatchNorm\'s running '
                                 'mean and variance), placed as such at init' % (k,))
        tensors = [session.tensors[k] for k in keys]
        arrays = [listed(v) for v in values]
        mine = [session.aux.contribution(copies) for copies in arrays]
        if session.settings.codec.exact_pushes:
            pushed = mine
        else:
            session.command(Command.AUX, {'chunks': session.aux.command_body(tensors, mine)},
                            refusal=ValueError)
            pushed = [tensor.zeros() for tensor in tensors]
        session.aux.average(tensors, arrays, pushed, session.num_workers, priority)
