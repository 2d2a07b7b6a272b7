"""The jobs that train mlp_model (scripts/mlp_job.py) or run stock MXNet
(scripts/stock_job.py), and their comparison with the numpy reference (tests/reference.py)."""
import glob
import json
import os
import sys

import numpy as np

import reference
from scripts import mlp_model
from support.jobs import SCRIPTS, assert_ok, run_job, stock_env
from support.model import MLP_NAMES

__all__ = ['RTOL', 'ATOL', 'MLP_BASE', 'STOCK_SCRIPT', 'run_mlp_job', 'simulate_mlp_job',
           'assert_equal_to_reference', 'differs_from_reference',
           'assert_matches_reference', 'has_data', 'batch_size', 'simulate_uneven',
           'assert_uneven_matches_reference', 'run_stock_job']


# -- the distributed trainer tests' job (scripts/mlp_job.py) ---------------------------------
#: Tolerance of the reference comparisons. The update kernels match MXNet's arithmetic, but
#: Gluon's backward (BLAS) and numpy's matmul round differently; over 16 steps the largest
#: difference measured is 3e-7 (weights are O(0.1-1)), far below what a wrong phase, pull
#: timing or rule makes (a stale initial pull moved them by 5e-2).
RTOL, ATOL = 1e-5, 1e-6
#: The common settings of mlp_job configs.
MLP_BASE = {'steps': 16, 'batch': 6, 'lr': 0.1, 'momentum': 0.9, 'wd': 1e-3}


def run_mlp_job(tmp_path, num_workers, config, num_servers=1, timeout=120, env=None):
    """Run scripts/mlp_job.py under mxdelay-launch; return {rank: npz} of the workers."""
    out = tmp_path / 'out'
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, os.path.join(SCRIPTS, 'mlp_job.py'), json.dumps(config), str(out)]
    result = run_job(command, num_workers=num_workers, num_servers=num_servers,
                     timeout=timeout, env=env)
    assert_ok(result)
    return {rank: np.load(str(out / ('worker%d.npz' % rank))) for rank in range(num_workers)}


def simulate_mlp_job(config, num_workers, **kw):
    """The numpy reference's trajectory of an mlp_job `config` with `num_workers` workers;
    `kw` goes to ``reference.simulate`` (e.g. ``synchronous_from``)."""
    def grad_fn(weights, rank, step):
        x, y = mlp_model.batch(rank, step, config['batch'])
        return mlp_model.numpy_grad(weights, x, y)
    return reference.simulate(
        mlp_model.init_params(), grad_fn, num_workers, config['steps'], config['delay'],
        config['warmup_steps'], config['lr'], momentum=config.get('momentum', 0.0),
        wd=config.get('wd', 0.0), rescale_grad=1.0 / config['batch'],
        local_lr=config.get('local_lr'), rule=config.get('local_rule', 'mirror'),
        dc_lambda=config.get('dc_lambda'), optimizer=config.get('optimizer', 'sgd'),
        fp16=config.get('compression') == {'type': 'fp16'},
        overflow={tuple(pair) for pair in config.get('overflow', [])},
        scale_window=config.get('scale_window', 2000), **dict(config.get('optimizer_params', {}),
                                                              **kw))


def assert_matches_reference(histories, trajectory, first=0):
    """Every worker's recorded weights equal the reference's local weights, step by step."""
    for rank, history in histories.items():
        for name in ('w1', 'b1', 'w2', 'b2'):
            got = history[name]
            for t in range(len(got)):
                want = trajectory.local[first + t][rank][name]
                np.testing.assert_allclose(
                    got[t], want, rtol=RTOL, atol=ATOL,
                    err_msg='worker %d, step %d, parameter %s' % (rank, first + t, name))


def assert_equal_to_reference(histories, trajectory):
    """In-process workers' weights (`histories`: per rank, a dict per step of the MLP's
    parameters) equal the reference's local weights bit for bit, step by step."""
    for rank, history in enumerate(histories):
        for t, weights in enumerate(history):
            for name in MLP_NAMES:
                np.testing.assert_array_equal(
                    weights[name], trajectory.local[t][rank][name],
                    err_msg='worker %d, step %d, parameter %s' % (rank, t, name))


def differs_from_reference(histories, trajectory):
    """Whether any weight of :func:`assert_equal_to_reference`'s `histories` differs."""
    return any(not np.array_equal(weights[name], trajectory.local[t][rank][name])
               for rank, history in enumerate(histories)
               for t, weights in enumerate(history) for name in MLP_NAMES)


def assert_rounds_equal_reference(histories, trajectory):
    """mlp_job's recorded weights (`histories`: per rank, each parameter after each of the
    worker's ``rounds``) equal the reference's local weights of those rounds, bit for bit."""
    for rank, history in histories.items():
        for i, t in enumerate(history['rounds']):
            for name in MLP_NAMES:
                np.testing.assert_array_equal(
                    history[name][i], trajectory.local[t][rank][name],
                    err_msg='worker %d, round %d, parameter %s' % (rank, t, name))


