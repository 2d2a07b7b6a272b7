"""Aux states (BatchNorm's running mean and variance): ``sync_weights(aux_states=True)``
makes every worker's the mean over the workers (docs/design.md §2.13).

What is tested, and against what:

- the servers: an aux chunk (registered ``{'aux': True}``) gets the round's sum, whatever the
  optimizer and AMP; bad aux settings are refused; a checkpoint saved before aux chunks
  (``{}``) loads as aux; with float16 pushes an aux chunk needs no pull keys;
- ``DelayedTrainer`` through the real store and servers, in one process (N workers in
  threads, support/native_workers.py; one worker, support/native.py): every worker's aux
  states after the sync equal the numpy mean (tests/reference.py ``aux_mean``) **bit for
  bit**, on every device: 2 and 3 workers, 1 and 2 servers, tensors split into chunks, k = 1
  and k > 1, in the warm-up and the delayed phase, 2 devices per worker, float16 pushes and
  compressed pulls, uneven data (a worker that ends first); frozen weights stay; the weights
  of every step equal those of the same run with ``sync_weights()`` alone; a checkpoint
  saved after an aux sync resumes bit for bit (the aux keys' rounds included);
- '2bit' (MXNet's native store quantizes every push): the values go by the ``AUX``
  command, the rounds push zeros; the command's refusals; a round without every worker's
  values fails;
- refusals: a push of an aux key, ``average`` of a trained key, a non-bool ``aux_states``,
  ``DelayedModule``.

- real 2-worker, 2-server jobs (marked ``jobs``), uncompressed and '2bit': a Gluon net with
  BatchNorm; every worker's statistics after the sync are the float32 mean of what each
  worker had.
"""
import json
import os
import sys

import numpy as np
import pytest
import mxnet as mx
from mxnet import gluon, nd

import mxdelay
import reference
from kvstore_ext.checkpoint import files
from kvstore_ext.protocol import commands
from kvstore_ext.server import appliers
from kvstore_ext.server.appliers import AuxSum
from kvstore_ext.protocol.keys import KeyLayout
from kvstore_ext.protocol.commands import Command
from kvstore_ext.server.controller import DelayServer
from support.jobs import SCRIPTS, PidFile, assert_ok, run_job
from support.model import BATCH, MLP_NAMES, backward_at, contexts, mlp_params
from support.native import delay_store, server_weights
from support.native_workers import run_workers

AUX = {'aux': True}
OPT = {'learning_rate': 0.1, 'momentum': 0.9, 'wd': 1e-3}
#: The aux states of the test model (BatchNorm's shapes: one value per channel) and its
#: frozen weight (grad_req='null', differentiable).
AUX_SHAPES = {'bn_running_mean': (5,), 'bn_running_var': (7,)}
FROZEN = 'frozen_weight'


# -- the servers ------------------------------------------------------------------------------
def _server(pull_keys=0):
    server = DelayServer.offline(rank=0, num_workers=2)
    hello = {'rank': 0, 'protocol': commands.PROTOCOL_VERSION, 'slots': 2, 'config': {}}
    server.command(Command.HELLO, dict(hello, pull_keys=pull_keys) if pull_keys else hello)
    return server


def _entry(codec=None, chunk=0, size=3):
    entry = [chunk, 0, chunk, 'bn%d_running_mean' % chunk, 1.0, 1.0, size]
    return entry if codec is None else entry + [codec]


@pytest.mark.parametrize('optimizer', [None, mx.optimizer.SGD(momentum=0.9),
                                       mx.optimizer.Adam()])
@pytest.mark.parametrize('amp', [False, True])
def test_an_aux_chunk_gets_the_sum_whatever_the_optimizer(optimizer, amp):
    updater = None if optimizer is None else mx.optimizer.get_updater(optimizer)
    assert type(appliers.choose('default', updater, AUX, amp, lambda chunk: None)) is AuxSum


