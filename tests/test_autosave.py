"""Periodic checkpoints (``DelayedTrainer(checkpoint_dir=...)``, :mod:`mxdelay.autosave`) and
their folder (:mod:`mxdelay.checkpoint_dir`).

What is tested: the folder's names, what counts as complete, pruning; when a save falls
(closed form in the schedule); the settings' checks; and a real job (2 workers, 1 server)
whose worker is SIGKILLed after the checkpoint of step 12 is complete: the launcher restarts
it, every worker resumes at step 12, and each worker's weights after every step from there
equal those of the first, uninterrupted attempt exactly (tolerance: none). The first
attempt's weights, which saved three times meanwhile, equal those of a job that never saves.
"""
import json
import os
import sys
import types

import numpy as np
import pytest

from mxnet import gluon

import mxdelay
from mxdelay import autosave, checkpoint_dir
from mxdelay.schedule import DelaySchedule
from support.jobs import SCRIPTS, assert_ok, run_job, worker_lines

pytestmark = pytest.mark.timeout(90)


def touch(folder, *names):
    for name in names:
        (folder / name).write_text('')


def test_the_newest_checkpoint_with_an_index_is_the_newest_complete(tmp_path):
    touch(tmp_path, 'step-00000006', 'step-00000006.worker0', 'step-00000012.worker0',
          'step-00000012.kvstore.server0', 'step-100000000', 'other', 'step-7',
          '.step-00000018.worker0.abc.tmp')
    assert checkpoint_dir.complete(str(tmp_path)) == [
        (100000000, str(tmp_path / 'step-100000000')), (6, str(tmp_path / 'step-00000006'))]
    assert checkpoint_dir.newest_complete(str(tmp_path)) == (
        100000000, str(tmp_path / 'step-100000000'))
    assert checkpoint_dir.newest_complete(str(tmp_path / 'missing')) is None
    assert checkpoint_dir.path_of('/d', 13) == '/d/step-00000013'


def test_pruning_keeps_the_newest_complete_and_anything_newer(tmp_path):
    touch(tmp_path, 'step-00000006', 'step-00000006.worker0', '.step-00000006.worker1.x.tmp',
          'step-00000009.worker0',                       # incomplete, older than the kept
          'step-00000012', 'step-00000012.worker0', 'step-00000018', 'step-00000018.worker0',
          'step-00000024.worker0', 'unrelated')          # a save under way
    checkpoint_dir.prune(str(tmp_path), 2)
    assert sorted(os.listdir(tmp_path)) == [
        'step-00000012', 'step-00000012.worker0', 'step-00000018', 'step-00000018.worker0',
        'step-00000024.worker0', 'unrelated']
    checkpoint_dir.prune(str(tmp_path / 'missing'), 2)   # nothing to do, no error


def test_saves_fall_after_each_multiple_where_the_servers_are_waited_for_anyway():
    # W=3, k=2: steps 0-3 are synchronous; from t0=4 the steps t = 6, 8, 10, ... apply a
    # pull. A save falls at the first counter >= each multiple of N that follows a
    # synchronous step (1-4) or precedes a step that applies a pull (6, 8, ...).
    for every, expected in ((6, [6, 12, 18]), (4, [4, 8, 12, 16]), (5, [6, 10, 16, 20]),
                            (1, [1, 2, 3, 4, 6, 8, 10])):
        trainer = types.SimpleNamespace(schedule=DelaySchedule(2, 3))
        saver = autosave.AutoSave(trainer, None, [], '/unused', every, 2)
        saver._resumed, saver._saved = 0, 0
        saves = []
        for counter in range(1, 21):
            if saver._due(counter):
                saves.append(counter)
                saver._saved = counter
        assert saves[:len(expected)] == expected, (every, saves)


def _net():
    net = gluon.nn.Dense(2, in_units=3)
    net.initialize()
    return net


