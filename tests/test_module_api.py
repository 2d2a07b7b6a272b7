"""The Module API on ``'dist_delay'`` (issue 12, item 5, first bullet): ``mx.mod.Module.fit(
kvstore='dist_delay')`` trains exactly like ``'dist_sync'``.

MXNet 1.9.1's ``Module.init_optimizer`` makes its optimizer with ``rescale_grad = 1/batch``,
multiplying the batch by the number of workers only for type strings containing ``'dist'``
and ``'_sync'``, and keeps an explicit ``rescale_grad`` of ``optimizer_params``; its
optimizer keeps the parameters' multipliers by name (biases get ``wd_mult=0``, Variables'
``lr_mult`` attributes), which MXNet's server finds through ``idx2name``. ``DistDelay``'s
``type`` is ``'dist_sync_delay'`` (so Module takes its dist_sync path) and it registers
Module's per-name multipliers with its servers (kvstore_ext/worker/dist_delay.py, ``type`` and
``_mults``).

1. Real jobs, 2 workers, ``Module.fit`` for 2 epochs of 4 batches of 6 (scripts/module_job.py:
   the MLP of mlp_model.py as a Symbol, ``l1_weight`` with ``lr_mult=0.5``, SGD with momentum
   0.9 and wd 0.01), with 1 server (worker scripts import mxdelay) and with 2 servers (a
   script without mxdelay under ``mxdelay-run``): the weights after every step are bit for
   bit those of the same run on stock ``'dist_sync'`` (no mxdelay in any process,
   stock_env()). Measured: equal in every element. The stock run itself follows the numpy
   reference of synchronous SGD (rescale 1/(batch*2), Module's multipliers) at
   ``rtol=1e-5, atol=1e-6``. Measured without the fix: the same job's weights end up to 0.29
   away from stock (39% of the largest final ``w1`` weight); with the rescale fixed but not
   the multipliers, 0.12. (An explicit ``rescale_grad``: tests/test_module_delay.py.)
2. In one process, on a ``DistDelay`` whose native store is a stand-in of 2 or 3 workers and
   whose servers are a FakeChannel: Module's own ``init_optimizer`` leaves the optimizer, in
   the hand-shake and in the pickle sent to the servers, with ``rescale_grad ==
   1.0/(batch*N)`` exactly (an explicit value unchanged), registers each parameter's
   multipliers by name; ``mx.kv.create(store.type)`` is mxdelay's store again; Module with
   ``MXNET_UPDATE_ON_KVSTORE=0`` is refused before any network use.
"""
import glob
import json
import os
import sys

import numpy as np
import pytest

import mxnet as mx

import reference
from support.jobs import SCRIPTS, PidFile, assert_ok, run_job, stock_env
from support.reference_jobs import ATOL, RTOL
from support.stores import WorkersNative, _no_channel, servers
from kvstore_ext.protocol import commands
from kvstore_ext.worker.dist_delay import DistDelay
from kvstore_ext.protocol.commands import Command
from scripts import mlp_model

SCRIPT = os.path.join(SCRIPTS, 'module_job.py')
MXDELAY_RUN = os.path.join(os.path.dirname(sys.executable), 'mxdelay-run')
SHORT = ('w1', 'b1', 'w2', 'b2')
CONFIG = {'epochs': 2, 'steps': 4, 'batch': 6, 'lr': 0.1, 'momentum': 0.9, 'wd': 0.01,
          'lr_mult': {'l1_weight': 0.5}}
#: What Module's optimizer applies per parameter (short names), for the reference.
LR_MULT, WD_MULT = {'w1': 0.5}, {'b1': 0.0, 'b2': 0.0}


# -- 1. real jobs -------------------------------------------------------------------------------
def run_module_job(out, config, num_servers):
    """Run scripts/module_job.py with 2 workers; return ({rank: npz}, {rank: report}, result)."""
    out.mkdir(parents=True)
    command = [sys.executable, SCRIPT, json.dumps(config), str(out)]
    if config['mode'] == 'run':
        command = [MXDELAY_RUN] + command
    pids = PidFile(out / 'pids')
    result = run_job(pids.wrap(command), num_workers=2, num_servers=num_servers, timeout=120,
                     env=stock_env())
    assert_ok(result)
    pids.assert_all_dead()
    histories = {r: np.load(str(out / ('worker%d.npz' % r))) for r in range(2)}
    reports = {}
    for rank in range(2):
        with open(str(out / ('worker%d.json' % rank)), encoding='utf-8') as src:
            reports[rank] = json.load(src)
    return histories, reports, result