def test_the_server_writes_an_aux_rounds_sum_and_keeps_no_optimizer_state():
    server = _server()
    server.command(Command.OPTIMIZER, {'rank': 0, 'optimizer': commands.encode_optimizer(
        mx.optimizer.SGD(learning_rate=0.5, momentum=0.9, wd=0.1))})
    server.command(Command.REGISTER, {'rank': 0, 'chunks': [_entry(AUX), _entry(chunk=1)]})
    total = np.array([0.25, -3.0, 7.5], np.float32)
    layout = KeyLayout(1, 2)
    for t in range(3):   # every round: the sum, unchanged by lr, momentum and wd
        stored = nd.array([9.0, 9.0, 9.0])
        server.complete_round(layout.slot_key(0, t % 2, 0), nd.array(total * (t + 1)), stored)
        np.testing.assert_array_equal(server.weight(0).asnumpy(), total * (t + 1))
    assert server.applied_rounds(0) == 3
    assert 0 not in server.updater.states
    # The other chunk is trained (and the whole-tensor check sees it alone).
    server.complete_round(layout.slot_key(1, 0, 0), nd.array(total), nd.ones(3))
    assert 1 in server.updater.states
    assert set(server._chunks.tensors()) == {1}   # pylint: disable=protected-access


@pytest.mark.parametrize('codec, message', [
    ({'aux': False}, r'chunk 0: codec setting aux=False is not True'),
    ({'aux': 1}, r'chunk 0: codec setting aux=1 is not True'),
    ({'aux': True, 'sum_scale': 0.5}, r"chunk 0: an aux chunk takes no other codec setting, "
                                      r"got \{'aux': True, 'sum_scale': 0\.5\}"),
])
def test_register_refuses_bad_aux_settings(codec, message):
    server = _server()
    with pytest.raises(ValueError, match=message):
        server.command(Command.REGISTER, {'rank': 0, 'chunks': [_entry(codec)]})
    counter = [9, 0, commands.FINISH_KEY, commands.FINISH_KEY, 1.0, 1.0, 2, AUX]
    with pytest.raises(ValueError, match=r'chunk 9 is the finish counter, which takes no codec'):
        server.command(Command.REGISTER, {'rank': 0, 'chunks': [counter]})
    assert server.stats()['chunks'] == {}


def test_workers_that_register_a_chunk_aux_and_not_aux_are_refused():
    server = _server()
    server.command(Command.REGISTER, {'rank': 0, 'chunks': [_entry(AUX)]})
    with pytest.raises(ValueError, match=r"worker 1 registers chunk 0 as .*'codec': \{\}.* but "
                                         r"another worker as .*'codec': \{'aux': True\}"):
        server.command(Command.REGISTER, {'rank': 1, 'chunks': [_entry()]})


def test_an_aux_chunk_has_no_pull_keys_with_float16_pushes():
    server = _server(pull_keys=2)
    server.command(Command.REGISTER, {'rank': 0, 'chunks': [_entry(AUX), _entry(chunk=1)]})
    layout = KeyLayout(1, 2, pull_keys=2)
    server.complete_round(layout.slot_key(0, 0, 0), nd.array([1.0, 2.0, 3.0]), nd.zeros(3))
    assert server.weight(0).asnumpy().tolist() == [1.0, 2.0, 3.0]
    with pytest.raises(RuntimeError, match='before its pull key was set up'):
        server.complete_round(layout.slot_key(1, 0, 0), nd.ones(3), nd.zeros(3))


def _saved(path, codec):
    chunk = {'param_index': 0, 'name': 'bn0_running_mean', 'lr_mult': 1.0, 'wd_mult': 1.0,
             'size': 3, 'weight': np.arange(3, dtype=np.float32), 'next_round': 2}
    if codec is not None:
        chunk['codec'] = codec
    files.write_archive(path, files.SERVER, {
        'server': 0, 'num_workers': 2, 'updater': None, 'chunks': {0: chunk}}, save_id=None)


@pytest.mark.parametrize('codec', [None, {}, AUX])
def test_a_checkpoint_of_before_aux_chunks_loads_as_aux(tmp_path, codec):
    path = str(tmp_path / 'ckpt.server0')
    _saved(path, codec)
    server = _server()
    server.command(Command.REGISTER, {'rank': 0, 'chunks': [_entry(AUX)]})
    assert server.command(Command.LOAD, {'rank': 0, 'paths': [path]})['chunks'] == 1
    assert server.applied_rounds(0) == 2
    assert server.weight(0).asnumpy().tolist() == [0.0, 1.0, 2.0]


