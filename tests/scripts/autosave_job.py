"""A worker of tests/test_autosave.py: mlp_job.py's tiny tanh MLP trained with DelayedTrainer
and periodic checkpoints (``mxdelay-launch --checkpoint-dir ... --checkpoint-every ...``),
killed once and restarted by the launcher (``--max-restarts``).

Usage: ``mxdelay-launch -n 2 -s 1 --max-restarts 1 --checkpoint-dir D --checkpoint-every E
python autosave_job.py CONFIG_JSON OUT_DIR``. Data is a pure function of (rank, step), so a
resumed run reproduces the uninterrupted one bit for bit.

CONFIG keys: steps, batch, lr, momentum, delay, warmup_steps, ``kill`` (``{'rank', 'after',
'wait_for'}``: in the first attempt, worker ``rank`` (ps-lite's) waits after step index
``after`` until the checkpoint of step ``wait_for`` is complete, then SIGKILLs itself),
``uneven`` (``{'rank', 'steps', 'join'}``: worker ``rank`` has data for that many steps only;
every worker then calls ``trainer.join()``, in which that one fills the others' rounds, or
with ``'join': False`` none does: that one's script ends, and it fills them at exit),
``stall`` (``{'rank', 'before', 'seconds'}``: worker ``rank`` sleeps before step ``before``,
so that the other reaches it, and the checkpoint due there, first).

Files in OUT_DIR: ``killed`` (made just before the kill: a later attempt sees it),
``attempt<A>.worker<rank>.npz`` (rewritten after every step: ``first``, the resumed step,
and every parameter after every step from ``first`` on; with ``uneven``, also each
parameter after the ``join``, as ``joined_<name>``).
"""
import mxdelay  # noqa: F401  before mxnet: the scheduler and servers become mxdelay's

import json
import os
import signal
import sys
import time

import numpy as np

from mxdelay import checkpoint_dir
from mlp_model import NAMES
import mlp_model


def save_history(path, first, history, **joined):
    tmp = path + '.tmp.npz'
    np.savez(tmp, first=first, **{k: np.array(v) for k, v in history.items()}, **joined)
    os.replace(tmp, path)


def kill_when_saved(kill, step):
    """Wait until the checkpoint of step `kill['wait_for']` is complete, then SIGKILL."""
    directory = os.environ['MXDELAY_CHECKPOINT_DIR']
    deadline = time.monotonic() + 30
    while (checkpoint_dir.newest_complete(directory) or (0,))[0] < kill['wait_for']:
        if time.monotonic() > deadline:
            sys.exit('the checkpoint of step %d never completed' % kill['wait_for'])
        time.sleep(0.01)
    print('killing myself after step index %d' % step, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def main():
    config, out_dir = json.loads(sys.argv[1]), sys.argv[2]
    marker = os.path.join(out_dir, 'killed')
    attempt = 2 if os.path.exists(marker) else 1
    net = mlp_model.build()[0]
    trainer = mxdelay.DelayedTrainer(
        net.collect_params(), 'sgd', {'learning_rate': config['lr'],
                                      'momentum': config['momentum']},
        kvstore='dist_delay', delay=config['delay'], warmup_steps=config['warmup_steps'])
    first = trainer.resumed_step            # mxdelay: resume (collective), before the loop
    rank = trainer.rank
    print('attempt %d resumed at step %d' % (attempt, first), flush=True)
    kill = config.get('kill') if attempt == 1 else None
    history = {name: [] for name in NAMES.values()}
    out = os.path.join(out_dir, 'attempt%d.worker%d.npz' % (attempt, rank))
    uneven, stall = config.get('uneven'), config.get('stall')
    steps = uneven['steps'] if uneven and uneven['rank'] == rank else config['steps']
    for step in range(first, steps):   # mxdelay: skip the steps already trained
        if stall and stall['rank'] == rank and stall['before'] == step:
            time.sleep(stall['seconds'])
        mlp_model.train_step(net, trainer, rank, step, config['batch'], history)
        save_history(out, first, history)
        if kill and kill['rank'] == rank and kill['after'] == step:
            open(marker, 'w').close()
            kill_when_saved(kill, step)
    if uneven and uneven.get('join', True):
        trainer.join()
        joined = mlp_model.weights_of(net)
        save_history(out, first, history, **{'joined_' + name: w for name, w in joined.items()})


if __name__ == '__main__':
    main()