def assert_stock(out, num_servers):
    """Every role of the stock job ran without mxdelay and saw no MXNET_* variable."""
    records = []
    for path in glob.glob(str(out / 'role-*.json')):
        with open(path, encoding='utf-8') as src:
            records.append(json.load(src))
    assert sorted((r['role'], r['rank']) for r in records) == sorted(
        [('scheduler', '0')] + [('server', str(i)) for i in range(num_servers)]
        + [('worker', str(i)) for i in range(2)]), records
    for record in records:
        for stage in ('imported_at_start', 'imported_at_exit'):
            assert record[stage] == {'mxdelay': False, 'kvstore_ext': False}, record
        assert record['env'] == {}, record


def simulate(rescale_grad, lr_mult=None, wd_mult=None):
    """Synchronous SGD of the job's 2 workers (numpy reference, warm-up over every step)."""
    steps = CONFIG['epochs'] * CONFIG['steps']

    def grad_fn(weights, rank, step):
        x, y = mlp_model.batch(rank, step % CONFIG['steps'], CONFIG['batch'])
        return mlp_model.numpy_grad(weights, x, y)
    return reference.simulate(
        mlp_model.init_params(), grad_fn, 2, steps, 1, steps, CONFIG['lr'],
        momentum=CONFIG['momentum'], wd=CONFIG['wd'], rescale_grad=rescale_grad,
        lr_mult=lr_mult, wd_mult=wd_mult)


def largest_difference(histories, trajectory):
    return max(float(np.abs(history[name][t] - trajectory.local[t][rank][name]).max())
               for rank, history in histories.items() for name in SHORT
               for t in range(len(trajectory.local)))


@pytest.mark.jobs
@pytest.mark.parametrize('num_servers, mode', [(1, 'import'), (2, 'run')])
def test_module_fit_on_dist_delay_equals_stock_dist_sync_bit_for_bit(tmp_path, num_servers,
                                                                      mode):
    stock, stock_reports, _ = run_module_job(
        tmp_path / 'stock', dict(CONFIG, kvstore='dist_sync', mode='stock'), num_servers)
    assert_stock(tmp_path / 'stock', num_servers)
    delay, reports, _ = run_module_job(
        tmp_path / 'delay', dict(CONFIG, kvstore='dist_delay', mode=mode), num_servers)

    # Module's optimizer: dist_sync's rescale_grad, 1/(batch*N), on both stores.
    rescale = 1.0 / (CONFIG['batch'] * 2)
    for rank in range(2):
        assert stock_reports[rank]['kvstore'] == 'mxnet.kvstore.kvstore.KVStore dist_sync'
        assert reports[rank]['kvstore'] == 'kvstore_ext.worker.dist_delay.DistDelay dist_sync_delay'
        for report in (stock_reports[rank], reports[rank]):
            assert report['update_on_kvstore'] is True, report
            assert report['rescale_grad'] == rescale, report

    # Bit for bit, every parameter after every step on every worker.
    for rank in range(2):
        for name in SHORT:
            assert delay[rank][name].shape[0] == CONFIG['epochs'] * CONFIG['steps']
            np.testing.assert_array_equal(delay[rank][name], stock[rank][name],
                                          err_msg='worker %d, %s' % (rank, name))

    # The stock run is the intended synchronous SGD, and the comparison says something: the
    # weights move, and the bug's rescale (1/batch) or dropping Module's multipliers would be
    # far outside the tolerance.
    trajectory = simulate(rescale, LR_MULT, WD_MULT)
    for rank in range(2):
        for name in SHORT:
            for t in range(len(trajectory.local)):
                np.testing.assert_allclose(stock[rank][name][t], trajectory.local[t][rank][name],
                                           rtol=RTOL, atol=ATOL,
                                           err_msg='worker %d, step %d, %s' % (rank, t, name))
    assert np.abs(stock[0]['w1'][-1] - mlp_model.init_params()['w1']).max() > 1e-2
    assert largest_difference(stock, simulate(2 * rescale, LR_MULT, WD_MULT)) > 0.1
    assert largest_difference(stock, simulate(rescale)) > 1e-2


