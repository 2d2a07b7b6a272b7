"""Periodic checkpoints (``DelayedTrainer(checkpoint_dir=...)``, :mod:`mxdelay.autosave`) and
their folder (:mod:`mxdelay.checkpoint_dir`).

What is tested: the folder's names, what counts as complete, pruning (never counting a newer
checkpoint of an earlier run); when a save falls (closed form in the schedule); a save that
waits for the previous one says so; a worker leaving without ``join`` fails its parts of the
saves due meanwhile; the settings' checks; and real jobs (2 workers, 1 server):

- worker 1 is SIGKILLed after the checkpoint of step 12 is complete, which it reached first
  (worker 0 sleeps before it): the launcher restarts it, every worker resumes at step 12, and
  each worker's weights after every step from there equal those of the first, uninterrupted
  attempt exactly (tolerance: none). The first attempt's weights, which saved three times
  meanwhile, equal those of a job that never saves;
- uneven data, whose shorter worker saves its part in ``join`` while it fills the others'
  rounds (and pushes round 5 after worker 0 reached the save of 6), and whose server
  SIGKILLs itself halfway through writing its part of a checkpoint in the background: that
  checkpoint never looks complete, the job resumes from the one before and continues bit
  for bit;
- uneven data without ``join``: the checkpoints after the shorter worker's end fail at once,
  naming the cause.
"""
import json
import os
import re
import sys
import threading
import time
import types

import numpy as np
import pytest

from mxnet import gluon

import mxdelay
from kvstore_ext.checkpoint import background
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
    checkpoint_dir.prune(str(tmp_path), 2, 18)
    assert sorted(os.listdir(tmp_path)) == [
        'step-00000012', 'step-00000012.worker0', 'step-00000018', 'step-00000018.worker0',
        'step-00000024.worker0', 'unrelated']
    checkpoint_dir.prune(str(tmp_path / 'missing'), 2, 18)   # nothing to do, no error


def test_pruning_never_counts_a_newer_checkpoint_of_an_earlier_run(tmp_path):
    # The resume refused step 30's checkpoint (a damaged part) and resumed from 12; this run
    # has just written 18. Counting 30, keep=1 would delete 18, the newest that loads.
    touch(tmp_path, 'step-00000012', 'step-00000012.worker0', 'step-00000018',
          'step-00000018.worker0', 'step-00000030', 'step-00000030.worker0')
    checkpoint_dir.prune(str(tmp_path), 1, 18)
    assert sorted(os.listdir(tmp_path)) == ['step-00000018', 'step-00000018.worker0',
                                            'step-00000030', 'step-00000030.worker0']


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


def test_a_save_waits_for_the_previous_one_and_says_so(caplog):
    saver = autosave.AutoSave(None, None, [], '/unused', 6, 2)
    saver._writer = threading.Thread(target=time.sleep, args=(0.3,))
    saver._writer.start()
    saver._wait_for_previous(12)
    assert saver._writer is None
    assert re.search(r'the checkpoint of step 12 waited 0\.[2-9] s for the previous one, '
                     r'still being written .* raise checkpoint_every \(now 6\)', caplog.text)
    caplog.clear()
    saver._writer = threading.Thread(target=lambda: None)
    saver._writer.start()
    saver._writer.join()
    saver._wait_for_previous(18)   # done already: no wait, nothing said
    assert saver._writer is None and caplog.text == ''


def test_a_worker_leaving_without_join_fails_its_parts_of_the_saves_due(tmp_path):
    # Worker 1's script ended at step 8 (W=3, k=2, saves every 6: due at 12 and 18): the
    # store's leave calls the hook before each round it fills at exit.
    schedule = DelaySchedule(2, 3)
    schedule.step = 8
    trainer = types.SimpleNamespace(schedule=schedule)
    saver = autosave.AutoSave(trainer, lambda: types.SimpleNamespace(rank=1), [],
                              str(tmp_path), 6, 2)
    saver._resumed, saver._saved, saver._token = 0, 6, 'tok'
    for round_index in range(8, 21):
        saver._leaving(round_index)
    assert sorted(os.listdir(tmp_path)) == ['step-00000012.worker1.sha256',
                                            'step-00000018.worker1.sha256']
    with pytest.raises(ValueError, match=r'step-00000018.worker1 could not be written: worker '
                                         r'1 ended its training script at step 8 without '
                                         r'trainer.join\(\)'):
        background.wait(str(tmp_path / 'step-00000018.worker1'), 'tok-18', 1)


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
# No collective at a save: each worker copies its state when it reaches the counter. Worker
# 0 sleeps before step 12, so worker 1 saves first and pushes its rounds 12 on (which the
# servers hold unapplied) before worker 0 has the servers copy theirs; the resume from 12
# is bit for bit only if the servers copied exactly the rounds before 12.
AHEAD = {'rank': 0, 'before': RESUMED, 'seconds': 0.5}


def _run(tmp_path, name, config, launcher_args, env=None):
    out = tmp_path / name
    out.mkdir()
    command = [sys.executable, os.path.join(SCRIPTS, 'autosave_job.py'), json.dumps(config),
               str(out)]
    result = run_job(command, num_workers=2, timeout=60, cwd=tmp_path, env=env,
                     extra_launcher_args=launcher_args)
    assert_ok(result)
    return out, result


