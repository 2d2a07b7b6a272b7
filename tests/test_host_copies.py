"""The engine's copies to host memory of a periodic checkpoint's worker part
(kvstore_ext/checkpoint/host_copies.py, docs/design.md §6.4): each holds its array's value
after the writes queued before it, whatever is queued after, without a wait on this thread;
row_sparse arrays are copied dense, as ``asnumpy`` gives them, and dtypes the engine cannot
write into numpy's memory are copied at once.
"""
import numpy as np
import pytest

import mxdelay  # noqa: F401
import mxnet as mx

from kvstore_ext.checkpoint.host_copies import HostCopies

pytestmark = pytest.mark.timeout(60)


def test_a_copy_holds_the_value_between_the_writes_queued_before_and_after():
    array = mx.nd.zeros((256, 256))
    total = mx.nd.ones((256, 256))
    for _ in range(20):                       # queued before the copy: in it
        total = mx.nd.dot(total, mx.nd.ones((256, 256))) / 256
    total.copyto(array)
    copies = HostCopies()
    host = copies(array)
    mx.nd.elemwise_add(array, mx.nd.ones((256, 256)), out=array)   # queued after: not in it
    copies.wait()
    np.testing.assert_array_equal(host, np.ones((256, 256), dtype=np.float32))
    np.testing.assert_array_equal(array.asnumpy(), np.full((256, 256), 2, dtype=np.float32))


def test_row_sparse_and_other_dtypes():
    dense = np.zeros((4, 3), dtype=np.float32)
    dense[2] = [1, 2, 3]
    sparse = mx.nd.array(dense).tostype('row_sparse')
    small = mx.nd.array([1, -2, 3], dtype='int8')
    copies = HostCopies()
    host_sparse, host_small = copies(sparse), copies(small)
    copies.wait()
    np.testing.assert_array_equal(host_sparse, dense)
    assert host_small.dtype == np.int8 and host_small.tolist() == [1, -2, 3]
