"""DelayedTrainer with sparse parameters (docs/design.md §1.4, §2.10): a dense weight with
row_sparse gradients and a row_sparse weight.

The model (scripts/sparse_delayed_job.py) is ``Dense(emb(ids))``, emb an
``Embedding(V=20, D=3, sparse_grad=True)`` or a row_sparse weight read through
``row_sparse_data``, with 4 ids per device and step, so most rows are untouched in a step:
lazy updates (only the gradient's rows change, weights and optimizer or rule state alike)
differ from dense ones in every step.

- Jobs against the numpy reference with lazy rows (tests/reference.py), every worker, step
  and parameter, with the tolerance of the other reference tests (``conftest.RTOL``,
  ``ATOL``: Gluon's backward and numpy's matmul round differently; measured at most 1.2e-7,
  while a dense reference differs by 0.16 or more): N = 2 and 3, 1 and 2 servers, warm-up,
  k > 1; SGD with momentum, Adam, the literal 'dc' rule; 2 devices; the embedding in 5
  chunks over 2 servers; ``sync_weights``; save and resume; ``join`` with uneven data.
- One worker in process (a real ``DistDelay`` over the native stand-in of support/native.py,
  mxdelay's real server), both kinds: w' equals the servers' W at every
  step, and the weights equal stock ``gluon.Trainer``'s (kvstore 'local'), for k in {1, 3}
  on one and two devices: Adam bit for bit; SGD with momentum up to float32 rounding (rtol
  1e-6, atol 1e-6; the dense layer's momentum buffer starts at ``W_{W+1} - W_W``, §1.4);
  every rule against the reference; rows a step does not touch keep their weights. Off
  'dist_delay' DelayedTrainer is gluon.Trainer, bit for bit.
- Every refusal that remains.
"""
import json
import os
import sys

import numpy as np
import pytest

import mxdelay
import mxnet as mx
from mxnet import autograd, gluon, nd
from mxnet.contrib.amp.loss_scaler import LossScaler

import reference
from support.jobs import assert_ok, run_job
from support.reference_jobs import ATOL, RTOL
from support.native import delay_store, server_weights
from scripts import sparse_delayed_job as job

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'scripts', 'sparse_delayed_job.py')
SGD = ('sgd', {'learning_rate': 0.1, 'momentum': 0.9, 'wd': 0.01})
ADAM = ('adam', {'learning_rate': 0.05, 'wd': 0.01})


def simulate(config, num_workers):
    """The reference trajectory of a job `config`; a worker past its ``steps_of`` pushes
    zero gradients (no rows) in the other workers' rounds, as ``join`` does."""
    devices = config.get('devices', 1)
    params = dict(config['optimizer_params'])
    lr = params.pop('learning_rate')

    def grad_fn(weights, rank, step):
        if step < config.get('steps_of', {}).get(str(rank), config['steps']):
            return job.numpy_grad(weights, rank, step, devices)
        zeros = {name: np.zeros_like(w) for name, w in weights.items()}
        return dict(zeros, emb=reference.RowSparseGrad(np.zeros(0, np.int64), zeros['emb']))
    return reference.simulate(
        job.init_params(), grad_fn, num_workers, config['steps'], config['delay'],
        config['warmup_steps'], lr,
        rescale_grad=1.0 / (job.BATCH * devices), rule=config.get('local_rule', 'mirror'),
        dc_lambda=config.get('dc_lambda'), optimizer=config['optimizer'], **params)


def assert_matches(histories, trajectory):
    for rank, history in histories.items():
        first = int(history['first'])
        for name in job.NAMES:
            for t, got in enumerate(history[name], first):
                np.testing.assert_allclose(got, trajectory.local[t][rank][name], rtol=RTOL,
                                           atol=ATOL, err_msg='worker %d, step %d, %s'
                                           % (rank, t, name))


def run_sparse_job(out, num_workers, num_servers, config, env=None):
    """Run scripts/sparse_delayed_job.py; return {rank: npz}."""
    out.mkdir(parents=True)
    env = dict(env or {}, MXNET_STORAGE_FALLBACK_LOG_VERBOSE=0)
    result = run_job([sys.executable, JOB, json.dumps(config), str(out)],
                     num_workers=num_workers, num_servers=num_servers, env=env, timeout=60)
    assert_ok(result)
    return {rank: np.load(str(out / ('worker%d.npz' % rank))) for rank in range(num_workers)}


