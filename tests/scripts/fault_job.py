"""A worker of the fault tests (tests/test_faults.py): mlp_job.py's tiny tanh MLP, trained
with DelayedTrainer, with checkpoints, markers and injected faults.

Usage: ``mxdelay-launch -n N -s S python fault_job.py CONFIG_JSON OUT_DIR``. Data is a pure
function of (rank, step), so a job resumed from a checkpoint reproduces the uninterrupted
run bit for bit. "rank" is the worker's ps-lite rank (its data and its files); "launcher
rank" is ``MXDELAY_RANK``, the rank mxdelay-launch names (and ``PidFile`` records).

Files in OUT_DIR, each written atomically (a temporary file, then rename):

- ``worker<rank>.npz``: ``first`` (the first step run) and every parameter after every
  step from ``first`` on (key ``<name>``, shape ``(steps - first,) + param.shape``).
- ``ckpt/step<s>...``: after step s when ``(s + 1) % ckpt_every == 0``, each worker writes
  its net's parameters ``ckpt/step<s>.net.worker<rank>.params``, then the collective
  ``trainer.save_states('ckpt/step<s>')``, whose index ``ckpt/step<s>`` is written after
  every other file of the checkpoint: it marks the checkpoint complete.
- ``marker.worker<launcher rank>``: the wall time after step ``marker_at``.
- ``fault.worker<launcher rank>``: the wall time just before the injected exception.
- ``loads.worker<rank>.json``: the outcome of each ``load_states`` of ``bad_loads``.

CONFIG keys: steps, batch, lr, momentum, wd, delay, warmup_steps, kvstore,
``by_launcher_rank`` ({launcher rank: {key: value}} overrides for one worker), ckpt_every,
marker_at, ``pace`` (seconds slept before each step after marker_at), ``hold`` (a file to
wait for after marker_at), raise_rank and raise_at (launcher rank raises at that step),
resume_from (a checkpoint index), bad_loads (paths given to load_states after step
bad_load_at; every exception is caught and recorded), hang_timeout (seconds: from
bad_load_at on, a worker still running after that dumps its threads' stacks and exits 1).
"""
import mxdelay  # noqa: F401  before mxnet: the scheduler and servers become mxdelay's

import faulthandler
import json
import os
import sys
import time

import numpy as np

from mlp_model import NAMES, train_step, weights_of
import mlp_model


def build():
    return mlp_model.build()[0]


def atomic_bytes(path, data):
    tmp = '%s.tmp%d' % (path, os.getpid())
    with open(tmp, 'wb') as out:
        out.write(data)
    os.replace(tmp, path)


def net_file(prefix, rank):
    return '%s.net.worker%d.params' % (prefix, rank)


def try_loads(trainer, net, paths):
    """Give each of `paths` to load_states; return what happened, and whether the weights
    stayed as they were (every exception is caught: the tests decide what is right)."""
    before = weights_of(net)
    outcomes = []
    for path in paths:
        try:
            trainer.load_states(path)
            outcomes.append({'path': path, 'type': None, 'message': None})
        except Exception as err:  # pylint: disable=broad-except
            outcomes.append({'path': path, 'type': type(err).__name__, 'message': str(err)})
    after = weights_of(net)
    unchanged = all(np.array_equal(before[n], after[n]) for n in before)
    return {'outcomes': outcomes, 'weights_unchanged': unchanged}


def main():
    config, out_dir = json.loads(sys.argv[1]), sys.argv[2]
    launcher_rank = int(os.environ['MXDELAY_RANK'])
    config.update(config.get('by_launcher_rank', {}).get(str(launcher_rank), {}))
    ckpt_dir = os.path.join(out_dir, 'ckpt')
    os.makedirs(ckpt_dir, exist_ok=True)

    net = build()
    trainer = mxdelay.DelayedTrainer(
        net.collect_params(), 'sgd', {'learning_rate': config['lr'],
                                      'momentum': config.get('momentum', 0.0),
                                      'wd': config.get('wd', 0.0)},
        kvstore=config.get('kvstore', 'dist_delay'), delay=config['delay'],
        warmup_steps=config['warmup_steps'])
    rank = trainer.rank  # creates the kvstore (and installs its excepthook)
    first = 0
    if config.get('resume_from'):
        prefix = config['resume_from']
        trainer.load_states(prefix)
        first = trainer.schedule.step
        # The net's file and the trainer's checkpoint were saved at the same step.
        saved = build()
        saved.load_parameters(net_file(prefix, rank))
        restored = weights_of(net)
        for name, value in weights_of(saved).items():
            assert np.array_equal(restored[name], value), 'net file and checkpoint differ'
    history = {name: [] for name in NAMES.values()}
    for step in range(first, config['steps']):
        if config.get('marker_at') is not None and step > config['marker_at']:
            time.sleep(config.get('pace', 0.0))
        if launcher_rank == config.get('raise_rank') and step == config.get('raise_at'):
            atomic_bytes(os.path.join(out_dir, 'fault.worker%d' % launcher_rank),
                         repr(time.time()).encode())
            raise RuntimeError('injected fault: worker %d raises at step %d'
                               % (launcher_rank, step))
        train_step(net, trainer, rank, step, config['batch'], history)
        if step == first:
            print('step %d done' % step)
        every = config.get('ckpt_every')
        if every and (step + 1) % every == 0:
            prefix = os.path.join(ckpt_dir, 'step%d' % step)
            tmp = '%s.tmp%d' % (net_file(prefix, rank), os.getpid())
            net.save_parameters(tmp)
            os.replace(tmp, net_file(prefix, rank))
            trainer.save_states(prefix)
        if step == config.get('bad_load_at'):
            if config.get('hang_timeout'):
                faulthandler.dump_traceback_later(config['hang_timeout'], exit=True)
            result = try_loads(trainer, net, config['bad_loads'])
            atomic_bytes(os.path.join(out_dir, 'loads.worker%d.json' % rank),
                         json.dumps(result).encode())
        if step == config.get('marker_at'):
            atomic_bytes(os.path.join(out_dir, 'marker.worker%d' % launcher_rank),
                         repr(time.time()).encode())
            hold, deadline = config.get('hold'), time.monotonic() + 60
            while hold and not os.path.exists(hold):
                if time.monotonic() > deadline:
                    raise RuntimeError('%s did not appear within 60 s' % hold)
                time.sleep(0.02)
    faulthandler.cancel_dump_traceback_later()
    tmp = os.path.join(out_dir, '.worker%d.npz' % rank)
    np.savez(tmp, first=first, **{k: np.array(v) for k, v in history.items()})
    os.replace(tmp, os.path.join(out_dir, 'worker%d.npz' % rank))


if __name__ == '__main__':
    main()
