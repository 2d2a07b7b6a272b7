"""Worker for quick throughput probes: the Fashion-MNIST MLP on fixed random batches.

Usage: ``mxdelay-launch -n 2 -s 1 python mlp_speed.py MODE STEPS OUT_JSON`` with MODE
``sync`` (gluon.Trainer on dist_sync), ``delay<k>`` (DelayedTrainer, delay k, warm-up 20)
or ``compute`` (no communication at all). A ``-amp`` suffix (``delay4-amp``) adds AMP's
dynamic loss scaling with no operator cast (float32 arithmetic: only the cost of the
overflow machinery, docs/design.md §11).
"""
import json
import time

from positional import positional

ARGS = positional(__doc__, 3)

import mxdelay  # noqa: F401,E402

import numpy as np
import mxnet as mx
from mxnet import autograd, gluon, nd


def main():
    mode, steps, out = ARGS[0], int(ARGS[1]), ARGS[2]
    use_amp = mode.endswith('-amp')
    mode = mode[:-len('-amp')] if use_amp else mode
    if use_amp:
        from mxnet.contrib import amp  # pylint: disable=import-outside-toplevel
        amp.init(target_dtype='bfloat16', target_precision_ops=[], conditional_fp32_ops=[],
                 fp32_ops=[])
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(1024, activation='relu', in_units=784),
            gluon.nn.Dense(1024, activation='relu', in_units=1024),
            gluon.nn.Dense(10, in_units=1024))
    net.initialize(mx.init.Xavier())
    net.hybridize()
    opt = {'learning_rate': 0.05, 'momentum': 0.9}
    if mode == 'sync':
        trainer = gluon.Trainer(net.collect_params(), 'sgd', opt, kvstore='dist_sync')
    elif mode == 'compute':
        trainer = gluon.Trainer(net.collect_params(), 'sgd', opt, kvstore=None)
    else:
        trainer = mxdelay.DelayedTrainer(net.collect_params(), 'sgd', opt, kvstore='dist_delay',
                                         delay=int(mode[5:]), warmup_steps=20)
    if use_amp:
        amp.init_trainer(trainer)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    rs = np.random.RandomState(0)
    x = nd.array(rs.rand(128, 784))
    y = nd.array(rs.randint(0, 10, 128))
    times = []
    for step in range(steps):
        start = time.time()
        with autograd.record():
            loss = loss_fn(net(x), y)
            if use_amp:
                with amp.scale_loss(loss, trainer) as scaled:
                    scaled.backward()
        if not use_amp:
            loss.backward()
        trainer.step(128)
        loss.asnumpy()   # a real loop reads its loss: this is where waiting shows
        times.append(time.time() - start)
    rank = trainer._kvstore.rank if trainer._kvstore else int(mxdelay.env.get('MXDELAY_RANK'))
    with open(out + '.%s' % rank, 'w') as dst:
        json.dump({'mode': mode + ('-amp' if use_amp else ''), 'times': times}, dst)


if __name__ == '__main__':
    main()