# -- jobs ------------------------------------------------------------------------------------
JOB_CASES = [
    # (num_workers, num_servers, env, config)
    (2, 1, {}, dict(optimizer=SGD[0], optimizer_params=SGD[1], delay=3, warmup_steps=2,
                    devices=2, sync_at_end=True)),
    # MXDELAY_CHUNK_SIZE 12: the embedding in 5 chunks of 4 rows on both servers (the
    # servers' lazy Adam state is fetched chunk by chunk at the switch).
    (3, 2, {'MXDELAY_CHUNK_SIZE': 12}, dict(optimizer=ADAM[0], optimizer_params=ADAM[1],
                                            delay=2, warmup_steps=1)),
    (3, 1, {}, dict(optimizer=SGD[0], optimizer_params=SGD[1], delay=2, warmup_steps=2,
                    local_rule='dc', dc_lambda=0.5)),
    # A row_sparse weight: the worker's copy of every row, row_sparse_data served from it.
    (3, 2, {'MXDELAY_CHUNK_SIZE': 12}, dict(optimizer=SGD[0], optimizer_params=SGD[1],
                                            delay=3, warmup_steps=1, devices=2,
                                            kind='weight', sync_at_end=True)),
]


@pytest.mark.jobs
@pytest.mark.parametrize('num_workers,num_servers,env,config', JOB_CASES,
                         ids=['%s-%s-%s-N%d-S%d-k%d' % (c[3].get('kind', 'grad'),
                                                        c[3]['optimizer'],
                                                        c[3].get('local_rule', 'mirror'), c[0],
                                                        c[1], c[3]['delay'])
                              for c in JOB_CASES])
def test_jobs_match_reference_with_lazy_rows(tmp_path, num_workers, num_servers, env, config):
    config = dict(config, steps=12)
    histories = run_sparse_job(tmp_path / 'out', num_workers, num_servers, config, env)
    trajectory = simulate(config, num_workers)
    assert_matches(histories, trajectory)
    # The workers' own weights differ between pulls (the delayed phase is exercised).
    last = config['steps'] - 1
    assert not np.allclose(histories[0]['emb'][last], histories[1]['emb'][last])
    if config.get('sync_at_end'):   # then every worker holds W after the last round
        for rank, history in histories.items():
            for name in job.NAMES:
                np.testing.assert_allclose(history['synced_' + name], trajectory.glob[-1][name],
                                           rtol=RTOL, atol=ATOL, err_msg='worker %d, synced %s'
                                           % (rank, name))


@pytest.mark.jobs
@pytest.mark.parametrize('kind,optimizer', [('weight', ADAM)], ids=['weight-adam'])
def test_save_and_resume_continue_the_reference(tmp_path, kind, optimizer):
    # Saved at step 7 (W=1, k=3: the pull issued at step 7 is pending), stopped after step
    # 8; a new job resumes from the files. Both match the reference. (Before the servers
    # restored a row_sparse chunk as row_sparse, the resumed W fell back to MXNet's standard
    # update: measured with a save at step 6, 14 of 20 rows off by up to 0.035 at the
    # first pull after the resume.)
    config = dict(optimizer=optimizer[0], optimizer_params=optimizer[1], delay=3,
                  warmup_steps=1, steps=12, kind=kind)
    env = {'MXDELAY_CHUNK_SIZE': 12}
    first = run_sparse_job(tmp_path / 'first', 2, 1, dict(config, save_at=7, stop_after=8),
                           env)
    resumed = run_sparse_job(tmp_path / 'resumed', 2, 1,
                             dict(config, resume_from=str(tmp_path / 'first' / 'ckpt')), env)
    trajectory = simulate(config, 2)
    assert [int(h['first']) for h in resumed.values()] == [8, 8]
    assert_matches(first, trajectory)
    assert_matches(resumed, trajectory)


@pytest.mark.jobs
def test_join_with_uneven_data_follows_the_reference(tmp_path):
    # Worker 1 has 8 batches, worker 0 has 12: worker 1's join fills rounds 8..11 with
    # zero gradients (no rows: its embedding rows stay, its dense layer still steps).
    config = dict(optimizer=SGD[0], optimizer_params=SGD[1], delay=3, warmup_steps=2,
                  steps=12, steps_of={'1': 8})
    histories = run_sparse_job(tmp_path / 'out', 2, 1, config)
    trajectory = simulate(config, 2)
    assert [len(h['emb']) for h in histories.values()] == [12, 8]
    assert_matches(histories, trajectory)
    for rank, history in histories.items():
        for name in job.NAMES:
            np.testing.assert_allclose(history['joined_' + name], trajectory.local[-1][rank][name],
                                       rtol=RTOL, atol=ATOL, err_msg='worker %d, joined %s'
                                       % (rank, name))


