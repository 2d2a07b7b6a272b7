"""Stock ``gluon.Trainer`` with sparse parameters on 'dist_delay' against stock 'dist_sync'.

scripts/sparse_gluon_job.py, 2 workers and 1 server, 4 steps: the baseline is a stock job
(no mxdelay in any process, ``stock_env()``) with a row_sparse weight; against it, on the
same initial weights and per-(rank, step, device) batches, ``gluon.Trainer`` on 'dist_delay'
with (a) the row_sparse weight and (b) a dense weight with ``grad_stype='row_sparse'``.
With Adam, also a stock ``dist_sync`` worker (no hello) served by mxdelay's servers
(docs/design.md §3.3). Tolerance: bit-equal, every worker and step. (b) has no stock job of its own: in MXNet 1.9.1
a dense weight with row_sparse gradients on 'dist_sync' aborts the server at the first
pull (``ndarray_function.cc: Check failed: size == to->Size()``; the worker's dense pull
lands in the row_sparse push buffer), so its baseline is (a)'s: the servers apply the same
lazy update to the same sums. Optimizers: SGD with momentum and weight decay on one
device, Adam (lazy update) on two (``mx.cpu(0), mx.cpu(1)``).

The refusals that Gluon makes on 'dist_sync' are made on 'dist_delay' too (fast tests at
the end, on a store without network).
"""
import json
import os
import sys

import numpy as np
import pytest
import mxnet as mx
from mxnet import gluon

from support.jobs import assert_ok, run_job, stock_env
from support.stores import offline_store

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'scripts', 'sparse_gluon_job.py')
CASES = {
    'sgd-1dev': {'optimizer': 'sgd', 'devices': 1,
                 'optimizer_params': {'learning_rate': 0.1, 'momentum': 0.9, 'wd': 0.01}},
    'adam-2dev': {'optimizer': 'adam', 'devices': 2,
                  'optimizer_params': {'learning_rate': 0.05, 'wd': 0.01}},
    # The weight in chunks of a few rows on 'dist_delay' (MXDELAY_CHUNK_SIZE): its
    # row_sparse_data is pulled chunk by chunk inside autograd.record().
    'sgd-1dev-chunks': {'optimizer': 'sgd', 'devices': 1, 'chunk_size': 8,
                        'optimizer_params': {'learning_rate': 0.1, 'momentum': 0.9, 'wd': 0.01}},
}
STEPS = 4


def run_sparse_job(out, store, kind, case):
    out.mkdir(parents=True)
    config = dict(CASES[case], kind=kind, steps=STEPS)
    env = {'MXNET_STORAGE_FALLBACK_LOG_VERBOSE': 0}
    if config.pop('chunk_size', None):
        env['MXDELAY_CHUNK_SIZE'] = str(CASES[case]['chunk_size'])
    if store == 'dist_sync':
        env.update(stock_env())
    result = run_job([sys.executable, JOB, store, json.dumps(config), str(out)], num_workers=2,
                     num_servers=1, env=env, timeout=60)
    assert_ok(result)
    expected_class = 'DistDelay' if store == 'dist_delay' else 'KVStore'
    assert sorted(line.split()[-3:] for line in result.stdout.splitlines() if 'DONE' in line) \
        == [['0', expected_class, 'True'], ['1', expected_class, 'True']]
    return [np.load(str(out / ('worker%d.npy' % rank))) for rank in range(2)]


@pytest.mark.jobs
@pytest.mark.parametrize('case', sorted(CASES))
def test_sparse_gluon_trainer_equals_dist_sync(tmp_path, case):
    stock = run_sparse_job(tmp_path / 'stock', 'dist_sync', 'weight', case)
    # Training moved the weights (rows of every step's batches), and both workers agree.
    assert not np.array_equal(stock[0][0], stock[0][-1])
    np.testing.assert_array_equal(stock[0], stock[1])
    jobs = [('dist_delay', 'weight'), ('dist_delay', 'grad')]
    if case == 'adam-2dev':
        jobs.append(('stock_client', 'weight'))  # a stock worker served by mxdelay's servers
    for store, kind in jobs:
        mine = run_sparse_job(tmp_path / (store + kind), store, kind, case)
        for rank in range(2):
            np.testing.assert_array_equal(mine[rank], stock[rank], err_msg='%s %s rank %d'
                                          % (store, kind, rank))


def _sparse_block(stype, grad_stype):
    block = gluon.nn.Block()
    with block.name_scope():
        param = block.params.get('weight', shape=(5, 2), stype=stype, grad_stype=grad_stype)
    block.initialize(ctx=mx.cpu())
    return block, param


@pytest.mark.parametrize('stype,message', [
    ('row_sparse', 'Cannot set update_on_kvstore=False when sparse weights are present'),
    ('default', 'Cannot set update_on_kvstore=False on dist kvstore when sparse gradients '
                'are present')])
def test_sparse_parameters_refuse_local_update_as_on_dist_sync(stype, message):
    block, _ = _sparse_block(stype, 'row_sparse')
    trainer = gluon.Trainer(block.collect_params(), 'sgd', kvstore=offline_store(),
                            update_on_kvstore=False)
    with pytest.raises(ValueError, match=message):
        trainer._init_kvstore()  # pylint: disable=protected-access


@pytest.mark.parametrize('stype,grad_stype', [('row_sparse', 'row_sparse'),
                                              ('default', 'row_sparse')])
def test_gluon_accepts_the_store_with_sparse_parameters(stype, grad_stype):
    block, _ = _sparse_block(stype, grad_stype)
    store = offline_store()
    trainer = gluon.Trainer(block.collect_params(), 'sgd', kvstore=store)
    trainer._init_kvstore()  # pylint: disable=protected-access
    assert trainer._kvstore is store and trainer._update_on_kvstore  # pylint: disable=protected-access
    # MXNet's own classes and other modules keep their checks.
    assert not isinstance(store, mx.kvstore.KVStore)


def test_loading_parameters_into_a_server_trainer_is_refused_as_on_dist_sync():
    block, param = _sparse_block('default', 'row_sparse')
    trainer = gluon.Trainer(block.collect_params(), 'sgd', kvstore=offline_store())
    trainer._init_kvstore()  # pylint: disable=protected-access
    trainer._params_to_init = []  # pylint: disable=protected-access  (as after its init)
    with pytest.raises(RuntimeError, match='Cannot reset distributed KVStore'):
        param.set_data(mx.nd.ones((5, 2)))
