"""``mx.gluon.Trainer`` swapped for a user's subclass of ``DelayedTrainer``, as a user does to
run an unmodified Gluon script (issue 36, item 4).

What is tested: with ``mx.gluon.Trainer`` (the same attribute as ``gluon.Trainer``) replaced by
a subclass of ``mxdelay.DelayedTrainer``, a script written for ``gluon.Trainer`` trains, saves
and loads its states exactly as with stock ``gluon.Trainer``:

1. on the kvstores None, ``'device'`` and ``'local'`` (two CPU contexts, one process), every
   step of a run that saves, goes on, then loads the saved states and the saved weights and
   trains again from there, and the saved file itself; also ``allreduce_grads``/``update``,
   and a row_sparse weight read through ``row_sparse_data`` (Gluon's ``_row_sparse_pull``).
   DelayedTrainer's pass-through mode used to call ``gluon.Trainer.step`` and the like
   through the module attribute, i.e. the swapped class, and recursed without end;
2. on ``'dist_delay'`` (2 workers, 1 server: scripts/swapped_trainer_job.py): every step
   equals a stock job's (scripts/stock_job.py, no mxdelay in any process, MXNet's own
   ``dist_sync``), and a job that saves at step 3 and a new job that loads those states go
   on as the stock job (DelayedTrainer's defaults: 200 synchronous steps, which are
   ``dist_sync``'s bit for bit, tests/test_optimizer_parity.py).

Tolerance: none, every comparison is exact.
"""
import filecmp
import json
import os
import sys
import tempfile

import numpy as np
import pytest

import mxdelay
import mxnet as mx
from mxnet import autograd, gluon, nd

from support.model import contexts
from support.reference_jobs import run_stock_job
from support.jobs import SCRIPTS, assert_ok, run_job
from scripts import mlp_model

OPT = {'learning_rate': 0.1, 'momentum': 0.9, 'wd': 1e-3}
STOCK = gluon.Trainer


class UsersTrainer(mxdelay.DelayedTrainer):
    """A user's subclass of DelayedTrainer."""


@pytest.fixture
def swapped(monkeypatch):
    """Install UsersTrainer as ``mx.gluon.Trainer``; undone after the test."""
    def swap():
        monkeypatch.setattr(mx.gluon, 'Trainer', UsersTrainer)
        assert gluon.Trainer is UsersTrainer
    return swap


def _train(net, trainer, ctxs, steps, history, manual=False):
    loss_fn = gluon.loss.L2Loss()
    for step in steps:
        x, y = mlp_model.batch(0, step, 6)
        xs = gluon.utils.split_and_load(nd.array(x), ctxs)
        ys = gluon.utils.split_and_load(nd.array(y), ctxs)
        with autograd.record():
            losses = [loss_fn(net(xi), yi) for xi, yi in zip(xs, ys)]
        autograd.backward(losses)
        if manual:
            trainer.allreduce_grads()
            trainer.update(6)
        else:
            trainer.step(6)
        history.append(mlp_model.weights_of(net))


def _stock_then_swapped(script, swapped):
    """Run `script` (it returns the trainer's class, the weights after every step, and
    anything else) with stock gluon.Trainer, then with UsersTrainer installed; check the
    classes and that every step's weights are equal; return both results."""
    stock = script()
    swapped()
    users = script()
    assert (stock[0], users[0]) == (STOCK, UsersTrainer)
    _assert_same(stock[1], users[1])
    return stock, users


def _script(tmp_path, kvstore):
    """A script written for gluon.Trainer: train 3 steps, save the weights and the trainer's
    states (in a new folder of `tmp_path`), train 2 more, load both, train those 2 steps
    again. Returns (the trainer's class, the weights after every step, the states file)."""
    folder = tempfile.mkdtemp(dir=str(tmp_path))
    ctxs = contexts(2)
    net, _ = mlp_model.build(ctxs)
    trainer = gluon.Trainer(net.collect_params(), 'sgd', dict(OPT), kvstore=kvstore)
    history = []
    _train(net, trainer, ctxs, range(3), history)
    states, params = os.path.join(folder, 'states'), os.path.join(folder, 'params')
    trainer.save_states(states)
    net.save_parameters(params)
    _train(net, trainer, ctxs, range(3, 5), history)
    net.load_parameters(params, ctx=ctxs)
    trainer.load_states(states)
    _train(net, trainer, ctxs, range(3, 5), history)
    return type(trainer), history, states


def _assert_same(want, got):
    assert len(want) == len(got)
    for step, (a, b) in enumerate(zip(want, got)):
        assert a.keys() == b.keys()
        for name in a:
            np.testing.assert_array_equal(a[name], b[name], err_msg='step %d %s' % (step, name))


