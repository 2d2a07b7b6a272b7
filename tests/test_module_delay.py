"""``mxdelay.DelayedModule``: the Module API with the k-step delayed update, through
``DelayedTrainer`` over the executors' own arrays (docs/design.md §1.7).

Single process (a real ``DistDelay`` over the native stand-in of support/native.py: one
worker, mxdelay's real server in process):

- the one-worker invariant: DelayedModule on one worker (``'dist_delay'``, warm-up 2, k in
  {1, 4}) equals plain ``mx.mod.Module`` on ``'local'`` with the same optimizer at every
  step: Adam bit for bit (its mirror is the servers' arithmetic), SGD with momentum and wd up
  to float32 rounding (``atol=1e-6``, largest measured 1.8e-7: the plain-SGD rule's momentum
  starts at ``W_{W+1} - W_W``, docs/design.md §1.4); ``'local'`` itself is bit for bit;
- ``delay='auto'`` with its decision forced (``MXDELAY_AUTO_DELAY_FORCE``): k=4 bit for bit
  like ``delay=4, slack=4``, staying synchronous like a warm-up over every step;
- the optimizer it gives the servers (stand-in store of N workers): Module's ``rescale_grad``
  for ``'dist_sync'``, ``1.0/(batch*N)``, or the explicit value unchanged, and Module's
  per-name multipliers on the Parameters;
- refusals, at construction or at ``init_optimizer``, each naming the value and the fix.

Real jobs (marked ``jobs``), scripts/module_job.py with ``module='delayed'``, the MLP, data
and initialisation of mlp_model.py, ``MXDELAY_CHUNK_SIZE=50`` (w1 and w2 span 3 and 2 chunks):

- 2 workers / 1 server (warm-up 2, k = 3, then ``sync_weights``) and 3 workers / 2 servers
  on 2 devices each (warm-up 1, k = 2): every worker's weights after every step against the
  numpy reference (tests/reference.py) with Module's rescale ``1/(batch*N)`` and multipliers,
  ``rtol=1e-5, atol=1e-6`` (conftest.RTOL/ATOL);
- explicit ``rescale_grad`` (0.05, not 1/(6*2)): a stock ``dist_sync`` job (no mxdelay in any
  process), plain Module on ``'dist_delay'`` and DelayedModule in its warm-up: bit for bit;
- ``save_checkpoint(..., save_optimizer_states=True)`` in the delayed phase, then a new job
  from ``DelayedModule.load(..., load_optimizer_states=True)``: the same weights at every
  later step, bit for bit.
"""
import json
import os
import sys

import numpy as np
import pytest

import mxdelay
import mxnet as mx

import reference
from support.jobs import SCRIPTS, PidFile, assert_ok, run_job, stock_env
from support.reference_jobs import ATOL, RTOL
from support.native import delay_store, server_optimizer, server_weights
from support.stores import WorkersNative, servers
from kvstore_ext.protocol import commands
from kvstore_ext.protocol.commands import Command
from scripts import mlp_model

SCRIPT = os.path.join(SCRIPTS, 'module_job.py')
SHORT = ('w1', 'b1', 'w2', 'b2')
BATCH = 6
SGD = {'learning_rate': 0.1, 'momentum': 0.9, 'wd': 0.01}
#: Module's multipliers (short names): the symbol's l1_weight lr_mult, wd_mult 0 for biases.
LR_MULT, WD_MULT = {'w1': 0.5}, {'b1': 0.0, 'b2': 0.0}


# -- single process ---------------------------------------------------------------------------
def bound(cls, contexts=(mx.cpu(),), **kwargs):
    mod = cls(mlp_model.symbol({'l1_weight': 0.5}), data_names=['data'], label_names=['label'],
              context=list(contexts), **kwargs)
    mod.bind(data_shapes=[('data', (BATCH, mlp_model.IN))],
             label_shapes=[('label', (BATCH, mlp_model.OUT))])
    init = mlp_model.init_params()
    mod.init_params(arg_params={name: mx.nd.array(init[short])
                                for name, short in mlp_model.NAMES.items()})
    return mod


