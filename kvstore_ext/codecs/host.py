"""An NDArray's host memory as a numpy array, without a copy: what the codec kernels
(:mod:`kvstore_ext.codecs.kernels`) read and write.

``asnumpy()`` copies (a pass over memory as long as the kernels' own), and ``arr[:] = x``
is one more. :func:`view` waits, as those do, until MXNet's engine is done with the array,
then hands its memory to numpy: the caller reads (or writes) it on the Python thread before
it queues anything else on the array. :func:`readable` says which arrays it can view: the
codecs pick their path by it (a kernel on the host's memory, else MXNet's operators on the
array's device, docs/design.md §2.15).
"""
import ctypes

import numpy as np
from mxnet.base import _LIB, check_call

__all__ = ['readable', 'view']

#: The devices whose memory the Python thread can read.
_HOST = ('cpu', 'cpu_pinned', 'cpu_shared')


def readable(context):
    """Whether an array on `context` lies in host memory (:func:`view` can read it): the CPU
    contexts, pinned and shared memory included; not a GPU."""
    return context.device_type in _HOST


def view(array, write=False):
    """The memory of `array` (a dense NDArray on the CPU) as a flat numpy array of its dtype,
    after its pending writes (with `write`: its pending reads too, and the view is
    writeable). The view keeps `array` alive.

    Raises
    ------
    ValueError
        If `array` is not on the CPU (a GPU's memory has no host address).
    """
    if not readable(array.context):
        raise ValueError('view: the array is on %s; copy it to the CPU first '
                         '(array.as_in_context(mx.cpu()))' % (array.context,))
    wait = _LIB.MXNDArrayWaitToWrite if write else _LIB.MXNDArrayWaitToRead
    check_call(wait(array.handle))
    dtype = np.dtype(array.dtype)
    if not array.size:
        return np.empty(0, dtype=dtype)
    pointer = ctypes.c_void_p()
    check_call(_LIB.MXNDArrayGetData(array.handle, ctypes.byref(pointer)))
    memory = (ctypes.c_char * (array.size * dtype.itemsize)).from_address(pointer.value)
    memory.owner = array   # numpy keeps `memory`, which keeps the NDArray and its memory
    out = np.frombuffer(memory, dtype=dtype)
    out.flags.writeable = write
    return out
