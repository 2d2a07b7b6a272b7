"""A worker that runs an unmodified Gluon script with ``mx.gluon.Trainer`` swapped for a
user's subclass of ``mxdelay.DelayedTrainer`` (tests/test_swapped_trainer.py).

Usage: ``mxdelay-launch -n N -s S python swapped_trainer_job.py CONFIG_JSON OUT_DIR``. The
script below the swap is stock_job.py's training (mlp_model's model and data, a
``gluon.Trainer`` on a kvstore it creates), on ``'dist_delay'``: the trainer it gets is the
subclass, with DelayedTrainer's defaults (warm-up 200 steps: synchronous throughout).
CONFIG keys: steps, batch, lr, momentum, wd; ``save_at`` (``save_states`` after that step),
``stop_after`` (end after that step), ``resume_from`` (``load_states`` before training) and
``first`` (the step it resumes at). Writes ``OUT_DIR/worker<rank>.npz`` as stock_job.py
(every parameter after every step) and ``trainer``, the class that trained.
"""
import mxdelay

import json
import os
import sys

import numpy as np
import mxnet as mx
from mxnet import gluon

from mlp_model import build, optimizer_of, train_step


class UsersTrainer(mxdelay.DelayedTrainer):
    """A user's subclass of DelayedTrainer, installed as ``gluon.Trainer``."""


mx.gluon.Trainer = UsersTrainer


def main():
    # From here on the script knows nothing of mxdelay.
    config, out_dir = json.loads(sys.argv[1]), sys.argv[2]
    kv = mx.kv.create('dist_delay')
    rank = kv.rank
    net, names = build([mx.cpu()])
    optimizer, opt = optimizer_of(config)
    trainer = gluon.Trainer(net.collect_params(), optimizer, opt, kvstore=kv)
    if config.get('resume_from'):
        trainer.load_states(config['resume_from'])
    history = {name: [] for name in names.values()}
    for step in range(config.get('first', 0), config['steps']):
        train_step(net, trainer, rank, step, config['batch'], history)
        if config.get('save_at') == step:
            trainer.save_states(os.path.join(out_dir, 'ckpt'))
        if config.get('stop_after') == step:
            break
    np.savez(os.path.join(out_dir, 'worker%d.npz' % rank), trainer=type(trainer).__name__,
             **{k: np.array(v) for k, v in history.items()})


if __name__ == '__main__':
    main()