def train(mod, kvstore, optimizer, params, steps=12):
    """Module's own loop (forward_backward, update); the weights after every step."""
    mod.init_optimizer(kvstore=kvstore, optimizer=optimizer, optimizer_params=params)
    history = []
    for t in range(steps):
        x, y = mlp_model.batch(0, t, BATCH)
        mod.forward_backward(mx.io.DataBatch([mx.nd.array(x)], [mx.nd.array(y)]))
        mod.update()
        args, _ = mod.get_params()
        history.append({short: args[name].asnumpy() for name, short in mlp_model.NAMES.items()})
    return history


@pytest.mark.parametrize('delay', [1, 4])
def test_one_worker_mirror_of_lars_is_the_servers_with_module_names(delay):
    # Module names its Parameters (l1_bias, ...) in the optimizer's idx2name, by Parameter
    # index, and LARS gives no ratio to names ending in bias. The servers key their optimizer
    # by chunk id, so they map the names to chunks (kvstore_ext.server.updates.ChunkUpdates.install;
    # before, chunk 3, l2_weight, was named 'l2_bias'); the mirror's copy, keyed by
    # Parameter index, then skips the same tensors: w' = W at every step, bit for bit.
    mod = bound(mxdelay.DelayedModule, delay=delay, warmup_steps=2)
    kv = delay_store()
    mod.init_optimizer(kvstore=kv, optimizer='lars', optimizer_params={
        'learning_rate': 0.1, 'momentum': 0.9, 'eta': 0.1, 'wd': 0.01})
    assert mod._optimizer.idx2name   # Module's names  # pylint: disable=protected-access
    keys = {name: i for i, name in enumerate(mod._exec_group.param_names)}  # pylint: disable=protected-access
    for t in range(2 + 3 * delay + 1):
        x, y = mlp_model.batch(0, t, BATCH)
        mod.forward_backward(mx.io.DataBatch([mx.nd.array(x)], [mx.nd.array(y)]))
        mod.update()
        args, _ = mod.get_params()
        for name in mlp_model.NAMES:
            np.testing.assert_array_equal(args[name].asnumpy(), server_weights(kv, keys[name]),
                                          err_msg='step %d, %s' % (t, name))
    optimizer = server_optimizer(kv)
    assert sorted(optimizer.idx2name.values()) == sorted(mlp_model.NAMES)
    for name, key in keys.items():   # every chunk by its own Parameter's name
        chunks = kv._session.tensors[key].chunks  # pylint: disable=protected-access
        assert [optimizer.idx2name[c.chunk_id] for c in chunks] == [name]


@pytest.mark.parametrize('optimizer, params, atol', [
    ('sgd', SGD, 1e-6), ('adam', {'learning_rate': 0.01, 'wd': 0.01}, 0)])
@pytest.mark.parametrize('delay', [1, 4])
def test_one_worker_equals_module_on_local(optimizer, params, atol, delay):
    plain = train(bound(mx.mod.Module), 'local', optimizer, params)
    delayed = train(bound(mxdelay.DelayedModule, delay=delay, warmup_steps=2), delay_store(),
                    optimizer, params)
    for t, (want, got) in enumerate(zip(plain, delayed)):
        for name in SHORT:
            np.testing.assert_allclose(got[name], want[name], rtol=0, atol=atol,
                                       err_msg='step %d, %s' % (t, name))
    assert np.abs(plain[-1]['w1'] - mlp_model.init_params()['w1']).max() > 1e-2  # it trains
    # Without a distributed store it is Gluon's update on the executors' arrays: bit for bit.
    local = train(bound(mxdelay.DelayedModule, delay=delay, warmup_steps=2), 'local',
                  optimizer, params)
    for want, got in zip(plain, local):
        for name in SHORT:
            np.testing.assert_array_equal(got[name], want[name])


@pytest.mark.parametrize('force, pinned', [('4', {'delay': 4, 'slack': 4, 'warmup_steps': 5}),
                                           ('stay', {'delay': 4, 'warmup_steps': 20})])