# -- 2. one process -----------------------------------------------------------------------------
def module(batch):
    mod = mx.mod.Module(mlp_model.symbol(CONFIG['lr_mult']), data_names=['data'],
                        label_names=['label'], context=mx.cpu())
    mod.bind(data_shapes=[('data', (batch, mlp_model.IN))],
             label_shapes=[('label', (batch, mlp_model.OUT))])
    init = mlp_model.init_params()
    mod.init_params(arg_params={name: mx.nd.array(init[short])
                                for name, short in mlp_model.NAMES.items()})
    return mod


@pytest.mark.parametrize('batch, num_workers, explicit', [(6, 2, None), (13, 3, None),
                                                     (6, 2, 0.05), (6, 2, 1.0 / 6)])
def test_module_init_optimizer_gives_the_servers_dist_syncs_rescale_and_multipliers(
        batch, num_workers, explicit):
    # (13, 3): (1/13)/3 != 1/39 in float64; Module computes 1.0/(13*3) for dist_sync. An
    # explicit value is kept, as dist_sync keeps it, even 1/batch.
    channel, sent = servers()
    store = DistDelay(native=WorkersNative(num_workers),
                      channel_factory=lambda native, layout: channel)
    mod = module(batch)
    params = {'learning_rate': 0.1, 'momentum': 0.9, 'wd': 0.01}
    if explicit is not None:
        params['rescale_grad'] = explicit
    mod.init_optimizer(kvstore=store, optimizer='sgd', optimizer_params=params)
    rescale = 1.0 / (batch * num_workers) if explicit is None else explicit
    optimizer = mod._optimizer  # pylint: disable=protected-access
    assert optimizer is store._session.optimizer and optimizer.rescale_grad == rescale
    assert channel.hello['config']['optimizer']['rescale_grad'] == rescale
    [body] = [body for command, body in sent if command == Command.OPTIMIZER]
    assert commands.decode_optimizer(body['optimizer']).rescale_grad == rescale
    registered = {chunk[3]: tuple(chunk[4:6]) for command, body in sent
                  if command == Command.REGISTER for chunk in body['chunks']}
    assert registered == {'l1_weight': (0.5, 1.0), 'l1_bias': (1.0, 0.0),
                          'l2_weight': (1.0, 1.0), 'l2_bias': (1.0, 0.0),
                          commands.FINISH_KEY: (1.0, 1.0)}
    store.set_optimizer(optimizer)  # again: unchanged
    assert optimizer.rescale_grad == rescale


def test_the_type_string_says_synchronous_and_creates_mxdelays_store():
    store = DistDelay(native=WorkersNative(2), channel_factory=_no_channel)
    assert 'dist' in store.type and '_sync' in store.type and 'async' not in store.type
    assert mx.kvstore.KVStoreBase.kv_registry[store.type] is \
        mx.kvstore.KVStoreBase.kv_registry['dist_delay']
    optimizer = mx.optimizer.create('sgd', learning_rate=0.1, rescale_grad=1.0 / 6)
    store.set_optimizer(optimizer)  # as Gluon's trainers make it: unchanged
    assert optimizer.rescale_grad == 1.0 / 6


def test_module_that_updates_locally_is_refused(monkeypatch):
    # MXNET_UPDATE_ON_KVSTORE=0: Module's own updater would apply 1/batch to the round's sum.
    monkeypatch.setenv('MXNET_UPDATE_ON_KVSTORE', '0')
    store = DistDelay(native=WorkersNative(2), channel_factory=_no_channel)
    with pytest.raises(ValueError, match='unset MXNET_UPDATE_ON_KVSTORE'):
        module(6).init_optimizer(kvstore=store, optimizer='sgd')
    assert store._session.link.channel is None  # refused before the hand-shake
