"""Gluon's per-parameter multipliers (``Parameter.lr_mult``, ``Parameter.wd_mult``) with
DelayedTrainer: honoured by mxdelay's servers (warm-up and every round) and by the local rule
(delayed phase).

1. Real jobs (scripts/mlp_job.py, 2 workers, delay 2, warm-up 3, 14 steps, SGD with
   momentum 0.9 and weight decay 0.01): ``w1`` has ``lr_mult=0.5`` and ``w2`` has
   ``wd_mult=0``. Every worker's weights after every step are checked against the numpy
   reference of docs/design.md §1 with the same multipliers (tests/reference.py, pinned in
   test_reference.py) at ``rtol=1e-5, atol=1e-6``, with rule ``'mirror'`` on 1 server and
   rule ``'sgd'`` (its own local lr) on 2 servers with 50-element chunks (``w1``'s 128
   elements are 3 chunks spread over both servers, each of which must apply ``w1``'s
   multiplier). The same job without multipliers is more than 100x the tolerance away, so
   a server or a rule that dropped one would fail.
2. In one process (N = 1, a real ``DistDelay`` over the native stand-in of
   support/native.py, whose real server takes the multipliers from the worker's REGISTER
   data): the
   N = 1 invariant, DelayedTrainer with rule ``'mirror'`` (and ``'sgd'`` without momentum)
   trains like a stock ``gluon.Trainer`` with the same multipliers, at every step of every
   phase, up to float32 rounding (``rtol=atol=1e-6``).
"""

import numpy as np
import pytest

import mxdelay
from mxdelay.schedule import DelaySchedule
from mxnet import gluon

import reference
from support.jobs import stock_env
from support.model import BATCH, backward_at, contexts, mlp_params
from support.reference_jobs import ATOL, RTOL, run_mlp_job
from support.native import delay_store
from scripts import mlp_model

NAMES = ('w1', 'b1', 'w2', 'b2')
MULTS = {'lr_mult': {'w1': 0.5}, 'wd_mult': {'w2': 0.0}}
BASE = {'steps': 14, 'batch': 6, 'lr': 0.1, 'momentum': 0.9, 'wd': 0.01, 'delay': 2,
        'warmup_steps': 3}


def simulate(config, num_workers, lr_mult=None, wd_mult=None):
    def grad_fn(weights, rank, step):
        x, y = mlp_model.batch(rank, step, config['batch'])
        return mlp_model.numpy_grad(weights, x, y)
    return reference.simulate(
        mlp_model.init_params(), grad_fn, num_workers, config['steps'], config['delay'],
        config['warmup_steps'], config['lr'], momentum=config['momentum'], wd=config['wd'],
        rescale_grad=1.0 / config['batch'], local_lr=config.get('local_lr'),
        rule=config['local_rule'], lr_mult=lr_mult, wd_mult=wd_mult)


def differences(histories, trajectory, name):
    """|job - reference| of parameter `name`, largest per step over the workers."""
    return [max(float(np.abs(history[name][t] - trajectory.local[t][rank][name]).max())
                for rank, history in histories.items())
            for t in range(len(trajectory.local))]


CASES = [
    # (num_servers, overrides, env)
    (1, {'local_rule': 'mirror'}, {}),
    (2, {'local_rule': 'sgd', 'local_lr': 0.05}, {'MXDELAY_CHUNK_SIZE': 50}),
]


@pytest.mark.jobs
@pytest.mark.parametrize('num_servers,overrides,env', CASES,
                         ids=['mirror-S1', 'sgd-local_lr-S2-chunks'])
def test_servers_and_local_rule_apply_the_multipliers(tmp_path, num_servers, overrides, env):
    config = dict(BASE, **overrides)
    histories = run_mlp_job(tmp_path, 2, dict(config, **MULTS), num_servers=num_servers,
                            env=dict(stock_env(), **env))
    want = simulate(config, 2, **MULTS)
    schedule = DelaySchedule(config['delay'], config['warmup_steps'])
    for rank, history in histories.items():
        for name in NAMES:
            assert len(history[name]) == config['steps']
            for t, got in enumerate(history[name]):
                phase = schedule.phase(t)
                np.testing.assert_allclose(
                    got, want.local[t][rank][name], rtol=RTOL, atol=ATOL,
                    err_msg='worker %d, step %d (%s), %s' % (rank, t, phase, name))
    # Each multiplier moves its parameter far beyond the tolerance, in the warm-up (the
    # servers' update) and at the delayed steps between pulls (the local rule's).
    plain = simulate(config, 2)
    delayed_free = [t for t in range(config['warmup_steps'] + 1, config['steps'])
                    if not schedule.applies_pull(t)]
    for name in ('w1', 'w2'):
        gaps = differences(histories, plain, name)
        assert gaps[config['warmup_steps'] - 1] > 100 * ATOL, (name, gaps)
        assert min(gaps[t] for t in delayed_free) > 100 * ATOL, (name, gaps)


# -- 2. one worker, in one process ----------------------------------------------------------
OPT = {'learning_rate': 0.1, 'momentum': 0.9, 'wd': 0.01}


def train(make_trainer, mults, steps=12):
    """{name: [weights after each step]} of one worker trained on rank 0's data."""
    ctxs = contexts(1)
    params = mlp_params(ctxs, **mults)
    trainer = make_trainer(params)
    history = {p.name: [] for p in params}
    for step in range(steps):
        backward_at(params, ctxs, step)
        trainer.step(BATCH)
        for p in params:
            history[p.name].append(p.data().asnumpy())
    return history


def stock(mults, momentum=0.9):
    return train(lambda params: gluon.Trainer(params, 'sgd', dict(OPT, momentum=momentum),
                                              kvstore=None), mults)


def delayed(mults, local_rule='mirror', momentum=0.9):
    return train(lambda params: mxdelay.DelayedTrainer(
        params, 'sgd', dict(OPT, momentum=momentum), kvstore=delay_store(),
        delay=2, warmup_steps=2, local_rule=local_rule), mults)


@pytest.mark.parametrize('local_rule,momentum', [('mirror', 0.9), ('sgd', 0.0)])
def test_one_worker_equals_gluon_trainer_with_multipliers(local_rule, momentum):
    # docs/design.md §1.6, N = 1, lam = 0, local_lr = lr: rule 'mirror' with momentum and rule
    # 'sgd' without give w' = W at every step, so DelayedTrainer trains as gluon.Trainer
    # does, multipliers included, in the warm-up (the server's update) and in the delayed
    # phase (the rule's). Up to float32 rounding: the mirror buffer starts as W_{W+1} - W_W,
    # and without momentum the server and rule 'sgd' run nd.sgd_update, which rounds
    # (1 - lr*wd)*w differently from gluon.Trainer's multi_sgd_update (measured over 12
    # steps: 1.2e-7 and 4.2e-7 at most).
    want = stock(MULTS, momentum)
    got = delayed(MULTS, local_rule, momentum)
    for name in NAMES:
        for t in range(12):
            np.testing.assert_allclose(got[name][t], want[name][t], rtol=1e-6, atol=1e-6,
                                       err_msg='step %d, %s' % (t, name))
    plain = stock({}, momentum)
    for name in ('w1', 'w2'):
        assert np.abs(plain[name][-1] - want[name][-1]).max() > 1e-3, name
