"""The data path of aux keys: states that are averaged over the workers, never trained.

A Gluon Parameter with ``differentiable=False`` (BatchNorm's running mean and variance) is
an *aux state*: each worker updates its own in its forward passes, and no gradient exists.
Gluon's trainer initialises it on the store like a weight (rank 0's value, broadcast), so
its key is placed at ``init`` like any dense key, but with this kind (docs/design.md §2.13):

- it registers with ``{'aux': True}`` (:data:`kvstore_ext.appliers.AUX`): the servers keep
  the round's sum, with no optimizer;
- its pushes are not encoded by the job's codec (no float16 copy, no residual, no batch-size
  factor) and its pulls read its slot keys (no pull keys, no model key);
- its rounds are not the job's training rounds: they are not flagged on the finish counter,
  padded at exit or counted in a checkpoint's flagged rounds. One round is one
  :meth:`AuxKeys.average`, which every worker calls at the same point (collective).
"""
import numpy as np
from mxnet import nd

from . import appliers, compression
from .dense import DenseKeys

__all__ = ['AuxKeys', 'is_aux']


def is_aux(param):
    """Whether Gluon Parameter `param` (or None: a key that is no Parameter) is an aux state:
    ``differentiable=False``, not a frozen weight (``grad_req='null'`` on a differentiable
    Parameter is a weight that is not trained now, and keeps its value)."""
    return param is not None and getattr(param, '_differentiable', True) is False


class AuxKeys(DenseKeys):
    """The data path of aux keys, chosen at ``init`` for an aux state's key.

    Parameters
    ----------
    native : mxnet.kvstore.KVStore
        The worker's native distributed store.
    slots : int
        R, slot keys per chunk.
    """

    #: Its rounds are not training rounds (:class:`kvstore_ext.dense.KeyKind`).
    trained = False

    def __init__(self, native, slots):
        # No codec: pushed in their own dtype, placed without pull keys, no residual.
        super(AuxKeys, self).__init__(native, slots, compression.NONE)

    def server_settings(self):
        """``{'aux': True}``: the servers keep the sum of each round."""
        return dict(appliers.AUX)

    def average(self, tensor, arrays, num_workers, priority):
        """Replace `arrays` (one per device) by the mean over the workers of each worker's
        mean over its devices; collective. Waits for the result.

        The worker pushes its devices' mean (their sum divided by the number of devices, in
        float32) as round ``tensor.next_round``, pulls the round's sum and divides it by
        ``float32(num_workers)``.
        """
        if len(arrays) == 1:
            mine = arrays[0]
        else:
            first = arrays[0].context
            mine = nd.add_n(*[a.as_in_context(first) for a in arrays]) / np.float32(len(arrays))
        self.push(tensor, [mine], priority)
        total = nd.zeros(tensor.shape, dtype=tensor.dtype)
        self.pull(tensor, [total], priority)
        mean = total / np.float32(num_workers)
        for array in arrays:
            mean.copyto(array)
        for array in arrays:
            array.wait_to_read()