def test_auto_delay_trains_like_the_arguments_it_decided(monkeypatch, force, pinned):
    # delay='auto' through the Module API, its decision forced (MXDELAY_AUTO_DELAY_FORCE): k=4
    # trains bit for bit like delay=4 with auto's slack, and staying synchronous like a job
    # whose warm-up covers every step; and unlike each other.
    monkeypatch.setenv('MXDELAY_AUTO_DELAY_FORCE', force)
    auto = train(bound(mxdelay.DelayedModule, delay='auto', warmup_steps=5), delay_store(),
                 'sgd', SGD, steps=16)
    monkeypatch.delenv('MXDELAY_AUTO_DELAY_FORCE')
    fixed = train(bound(mxdelay.DelayedModule, **pinned), delay_store(), 'sgd', SGD, steps=16)
    for t, (want, got) in enumerate(zip(fixed, auto)):
        for name in SHORT:
            np.testing.assert_array_equal(got[name], want[name], err_msg='step %d, %s' % (t, name))
    other = train(bound(mxdelay.DelayedModule, **({'delay': 4, 'warmup_steps': 20}
                                                   if force == '4' else
                                                   {'delay': 4, 'slack': 4, 'warmup_steps': 5})),
                  delay_store(), 'sgd', SGD, steps=16)
    assert any(not np.array_equal(other[-1][n], auto[-1][n]) for n in SHORT)


@pytest.mark.parametrize('batch, num_workers, params, expected', [
    (6, 2, {}, 1.0 / 12), (13, 3, {}, 1.0 / 39), (6, 2, {'rescale_grad': 0.05}, 0.05)])
def test_the_servers_get_dist_syncs_rescale_grad_and_modules_multipliers(
        batch, num_workers, params, expected):
    # (13, 3): (1/13)/3 != 1/39 in float64; Module computes 1.0/(13*3) for dist_sync.
    channel, sent = servers()
    store = mxdelay.DistDelay(native=WorkersNative(num_workers),
                              channel_factory=lambda native, layout: channel)
    mod = mxdelay.DelayedModule(mlp_model.symbol({'l1_weight': 0.5}), data_names=['data'],
                                label_names=['label'], delay=2, warmup_steps=1)
    mod.bind(data_shapes=[('data', (batch, mlp_model.IN))],
             label_shapes=[('label', (batch, mlp_model.OUT))])
    mod.init_params()
    mod.init_optimizer(kvstore=store, optimizer='sgd',
                       optimizer_params=dict(SGD, **params))
    assert mod.trainer.optimizer.rescale_grad == expected
    assert channel.hello['config']['optimizer']['rescale_grad'] == expected
    [body] = [body for command, body in sent if command == Command.OPTIMIZER]
    assert commands.decode_optimizer(body['optimizer']).rescale_grad == expected
    registered = {chunk[3]: tuple(chunk[4:6]) for command, body in sent
                  if command == Command.REGISTER for chunk in body['chunks']}
    assert registered == {'l1_weight': (0.5, 1.0), 'l1_bias': (1.0, 0.0),
                          'l2_weight': (1.0, 1.0), 'l2_bias': (1.0, 0.0),
                          commands.FINISH_KEY: (1.0, 1.0)}


def test_the_trainer_works_on_the_executors_arrays():
    mod = bound(mxdelay.DelayedModule, contexts=(mx.cpu(0), mx.cpu(1)))
    mod.init_optimizer(kvstore=delay_store(), optimizer='sgd', optimizer_params=SGD)
    group = mod._exec_group  # pylint: disable=protected-access
    for param, datas, grads in zip(mod.trainer._params, group.param_arrays, group.grad_arrays):
        assert [d.handle.value for d in param.list_data()] == [d.handle.value for d in datas]
        assert [g.handle.value for g in param.list_grad()] == [g.handle.value for g in grads]


@pytest.mark.parametrize('kwargs, match', [
    ({'delay': 0}, 'delay must be an integer >= 1'),
    ({'warmup_steps': -1}, 'warmup_steps'),
    ({'local_rule': 'mirorr'}, 'mirorr'),
    ({'local_lr': -0.1}, 'local_lr'),
    ({'delay': 4, 'slack': 2}, 'slack >= delay=4'),
    ({'compression_params': {'type': '2bit'}}, 'compression_params'),
])
def test_bad_arguments_are_refused_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mxdelay.DelayedModule(mlp_model.symbol(), data_names=['data'], label_names=['label'],
                              **kwargs)


