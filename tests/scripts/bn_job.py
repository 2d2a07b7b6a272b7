"""A worker of the aux-state job test: a Gluon net with BatchNorm trained by DelayedTrainer
on data that differs per rank, so that every worker's running statistics differ; then
``sync_weights(aux_states=True)``.

Usage: ``mxdelay-launch -n N -s S python bn_job.py OUT_DIR STEPS [COMPRESSION_JSON]``
(the trainer's ``compression_params``, e.g. ``'{"type": "2bit", "threshold": 0.5}'``; default
none). Each worker writes
``OUT_DIR/worker<rank>.npz``: ``pre_<name>`` and ``post_<name>`` for every parameter (its
first device's copy) before and after the sync.
"""
import mxdelay  # noqa: F401  before mxnet: servers become mxdelay's

import json
import os
import sys

import numpy as np
import mxnet as mx
from mxnet import autograd, gluon, nd


def main():
    out_dir, steps = sys.argv[1], int(sys.argv[2])
    compression = json.loads(sys.argv[3]) if len(sys.argv) > 3 else None
    mx.random.seed(7)   # the same initial weights on every worker (rank 0's are broadcast)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(6, in_units=4), gluon.nn.BatchNorm(in_channels=6),
            gluon.nn.Dense(2, in_units=6))
    net.initialize(mx.init.Xavier())
    trainer = mxdelay.DelayedTrainer(net.collect_params(), 'sgd',
                                     {'learning_rate': 0.1, 'momentum': 0.9},
                                     kvstore='dist_delay', delay=2, warmup_steps=1,
                                     compression_params=compression)
    rank = trainer.rank
    rs = np.random.RandomState(rank)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    for _ in range(steps):
        x = nd.array(rs.randn(8, 4) * (1 + rank) + rank)   # each rank its own statistics
        y = nd.array(rs.randint(0, 2, size=8))
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(8)
    params = net.collect_params()
    record = {'pre_' + name: p.data().asnumpy() for name, p in params.items()}
    trainer.sync_weights(aux_states=True)
    record.update({'post_' + name: p.data().asnumpy() for name, p in params.items()})
    np.savez(os.path.join(out_dir, 'worker%d.npz' % rank), **record)


if __name__ == '__main__':
    main()
