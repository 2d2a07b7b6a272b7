"""The user-facing example, examples/train_fashion_mnist.py, as a real 2-worker job.

One job trains one short epoch through ``mxdelay-launch`` (1 scheduler, 1 server, 2
workers on loopback) with a short warm-up, so that the warm-up, the switch and the delayed
phase all run; a second job resumes from its checkpoint with ``--epochs 2``.

Accuracy bound: Fashion-MNIST has 10 balanced classes, so chance is 0.1. After the
STEPS = 50 steps of this test (2 workers x batch 128, warm-up 20, delay 4) the MLP reached
test accuracy 0.799 (0.798-0.800 over runs), and 0.832 after the resumed job's 100 steps.
The bound 0.5 is far from both: the test fails on training that does not learn (a diverged
run ends at 0.1, its loss NaN) and not on noise.
"""
import json
import math
import os
import sys

import pytest

from support.jobs import REPO, PidFile, assert_ok, run_job

EXAMPLE = os.path.join(REPO, 'examples', 'train_fashion_mnist.py')
DATA_DIR = '/usr/share/datasets/fashion-mnist'
STEPS = 50
ACCURACY_BOUND = 0.5
TIMEOUT = 120  # a job takes 5-15 s on 2 idle cores; the bound only stops a hang

pytestmark = pytest.mark.skipif(
    not os.path.isfile(os.path.join(DATA_DIR, 't10k-labels-idx1-ubyte.gz')),
    reason='Fashion-MNIST is not in %s: apt-get install dataset-fashion-mnist' % DATA_DIR)


def _train(out, pids, *extra):
    command = [sys.executable, EXAMPLE, '--data-dir', DATA_DIR, '--max-steps-per-epoch', str(STEPS),
               '--warmup-steps', '20', '--delay', '4', '--no-progress',
               '--checkpoint-dir', str(out / 'ckpt'), '--metrics-file', str(out / 'metrics.jsonl')]
    result = run_job(pids.wrap(command + list(extra)), num_workers=2, timeout=TIMEOUT,
                     cwd=str(out))
    assert_ok(result)
    pids.assert_all_dead()
    return result


def _metrics(out):
    with open(str(out / 'metrics.jsonl'), encoding='utf-8') as src:
        return [json.loads(line) for line in src]


@pytest.fixture(scope='module')
def first_job(tmp_path_factory):
    """One epoch of the example: (output folder, job result)."""
    out = tmp_path_factory.mktemp('example')
    return out, _train(out, PidFile(out / 'pids-first'), '--epochs', '1')


@pytest.mark.jobs
def test_one_epoch_learns_and_checkpoints(first_job):
    out, result = first_job
    assert 'rank 0 INFO DelayedTrainer: step 21 enters the delayed phase' in result.stderr
    [record] = _metrics(out)
    assert record['epoch'] == 1 and record['steps'] == STEPS
    assert math.isfinite(record['loss'])
    assert record['test_acc'] > ACCURACY_BOUND, record
    assert record['samples_per_s'] > 0 and 0 <= record['comm_wait_s'] <= record['time']
    with open(str(out / 'ckpt' / 'latest.json'), encoding='utf-8') as src:
        latest = json.load(src)
    assert latest['epoch'] == 1
    for path in (latest['params'], latest['states'], latest['states'] + '.worker0',
                 latest['states'] + '.worker1'):
        assert os.path.isfile(path), path


@pytest.mark.jobs
def test_resume_continues_at_epoch_2(first_job):
    out, _ = first_job
    result = _train(out, PidFile(out / 'pids-resumed'), '--epochs', '2', '--resume')
    assert 'continuing at epoch 2' in result.stderr
    # The trainer's step counter came back with the checkpoint (it logs the phase it enters).
    assert 'rank 0 INFO DelayedTrainer: step %d enters the delayed phase' % STEPS in result.stderr
    first, second = _metrics(out)
    assert (first['epoch'], second['epoch']) == (1, 2)
    assert math.isfinite(second['loss']) and second['test_acc'] > ACCURACY_BOUND, second
    names = sorted(os.listdir(str(out / 'ckpt')))
    assert 'epoch-0002.params' in names
    assert not [name for name in names if name.startswith('epoch-0001.')], names


ACCURACY_STEPS = 300   # 300 steps of 2 x 128 samples: 1.3 epochs of Fashion-MNIST
ACCURACY_MARGIN = 0.02


def _accuracy(tmp_path, name, *extra, env=None):
    out = tmp_path / name
    out.mkdir()
    command = [sys.executable, EXAMPLE, '--data-dir', DATA_DIR, '--epochs', '1',
               '--max-steps-per-epoch', str(ACCURACY_STEPS), '--warmup-steps', '100',
               '--no-progress', '--metrics-file', str(out / 'metrics.jsonl')] + list(extra)
    assert_ok(run_job(command, num_workers=2, env=env, timeout=240, cwd=str(out)))
    with open(str(out / 'metrics.jsonl'), encoding='utf-8') as src:
        return json.loads(src.read().splitlines()[-1])['test_acc']


@pytest.mark.jobs
def test_delayed_update_keeps_dist_sync_accuracy(tmp_path):
    # Real data, 300 steps, 2 workers, SGD lr 0.05 momentum 0.9, warm-up 100: the default
    # rule ('mirror') at k = 4 must stay within 2 points of stock gluon.Trainer on
    # dist_sync (after 10 epochs over 3 seeds k = 4 ends at 0.8899 against 0.8873,
    # docs/benchmarks/tta/results.md).
    # Stock gluon.Trainer's pickled optimizer: mxdelay's servers take it only when asked to.
    sync = _accuracy(tmp_path, 'sync', '--trainer', 'sync', env={'MXDELAY_ALLOW_PICKLE': '1'})
    mirror = _accuracy(tmp_path, 'mirror', '--delay', '4', '--local-rule', 'mirror')
    assert sync > 0.75, sync
    assert mirror > sync - ACCURACY_MARGIN, (mirror, sync)