# -- one worker, in process ------------------------------------------------------------------
def train(trainer_kind, optimizer, steps, devices=1, delay=3, warmup_steps=2, kind='grad',
          **kwargs):
    """Yield (step, {name: w'}, {name: W} or None) of a one-worker training of the job's
    model of `kind`: DelayedTrainer on the native stand-in ('delayed') or on 'local'
    ('delayed-local'), or stock gluon.Trainer on 'local' ('gluon')."""
    ctxs = [mx.cpu(i) for i in range(devices)]
    net, names = job.build(ctxs, kind)
    params = net.collect_params()
    if trainer_kind.startswith('delayed'):
        kv = delay_store() if trainer_kind == 'delayed' else 'local'
        trainer = mxdelay.DelayedTrainer(params, optimizer[0], dict(optimizer[1]), kvstore=kv,
                                         delay=delay, warmup_steps=warmup_steps, **kwargs)
        kv = kv if trainer_kind == 'delayed' else None
    else:
        kv = None
        trainer = gluon.Trainer(params, optimizer[0], dict(optimizer[1]), kvstore='local')
    for step in range(steps):
        with autograd.record():
            losses = []
            for device, ctx in enumerate(ctxs):
                ids, target = job.batch(0, step, device)
                losses.append(((net(nd.array(ids, ctx=ctx)) - nd.array(target, ctx=ctx)) ** 2)
                              .sum())
        autograd.backward(losses)
        trainer.step(job.BATCH * devices)
        local = {}
        for full, p in params.items():
            copies = job.weights_of(p)
            local[names[full]] = copies[0]
            for other in copies[1:]:
                np.testing.assert_array_equal(other, copies[0])
        index = trainer._param2idx  # pylint: disable=protected-access
        glob = None if kv is None else {names[full]: server_weights(kv, index[full])
                                        for full in params}
        yield step, local, glob


@pytest.mark.parametrize('kind', ['grad', 'weight'])
@pytest.mark.parametrize('devices', [1, 2])
@pytest.mark.parametrize('delay', [1, 3])
@pytest.mark.parametrize('optimizer', [SGD, ADAM], ids=['sgd', 'adam'])
def test_one_worker_is_gluon_trainer(optimizer, delay, devices, kind):
    steps = 2 + 3 * delay + 2
    stock = list(train('gluon', optimizer, steps, devices, kind=kind))
    for (step, local, glob), (_, want, _) in zip(train('delayed', optimizer, steps, devices,
                                                       delay=delay, kind=kind), stock):
        for name in job.NAMES:
            for other, what in ((glob, 'W'), (want, 'gluon.Trainer')):
                if optimizer is ADAM:
                    np.testing.assert_array_equal(local[name], other[name], err_msg='%s, step '
                                                  '%d, %s' % (what, step, name))
                else:
                    np.testing.assert_allclose(local[name], other[name], rtol=1e-6, atol=1e-6,
                                               err_msg='%s, step %d, %s' % (what, step, name))


@pytest.mark.parametrize('kind', ['grad', 'weight'])
def test_off_dist_delay_it_is_gluon_trainer(kind):
    for (step, local, _), (_, want, _) in zip(train('delayed-local', SGD, 8, 2, kind=kind),
                                              train('gluon', SGD, 8, 2, kind=kind)):
        for name in job.NAMES:
            np.testing.assert_array_equal(local[name], want[name],
                                          err_msg='step %d, %s' % (step, name))


RULE_CASES = {
    'mirror-sgd-lam': (SGD, {'local_rule': 'mirror', 'dc_lambda': 0.3}),
    'mirror-adam': (ADAM, {'local_rule': 'mirror'}),
    'sgd': (SGD, {'local_rule': 'sgd'}),
    'dc': (SGD, {'local_rule': 'dc', 'dc_lambda': 0.5}),
    'dc_adaptive': (SGD, {'local_rule': 'dc_adaptive', 'dc_lambda': 0.02}),
}


