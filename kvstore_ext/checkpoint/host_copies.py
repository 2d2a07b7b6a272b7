"""Copies of NDArrays to host memory by MXNet's engine, for a checkpoint part that a thread
writes while training goes on (docs/design.md §6.4): the Python thread queues the copies
and goes on, the writing thread waits for them.
"""
import numpy as np
from mxnet import nd

__all__ = ['HostCopies']

#: The dtypes that nd.from_numpy wraps without a copy (DLPack's).
_ENGINE_DTYPES = ('float16', 'float32', 'float64', 'int32', 'int64', 'uint8')


class HostCopies(object):
    """Copies of NDArrays to host memory by MXNet's engine (:mod:`mxdelay.autosave`'s).

    ``copies(array)`` returns a numpy array that the engine fills with `array`'s value after
    the writes queued on it so far and before any queued later (one copy; no wait here).
    Read none of them before :meth:`wait`. An array of a dtype the engine cannot write into
    numpy's memory (int8, bfloat16) is copied at once, waiting for its writes.
    """

    def __init__(self):
        self._targets = []

    def __call__(self, array):
        if array.stype != 'default':
            array = array.tostype('default')   # as asnumpy gives a row_sparse array
        host = np.empty(array.shape, dtype=array.dtype)
        if not host.size or str(host.dtype) not in _ENGINE_DTYPES:
            return array.asnumpy()
        target = nd.from_numpy(host, zero_copy=True)   # the engine writes `host`
        array.copyto(target)
        self._targets.append(target)
        return host

    def wait(self):
        """Wait until every copy is written (any thread)."""
        for target in self._targets:
            target.wait_to_read()
        self._targets = []
