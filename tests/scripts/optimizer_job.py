"""A worker of the optimizer-mismatch tests (tests/test_optimizer_mismatch.py).

Usage: ``mxdelay-launch -n N -s S python optimizer_job.py CONFIG_JSON OUT_DIR``.

CONFIG keys:

- ``mode``: ``'trainer'`` (DelayedTrainer on mlp_job's MLP) or ``'kvstore'`` (a bare
  ``'dist_delay'`` kvstore: ``init`` first, so the hand-shake carries no optimizer, then
  ``set_optimizer``);
- ``optimizer`` (a name for ``mx.optimizer.create``), ``optimizer_params`` (dict), and
  ``by_launcher_rank`` ({launcher rank: {key: value}} overrides for one worker);
- trainer mode: ``steps``, ``batch``, ``delay``, ``warmup_steps``; ``save_to`` (a checkpoint
  written after the last step), ``load_from`` (given to ``load_states`` after the first
  step; the exception is caught and written to ``load.worker<rank>.json`` with whether the
  weights stayed as they were), ``reset_optimizer`` (optimizer params: after the steps,
  ``set_optimizer`` of a new optimizer on the kvstore, which must fail), ``change_at``
  (after that step: ``set_learning_rate(change_lr)`` and batches of ``change_batch``; the
  servers' learning rate then differs from the optimizer first sent, and this worker's
  rescale_grad from the job's).

Every uncaught exception ends the worker with exit code 1 (mxdelay's excepthook).
"""
import mxdelay  # noqa: F401  before mxnet: the scheduler and servers become mxdelay's

import json
import os
import sys

import numpy as np
import mxnet as mx
from mxnet import autograd, gluon, nd

from fault_job import build  # noqa: E402
from mlp_model import batch, weights_of  # noqa: E402


def write_json(path, value):
    tmp = '%s.tmp%d' % (path, os.getpid())
    with open(tmp, 'w', encoding='utf-8') as out:
        json.dump(value, out)
    os.replace(tmp, path)


def run_kvstore(config):
    kv = mx.kv.create('dist_delay')
    kv.init(0, nd.zeros(4))
    kv.set_optimizer(mx.optimizer.create(config['optimizer'], **config['optimizer_params']))
    kv.push(0, nd.ones(4))
    out = nd.zeros(4)
    kv.pull(0, out=out)
    print('pulled %s' % out.asnumpy().tolist())


def run_trainer(config, out_dir):
    net = build()
    trainer = mxdelay.DelayedTrainer(net.collect_params(), config['optimizer'],
                                     dict(config['optimizer_params']),
                                     delay=config['delay'], warmup_steps=config['warmup_steps'],
                                     local_rule=config.get('local_rule', 'mirror'))
    rank = trainer.rank
    loss_fn = gluon.loss.L2Loss()
    size = config['batch']
    for step in range(config['steps']):
        x, y = batch(rank, step, size)
        with autograd.record():
            loss = loss_fn(net(nd.array(x)), nd.array(y))
        loss.backward()
        trainer.step(size)
        print('step %d done' % step)
        if step == config.get('change_at'):
            trainer.set_learning_rate(config['change_lr'])
            size = config['change_batch']
        if step == 0 and config.get('load_from'):
            before = weights_of(net)
            try:
                trainer.load_states(config['load_from'])
                outcome = {'type': None, 'message': None}
            except Exception as err:  # pylint: disable=broad-except
                outcome = {'type': type(err).__name__, 'message': str(err)}
            after = weights_of(net)
            outcome['weights_unchanged'] = all(np.array_equal(before[n], after[n])
                                               for n in before)
            write_json(os.path.join(out_dir, 'load.worker%d.json' % rank), outcome)
    if config.get('save_to'):
        trainer.save_states(config['save_to'])
    if config.get('reset_optimizer') is not None:
        trainer._kvstore.set_optimizer(  # pylint: disable=protected-access
            mx.optimizer.create(config['optimizer'], **config['reset_optimizer']))


def main():
    config, out_dir = json.loads(sys.argv[1]), sys.argv[2]
    config.update(config.get('by_launcher_rank', {}).get(os.environ['MXDELAY_RANK'], {}))
    if config['mode'] == 'kvstore':
        run_kvstore(config)
    else:
        run_trainer(config, out_dir)


if __name__ == '__main__':
    main()
