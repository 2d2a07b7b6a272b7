"""'2bit' gradient compression in real jobs: stock parity, the numpy reference, join, resume.

Threshold 0.5 with mlp_job's raw (batch-summed) gradients, which reach 0.96: about 17% of
the values sent are nonzero, the residuals carry the rest, and after 16 steps the weights
differ from uncompressed training by 0.16 (checked below, so that the comparisons say
something). 0.5 is a power of two: any sum of the workers' +-t is exact in any order.

- Stock parity, bit for bit (``assert_array_equal``): a stock ``dist_sync`` job with 2bit
  (no mxdelay in any process, tests/scripts/stock_job.py; MXNet 1.9.1's Gluon sends dense
  gradients with ``pushpull``, which its native store refuses with compression, so the
  stock workers push, then pull: ``mlp_model.PushThenPullTrainer``) against
  ``gluon.Trainer`` on ``'dist_delay'``, ``DelayedTrainer``'s warm-up, and the same stock
  client on ``'dist_sync'`` whose servers are mxdelay's (design §3.3), with 2 workers, 1 and 2
  servers and ``MXDELAY_CHUNK_SIZE=40`` (the 128-element w1 spans 4 chunks over the
  servers), SGD with momentum; all four also against the reference (``RTOL, ATOL``).
- The reference (tests/reference.py with its worker-side quantizer) for N = 2 and 3 with a
  warm-up and k > 1, at the reference tests' tolerance (``RTOL, ATOL``).
- One worker: ``w' == W`` at every step with compression (the local rule steps with what
  the worker sent), rule 'sgd' with plain SGD, bit for bit.
- Uneven data with join: the finish counter's flags survive the quantization (reference).
- A checkpoint in the delayed phase resumes bit for bit (the residuals are in it).
"""
import numpy as np
import pytest

import reference
from support.jobs import stock_env
from support.reference_jobs import (MLP_BASE, assert_matches_reference,
                                    assert_uneven_matches_reference, run_mlp_job, run_stock_job,
                                    simulate_uneven)
from scripts import mlp_model

NAMES = ('w1', 'b1', 'w2', 'b2')
COMPRESSION = {'type': '2bit', 'threshold': 0.5}
STEPS = 8
STOCK = {'steps': STEPS, 'batch': 6, 'lr': 0.1, 'momentum': 0.9, 'wd': 1e-3,
         'compression': COMPRESSION}


def simulate(config, num_workers, threshold=0.5):
    """The reference of an mlp_job `config` (synchronous over every step unless it has a
    warm-up) with 2bit compression at `threshold` (None: uncompressed)."""
    def grad_fn(weights, rank, step):
        x, y = mlp_model.batch(rank, step, config['batch'])
        return mlp_model.numpy_grad(weights, x, y)
    return reference.simulate(
        mlp_model.init_params(), grad_fn, num_workers, config['steps'],
        config.get('delay', 1), config.get('warmup_steps', config['steps']), config['lr'],
        momentum=config['momentum'], wd=config['wd'], rescale_grad=1.0 / config['batch'],
        rule=config.get('local_rule', 'mirror'), compression_threshold=threshold)


def test_threshold_quantizes_and_matters():
    """Not a job: the reference shows that 0.5 keeps most values back and changes training."""
    config = dict(MLP_BASE, delay=3, warmup_steps=3)
    compressed = simulate(config, 2)
    plain = simulate(config, 2, threshold=None)
    sent = [a for step in compressed.grads for worker in step for a in worker.values()]
    fraction = sum(np.count_nonzero(a) for a in sent) / sum(a.size for a in sent)
    assert 0.1 < fraction < 0.3, fraction
    assert max(np.abs(compressed.glob[-1][n] - plain.glob[-1][n]).max() for n in NAMES) > 0.1


