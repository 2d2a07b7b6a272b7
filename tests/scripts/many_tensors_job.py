"""A worker of tests/test_limits.py: a model of many small parameter tensors.

Usage: ``mxdelay-launch -n N -s S python many_tensors_job.py CONFIG_JSON OUT_DIR``. CONFIG:
``tensors`` (parameter count), ``size`` (elements of each), ``steps``, ``delay``,
``warmup_steps``, ``lr``, ``momentum``, and ``sampled`` (optional: record only the elements of
:func:`sample_indices`, for models too big to record whole). Parameter i is ``p<i>`` (shape ``(size,)``), its
initial value :func:`init_params`; the loss of worker r at step t is
``sum_i sum(x_i * p_i + p_i * p_i / 2)`` with ``x`` = :func:`data`, so its gradient is
``x_i + p_i`` (:func:`numpy_grad`), which tests/reference.py replays. Each worker writes
``OUT_DIR/worker<rank>.npz``: every parameter after every step, as one array
``(steps, tensors, size)`` (``(steps, tensors, len(sample_indices(size)))`` when sampled).
"""
import mxdelay  # noqa: F401  before mxnet: servers become mxdelay's

import json
import os
import sys

import numpy as np
import mxnet as mx
from mxnet import autograd, gluon, nd


def name(i):
    return 'p%04d' % i


def init_params(tensors, size):
    rs = np.random.RandomState(3)
    return {name(i): rs.randn(size).astype(np.float32) * 0.5 for i in range(tensors)}


def data(tensors, size, rank, step):
    rs = np.random.RandomState(7919 * step + 13 * rank + 1)
    return rs.randn(tensors, size).astype(np.float32)


def sample_indices(size, chunk_size=524288):
    """Elements recorded of each parameter in a sampled run: every 1009th, the last, and both
    sides of every boundary of the store's chunks (`chunk_size`, its default), so that every
    chunk of every parameter is seen. The gradient is elementwise, so the reference can replay
    these elements alone."""
    picked = set(range(0, size, 1009)) | {size - 1}
    for boundary in range(chunk_size, size, chunk_size):
        picked |= {boundary - 1, boundary}
    return np.array(sorted(picked))


def numpy_grad(weights, x):
    return {n: x[i] + weights[n] for i, n in enumerate(sorted(weights))}


class Many(gluon.Block):
    def __init__(self, tensors, size):
        super(Many, self).__init__(prefix='')
        self.names = [name(i) for i in range(tensors)]
        for n in self.names:
            self.params.get(n, shape=(size,))

    def forward(self, x):  # pylint: disable=arguments-differ
        loss = None
        for i, n in enumerate(self.names):
            p = self.params.get(n).data()
            term = (x[i] * p + 0.5 * p * p).sum()
            loss = term if loss is None else loss + term
        return loss


def main():
    config, out_dir = json.loads(sys.argv[1]), sys.argv[2]
    tensors, size = config['tensors'], config['size']
    net = Many(tensors, size)
    net.initialize(mx.init.Zero())
    for n, value in init_params(tensors, size).items():
        net.params.get(n).set_data(nd.array(value))
    trainer = mxdelay.DelayedTrainer(
        net.collect_params(), 'sgd', {'learning_rate': config['lr'],
                                      'momentum': config['momentum']},
        kvstore='dist_delay', delay=config['delay'], warmup_steps=config['warmup_steps'])
    rank = trainer.rank
    history = []
    params = [net.params.get(n) for n in net.names]
    picked = nd.array(sample_indices(size)) if config.get('sampled') else None
    for step in range(config['steps']):
        x = nd.array(data(tensors, size, rank, step))
        with autograd.record():
            loss = net(x)
        loss.backward()
        trainer.step(1)
        stacked = [p.data() if picked is None else nd.take(p.data(), picked) for p in params]
        history.append(nd.stack(*stacked).asnumpy())   # one wait a step
    np.savez(os.path.join(out_dir, 'worker%d.npz' % rank), weights=np.array(history))


if __name__ == '__main__':
    main()
