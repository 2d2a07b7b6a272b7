"""DelayedTrainer in real distributed jobs (scheduler, servers, workers over sockets)
against the numpy reference of docs/design.md §1 (tests/reference.py), step by step: every
worker, every step, every parameter.

Tolerance: the update kernels match MXNet's arithmetic, but Gluon's backward (BLAS) and
numpy's matmul round differently; over 16 steps the largest difference measured is 3e-7
(weights are O(0.1-1)). We allow ``rtol=1e-5, atol=1e-6``, far below what a wrong phase,
pull timing or rule makes (a stale initial pull, found by this test, moved them by 5e-2).
"""

import numpy as np
import pytest

import mxdelay.schedule
from support.reference_jobs import (ATOL, RTOL, MLP_BASE as BASE, assert_matches_reference,
                                    run_mlp_job, simulate_mlp_job as simulate)

pytestmark = pytest.mark.jobs

CASES = [
    # (num_workers, num_servers, overrides)
    (2, 1, {'delay': 1, 'warmup_steps': 0, 'local_rule': 'sgd'}),
    (2, 2, {'delay': 2, 'warmup_steps': 3, 'local_rule': 'mirror'}),
    (3, 1, {'delay': 3, 'warmup_steps': 2, 'local_rule': 'dc', 'dc_lambda': 0.5}),
    (2, 1, {'delay': 5, 'warmup_steps': 1, 'local_rule': 'dc_adaptive', 'dc_lambda': 0.02}),
    (3, 2, {'delay': 2, 'warmup_steps': 0, 'local_rule': 'mirror', 'dc_lambda': 0.3,
            'local_lr': 0.05}),
]


@pytest.mark.parametrize('num_workers,num_servers,overrides', CASES,
                         ids=['-'.join('%s=%s' % kv for kv in sorted(c[2].items())) +
                              '-N%d-S%d' % c[:2] for c in CASES])
def test_matches_reference(tmp_path, num_workers, num_servers, overrides):
    config = dict(BASE, **overrides)
    histories = run_mlp_job(tmp_path, num_workers, config, num_servers=num_servers)
    assert_matches_reference(histories, simulate(config, num_workers))


def test_two_devices_equal_one_device_with_double_batch(tmp_path):
    # Two devices per worker, each with half of the worker's batch, push the sum of their
    # gradients: the same trajectory as one device with the whole batch.
    config = dict(BASE, delay=3, warmup_steps=2, local_rule='mirror', devices=2)
    histories = run_mlp_job(tmp_path, 2, config)
    assert_matches_reference(histories, simulate(config, 2))


@pytest.mark.alone   # the lead of a free step is worker 1's sleep less worker 0's CPU time
def test_straggler_waits_only_at_pull_applications(tmp_path):
    # Worker 1 sleeps 150 ms before every step. Worker 0's steps (trainer.step plus reading
    # the new weights) must not wait for it except where a pull is applied; and the
    # trajectory is still exactly the reference's. Said by the order of events on one wall
    # clock, not by a step's duration, which machine load stretches: a free step t of
    # worker 0 ends before worker 1 has begun its step t (so it needed nothing worker 1 sends
    # in step t or later), while each application waits for worker 1's round before it.
    sleep = 0.15   # a lead of ~2 sleeps at the first free step after an application
    config = dict(BASE, steps=19, delay=4, warmup_steps=2, local_rule='mirror',
                  sleep_rank=1, sleep=sleep)
    histories = run_mlp_job(tmp_path, 2, config)
    assert_matches_reference(histories, simulate(config, 2))
    times = histories[0]['step_times']
    fast, straggler = histories[0]['step_clock'], histories[1]['step_clock']
    schedule = mxdelay.schedule.DelaySchedule(config['delay'], config['warmup_steps'])
    delayed = range(schedule.first_delayed_step + 1, config['steps'])
    free = [t for t in delayed if not schedule.applies_pull(t)]
    waiting = [t for t in delayed if schedule.applies_pull(t)]
    assert len(free) >= 9 and len(waiting) >= 3
    ahead = {t: straggler[t][0] - fast[t][1] for t in free}
    assert all(lead > 0 for lead in ahead.values()), \
        'worker 0 waited for worker 1 at a step without a pull: step -> lead (s) %s' % ahead
    # Step t applies the pull of W_t, which needs worker 1's round t - 1: worker 0 ends step
    # t after worker 1 began it, having waited for the straggler's sleep there.
    assert all(fast[t][1] > straggler[t - 1][0] for t in waiting), (fast, straggler)
    assert min(times[t] for t in waiting) > sleep, [times[t] for t in waiting]


def test_save_kill_resume_continues_exactly(tmp_path):
    # Save at step 8 (delayed phase, a pull pending: W=3, k=3 issues pulls at 6, 9, ...;
    # 8 ends a period), run on to step 10, stop; a new job resumes from the files and must
    # reproduce steps 9..15 of the uninterrupted run exactly.
    config = dict(BASE, steps=16, delay=3, warmup_steps=3, local_rule='mirror')
    full = run_mlp_job(tmp_path / 'full', 2, config)
    first = run_mlp_job(tmp_path / 'first', 2, dict(config, save_at=8, stop_after=10))
    ckpt = str(tmp_path / 'first' / 'out' / 'ckpt')
    resumed = run_mlp_job(tmp_path / 'resumed', 2, dict(config, resume_from=ckpt))
    for rank in range(2):
        assert int(resumed[rank]['first']) == 9
        for name in ('w1', 'b1', 'w2', 'b2'):
            np.testing.assert_array_equal(first[rank][name][:9], full[rank][name][:9])
            np.testing.assert_array_equal(resumed[rank][name], full[rank][name][9:],
                                          err_msg='worker %d %s after resume' % (rank, name))