def test_a_checkpoint_with_other_settings_does_not_load_as_aux(tmp_path):
    path = str(tmp_path / 'ckpt.server0')
    _saved(path, {'sum_scale': 0.5})
    server = _server()
    server.command(Command.REGISTER, {'rank': 0, 'chunks': [_entry(AUX)]})
    with pytest.raises(ValueError, match=r"chunk 0 was .*'sum_scale': 0\.5.* when saved, is .*"
                                         r"'aux': True.* now"):
        server.command(Command.LOAD, {'rank': 0, 'paths': [path]})
    # And an aux checkpoint does not load into a trained chunk.
    _saved(path, AUX)
    plain = _server()
    plain.command(Command.REGISTER, {'rank': 0, 'chunks': [_entry()]})
    with pytest.raises(ValueError, match=r"when saved, is .*'codec': \{\}.* now"):
        plain.command(Command.LOAD, {'rank': 0, 'paths': [path]})


# -- DelayedTrainer: the numpy mean ------------------------------------------------------------
def net_params(ctxs):
    """mlp_model's parameters (trained), two aux states and a frozen weight, on `ctxs`."""
    params = mlp_params(ctxs)
    for name, shape in sorted(AUX_SHAPES.items()):
        param = gluon.Parameter(name, shape=shape, differentiable=False,
                                init=mx.init.Constant(1.0))
        param.initialize(ctx=ctxs)
        params.append(param)
    frozen = gluon.Parameter(FROZEN, shape=(4,), grad_req='null', init=mx.init.Constant(2.0))
    frozen.initialize(ctx=ctxs)
    return params + [frozen]


def worker_aux(rank, rnd, ctxs):
    """Worker `rank`'s aux states before its sync `rnd`: {name: [one array per device]},
    different on every worker, device and sync (and not exact in halves: the mean rounds)."""
    out = {}
    for i, (name, shape) in enumerate(sorted(AUX_SHAPES.items())):
        rs = np.random.RandomState(1000 * rnd + 100 * rank + i)
        out[name] = [(rs.randn(*shape) * 3.3 + 0.7).astype(np.float32) for _ in ctxs]
    return out


def aux_of(params, ctxs):
    return {p.name: [p.data(c).asnumpy() for c in ctxs] for p in params
            if p.name in AUX_SHAPES}


def train(rank, store, steps, sync_after, ctxs, aux_states=True, delay=3, warmup=2,
          save=None, load=None, first=0, **trainer_args):
    """Train net_params as worker `rank` on `store` for steps ``first .. steps[rank]-1``;
    after step ``t`` for each t + 1 in `sync_after` (and after the last step if
    ``sync_after`` holds None) write worker_aux and call ``sync_weights(aux_states)``.
    `save`/`load`: a checkpoint path written after (read before) the steps.

    Returns ``{'weights': [per step {name: array}], 'syncs': [(before, after)],
    'frozen': [per device], 'rounds': {aux name: the aux key's rounds}}``."""
    params = net_params(ctxs)
    trainer = mxdelay.DelayedTrainer(params, 'sgd', dict(OPT), kvstore=store, delay=delay,
                                     warmup_steps=warmup, **trainer_args)
    if load is not None:
        trainer.load_states(load)
    trained = [p for p in params if p.name in MLP_NAMES]
    out = {'weights': [], 'syncs': []}

    def sync():
        before = worker_aux(rank, len(out['syncs']) + first, ctxs)
        for p in params:
            if p.name in before:
                for ctx, value in zip(ctxs, before[p.name]):
                    p.data(ctx)[:] = value
        trainer.sync_weights(aux_states=aux_states)
        out['syncs'].append((before, aux_of(params, ctxs)))
        for p in trained:   # the weights are the servers' W, as with sync_weights()
            np.testing.assert_array_equal(p.data(ctxs[-1]).asnumpy(),
                                          server_weights(store, trainer._param2idx[p.name]))
    for t in range(first, steps[rank]):
        backward_at(trained, ctxs, t, rank=rank)
        trainer.step(BATCH)
        out['weights'].append({p.name: p.data().asnumpy() for p in trained})
        if t + 1 in sync_after:
            sync()
    if None in sync_after:
        sync()
    if save is not None:
        trainer.save_states(save)
    out['frozen'] = [p.data(c).asnumpy() for p in params if p.name == FROZEN for c in ctxs]
    out['rounds'] = {p.name: store.delayed.rounds.rounds(trainer._param2idx[p.name]) for p in params
                     if p.name in AUX_SHAPES}
    return out


