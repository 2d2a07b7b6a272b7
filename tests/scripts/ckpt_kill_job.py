"""A worker of tests/test_checkpoint_format.py: mlp_job.py's tiny tanh MLP trained with
DelayedTrainer, saving every checkpoint to ONE name (``OUT_DIR/ckpt/latest``), with a SIGKILL
timed between the parts of one save.

Usage: ``mxdelay-launch -n 2 -s 1 python ckpt_kill_job.py CONFIG_JSON OUT_DIR``. Data is a
pure function of (rank, step), so a resumed job reproduces the uninterrupted one bit for bit.

CONFIG keys: steps, batch, lr, momentum, delay, warmup_steps, ``save_after`` (the steps after
which ``trainer.save_states(OUT_DIR/ckpt/latest)`` runs), ``kill`` (``{'rank', 'save',
'when'}``: worker ``rank`` (ps-lite's) SIGKILLs itself in save number ``save`` (0-based),
``when`` one of ``'before_save'`` (before anything of that save: before the vote on its id),
``'after_own_part'`` (right after its worker file is written), ``'after_servers'`` (rank 0:
after the servers wrote theirs, before the kvstore index)), ``resume_from`` (a checkpoint
index given to ``load_states`` before training, with ``trusted`` (default False); its outcome
is recorded), ``train_after_refusal`` (after a refused load, train from step 0 instead of
stopping: what a refused load left must be the fresh job's state), ``break_apply`` (worker 0
sends the servers' apply of the load another save id than their check: a server refuses the
apply after every check passed).

Files in OUT_DIR (written atomically): ``worker<rank>.npz`` (``first``, the first step run,
and every parameter after every step from ``first`` on), ``load.worker<rank>.json`` (the
outcome of the load; after a refused load the job stops there).
"""
import mxdelay  # noqa: F401  before mxnet: the scheduler and servers become mxdelay's

import json
import os
import signal
import sys

import numpy as np

import kvstore_ext.checkpoint.files
import kvstore_ext.protocol.commands
import kvstore_ext.worker.session
import kvstore_ext.worker.store_checkpoint
from mlp_model import NAMES, train_step
import mlp_model


def atomic_bytes(path, data):
    tmp = '%s.tmp%d' % (path, os.getpid())
    with open(tmp, 'wb') as out:
        out.write(data)
    os.replace(tmp, path)


def arm_kill(kill, rank, saves):
    """Make this worker SIGKILL itself at the point `kill` names (`saves[0]`: the number of
    the save running now, kept by the caller)."""
    if not kill or kill['rank'] != rank:
        return

    def now():
        return saves[0] == kill['save']

    def die():
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    if kill['when'] == 'before_save':
        checkpoint_class = kvstore_ext.worker.store_checkpoint.StoreCheckpoint
        shared = checkpoint_class.shared_save_id

        def shared_save_id(checkpoint):
            if now():
                die()
            return shared(checkpoint)
        checkpoint_class.shared_save_id = shared_save_id
        return
    write_archive, write_json = (kvstore_ext.checkpoint.files.write_archive,
                                 kvstore_ext.checkpoint.files.write_json)

    def archive(path, kind, body, save_id):
        digest = write_archive(path, kind, body, save_id)
        if now() and kill['when'] == 'after_own_part' and kind == kvstore_ext.checkpoint.files.WORKER:
            die()
        return digest

    def json_file(path, kind, body):
        if (now() and kill['when'] == 'after_servers'
                and kind == kvstore_ext.checkpoint.files.KVSTORE_INDEX):
            die()
        return write_json(path, kind, body)
    kvstore_ext.checkpoint.files.write_archive = archive
    kvstore_ext.checkpoint.files.write_json = json_file


def main():
    config, out_dir = json.loads(sys.argv[1]), sys.argv[2]
    ckpt = os.path.join(out_dir, 'ckpt', 'latest')
    os.makedirs(os.path.dirname(ckpt), exist_ok=True)
    net = mlp_model.build()[0]
    trainer = mxdelay.DelayedTrainer(
        net.collect_params(), 'sgd', {'learning_rate': config['lr'],
                                      'momentum': config['momentum']},
        kvstore='dist_delay', delay=config['delay'], warmup_steps=config['warmup_steps'])
    rank = trainer.rank
    saves = [0]
    arm_kill(config.get('kill'), rank, saves)
    first = 0
    if config.get('break_apply') and rank == 0:
        session_class = kvstore_ext.worker.session.Session
        command = session_class.command

        def broken(self, name, body, *args, **kwargs):
            if name == kvstore_ext.protocol.commands.Command.LOAD and not body.get('check_only'):
                body = dict(body, save_id='another-save')
            return command(self, name, body, *args, **kwargs)
        session_class.command = broken
    if config.get('resume_from'):
        try:
            trainer.load_states(config['resume_from'], trusted=config.get('trusted', False))
            outcome = {'type': None, 'message': None}
        except Exception as err:  # pylint: disable=broad-except
            outcome = {'type': type(err).__name__, 'message': str(err)}
        atomic_bytes(os.path.join(out_dir, 'load.worker%d.json' % rank),
                     json.dumps(outcome).encode())
        if outcome['type'] is not None and not config.get('train_after_refusal'):
            return
        first = trainer.schedule.step
    history = {name: [] for name in NAMES.values()}
    for step in range(first, config['steps']):
        train_step(net, trainer, rank, step, config['batch'], history)
        if step in config.get('save_after', ()):
            trainer.save_states(ckpt)
            saves[0] += 1
    tmp = os.path.join(out_dir, '.worker%d.npz' % rank)
    np.savez(tmp, first=first, **{k: np.array(v) for k, v in history.items()})
    os.replace(tmp, os.path.join(out_dir, 'worker%d.npz' % rank))


if __name__ == '__main__':
    main()
