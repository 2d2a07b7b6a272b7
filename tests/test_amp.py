"""AMP dynamic loss scaling with DelayedTrainer on 'dist_delay' (docs/design.md §11), in
real jobs against the numpy reference (tests/reference.py with ``overflow``) and against
stock MXNet.

Overflows are injected by the job script (tests/scripts/mlp_job.py: the w1 gradient of
chosen (rank, step) pairs times inf). With ``amp='float32'`` AMP casts no operator, so the
arithmetic is float32 with loss scaling by powers of two, which the reference replays with
the unscaled gradients: the tolerance is the reference tests' (conftest RTOL, ATOL), and
loss scales must be equal.
"""
import numpy as np
import pytest

import reference
from support.reference_jobs import (MLP_BASE as BASE, assert_matches_reference, run_mlp_job,
                                    run_stock_job, simulate_mlp_job as simulate)

pytestmark = pytest.mark.jobs

CASES = [
    # (num_workers, num_servers, overrides). W = 3, k = 3: overflows in the warm-up (1),
    # at the switch (3) and in the delayed phase (6, the second step of a period) on one
    # worker; a window of 3 lets the scale also grow.
    (2, 2, {'delay': 3, 'warmup_steps': 3, 'local_rule': 'mirror', 'scale_window': 3,
            'overflow': [[1, 1], [0, 3], [1, 6]]}),
    # N = 3 with Adam (the update count skips overflowed rounds): two workers at once in
    # the delayed phase, one at a pull application (7: k = 2, pulls applied at 4, 6, 8).
    (3, 1, {'optimizer': 'adam', 'lr': 0.01, 'delay': 2, 'warmup_steps': 1,
            'scale_window': 4, 'overflow': [[2, 0], [0, 4], [1, 4], [2, 7]]}),
]


@pytest.mark.parametrize('num_workers,num_servers,overrides', CASES,
                         ids=['N%d-S%d-%s' % (c[0], c[1], c[2].get('optimizer', 'sgd'))
                              for c in CASES])
def test_overflowed_rounds_match_reference(tmp_path, num_workers, num_servers, overrides):
    config = dict(BASE, steps=14, amp='float32', **overrides)
    histories = run_mlp_job(tmp_path, num_workers, config, num_servers=num_servers,
                            env={'MXDELAY_CHUNK_SIZE': 50})
    trajectory = simulate(config, num_workers)
    assert trajectory.skipped == sorted({t for _, t in config['overflow']})
    assert_matches_reference(histories, trajectory)
    for rank, history in histories.items():
        np.testing.assert_array_equal(history['loss_scale'], trajectory.scales,
                                      err_msg='worker %d loss scale' % rank)
    assert len(set(trajectory.scales)) >= 3, 'the test needs the scale to fall and rise'


def test_save_resume_with_a_pending_overflow_continues_exactly(tmp_path):
    # W = 3, k = 3: pulls issued at 6, 9, 12 and applied at 7, 10, 13. Saved at 8, the
    # overflow of round 7 (worker 1) has not reached the loss scale yet: after the resume
    # the pull applied at 10 must still see it (the counter's marks are restored on its
    # server), and the loss scaler's state comes from the worker's file.
    # The overflow of round 2 leaves the saved scale at half a fresh scaler's.
    config = dict(BASE, steps=16, delay=3, warmup_steps=3, amp='float32',
                  overflow=[[0, 2], [1, 7]])
    full = run_mlp_job(tmp_path / 'full', 2, config)
    run_mlp_job(tmp_path / 'first', 2, dict(config, save_at=8, stop_after=10))
    ckpt = str(tmp_path / 'first' / 'out' / 'ckpt')
    resumed = run_mlp_job(tmp_path / 'resumed', 2, dict(config, resume_from=ckpt))
    assert_matches_reference(full, simulate(config, 2))
    for rank in range(2):
        assert int(resumed[rank]['first']) == 9
        for name in ('w1', 'b1', 'w2', 'b2', 'loss_scale'):
            np.testing.assert_array_equal(resumed[rank][name], full[rank][name][9:],
                                          err_msg='worker %d %s after resume' % (rank, name))
    assert full[0]['loss_scale'][9] != full[0]['loss_scale'][10], 'round 7 must matter at 10'


def _local_scales(overflowed_steps, steps):
    scale, scales = reference.LossScale(), []
    for t in range(steps):
        scale.advance(t in overflowed_steps)
        scales.append(scale.scale)
    return scales


def test_stock_gluon_trainer_with_amp_on_dist_delay_is_stock_dist_sync(tmp_path):
    # gluon.Trainer (not DelayedTrainer) with AMP is left as on MXNet's dist_sync: the
    # servers apply worker 1's overflowed round 4 (inf and NaN weights from then on, bit for bit
    # against a stock job with no mxdelay in any process, NaNs included), and each worker's
    # scaler sees only its own gradients. One difference: MXNet's native store pulls into
    # the pushed gradient, so stock worker 0's scaler finds the NaN weights of round 4 in
    # its gradient at step 4; on 'dist_delay' it sees its own finite gradient, as Gluon
    # means (docs/design.md §11). 6 steps: at step 6 Gluon's batch-size check would refuse
    # worker 1's new loss scale on either store.

    config = dict(BASE, steps=6, amp='float32', overflow=[[1, 4]])
    stock = run_stock_job(tmp_path / 'stock', config)
    ours = run_mlp_job(tmp_path / 'delay', 2, dict(config, trainer='gluon', delay=1,
                                                   warmup_steps=0, kvstore='dist_delay'))
    for rank in range(2):
        for name in ('w1', 'b1', 'w2', 'b2'):
            np.testing.assert_array_equal(ours[rank][name], stock[rank][name],
                                          err_msg='worker %d %s' % (rank, name))
    assert not np.isfinite(stock[0]['w1'][4]).any() and np.isfinite(stock[0]['w1'][3]).all()
    np.testing.assert_array_equal(ours[0]['loss_scale'], _local_scales({5}, 6))
    np.testing.assert_array_equal(stock[0]['loss_scale'], _local_scales({4, 5}, 6))
    for run in (ours, stock):
        np.testing.assert_array_equal(run[1]['loss_scale'], _local_scales({4, 5}, 6))


def test_bfloat16_amp_trains_and_loss_scales_agree(tmp_path):
    # AMP's own bfloat16 casts on the CPU, with one injected overflow in the delayed phase:
    # training moves the weights, they stay finite, every worker has the same loss scale at
    # every step, and the weights stay near the float32 reference (bfloat16 keeps 8 bits).
    config = dict(BASE, steps=16, delay=3, warmup_steps=3, amp='bfloat16', overflow=[[1, 9]])
    histories = run_mlp_job(tmp_path, 2, config)
    trajectory = simulate(config, 2)
    for rank, history in histories.items():
        np.testing.assert_array_equal(history['loss_scale'], histories[0]['loss_scale'])
        np.testing.assert_array_equal(history['loss_scale'], trajectory.scales)
        for name in ('w1', 'b1', 'w2', 'b2'):
            assert np.isfinite(history[name]).all()
            moved = np.abs(trajectory.local[-1][rank][name] - history[name][0]).max()
            error = np.abs(trajectory.local[-1][rank][name] - history[name][-1]).max()
            print('%d %s: moved %.3g, off the float32 reference by %.3g'
                  % (rank, name, moved, error))
            assert 1e-5 < error < 0.05 * moved, (rank, name, error, moved)  # bf16 used

