"""The stock pin: mxdelay's synchronous training against MXNet's own ``dist_sync``.

The other distributed tests compare against jobs that import mxdelay, so their servers are
mxdelay's. Here the baseline is a job in which no process imports mxdelay or kvstore_ext
(scripts/stock_job.py: the scheduler and servers are MXNet 1.9.1's, the workers run a stock
``gluon.Trainer`` on the native ``'dist_sync'`` store; each role records what it imported,
and each worker checks it before training), launched like every job by ``mxdelay-launch``
with every ``MXNET_*`` variable removed from its environment (conftest.stock_env: a test
process that imported mxdelay carries ``MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN_BWD=4``).

Against it, on the same model, initial weights and per-rank batches (scripts/mlp_model.py),
2 workers with 1 and with 2 servers, SGD with momentum 0.9 and weight decay 1e-3, 8 steps:

(i) ``DelayedTrainer`` on ``'dist_delay'`` during its warm-up and switch (warm-up 7: step 7
    is the switch, which still pulls the servers' weights);
(ii) a stock ``gluon.Trainer`` on ``'dist_delay'``.

Tolerance: bit-equal (``assert_array_equal``), every worker, step and parameter. That is
what is expected: with 2 workers a round's sum is the same in either arrival order, and
mxdelay's server applies MXNet's SGD arithmetic (single-tensor ``sgd_mom_update``, which
computes what the stock server's ``multi_sgd_mom_update`` does). All three are also checked
against the numpy reference (synchronous SGD) at ``rtol=1e-5, atol=1e-6``, so that the three
cannot agree on something else.

Also pinned: MXNet's own server ignores ``lr_mult`` and ``wd_mult`` (the optimizer it
receives is unpickled, and ``Optimizer.__setstate__`` empties ``param_dict``), which is why
mxdelay's server takes them from the workers (tests/test_multipliers.py tests that it does).
"""

import numpy as np
import pytest

import reference
from support.jobs import stock_env
from support.reference_jobs import ATOL, RTOL, run_mlp_job, run_stock_job
from scripts import mlp_model

NAMES = ('w1', 'b1', 'w2', 'b2')
STEPS = 8
CONFIG = {'steps': STEPS, 'batch': 6, 'lr': 0.1, 'momentum': 0.9, 'wd': 1e-3}


def simulate(config, lr_mult=None, wd_mult=None):
    """Synchronous SGD on 2 workers' gradients: the reference with warm-up over every step."""
    def grad_fn(weights, rank, step):
        x, y = mlp_model.batch(rank, step, config['batch'])
        return mlp_model.numpy_grad(weights, x, y)
    return reference.simulate(
        mlp_model.init_params(), grad_fn, 2, config['steps'], 1, config['steps'], config['lr'],
        momentum=config['momentum'], wd=config['wd'], rescale_grad=1.0 / config['batch'],
        lr_mult=lr_mult, wd_mult=wd_mult)


def largest_difference(histories, trajectory):
    """The largest |job - reference| over every worker, step and parameter."""
    return max(float(np.abs(history[name][t] - trajectory.local[t][rank][name]).max())
               for rank, history in histories.items() for name in NAMES
               for t in range(len(history[name])))


def assert_close_to(histories, trajectory, what):
    for rank, history in histories.items():
        for name in NAMES:
            assert len(history[name]) == len(trajectory.local)
            for t, got in enumerate(history[name]):
                np.testing.assert_allclose(got, trajectory.local[t][rank][name], rtol=RTOL,
                                           atol=ATOL, err_msg='%s: worker %d, step %d, %s'
                                           % (what, rank, t, name))


@pytest.mark.jobs
@pytest.mark.parametrize('num_servers', [1, 2])
def test_synchronous_training_equals_stock_dist_sync_bit_for_bit(tmp_path, num_servers):
    stock = run_stock_job(tmp_path / 'stock', CONFIG, num_servers=num_servers)
    runs = {
        'DelayedTrainer warm-up on dist_delay': run_mlp_job(
            tmp_path / 'delayed', 2, dict(CONFIG, trainer='delayed', kvstore='dist_delay',
                                          delay=2, warmup_steps=STEPS - 1),
            num_servers=num_servers, env=stock_env()),
        'gluon.Trainer on dist_delay': run_mlp_job(
            tmp_path / 'gluon', 2, dict(CONFIG, trainer='gluon', kvstore='dist_delay'),
            num_servers=num_servers, env=stock_env()),
    }
    trajectory = simulate(CONFIG)
    assert_close_to(stock, trajectory, 'stock dist_sync')
    # The weights move well beyond the tolerance, so that equality says something.
    assert np.abs(stock[0]['w1'][-1] - mlp_model.init_params()['w1']).max() > 1e-2
    for what, histories in runs.items():
        for rank in range(2):
            for name in NAMES:
                np.testing.assert_array_equal(
                    histories[rank][name], stock[rank][name],
                    err_msg='%s vs stock dist_sync, worker %d, %s' % (what, rank, name))
        assert_close_to(histories, trajectory, what)


@pytest.fixture(scope='module')
def plain_sgd_runs(tmp_path_factory):
    """SGD without momentum, with weight decay, 1 server: the stock job and a stock
    gluon.Trainer on 'dist_delay'."""
    out = tmp_path_factory.mktemp('plain_sgd')
    config = dict(CONFIG, momentum=0.0)
    stock = run_stock_job(out / 'stock', config)
    delay = run_mlp_job(out / 'gluon', 2, dict(config, trainer='gluon', kvstore='dist_delay'),
                        env=stock_env())
    return config, stock, delay


@pytest.mark.jobs
def test_plain_sgd_with_weight_decay_is_stock_up_to_rounding(plain_sgd_runs):
    # Without momentum mxdelay's server runs nd.sgd_update, which computes
    # (1 - lr*wd)*w - (lr*rg)*g; MXNet's own server runs optimizer.SGD's multi_sgd_update,
    # which computes w - ((lr*wd)*w + (lr*rg)*g). With wd > 0 they differ in the last bit:
    # measured over 8 steps, 1.8e-7 at most (weights O(0.1-1)), in about a third of the
    # elements. Tolerance: rtol=atol=1e-6, and the reference's.
    config, stock, delay = plain_sgd_runs
    for rank in range(2):
        for name in NAMES:
            np.testing.assert_allclose(delay[rank][name], stock[rank][name], rtol=1e-6,
                                       atol=1e-6, err_msg='worker %d, %s' % (rank, name))
    assert_close_to(stock, simulate(config), 'stock dist_sync')
    assert_close_to(delay, simulate(config), 'gluon.Trainer on dist_delay')


@pytest.mark.jobs
def test_plain_sgd_with_weight_decay_is_stock_bit_for_bit(plain_sgd_runs):
    _, stock, delay = plain_sgd_runs
    for rank in range(2):
        for name in NAMES:
            np.testing.assert_array_equal(delay[rank][name], stock[rank][name])


@pytest.mark.jobs
def test_stock_dist_sync_ignores_lr_mult_and_wd_mult(tmp_path):
    # The baseline's known limit, pinned: MXNet's own server applies lr and wd without the
    # Parameters' multipliers, so its weights follow the reference without them.
    mults = {'lr_mult': {'w1': 0.5}, 'wd_mult': {'w2': 0.0}}
    config = dict(CONFIG, wd=0.05, **mults)
    stock = run_stock_job(tmp_path / 'stock', config)
    without = simulate(config)
    honoured = simulate(config, **mults)
    assert_close_to(stock, without, 'stock dist_sync with multipliers')
    assert largest_difference(stock, honoured) > 1e-3