@pytest.mark.parametrize('kind', ['grad', 'weight'])
@pytest.mark.parametrize('case', sorted(RULE_CASES))
def test_one_worker_rules_match_reference_and_leave_untouched_rows(case, kind):
    optimizer, kwargs = RULE_CASES[case]
    config = dict(optimizer=optimizer[0], optimizer_params=optimizer[1], steps=12, delay=3,
                  warmup_steps=2, devices=2, **kwargs)
    trajectory = simulate(config, 1)
    schedule = mxdelay.schedule.DelaySchedule(3, 2)
    previous = None
    for step, local, _ in train('delayed', optimizer, 12, 2, 3, 2, kind, **kwargs):
        for name in job.NAMES:
            np.testing.assert_allclose(local[name], trajectory.local[step][0][name], rtol=RTOL,
                                       atol=ATOL, err_msg='step %d, %s' % (step, name))
        if step > schedule.warmup_steps and not schedule.applies_pull(step):
            touched = np.unique(np.concatenate([job.batch(0, step, d)[0] for d in range(2)]))
            untouched = np.setdiff1d(np.arange(job.V), touched.astype(np.int64))
            np.testing.assert_array_equal(local['emb'][untouched], previous[untouched])
            assert not np.array_equal(local['emb'][touched.astype(np.int64)],
                                      previous[touched.astype(np.int64)])
        previous = local['emb']


def test_reference_with_every_row_is_the_dense_reference():
    # A RowSparseGrad holding every row is a dense gradient: the lazy reference must then
    # be the dense one: bit for bit with Adam; with SGD the mirror's momentum buffer starts
    # at the server's buffer instead of W_{W+1} - W_W (equal up to float32 rounding).
    def grads(weights, rank, step, dense):
        g = job.numpy_grad(weights, rank, step, 1)
        everything = reference.RowSparseGrad(np.arange(job.V), g['emb'].values)
        return dict(g, emb=g['emb'].values if dense else everything)
    for optimizer, params in (SGD, ADAM):
        params = dict(params)
        lr = params.pop('learning_rate')
        runs = [reference.simulate(job.init_params(),
                                   lambda w, r, t, dense=dense: grads(w, r, t, dense), 2, 8, 2,
                                   2, lr, optimizer=optimizer, rescale_grad=0.25, **params)
                for dense in (True, False)]
        for t in range(8):
            for name in job.NAMES:
                np.testing.assert_allclose(runs[0].local[t][1][name],
                                           runs[1].local[t][1][name],
                                           rtol=0 if optimizer == 'adam' else 1e-6,
                                           atol=0 if optimizer == 'adam' else 1e-7)


# -- refusals --------------------------------------------------------------------------------
def _params():
    net, _ = job.build([mx.cpu()])
    return net, net.collect_params()


@pytest.mark.parametrize('compression', [{'type': '2bit', 'threshold': 0.5}, {'type': 'fp16'}])
def test_compression_with_sparse_gradients_is_refused(compression):
    _, params = _params()
    with pytest.raises(ValueError, match="(?s)compression_params=.*row_sparse gradients.*"
                                         "embedding.*compression_params=None"):
        mxdelay.DelayedTrainer(params, 'sgd', kvstore='dist_delay',
                               compression_params=compression)


def test_amp_with_sparse_gradients_is_refused():
    _, params = _params()
    trainer = mxdelay.DelayedTrainer(params, 'sgd', {'learning_rate': 0.1},
                                     kvstore=delay_store(), delay=2, warmup_steps=1)
    trainer._amp_loss_scaler = LossScaler()  # what amp.init_trainer sets
    with pytest.raises(ValueError, match="(?s)AMP.*row_sparse gradients.*embedding.*without "
                                         "AMP"):
        trainer.rank  # pylint: disable=pointless-statement  (creates the kvstore)


def test_frozen_variance_adam_with_sparse_gradients_is_refused():
    _, trainer_params = _params()
    with pytest.raises(ValueError, match="(?s)'frozenvarianceadam' takes dense gradients only.*"
                                         "Parameter .*embedding.* use optimizer 'adam'"):
        mxdelay.DelayedTrainer(trainer_params, 'frozenvarianceadam', {'freeze_after': 5},
                               kvstore='dist_delay')


@pytest.mark.parametrize('optimizer,params,why', [
    ('nag', {'momentum': 0.9}, 'NAG has no lazy update'),
    ('adam', {'lazy_update': False}, 'Adam was given lazy_update=False'),
    ('rmsprop', {}, 'RMSProp has no lazy update')])
def test_mirror_refuses_optimizers_without_lazy_updates(optimizer, params, why):
    _, trainer_params = _params()
    with pytest.raises(ValueError, match="(?s)row_sparse gradients \\(Parameter .*embedding.*"
                                         "%s.*'sgd' or 'adam' with lazy_update=True.*"
                                         "local_rule='sgd'" % why):
        mxdelay.DelayedTrainer(trainer_params, optimizer, params, kvstore='dist_delay')
    # The literal rule reads only the learning rate and wd: accepted.
    mxdelay.DelayedTrainer(trainer_params, optimizer, params, kvstore='dist_delay',
                           local_rule='sgd')