def _history(out, attempt, rank):
    with np.load(out / ('attempt%d.worker%d.npz' % (attempt, rank))) as data:
        return {name: data[name] for name in data.files}


@pytest.mark.jobs
def test_a_killed_job_resumes_from_its_checkpoint_bit_for_bit(tmp_path):
    out, result = _run(tmp_path, 'killed', dict(CONFIG, kill=KILL, stall=AHEAD), [
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


UNEVEN = dict(CONFIG, uneven={'rank': 1, 'steps': 8})   # worker 1 fills rounds 8-21 in join
# Worker 1 sleeps before step 5: worker 0 reaches the save of 6 while round 5 waits for
# worker 1's pushes; the servers must copy their state only once round 5 is applied.
BEHIND = {'rank': 1, 'before': EVERY - 1, 'seconds': 0.5}


@pytest.mark.jobs
def test_a_server_killed_while_writing_in_the_background_leaves_no_complete_checkpoint(
        tmp_path):
    # Worker 1 has data for 8 steps: the checkpoints of steps 12 and 18 fall while it fills
    # the others' rounds in join, where it saves its part. The server SIGKILLs itself halfway
    # through writing its part of step 12 (in the background, after answering): the
    # checkpoint of step 12 never looks complete, the job restarts from step 6's and
    # continues bit for bit, the uneven worker's join included. Worker 1 pushes round 5
    # half a second after worker 0 has reached the save of step 6 (BEHIND), in both attempts.
    out, result = _run(tmp_path, 'killed', dict(UNEVEN, stall=BEHIND), [
        '--max-restarts', '1', '--checkpoint-dir', 'ckpt', '--checkpoint-every', str(EVERY)],
        env={'MXDELAY_SERVER_IMPORTS': 'dies_while_saving',
             'SERVER_DIES_AT': 'step-%08d.kvstore.server0' % RESUMED,
             'SERVER_DIES_MARKER': str(tmp_path / 'killed' / 'killed')})
    assert 'server 0 died with signal SIGKILL' in result.stderr
    assert 'the workers resume from the checkpoint of step %d' % EVERY in result.stderr
    for rank in range(2):
        assert 'attempt 2 resumed at step %d' % EVERY in worker_lines(result.stdout, rank)
    reference, _ = _run(tmp_path, 'reference', UNEVEN, [])   # no checkpoints, no kill
    for rank, steps in ((0, CONFIG['steps']), (1, UNEVEN['uneven']['steps'])):
        first, second = _history(out, 1, rank), _history(out, 2, rank)
        never_saved = _history(reference, 1, rank)
        assert int(second['first']) == EVERY and len(second['w1']) == steps - EVERY
        assert len(first['w1']) >= min(RESUMED, steps)   # the server died at step 12's save
        for name in ('w1', 'b1', 'w2', 'b2'):
            np.testing.assert_array_equal(first[name], never_saved[name][:len(first[name])])
            np.testing.assert_array_equal(second[name], never_saved[name][EVERY:])
            np.testing.assert_array_equal(second['joined_' + name],
                                          never_saved['joined_' + name])
    # Step 12 saved again in attempt 2 (its half-written temporary removed then), and 18;
    # the servers' sha256 files go once the kvstore index lists them.
    assert sorted(os.listdir(tmp_path / 'ckpt')) == sorted(
        'step-%08d%s' % (step, part) for step in (12, 18)
        for part in ('', '.worker0', '.worker1', '.worker1.sha256', '.kvstore',
                     '.kvstore.server0'))


@pytest.mark.jobs
def test_a_worker_that_ends_without_join_fails_its_parts_at_once(tmp_path):
    # Worker 1 has data for 8 steps and its script ends without join: it fills the other's
    # rounds at exit, its state frozen at step 8, so the checkpoints of 12 and 18 cannot be
    # complete. It says so in its part's place; worker 0 gives them up at once, naming the
    # cause (not after PART_TIMEOUT, 600 s: this job's timeout is 60 s, and worker 0's
    # writing thread would keep it from exiting until then).
    config = dict(CONFIG, uneven={'rank': 1, 'steps': 8, 'join': False})
    _, result = _run(tmp_path, 'left', config, [
        '--checkpoint-dir', 'ckpt', '--checkpoint-every', str(EVERY)])
    left = ('worker 1 ended its training script at step 8 without trainer.join() and fills '
            "the other workers' rounds until they end")
    for step in (12, 18):
        assert ('step-%08d.worker1 could not be written: %s' % (step, left)) in result.stderr
    # (ps-lite's rank 1, which need not be the launcher's worker 1)
    assert ('DelayedTrainer: worker 1 ended its training script at step 8 without '
            'trainer.join() while the others go on') in result.stderr
    assert checkpoint_dir.complete(str(tmp_path / 'ckpt')) == [
        (EVERY, str(tmp_path / 'ckpt' / ('step-%08d' % EVERY)))]