def test_stock_gluon_trainer_on_dist_delay_equals_dist_sync(tmp_path):
    # Stock gluon.Trainer: 'dist_delay' must train exactly like MXNet's 'dist_sync' (N = 2:
    # the server's sum of two gradients is exact in any order, so the weights are equal).
    config = dict(BASE, steps=20, delay=1, warmup_steps=0, trainer='gluon')
    sync = run_mlp_job(tmp_path / 'sync', 2, dict(config, kvstore='dist_sync'))
    delay = run_mlp_job(tmp_path / 'delay', 2, dict(config, kvstore='dist_delay'))
    for rank in range(2):
        for name in ('w1', 'b1', 'w2', 'b2'):
            np.testing.assert_array_equal(delay[rank][name], sync[rank][name])
    # ... and both equal synchronous SGD, i.e. the reference with warm-up over all steps.
    assert_matches_reference(delay, simulate(dict(config, warmup_steps=20), 2))


def test_status_keys_and_chunks_below_a_small_bigarray_bound(tmp_path):
    # With MXNET_KVSTORE_BIGARRAY_BOUND = 3 * 1024 + 1 the status key of 3 workers has the
    # smallest segments (1024 floats each) and every chunk must stay below the bound (MXNet
    # would otherwise split a key over both servers): the trajectory is still exact.
    config = dict(BASE, delay=2, warmup_steps=2, local_rule='mirror')
    env = {'MXNET_KVSTORE_BIGARRAY_BOUND': 3 * 1024 + 1, 'MXDELAY_CHUNK_SIZE': 50}
    histories = run_mlp_job(tmp_path, 3, config, num_servers=2, env=env)
    assert_matches_reference(histories, simulate(config, 3))


@pytest.mark.parametrize('num_workers,num_servers,devices', [(2, 1, 1), (3, 2, 2)])
def test_sync_weights_gives_every_worker_the_global_model(tmp_path, num_workers, num_servers,
                                                          devices):
    # 11 steps, warm-up 2, k=3: the last step is mid-period (its pull is not due), so the
    # workers' own weights differ from the servers' W; after sync_weights all equal W_11.
    config = dict(BASE, steps=11, delay=3, warmup_steps=2, sync_at_end=True, devices=devices)
    histories = run_mlp_job(tmp_path, num_workers, config, num_servers=num_servers)
    trajectory = simulate(config, num_workers)
    assert_matches_reference(histories, trajectory)
    final = trajectory.glob[-1]
    for rank, history in histories.items():
        assert any(not np.allclose(history[name][-1], final[name], rtol=RTOL, atol=ATOL)
                   for name in final), 'the test needs local weights that differ from W'
        for name in final:
            np.testing.assert_allclose(history['synced_' + name], final[name], rtol=RTOL,
                                       atol=ATOL, err_msg='worker %d, %s' % (rank, name))


OPTIMIZER_CASES = [
    # (num_workers, num_servers, overrides): the mirror of Adam and NAG (docs/design.md §1.4)
    (2, 1, {'optimizer': 'adam', 'lr': 0.01, 'delay': 3, 'warmup_steps': 2}),
    (3, 2, {'optimizer': 'adam', 'lr': 0.01, 'delay': 2, 'warmup_steps': 1,
            'optimizer_params': {'beta1': 0.8, 'beta2': 0.99}}),
    # FrozenVarianceAdam (docs/design.md §1.5): frozen at the switch, and mid delayed phase.
    (2, 1, {'optimizer': 'frozenvarianceadam', 'lr': 0.01, 'delay': 3, 'warmup_steps': 2,
            'optimizer_params': {'freeze_after': 2}}),
    (3, 2, {'optimizer': 'frozenvarianceadam', 'lr': 0.01, 'delay': 2, 'warmup_steps': 1,
            'optimizer_params': {'freeze_after': 4, 'beta2': 0.99}}),
    (2, 2, {'optimizer': 'nag', 'delay': 2, 'warmup_steps': 3}),
    (3, 1, {'optimizer': 'nag', 'delay': 4, 'warmup_steps': 0}),
]


@pytest.mark.parametrize('num_workers,num_servers,overrides', OPTIMIZER_CASES,
                         ids=['%s-N%d-S%d-k%d' % (c[2]['optimizer'], c[0], c[1], c[2]['delay'])
                              for c in OPTIMIZER_CASES])
def test_mirror_of_adam_and_nag_matches_reference(tmp_path, num_workers, num_servers,
                                                  overrides):
    # The local optimizer's state starts as the servers' after round W (fetched through the
    # state keys, with MXDELAY_CHUNK_SIZE 50 so that w1 and w2 have several chunks on both
    # servers) and continues locally on N * g.
    config = dict(BASE, **overrides)
    histories = run_mlp_job(tmp_path, num_workers, config, num_servers=num_servers,
                            env={'MXDELAY_CHUNK_SIZE': 50})
    trajectory = simulate(config, num_workers)
    assert_matches_reference(histories, trajectory)
    worst = max(float(np.max(np.abs(h[name] - np.array([trajectory.local[t][rank][name]
                                                         for t in range(len(h[name]))]))))
                for rank, h in histories.items() for name in ('w1', 'b1', 'w2', 'b2'))
    print('\nreference %s: max |w\' - reference| = %.3g' % (overrides['optimizer'], worst))
