"""A worker that makes calls MXNet's kvstore rejects, and reports what each raised.

Usage: ``mxdelay-launch -n 1 -s 1 python bad_calls_job.py STORE``; STORE is ``dist_sync``
(MXNet's own store and servers: nothing of mxdelay is imported) or ``dist_delay``. Each call
of :data:`CALLS` runs on keys of its own, its asynchronous errors waited for, and the worker
prints one JSON line ``RESULT {name: [exception class names (MRO), message] or None}``
(tests/test_error_types.py compares the stores' lines).
"""
import sys

if sys.argv[1] == 'dist_delay':
    import mxdelay  # noqa: F401  mxdelay's servers and store

import json  # noqa: E402

import mxnet as mx  # noqa: E402
from mxnet import nd  # noqa: E402

SHAPE = (2, 3)


def _rsp():
    return nd.ones(SHAPE).tostype('row_sparse')


def pull_unknown(kv):
    kv.pull('never_initialised', out=nd.zeros(SHAPE))


def push_unknown(kv):
    kv.push('never_initialised', nd.ones(SHAPE))


def row_sparse_pull_unknown(kv):
    kv.row_sparse_pull('never_initialised', out=_rsp(), row_ids=nd.array([0, 1]))


def init_twice(kv):
    kv.init('twice', nd.ones(SHAPE))
    kv.init('twice', nd.ones(SHAPE))


def pull_sparse_not_ignored(kv):
    kv.init('sparse_pull', _rsp())
    kv.pull('sparse_pull', out=_rsp(), ignore_sparse=False)


def row_sparse_pull_dense_out(kv):
    kv.init('rsp_dense_out', _rsp())
    kv.row_sparse_pull('rsp_dense_out', out=nd.zeros(SHAPE), row_ids=nd.array([0, 1]))


def row_sparse_pull_without_row_ids(kv):
    kv.init('rsp_no_ids', _rsp())
    kv.row_sparse_pull('rsp_no_ids', out=_rsp())


def push_wrong_shape(kv):
    kv.init('push_shape', nd.ones(SHAPE))
    kv.push('push_shape', nd.ones((3, 2)))


def pull_wrong_shape(kv):
    kv.init('pull_shape', nd.ones(SHAPE))
    kv.pull('pull_shape', out=nd.zeros((3, 2)))


def row_sparse_pull_dense_key(kv):
    kv.init('dense_rsp_pull', nd.ones(SHAPE))
    kv.row_sparse_pull('dense_rsp_pull', out=_rsp(), row_ids=nd.array([0, 1]))


def push_dense_to_row_sparse(kv):
    kv.init('rsp_dense_push', _rsp())
    kv.push('rsp_dense_push', nd.ones(SHAPE))


def set_optimizer_not_an_optimizer(kv):
    kv.set_optimizer('sgd')


#: name -> a call that MXNet's 'dist_sync' rejects (tests/test_error_types.py checks that it
#: does, on a stock job).
CALLS = {f.__name__: f for f in (pull_unknown, push_unknown, row_sparse_pull_unknown,
                                 init_twice, pull_sparse_not_ignored, row_sparse_pull_dense_out,
                                 row_sparse_pull_without_row_ids, push_wrong_shape,
                                 pull_wrong_shape, row_sparse_pull_dense_key,
                                 push_dense_to_row_sparse, set_optimizer_not_an_optimizer)}


def main():
    kv = mx.kv.create(sys.argv[1])
    results = {}
    for name in sys.argv[2:] or CALLS:
        call = CALLS[name]
        try:
            call(kv)
            nd.waitall()   # an error of the engine is raised here
            results[name] = None
        except Exception as err:  # pylint: disable=broad-except
            # MXNet's messages start with the C++ traceback; its last line says what failed.
            results[name] = [[cls.__name__ for cls in type(err).__mro__],
                             (str(err).strip().splitlines() or [''])[-1][:300]]
    print('RESULT ' + json.dumps(results), flush=True)


if __name__ == '__main__':
    main()