@pytest.mark.jobs
@pytest.mark.parametrize('num_servers', [1, 2])
def test_2bit_equals_stock_dist_sync_bit_for_bit(tmp_path, num_servers):
    stock = run_stock_job(tmp_path / 'stock', STOCK, num_servers=num_servers)
    env = dict(stock_env(), MXDELAY_CHUNK_SIZE='40')
    runs = {
        'gluon.Trainer on dist_delay': run_mlp_job(
            tmp_path / 'gluon', 2, dict(STOCK, trainer='gluon', kvstore='dist_delay'),
            num_servers=num_servers, env=env),
        'DelayedTrainer warm-up': run_mlp_job(
            tmp_path / 'delayed', 2, dict(STOCK, trainer='delayed', delay=2,
                                          warmup_steps=STEPS - 1),
            num_servers=num_servers, env=env),
        "stock dist_sync client on mxdelay's servers": run_mlp_job(
            tmp_path / 'client', 2, dict(STOCK, trainer='gluon', kvstore='dist_sync',
                                         push_then_pull=True),
            num_servers=num_servers, env=stock_env()),
    }
    trajectory = simulate(STOCK, 2)
    assert_matches_reference(stock, trajectory)
    for what, histories in runs.items():
        for rank in range(2):
            for name in NAMES:
                np.testing.assert_array_equal(
                    histories[rank][name], stock[rank][name],
                    err_msg='%s vs stock dist_sync 2bit, worker %d, %s' % (what, rank, name))
        assert_matches_reference(histories, trajectory)


@pytest.mark.jobs
@pytest.mark.parametrize('num_workers,num_servers', [(2, 1), (3, 2)])
def test_delayed_phase_with_2bit_matches_reference(tmp_path, num_workers, num_servers):
    config = dict(MLP_BASE, delay=3, warmup_steps=3, compression=COMPRESSION)
    histories = run_mlp_job(tmp_path, num_workers, config, num_servers=num_servers,
                            env={'MXDELAY_CHUNK_SIZE': '40'}, timeout=240)
    assert_matches_reference(histories, simulate(config, num_workers))


@pytest.mark.jobs
def test_one_worker_local_weights_are_the_servers_with_2bit(tmp_path):
    # N = 1, rule 'sgd', plain SGD, local_lr = lr: the local step is the server's kernel on
    # what the worker sent, so w' == W at every step (bit for bit), for k = 3. The
    # reference's w' is W too; compared at RTOL, ATOL (backward differs from numpy's).
    config = dict(MLP_BASE, momentum=0.0, delay=3, warmup_steps=2, local_rule='sgd',
                  compression=COMPRESSION, sync_at_end=True)
    histories = run_mlp_job(tmp_path, 1, config)
    trajectory = simulate(config, 1)
    for t in range(config['steps']):
        for name in NAMES:
            np.testing.assert_array_equal(trajectory.local[t][0][name], trajectory.glob[t][name])
    for name in NAMES:   # the servers' W after the last step is the worker's w'
        np.testing.assert_array_equal(histories[0]['synced_' + name], histories[0][name][-1])
    assert_matches_reference(histories, trajectory)


@pytest.mark.jobs
def test_join_with_uneven_data_and_2bit_is_exact(tmp_path):
    # Flags 1 travel as t (exact on the wire); padded rounds quantize a zero gradient with
    # the worker's residual, as the reference does.
    config = dict(MLP_BASE, batches=[3, 6], epochs=2, join=True, delay=2, warmup_steps=2,
                  compression=COMPRESSION)
    histories = run_mlp_job(tmp_path, 2, config)
    want = simulate_uneven(config, 2, 2, compression_threshold=0.5)
    assert_uneven_matches_reference(histories, config, want)


@pytest.mark.jobs
def test_checkpoint_with_2bit_resumes_bit_for_bit(tmp_path):
    # Saved at step 8 of the delayed phase (W = 3, k = 3), the job stops at 10; a new job
    # resumes from the files: steps 9..15 equal the uninterrupted run's.
    config = dict(MLP_BASE, delay=3, warmup_steps=3, compression=COMPRESSION)
    full = run_mlp_job(tmp_path / 'full', 2, config)
    run_mlp_job(tmp_path / 'first', 2, dict(config, save_at=8, stop_after=10))
    ckpt = str(tmp_path / 'first' / 'out' / 'ckpt')
    resumed = run_mlp_job(tmp_path / 'resumed', 2, dict(config, resume_from=ckpt))
    for rank in range(2):
        assert int(resumed[rank]['first']) == 9
        for name in NAMES:
            np.testing.assert_array_equal(resumed[rank][name], full[rank][name][9:],
                                          err_msg='worker %d %s after resume' % (rank, name))
    assert_matches_reference(full, simulate(config, 2))