def test_what_cannot_work_is_refused_at_init_optimizer(monkeypatch):
    with pytest.raises(ValueError, match="kvstore='dist_sync'.*use kvstore='dist_delay'"):
        bound(mxdelay.DelayedModule).init_optimizer(kvstore='dist_sync')
    mod = bound(mxdelay.DelayedModule)
    mod.init_optimizer(kvstore=delay_store(), optimizer='sgd', optimizer_params=SGD)
    with pytest.raises(ValueError, match='force_init=True: DelayedModule cannot replace'):
        mod.init_optimizer(kvstore=delay_store(), force_init=True)
    with pytest.raises(ValueError, match='force_rebind=True after init_optimizer'):
        mod.bind(data_shapes=[('data', (BATCH, mlp_model.IN))],
                 label_shapes=[('label', (BATCH, mlp_model.OUT))], force_rebind=True)
    with pytest.raises(ValueError, match='cannot borrow or share an optimizer'):
        bound(mxdelay.DelayedModule).borrow_optimizer(mod)
    monkeypatch.setenv('MXNET_UPDATE_ON_KVSTORE', '0')
    with pytest.raises(ValueError, match='unset MXNET_UPDATE_ON_KVSTORE'):
        bound(mxdelay.DelayedModule).init_optimizer(kvstore=delay_store())


# -- real jobs -------------------------------------------------------------------------------
BASE = {'mode': 'import', 'module': 'delayed', 'kvstore': 'dist_delay', 'epochs': 3,
        'steps': 4, 'batch': BATCH, 'lr': 0.1, 'momentum': 0.9, 'wd': 0.01,
        'lr_mult': {'l1_weight': 0.5}}
CHUNKS = {'MXDELAY_CHUNK_SIZE': 50}


def run_module_job(out, config, num_workers, num_servers=1, env=None):
    """Run scripts/module_job.py; return {rank: npz}."""
    out.mkdir(parents=True)
    pids = PidFile(out / 'pids')
    command = [sys.executable, SCRIPT, json.dumps(config), str(out)]
    result = run_job(pids.wrap(command), num_workers=num_workers, num_servers=num_servers,
                     timeout=60, env=env)
    assert_ok(result)
    pids.assert_all_dead()
    return {r: np.load(str(out / ('worker%d.npz' % r))) for r in range(num_workers)}


def simulate(config, num_workers, rescale_grad=None):
    """The numpy reference of a module_job config (Module's rescale and multipliers)."""
    steps = config['epochs'] * config['steps']

    def grad_fn(weights, rank, step):
        x, y = mlp_model.batch(rank, step % config['steps'], config['batch'])
        return mlp_model.numpy_grad(weights, x, y)
    return reference.simulate(
        mlp_model.init_params(), grad_fn, num_workers, steps, config['delay'],
        config['warmup_steps'], config['lr'], momentum=config['momentum'], wd=config['wd'],
        rescale_grad=rescale_grad or 1.0 / (config['batch'] * num_workers),
        lr_mult=LR_MULT, wd_mult=WD_MULT)


def assert_reference(histories, trajectory):
    for rank, history in histories.items():
        for name in SHORT:
            assert len(history[name]) == len(trajectory.local)
            for t, got in enumerate(history[name]):
                np.testing.assert_allclose(got, trajectory.local[t][rank][name], rtol=RTOL,
                                           atol=ATOL,
                                           err_msg='worker %d, step %d, %s' % (rank, t, name))