# -- 1. non-distributed kvstores, in this process --------------------------------------------
@pytest.mark.parametrize('kvstore', [None, 'device', 'local'])
def test_swapped_trainer_trains_saves_and_loads_as_gluon_trainer(tmp_path, swapped, kvstore):
    stock, users = _stock_then_swapped(lambda: _script(tmp_path, kvstore), swapped)
    assert filecmp.cmp(stock[2], users[2], shallow=False)
    if kvstore is not None:
        # The run went back: the reloaded steps are the first run of steps 3 and 4 again.
        # (Without a kvstore each device steps with its own gradient, and save_parameters
        # saves the devices' mean.)
        _assert_same(stock[1][3:5], stock[1][5:7])


@pytest.mark.parametrize('kvstore', [None, 'device', 'local'])
def test_swapped_trainer_allreduces_and_updates_as_gluon_trainer(swapped, kvstore):
    def script():
        ctxs = contexts(2)
        net, _ = mlp_model.build(ctxs)
        trainer = gluon.Trainer(net.collect_params(), 'sgd', dict(OPT), kvstore=kvstore,
                                update_on_kvstore=False)
        history = []
        _train(net, trainer, ctxs, range(3), history, manual=True)
        return type(trainer), history

    _stock_then_swapped(script, swapped)


class _RowSparseLinear(gluon.Block):
    """``y = onehot(ids) . W`` with W a row_sparse weight (read by ``row_sparse_data``)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.weight = self.params.get('weight', shape=(12, 3), stype='row_sparse',
                                          grad_stype='row_sparse')

    def forward(self, ids):  # pylint: disable=arguments-differ
        return nd.sparse.dot(nd.one_hot(ids, 12).tostype('csr'),
                             self.weight.row_sparse_data(ids))


@pytest.mark.parametrize('kvstore', ['device', 'local'])
def test_swapped_trainer_reads_row_sparse_weights_as_gluon_trainer(swapped, kvstore):
    def script():
        mx.random.seed(7)
        block = _RowSparseLinear(prefix='emb_')
        block.initialize(mx.init.Uniform(), ctx=mx.cpu())
        trainer = gluon.Trainer(block.collect_params(), 'sgd', {'learning_rate': 0.5},
                                kvstore=kvstore)
        rng = np.random.RandomState(0)
        history = []
        for _ in range(3):
            ids = nd.array(rng.randint(0, 12, size=4))
            target = nd.array(rng.uniform(-1, 1, size=(4, 3)))
            with autograd.record():
                loss = ((block(ids) - target) ** 2).sum()
            loss.backward()
            trainer.step(4)
            history.append({'w': block.weight.row_sparse_data(nd.arange(12)).asnumpy()})
        return type(trainer), history

    (_, want), _ = _stock_then_swapped(script, swapped)
    assert not np.array_equal(want[0]['w'], want[-1]['w'])


# -- 2. 'dist_delay': real jobs ----------------------------------------------------------------
JOB = {'steps': 6, 'batch': 6, 'lr': 0.1, 'momentum': 0.9, 'wd': 1e-3}


def _swapped_job(out, config):
    out.mkdir(parents=True)
    command = [sys.executable, os.path.join(SCRIPTS, 'swapped_trainer_job.py'),
               json.dumps(config), str(out)]
    assert_ok(run_job(command, num_workers=2, num_servers=1, timeout=120))
    runs = {rank: np.load(str(out / ('worker%d.npz' % rank))) for rank in range(2)}
    assert all(str(run['trainer']) == 'UsersTrainer' for run in runs.values())
    return runs


@pytest.mark.jobs
def test_swapped_trainer_on_dist_delay_trains_saves_and_loads_as_stock(tmp_path):
    stock = run_stock_job(tmp_path / 'stock', JOB)
    assert not np.array_equal(stock[0]['w1'][-1], mlp_model.init_params()['w1'])
    full = _swapped_job(tmp_path / 'full', JOB)
    first = _swapped_job(tmp_path / 'first', dict(JOB, save_at=3, stop_after=4))
    resumed = _swapped_job(tmp_path / 'resumed', dict(
        JOB, resume_from=str(tmp_path / 'first' / 'ckpt'), first=4))
    for rank in range(2):
        for name in ('w1', 'b1', 'w2', 'b2'):
            want = stock[rank][name]
            message = 'worker %d %s' % (rank, name)
            np.testing.assert_array_equal(full[rank][name], want, err_msg=message)
            np.testing.assert_array_equal(first[rank][name], want[:5], err_msg=message)
            np.testing.assert_array_equal(resumed[rank][name], want[4:], err_msg=message)
