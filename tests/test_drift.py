"""The drift-corrected rule (``local_rule='drift'``, docs/design.md §1.4): the rule object on
NDArrays against its closed form, the numpy reference's own invariants, and real jobs
(N = 2 and 3, warm-up, k > 1, Adam on chunks over two servers, AMP overflows) against the
reference."""
import numpy as np
import pytest

import mxnet as mx
from mxnet import nd

import reference
from support.reference_jobs import (MLP_BASE as BASE, assert_matches_reference, run_mlp_job,
                      simulate_mlp_job as simulate)
from mxdelay.rules import DriftCorrected, LocalSGDRule, MirrorRule, RuleContext, create_rule

F32 = np.float32


def _context(pulled, issues_pull=False, delay=3):
    return RuleContext(lr=0.1, wd=0.01, momentum=0.9, clip_gradient=-1.0, rescale_grad=0.5,
                       num_workers=2, index=0, step=5, pulled=pulled, issues_pull=issues_pull,
                       delay=delay)


def test_update_adds_the_per_step_drift_learnt_at_each_pull():
    # Closed form: at a pull d := d + (W_t - w'_before) / k; every step w' := mirror(w') + d.
    rng = np.random.RandomState(0)
    w0, last_step = rng.randn(4, 3).astype(F32), rng.randn(4, 3).astype(F32) * F32(0.01)
    rule = DriftCorrected(MirrorRule())
    weight = nd.array(w0)
    state = rule.create_state_for(0, weight, nd.array(last_step))
    w, v, d, before = w0.copy(), last_step.copy(), np.zeros_like(w0), w0.copy()
    pulls = {2: rng.randn(4, 3).astype(F32), 5: rng.randn(4, 3).astype(F32)}  # W_t applied
    for step in range(7):
        grad = rng.randn(4, 3).astype(F32)
        ctx = _context(pulled=step in pulls)
        if step in pulls:
            weight[:] = pulls[step]
            w = pulls[step].copy()
            d = d + (w - before) / F32(3)
        rule.update(weight, nd.array(grad), None, state, ctx)
        w, v = reference.sgd_mom_step(w, grad, v, F32(ctx.lr), F32(ctx.wd), F32(2 * 0.5),
                                      F32(0.9))
        w = w + d
        before = w.copy()
        np.testing.assert_array_equal(weight.asnumpy(), w)
        np.testing.assert_array_equal(state[1].asnumpy(), d)
    assert np.abs(d).max() > 0.1   # the pulls moved it: the correction is not a no-op


def test_builtin_name_wraps_the_mirror_and_delegates_the_server_state():
    rule = create_rule('drift', dc_lambda=0.2)
    assert isinstance(rule, DriftCorrected) and isinstance(rule.rule, MirrorRule)
    assert rule.dc_lambda == 0.2 and rule.needs_grad_sync
    assert repr(rule) == 'DriftCorrected(MirrorRule(dc_lambda=0.2))'
    optimizer = mx.optimizer.create('adam')
    rule.start(optimizer)
    weight = nd.ones((2, 3))
    state = rule.create_state_for(0, weight, nd.zeros((2, 3)))
    arrays = rule.server_state(weight, state, 0)
    assert arrays is not None and arrays == list(state[0])   # Adam's mean and var


def test_wrapping_is_checked():
    with pytest.raises(TypeError, match='LocalRule instance'):
        DriftCorrected(MirrorRule)
    with pytest.raises(TypeError, match='not DriftCorrected'):
        DriftCorrected(DriftCorrected(LocalSGDRule()))


def test_row_sparse_gradients_are_refused():
    param = mx.gluon.Parameter('embedding0_weight', shape=(10, 4), grad_stype='row_sparse')
    optimizer = mx.optimizer.create('sgd', momentum=0.9, param_dict={0: param})
    with pytest.raises(ValueError, match="lazy updates of Parameter embedding0_weight.*'mirror'"):
        create_rule('drift').check_optimizer(optimizer)


def _mlp_reference(num_workers, **overrides):
    return simulate(dict(BASE, **overrides), num_workers)


@pytest.mark.parametrize('optimizer', ['sgd', 'adam'])
def test_reference_one_worker_stays_on_the_global_trajectory(optimizer):
    # With one worker the mirror's steps are the server's, so d stays 0 (Adam: exactly; SGD
    # momentum: its buffer starts at W_{W+1} - W_W, float32 rounding).
    extra = {'optimizer': optimizer, 'lr': 0.01} if optimizer == 'adam' else {}
    traj = _mlp_reference(1, delay=3, warmup_steps=2, local_rule='drift', **extra)
    for t in range(len(traj.glob)):
        for name, value in traj.glob[t].items():
            np.testing.assert_allclose(traj.local[t][0][name], value, rtol=0,
                                       atol=0 if optimizer == 'adam' else 1e-6)


def test_reference_two_workers_differ_from_the_mirror_after_the_first_pull():
    drift = _mlp_reference(2, delay=3, warmup_steps=2, local_rule='drift')
    mirror = _mlp_reference(2, delay=3, warmup_steps=2, local_rule='mirror')
    first = 2 + 1 + 3          # W + 1 + k: the step that applies the first pull
    for t in range(first):     # the same until d is first learnt
        np.testing.assert_array_equal(drift.local[t][1]['w1'], mirror.local[t][1]['w1'])
    assert np.abs(drift.local[first][1]['w1'] - mirror.local[first][1]['w1']).max() > 1e-6


CASES = [
    # (num_workers, num_servers, overrides)
    (2, 1, {'delay': 3, 'warmup_steps': 2}),
    (3, 2, {'delay': 2, 'warmup_steps': 1, 'optimizer': 'adam', 'lr': 0.01}),
    (2, 2, {'delay': 3, 'warmup_steps': 3, 'amp': 'float32', 'scale_window': 3,
            'overflow': [[1, 1], [0, 6], [1, 7]]}),
]


@pytest.mark.jobs
@pytest.mark.parametrize('num_workers,num_servers,overrides', CASES,
                         ids=['N%d-S%d-%s%s' % (c[0], c[1], c[2].get('optimizer', 'sgd'),
                                                '-amp' if 'amp' in c[2] else '')
                              for c in CASES])
def test_jobs_match_reference(tmp_path, num_workers, num_servers, overrides):
    # MXDELAY_CHUNK_SIZE 50: w1 and w2 in several chunks on both servers.
    config = dict(BASE, local_rule='drift', **overrides)
    histories = run_mlp_job(tmp_path, num_workers, config, num_servers=num_servers,
                            env={'MXDELAY_CHUNK_SIZE': 50})
    assert_matches_reference(histories, simulate(config, num_workers))