def assert_means(results, ctxs):
    """Every worker's aux states after each sync are reference.aux_mean of the workers'
    before, on every device, bit for bit; the frozen weight is its initial value."""
    for rnd in range(len(results[0]['syncs'])):
        for name in AUX_SHAPES:
            want = reference.aux_mean([r['syncs'][rnd][0][name] for r in results])
            for rank, result in enumerate(results):
                for dev, got in enumerate(result['syncs'][rnd][1][name]):
                    np.testing.assert_array_equal(got, want, err_msg='worker %d, device %d, '
                                                  'sync %d, %s' % (rank, dev, rnd, name))
    for result in results:
        for frozen in result['frozen']:
            np.testing.assert_array_equal(frozen, np.full(4, 2.0, np.float32))


@pytest.mark.parametrize('num_workers, num_servers, chunk, delay, warmup, devices', [
    (2, 1, None, 3, 2, 1),
    (3, 2, 3, 3, 2, 1),     # chunks of 3 elements over 2 servers
    (2, 2, 4, 1, 0, 2),     # k = 1; two devices per worker
    (3, 1, 2, 4, 1, 2),
])
def test_sync_weights_averages_the_aux_states_bit_for_bit(monkeypatch, num_workers, num_servers,
                                                          chunk, delay, warmup, devices):
    if chunk is not None:
        monkeypatch.setenv('MXDELAY_CHUNK_SIZE', str(chunk))
    ctxs = contexts(devices)
    steps = [9] * num_workers
    sync_after = (1, 5, 9)   # warm-up (or k = 1), delayed phase mid-period, the last step

    def run(aux_states):
        return run_workers(num_workers, lambda rank, store: train(
            rank, store, steps, sync_after, ctxs, aux_states, delay, warmup),
            num_servers=num_servers)[1]
    results = run(True)
    assert_means(results, ctxs)
    assert all(r['rounds'] == dict.fromkeys(AUX_SHAPES, 3) for r in results)
    # The weights of every step are those of the same run without the aux states.
    plain = run(False)
    for mine, theirs in zip(results, plain):
        for t, (got, want) in enumerate(zip(mine['weights'], theirs['weights'])):
            for name in MLP_NAMES:
                np.testing.assert_array_equal(got[name], want[name], err_msg='step %d' % t)
    # Without aux_states every worker keeps its own.
    for rank, result in enumerate(plain):
        for before, after in result['syncs']:
            for name in AUX_SHAPES:
                for got, want in zip(after[name], before[name]):
                    np.testing.assert_array_equal(got, want)


def test_uneven_data_a_worker_that_ends_first(monkeypatch):
    monkeypatch.setenv('MXDELAY_CHUNK_SIZE', '4')
    ctxs = contexts(1)
    # Worker 1 has 4 steps fewer: sync_weights joins first (its rounds are padded), then
    # both average; then both train on, and meet again at the end.
    _, results = run_workers(2, lambda rank, store: train(
        rank, store, [10, 6], (None,), ctxs), num_servers=2)
    assert_means(results, ctxs)
    assert [r['rounds'] for r in results] == [dict.fromkeys(AUX_SHAPES, 1)] * 2


def test_with_compressed_pulls(monkeypatch):
    monkeypatch.setenv('MXDELAY_CHUNK_SIZE', '5')
    ctxs = contexts(1)
    _, results = run_workers(2, lambda rank, store: train(
        rank, store, [8, 8], (3, 7), ctxs,
        pull_compression={'type': 'int8', 'block_size': 4}))
    assert_means(results, ctxs)


def test_one_worker_with_float16_pushes_and_two_devices():
    ctxs = contexts(2)
    result = train(0, delay_store(num_servers=2), [7], (2, 7), ctxs,
                   compression_params={'type': 'fp16'})
    assert_means([result], ctxs)