def rounds_differ_from_reference(histories, trajectory):
    """Whether any weight of :func:`assert_rounds_equal_reference`'s `histories` differs."""
    return any(not np.array_equal(h[name][i], trajectory.local[t][rank][name])
               for rank, h in histories.items() for name in MLP_NAMES
               for i, t in enumerate(h['rounds']))


# -- uneven data: mlp_job's plans of batches per worker (tests/test_uneven_data.py) -------
def has_data(config, rank, t):
    """Worker `rank` has a batch in round `t` (mlp_job's plan)."""
    batches = config['batches']
    if config.get('join'):
        return t % max(batches) < batches[rank]
    return t < config['epochs'] * batches[rank]


def batch_size(config, rank, t):
    """The size of worker `rank`'s batch in round `t` (mlp_job's plan)."""
    size = config.get('batch_sizes', {}).get(str(rank), config['batch'])
    batches, last = config['batches'][rank], config.get('last_batch')
    index = t % max(config['batches']) if config.get('join') else t % batches
    return last if last and index == batches - 1 else size


def simulate_uneven(config, num_workers, warmup_steps, **kw):
    """The reference: zero gradients where a worker has no data; the servers apply worker 0's
    first rescale_grad, and every worker's gradient is scaled by its own batch size. `kw`
    goes to ``reference.simulate`` (e.g. ``compression_threshold``)."""
    rounds = config['epochs'] * max(config['batches'])
    job_batch = batch_size(config, 0, 0)

    def grad_fn(weights, rank, t):
        if not has_data(config, rank, t):
            return {name: np.zeros_like(w) for name, w in weights.items()}
        size = batch_size(config, rank, t)
        x, y = mlp_model.batch(rank, t, size)
        factor = np.float32(job_batch / size)
        return {name: g.astype(np.float32) * factor
                for name, g in mlp_model.numpy_grad(weights, x, y).items()}
    return reference.simulate(
        mlp_model.init_params(), grad_fn, num_workers, rounds, config['delay'], warmup_steps,
        config['lr'], momentum=config['momentum'], wd=config['wd'],
        rescale_grad=1.0 / job_batch, rule=config.get('local_rule', 'mirror'), **kw)


def assert_uneven_matches_reference(histories, config, trajectory):
    """Each worker trained exactly its rounds with data, and its weights after each equal
    the reference's local weights."""
    for rank, history in histories.items():
        want_rounds = [t for t in range(len(trajectory.glob)) if has_data(config, rank, t)]
        assert list(history['rounds']) == want_rounds, 'worker %d trained other rounds' % rank
        for name in ('w1', 'b1', 'w2', 'b2'):
            for index, t in enumerate(want_rounds):
                np.testing.assert_allclose(
                    history[name][index], trajectory.local[t][rank][name], rtol=RTOL, atol=ATOL,
                    err_msg='worker %d, round %d, parameter %s' % (rank, t, name))


# -- stock MXNet's job (scripts/stock_job.py) --------------------------------------------------
#: Stock MXNet's gluon.Trainer on dist_sync in every role (scripts/stock_job.py).
STOCK_SCRIPT = os.path.join(SCRIPTS, 'stock_job.py')


def run_stock_job(out, config, num_workers=2, num_servers=1):
    """Run scripts/stock_job.py; return ({rank: npz}, [role records]) after checking that no
    role of the job imported mxdelay or kvstore_ext and none saw an MXNET_* variable."""
    out.mkdir(parents=True)
    command = [sys.executable, STOCK_SCRIPT, json.dumps(config), str(out)]
    result = run_job(command, num_workers=num_workers, num_servers=num_servers, timeout=90,
                     env=stock_env())
    assert_ok(result)
    records = []
    for path in sorted(glob.glob(str(out / 'role-*.json'))):
        with open(path, encoding='utf-8') as src:
            records.append(json.load(src))
    roles = sorted((r['role'], r['rank']) for r in records)
    assert roles == sorted([('scheduler', '0')] + [('server', str(i)) for i in range(num_servers)]
                           + [('worker', str(i)) for i in range(num_workers)]), roles
    for record in records:
        where = '%s %s' % (record['role'], record['rank'])
        for stage in ('imported_at_start', 'imported_at_exit'):
            assert record[stage] == {'mxdelay': False, 'kvstore_ext': False}, (where, record)
        assert record['env'] == {}, (where, record['env'])
        if record['role'] == 'worker':
            assert record['kvstore'] == 'mxnet.kvstore.kvstore.KVStore dist_sync', record
            assert record['update_on_kvstore'] is True, record
    histories = {rank: np.load(str(out / ('worker%d.npz' % rank))) for rank in range(num_workers)}
    return histories
