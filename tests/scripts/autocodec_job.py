"""A worker of tests/test_autocodec.py: a 784-256-10 MLP (203k parameters, enough that the
codecs matter to compression_params='auto') on data that is a pure function of (rank, step),
trained by DelayedTrainer; it logs at INFO (auto's measurements and choice) and saves its
final weights.

Usage: autocodec_job.py CONFIG_JSON OUT_DIR, CONFIG with ``compression`` and
``pull_compression`` (the trainer's arguments, e.g. "auto"), ``optimizer`` ('sgd'),
``steps`` (8), ``delay`` (2), ``warmup_steps`` (3), ``slack`` (None), and
``checkpoint_dir`` with ``checkpoint_every`` (the job then resumes from the newest checkpoint
there and skips the steps it holds), ``save_states`` ([path, step]: ``trainer.save_states``
before that step) and ``load_states`` ([path, step]: ``trainer.load_states`` before the first
step, which is then that step). Writes OUT_DIR/worker<rank>.npz.
"""
import json
import logging
import os
import sys

import mxdelay  # noqa: F401  (before mxnet)
import numpy as np
import mxnet as mx
from mxnet import autograd, gluon, nd

logging.basicConfig(level=logging.INFO, format='%(name)s: %(message)s')


def main():
    config, out = json.loads(sys.argv[1]), sys.argv[2]
    mx.random.seed(1)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(256, in_units=784, activation='tanh'), gluon.nn.Dense(10, in_units=256))
    net.initialize(mx.init.Xavier(rnd_type='uniform'))
    for name, param in sorted(net.collect_params().items()):
        param.set_data(nd.array(np.random.RandomState(len(name)).uniform(
            -0.05, 0.05, param.shape).astype(np.float32)))
    optimizer_params = {'learning_rate': 0.05}
    if config.get('optimizer', 'sgd') == 'sgd':
        optimizer_params['momentum'] = 0.9
    trainer = mxdelay.DelayedTrainer(
        net.collect_params(), config.get('optimizer', 'sgd'), optimizer_params,
        compression_params=config.get('compression'),
        pull_compression=config.get('pull_compression'), delay=config.get('delay', 2),
        warmup_steps=config.get('warmup_steps', 3), slack=config.get('slack'),
        checkpoint_dir=config.get('checkpoint_dir'),
        checkpoint_every=config.get('checkpoint_every'))
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    rank, first = None, 0
    if config.get('checkpoint_dir'):
        first, rank = trainer.resumed_step, trainer.rank   # resumes: skip what it had done
    if config.get('load_states'):
        path, first = config['load_states']
        trainer.load_states(path)
        rank = trainer.rank
    save_path, save_step = config.get('save_states') or (None, None)
    for step in range(first, config.get('steps', 8)):
        if step == save_step:
            trainer.save_states(save_path)
        rs = np.random.RandomState(1000 * step + (rank or 0) + 1)
        x = nd.array(rs.randn(16, 784).astype(np.float32))
        y = nd.array(rs.randint(0, 10, 16).astype(np.float32))
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(16)
        rank = trainer.rank   # known after the first step; its data from the second
    trainer.sync_weights()
    np.savez(os.path.join(out, 'worker%d.npz' % trainer.rank),
             **{name: p.data().asnumpy() for name, p in net.collect_params().items()})


if __name__ == '__main__':
    main()