def test_a_checkpoint_after_an_aux_sync_resumes_bit_for_bit(monkeypatch, tmp_path):
    monkeypatch.setenv('MXDELAY_CHUNK_SIZE', '4')
    ctxs = contexts(1)
    path = str(tmp_path / 'ckpt')

    def full(rank, store):
        return train(rank, store, [12, 12], (4, 6, 10), ctxs)

    def first(rank, store):
        return train(rank, store, [6, 6], (4, 6), ctxs, save=path)

    def second(rank, store):
        return train(rank, store, [12, 12], (10,), ctxs, load=path, first=6)
    _, want = run_workers(2, full, num_servers=2)
    _, saved = run_workers(2, first, num_servers=2)
    assert [r['rounds'] for r in saved] == [dict.fromkeys(AUX_SHAPES, 2)] * 2
    _, resumed = run_workers(2, second, num_servers=2)
    assert_means(resumed, ctxs)
    for rank in range(2):
        assert resumed[rank]['rounds'] == want[rank]['rounds'] == dict.fromkeys(AUX_SHAPES, 3)
        for got, expected in zip(resumed[rank]['weights'], want[rank]['weights'][6:]):
            for name in MLP_NAMES:
                np.testing.assert_array_equal(got[name], expected[name])


# -- refusals --------------------------------------------------------------------------------
def test_with_2bit_the_values_go_by_command(monkeypatch):
    monkeypatch.setenv('MXDELAY_CHUNK_SIZE', '4')
    ctxs = contexts(1)
    two_bit = {'type': '2bit', 'threshold': 0.5}
    job, results = run_workers(2, lambda rank, store: train(
        rank, store, [7, 7], (2, 7), ctxs, compression_params=two_bit), num_servers=2)
    assert_means(results, ctxs)
    for server in job.servers:   # every round took the values of both workers
        assert server._rounds.aux._values == {}   # pylint: disable=protected-access
    # Aux keys have no residual (a checkpoint lists none for them).
    store = delay_store()
    params = net_params(ctxs)
    trainer = mxdelay.DelayedTrainer(params, 'sgd', dict(OPT), kvstore=store, delay=2,
                                     warmup_steps=1, compression_params=two_bit)
    backward_at(params[:4], ctxs, 0)
    trainer.step(BATCH)
    residuals = store.delayed.checkpoint.residuals()
    assert set(residuals) >= {trainer._param2idx[n] for n in MLP_NAMES}
    assert not set(residuals) & {trainer._param2idx[n] for n in AUX_SHAPES}


def test_the_aux_command_and_its_refusals():
    server = _server()
    server.command(Command.REGISTER, {'rank': 0, 'chunks': [_entry(AUX), _entry(chunk=1)]})
    values = [[0.1, 0.7, -2.5], [1e-8, 3.3, 0.25]]
    for rank, v in enumerate(values):
        assert server.command(Command.AUX, {'rank': rank, 'chunks': {'0': v, '7': [1.0]}}) \
            == {'chunks': 1}   # chunk 7: another server's
    server.complete_round(KeyLayout(1, 2).slot_key(0, 0, 0), nd.zeros(3), nd.zeros(3))
    want = np.array(values[0], np.float32) + np.array(values[1], np.float32)
    np.testing.assert_array_equal(server.weight(0).asnumpy(), want)
    # The next round without values: the pushed sum again.
    server.complete_round(KeyLayout(1, 2).slot_key(0, 1, 0), nd.ones(3), nd.zeros(3))
    np.testing.assert_array_equal(server.weight(0).asnumpy(), np.ones(3, np.float32))
    for chunks, message in [
            ({'1': [1.0, 2.0, 3.0]}, r'chunk 1 is not an aux chunk of 3 elements'),
            ({'0': [1.0]}, r'chunk 0 is not an aux chunk of 3 elements \(got 1 values\)'),
            ({'0': [1.0, 'x', 2.0]}, r'chunks must map chunk ids to lists of numbers'),
            ({'a': [1.0]}, r'chunks must map chunk ids to lists of numbers')]:
        with pytest.raises(ValueError, match=message):
            server.command(Command.AUX, {'rank': 0, 'chunks': chunks})
    with pytest.raises(ValueError, match="command field 'rank'"):
        server.command(Command.AUX, {'chunks': {}})
    # A round with the values of one worker of two fails.
    server.command(Command.AUX, {'rank': 1, 'chunks': {'0': [1.0, 2.0, 3.0]}})
    with pytest.raises(RuntimeError, match=r'aux chunk 0: a round with the values of workers '
                                           r'\[1\], not of all 2'):
        server.complete_round(KeyLayout(1, 2).slot_key(0, 0, 0), nd.zeros(3), nd.zeros(3))