@pytest.mark.parametrize('kwargs, env, error, message', [
    (dict(kvstore='local', checkpoint_dir='c', checkpoint_every=5), {}, ValueError,
     "checkpoint_dir='%s' needs kvstore='dist_delay'"),
    (dict(kvstore=None, checkpoint_every=5), {'MXDELAY_CHECKPOINT_DIR': 'c'}, ValueError,
     "MXDELAY_CHECKPOINT_DIR='%s' needs kvstore='dist_delay'"),
    (dict(checkpoint_dir='c'), {}, ValueError,
     "checkpoint_dir='%s' needs checkpoint_every=N, the steps between two checkpoints"),
    (dict(checkpoint_every=5), {}, ValueError, 'checkpoint_every=5 needs checkpoint_dir'),
    (dict(keep_checkpoints=2), {}, ValueError, 'keep_checkpoints=2 needs checkpoint_dir'),
    (dict(checkpoint_dir='c', checkpoint_every=0), {}, ValueError,
     'checkpoint_every must be an integer >= 1, got 0'),
    (dict(checkpoint_dir='c', checkpoint_every=2.0), {}, TypeError,
     'checkpoint_every must be an integer >= 1, got 2.0'),
    (dict(checkpoint_dir='c', checkpoint_every=5, keep_checkpoints=0), {}, ValueError,
     'keep_checkpoints must be an integer >= 1, got 0'),
    (dict(checkpoint_dir='c'), {'MXDELAY_CHECKPOINT_EVERY': '0'}, ValueError,
     'environment variable MXDELAY_CHECKPOINT_EVERY=\'0\''),
    (dict(checkpoint_dir=b'c', checkpoint_every=5), {}, TypeError,
     'checkpoint_dir must be a file path'),
])
def test_bad_settings_are_refused_at_construction(tmp_path, monkeypatch, kwargs, env, error,
                                                  message):
    monkeypatch.chdir(tmp_path)
    for name in ('MXDELAY_CHECKPOINT_DIR', 'MXDELAY_CHECKPOINT_EVERY',
                 'MXDELAY_KEEP_CHECKPOINTS'):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(error) as raised:
        mxdelay.DelayedTrainer(_net().collect_params(), 'sgd', **kwargs)
    assert message.replace('%s', str(tmp_path / 'c')) in str(raised.value)


def test_without_a_folder_nothing_is_saved_and_nothing_resumed(monkeypatch):
    monkeypatch.delenv('MXDELAY_CHECKPOINT_DIR', raising=False)
    trainer = mxdelay.DelayedTrainer(_net().collect_params(), 'sgd', kvstore='local')
    assert trainer.resumed_step == 0


# -- a real job: killed, restarted, resumed ------------------------------------------------
CONFIG = {'steps': 22, 'batch': 4, 'lr': 0.1, 'momentum': 0.9, 'delay': 2, 'warmup_steps': 3}
EVERY, RESUMED = 6, 12   # saves at 6, 12, 18 (see above); the kill waits for 12
KILL = {'rank': 1, 'after': 16, 'wait_for': RESUMED}


def _run(tmp_path, name, config, launcher_args):
    out = tmp_path / name
    out.mkdir()
    command = [sys.executable, os.path.join(SCRIPTS, 'autosave_job.py'), json.dumps(config),
               str(out)]
    result = run_job(command, num_workers=2, timeout=60, cwd=tmp_path,
                     extra_launcher_args=launcher_args)
    assert_ok(result)
    return out, result


def _history(out, attempt, rank):
    with np.load(out / ('attempt%d.worker%d.npz' % (attempt, rank))) as data:
        return {name: data[name] for name in data.files}


@pytest.mark.jobs
def test_a_killed_job_resumes_from_its_checkpoint_bit_for_bit(tmp_path):
    out, result = _run(tmp_path, 'killed', dict(CONFIG, kill=KILL), [
        '--max-restarts', '1', '--checkpoint-dir', 'ckpt', '--checkpoint-every', str(EVERY)])
    assert 'the workers resume from the checkpoint of step %d' % RESUMED in result.stderr
    assert 'the job finished in attempt 2, after surviving 1 failure(s)' in result.stderr
    for rank in range(2):
        lines = worker_lines(result.stdout, rank)
        assert 'attempt 2 resumed at step %d' % RESUMED in lines, lines
    reference, _ = _run(tmp_path, 'reference', CONFIG, [])   # no checkpoints, no kill
    names = ('w1', 'b1', 'w2', 'b2')
    for rank in range(2):
        first, second = _history(out, 1, rank), _history(out, 2, rank)
        never_saved = _history(reference, 1, rank)
        assert int(second['first']) == RESUMED and len(second['w1']) == CONFIG['steps'] - RESUMED
        done = len(first['w1'])   # worker 1 died after step index 16; worker 0 got as far
        assert done > RESUMED + 1
        for name in names:
            # Saving changed nothing; the resumed attempt continues the first one exactly.
            np.testing.assert_array_equal(first[name], never_saved[name][:done])
            np.testing.assert_array_equal(second[name][:done - RESUMED], first[name][RESUMED:])
            np.testing.assert_array_equal(second[name], never_saved[name][RESUMED:])
        # The weights moved in every step: the comparison above is not of constants.
        assert all(np.any(a != b) for a, b in zip(never_saved['w1'], never_saved['w1'][1:]))
    # Saved at 6, 12 (attempt 1) and 18 (attempt 2); the newest 2 kept, 6 deleted whole.
    # (worker 1 leaves its file's sha256 for worker 0, which then need not read it whole).
    assert sorted(os.listdir(tmp_path / 'ckpt')) == sorted(
        'step-%08d%s' % (step, part) for step in (12, 18)
        for part in ('', '.worker0', '.worker1', '.worker1.sha256', '.kvstore',
                     '.kvstore.server0'))