@pytest.mark.jobs
@pytest.mark.parametrize('num_workers, num_servers, overrides', [
    (2, 1, {'delay': 3, 'warmup_steps': 2, 'sync_at_end': True}),
    (3, 2, {'delay': 2, 'warmup_steps': 1, 'devices': 2}),
], ids=['N2-S1-k3', 'N3-S2-k2-2devices'])
def test_delayed_module_matches_reference(tmp_path, num_workers, num_servers, overrides):
    config = dict(BASE, **overrides)
    histories = run_module_job(tmp_path / 'out', config, num_workers, num_servers, CHUNKS)
    trajectory = simulate(config, num_workers)
    assert_reference(histories, trajectory)
    # The delayed phase makes the workers' weights differ from each other (the test would
    # not see a worker that pulled every step).
    assert np.abs(histories[0]['w1'][-1] - histories[1]['w1'][-1]).max() > 1e-4
    if config.get('sync_at_end'):
        for rank, history in histories.items():
            for name in SHORT:
                np.testing.assert_allclose(history['synced_' + name], trajectory.glob[-1][name],
                                           rtol=RTOL, atol=ATOL, err_msg='%d %s' % (rank, name))


def _modules_equal_stock(tmp_path, config):
    """Run `config` as stock dist_sync (plain Module), plain Module on 'dist_delay' and
    DelayedModule's warm-up (2 workers); assert the last two equal the first bit for bit
    and return the stock job's weights."""
    stock = run_module_job(tmp_path / 'stock', dict(config, mode='stock', module='plain',
                                                    kvstore='dist_sync'), 2, env=stock_env())
    plain = run_module_job(tmp_path / 'plain', dict(config, module='plain'), 2)
    delayed = run_module_job(tmp_path / 'delayed', dict(config, delay=2, warmup_steps=8), 2)
    for rank in range(2):
        for name in SHORT:
            np.testing.assert_array_equal(plain[rank][name], stock[rank][name],
                                          err_msg='plain Module, %d %s' % (rank, name))
            np.testing.assert_array_equal(delayed[rank][name], stock[rank][name],
                                          err_msg='DelayedModule, %d %s' % (rank, name))
    return stock


@pytest.mark.jobs
def test_explicit_rescale_grad_is_kept_as_dist_sync_keeps_it(tmp_path):
    config = dict(BASE, epochs=2, optimizer_params={'rescale_grad': 0.05})
    stock = _modules_equal_stock(tmp_path, config)
    # Synchronous SGD with rescale 0.05; dividing it by N would be far off.
    sync = dict(config, delay=1, warmup_steps=8)
    assert_reference(stock, simulate(sync, 2, rescale_grad=0.05))
    assert np.abs(stock[0]['w1'][-1] - simulate(sync, 2, 0.025).local[-1][0]['w1']).max() > 1e-2


@pytest.mark.jobs
def test_lars_names_its_biases_on_mxdelays_servers_as_on_stock_dist_sync(tmp_path):
    # Module's idx2name names the Parameters by index and LARS gives no ratio to biases; the
    # servers map the names to their chunks (kvstore_ext.server.updates): stock dist_sync, plain
    # Module on 'dist_delay' and DelayedModule's warm-up are then the same, bit for bit
    # (before, plain Module differed by 6.4e-3 in w1). The default chunk size: LARS refuses
    # a tensor split into chunks.
    config = dict(BASE, epochs=2, optimizer='lars', optimizer_params={'eta': 0.1})
    stock = _modules_equal_stock(tmp_path, config)
    assert np.abs(stock[0]['b1'][-1] - mlp_model.init_params()['b1']).max() > 1e-3


@pytest.mark.jobs
def test_checkpoint_through_modules_api_resumes_bit_for_bit(tmp_path):
    # Saved after epoch 2 (steps 0-7; warm-up 2, k = 3: the delayed phase, mid-period).
    config = dict(BASE, delay=3, warmup_steps=2)
    full = run_module_job(tmp_path / 'full', dict(config, save_epoch=2), 2, env=CHUNKS)
    prefix = str(tmp_path / 'full' / 'ckpt')
    resumed = run_module_job(tmp_path / 'resumed', dict(config, resume_from=[prefix, 2]), 2,
                             env=CHUNKS)
    first = 2 * config['steps']
    for rank in range(2):
        for name in SHORT:
            assert len(resumed[rank][name]) == len(full[rank][name]) - first
            np.testing.assert_array_equal(resumed[rank][name], full[rank][name][first:],
                                          err_msg='worker %d %s after resume' % (rank, name))
    assert_reference(full, simulate(config, 2))