def test_refusals_name_the_key_and_the_fix():
    ctxs = contexts(1)
    params = net_params(ctxs)
    store = delay_store()
    trainer = mxdelay.DelayedTrainer(params, 'sgd', dict(OPT), kvstore=store, delay=2,
                                     warmup_steps=1)
    backward_at(params[:4], ctxs, 0)
    trainer.step(BATCH)
    aux, weight = trainer._param2idx['bn_running_var'], trainer._param2idx['w1']
    with pytest.raises(ValueError, match=r'key %d holds aux states .* use average\(\), or '
                                         r'trainer\.sync_weights\(aux_states=True\)' % aux):
        store.push(aux, nd.zeros(7))
    with pytest.raises(ValueError, match=r'key %d does not hold aux states' % weight):
        store.delayed.aux.average(weight, params[weight].data())
    with pytest.raises(TypeError, match=r"aux_states must be True or False, got 'yes'"):
        trainer.sync_weights(aux_states='yes')
    frozen = trainer._param2idx[FROZEN]
    with pytest.raises(ValueError, match='does not hold aux states'):
        store.delayed.aux.average(frozen, params[frozen].data())
    # Registered as aux on the servers; the frozen weight and the trained ones are not.
    info = store._session.native.servers[0]._chunks._chunks   # pylint: disable=protected-access
    kinds = {i['param_index']: i['codec'] for i in info.values()}
    assert kinds[aux] == AUX and kinds[frozen] == {} and kinds[weight] == {}


def test_without_a_distributed_kvstore_nothing_changes():
    ctxs = contexts(1)
    params = net_params(ctxs)
    trainer = mxdelay.DelayedTrainer(params, 'sgd', dict(OPT), kvstore='local')
    backward_at(params[:4], ctxs, 0)
    trainer.step(BATCH)
    before = aux_of(params, ctxs)
    trainer.sync_weights(aux_states=True)
    for name, copies in aux_of(params, ctxs).items():
        np.testing.assert_array_equal(copies[0], before[name][0])


def test_delayed_module_refuses_aux_states():
    net = mx.sym.BatchNorm(mx.sym.FullyConnected(mx.sym.Variable('data'), num_hidden=3),
                           name='bn')
    mod = mxdelay.DelayedModule(net, label_names=None, delay=2, warmup_steps=1)
    with pytest.raises(ValueError, match=r'DelayedModule\.sync_weights\(aux_states=True\) is '
                                         r"not supported: a Module's aux states \(bn_moving_mean, "
                                         r'bn_moving_var\)'):
        mod.sync_weights(aux_states=True)


# -- a real job ----------------------------------------------------------------------------------
@pytest.mark.jobs
@pytest.mark.parametrize('compression', [None, {'type': '2bit', 'threshold': 0.5}],
                         ids=['plain', '2bit'])
def test_a_real_job_averages_batchnorm_statistics(tmp_path, compression):
    # Two workers and two servers over sockets, chunks of 4 elements: each worker's
    # BatchNorm statistics (from its own data) before the sync; after it every worker holds
    # their float32 mean, exactly (two workers: the server's sum does not depend on the
    # arrival order), and the servers' weights. With 2bit MXNet's native store quantizes
    # every push: the values go by command.
    pids = PidFile(tmp_path / 'pids')
    script = [sys.executable, os.path.join(SCRIPTS, 'bn_job.py'), str(tmp_path), '5']
    if compression is not None:
        script.append(json.dumps(compression))
    result = run_job(pids.wrap(script), num_workers=2, num_servers=2,
                     env={'MXDELAY_CHUNK_SIZE': 4})
    assert_ok(result)
    pids.assert_all_dead()
    runs = [dict(np.load(str(tmp_path / ('worker%d.npz' % r)))) for r in range(2)]
    aux = sorted(k[4:] for k in runs[0] if k.startswith('pre_') and 'running_' in k)
    assert len(aux) == 2
    for name in aux:
        before = [run['pre_' + name] for run in runs]
        assert not np.array_equal(before[0], before[1]), 'the test needs statistics that differ'
        want = reference.aux_mean([[b] for b in before])
        for rank, run in enumerate(runs):
            np.testing.assert_array_equal(run['post_' + name], want,
                                          err_msg='worker %d, %s' % (rank, name))
    for name in (k[5:] for k in runs[0] if k.startswith('post_')):
        np.testing.assert_array_equal(runs[0]['post_' + name], runs[1]['post_' + name])
