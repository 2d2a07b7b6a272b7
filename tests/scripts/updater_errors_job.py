"""A worker whose kvstore optimizer (tests/scripts/user_optimizer.py) fails on row_sparse keys.

Usage: ``mxdelay-launch -n N -s S python updater_errors_job.py STORE ROUNDS``; STORE is
``dist_sync`` (MXNet's store and servers, nothing of mxdelay) or ``dist_delay``. Each worker
sets the optimizer (``rescale_grad`` 0.5) on the store, initialises a dense key ``'dense'`` and
a row_sparse key ``'emb'`` (4 x 3 ones), and in each round t pushes ``rank + 1 + t`` into
every element of ``'dense'`` and into row ``rank % 4`` of ``'emb'``, then pulls both (a pull
waits for the round). Prints ``RESULT {"rank", "dense": [[...]], "emb": [[...]]}``: the
weights after the last round.
"""
import sys

if sys.argv[1] == 'dist_delay':
    import mxdelay  # noqa: F401  mxdelay's servers and store

import json  # noqa: E402

import mxnet as mx  # noqa: E402
from mxnet import nd  # noqa: E402

import user_optimizer  # noqa: E402,F401  registers 'failsonrowsparse'

SHAPE = (4, 3)


def main():
    store, rounds = sys.argv[1], int(sys.argv[2])
    kv = mx.kv.create(store)
    kv.set_optimizer(mx.optimizer.create('failsonrowsparse', rescale_grad=0.5))
    kv.init('dense', nd.ones(SHAPE))
    kv.init('emb', nd.ones(SHAPE).tostype('row_sparse'))
    dense = nd.zeros(SHAPE)
    emb = nd.sparse.zeros('row_sparse', SHAPE)
    for t in range(rounds):
        value = kv.rank + 1 + t
        kv.push('dense', nd.full(SHAPE, value))
        grad = nd.zeros(SHAPE)
        grad[kv.rank % SHAPE[0]] = value
        kv.push('emb', grad.tostype('row_sparse'))
        kv.pull('dense', out=dense)
        kv.row_sparse_pull('emb', out=emb, row_ids=nd.arange(SHAPE[0], dtype='int64'))
        emb.wait_to_read()
    print('RESULT ' + json.dumps({'rank': kv.rank, 'dense': dense.asnumpy().tolist(),
                                  'emb': emb.asnumpy().tolist()}), flush=True)


if __name__ == '__main__':
    main()
