"""A worker that records its timeline (mxdelay.timeline) during warm-up and the delayed
phase, for a 6-layer MLP with one large layer. Writes ``OUT_DIR/timeline<rank>.json``:
the per-step rows of the recording (``mxdelay.timeline.summarize`` with the trainer's
schedule), the per-parameter rows (``parameter_rows``) with the forward order of the
parameters, the mean step time of each phase, the delay and warm-up length, and the
recording's table (``format_table``) as text.

Usage: ``mxdelay-launch -n 2 -s 1 python timeline_job.py MODE OUT_DIR STEPS`` with MODE
``layerwise`` (DelayedTrainer as it is) or ``after_backward`` (the same trainer forced to
push only after backward has fully finished: ``mx.nd.waitall()`` before the pushes) or
``after_grads`` (the same, waiting for the gradients only: ``wait_to_read`` on each).
"""
import mxdelay

import json
import os
import sys
import time

import numpy as np
import mxnet as mx
from mxnet import autograd, gluon, nd

LAYERS = [(2048, 784), (1024, 2048), (512, 1024), (512, 512), (256, 512), (10, 256)]


class PushAfterBackward(mxdelay.DelayedTrainer):
    """The baseline of the overlap benchmark: no push starts before backward has ended.

    ``mx.nd.waitall()`` also waits for everything else queued: in the delayed phase, the
    previous round's pushes (acknowledged when every worker has pushed), which takes away
    the slack between rounds. :class:`PushAfterGradients` waits for backward only.
    """

    def _push_all(self):
        mx.nd.waitall()
        super(PushAfterBackward, self)._push_all()


class PushAfterGradients(mxdelay.DelayedTrainer):
    """Pushes after backward has written every gradient, and waits for nothing else."""

    def _push_all(self):
        for param in self._params:
            if param.grad_req != 'null':
                for grad in param.list_grad():
                    grad.wait_to_read()
        super(PushAfterGradients, self)._push_all()


MODES = {'layerwise': mxdelay.DelayedTrainer, 'after_backward': PushAfterBackward,
         'after_grads': PushAfterGradients}


def main():
    mode, out_dir, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    net = gluon.nn.HybridSequential()
    for units, in_units in LAYERS:
        net.add(gluon.nn.Dense(units, activation='relu' if units > 10 else None,
                               in_units=in_units))
    net.initialize(mx.init.Xavier())
    net.hybridize()
    cls = MODES[mode]
    warmup = steps  # >= 6
    trainer = cls(net.collect_params(), 'sgd', {'learning_rate': 0.01, 'momentum': 0.9},
                  delay=2, warmup_steps=warmup)
    rank = trainer.rank
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    rs = np.random.RandomState(rank)
    x = nd.array(rs.rand(64, 784))
    y = nd.array(rs.randint(0, 10, 64))

    def train(count):
        start = time.time()
        for _ in range(count):
            with autograd.record():
                loss = loss_fn(net(x), y)
            loss.backward()
            trainer.step(64)
            loss.asnumpy()
        return (time.time() - start) / count

    result = {'mode': mode, 'rank': rank}
    train(3)                                                   # not timed
    result['warmup_step_s'] = train(warmup - 3 - trainer.schedule.step)
    # MXNet's profiler writes a complete trace once per process: one recording spanning
    # the last warm-up steps, the switch and the first delayed steps.
    first = trainer.schedule.step
    path = os.path.join(out_dir, '%s-%d.trace.json' % (mode, rank))
    with mxdelay.timeline.recording(path, trainer):
        train(8)
    result['rows'] = mxdelay.timeline.summarize(path, trainer.keys_per_step, trainer.schedule,
                                                first_step=first)
    result['parameter_rows'] = mxdelay.timeline.parameter_rows(path)
    result['forward_order'] = trainer.priority_order()
    result['table'] = mxdelay.timeline.format_table(result['rows'])
    result.update(delay=trainer.schedule.delay, warmup_steps=trainer.schedule.warmup_steps)
    result['delayed_step_s'] = train(10)
    with open(os.path.join(out_dir, 'timeline%d.json' % rank), 'w') as dst:
        json.dump(result, dst)


if __name__ == '__main__':
    main()
