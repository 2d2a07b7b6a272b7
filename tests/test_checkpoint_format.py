"""Checkpoint files of version 2 (kvstore_ext/checkpoint/files.py, docs/design.md §6).

1. Nothing runs that nobody asked for: a pickle bomb as a worker or server file (a version-1
   pickle, or a forged version-2 archive whose arrays or header are pickled objects), loaded
   the default way, raises ValueError and creates nothing. Version 1 loads only with
   ``trusted=True``.
2. The archive keeps every value exactly (dtypes, tuples, int keys, numpy scalars, NDArrays
   dense and row_sparse), and an optimizer (registry name and fields, scheduler with its
   progress) comes back updating bit for bit like the original; unregistered classes are
   refused with the fix.
3. Saves that can't mix: the save id and sha256 checks (worker and server), the servers'
   rounds against the kvstore index, the file mode (umask), the folder fsync, stale
   temporaries. In real jobs (a hard timeout each): a second save to one name SIGKILLed
   between its parts is refused on every worker, or, killed before its first part, loads the
   previous save and continues bit for bit; pickle bombs in place of a worker's or the
   server's file (or a whole version-1 checkpoint of them) make ``load_states`` raise on every
   worker and run nothing; a version-1 checkpoint resumes bit for bit with ``trusted=True``.
"""
import json
import logging
import os
import pickle
import sys
import types

import numpy as np
import pytest

import mxdelay  # noqa: F401
import mxnet as mx

from kvstore_ext.checkpoint import files
from kvstore_ext.protocol import commands
from kvstore_ext.protocol.keys import KeyLayout
from kvstore_ext.optim.optimizers import (build_optimizer, describe_optimizer, optimizer_record,
                                    register_lr_scheduler)
from kvstore_ext.protocol.commands import Command
from kvstore_ext.server.controller import DelayServer
from mxdelay import worker_state
from support.jobs import PidFile, assert_ok, run_job

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, 'scripts', 'ckpt_kill_job.py')


class Bomb(object):
    """Unpickling it creates the file `marker` (what a malicious checkpoint would do)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, 'w'))


def legacy_file(path, kind, body):
    """A version-1 file: a pickled dict stamped as mxdelay before version 2 wrote them."""
    with open(path, 'wb') as out:
        pickle.dump(dict(body, format=kind, version=files.LEGACY_VERSION), out, protocol=4)


def forged_archive(path, kind, body_tree, arrays, save_id='forged', header=None):
    """A version-2 archive written by hand: `arrays` may be object arrays (pickled by
    np.savez), `header` may replace the JSON header entry."""
    text = json.dumps({'format': kind, 'version': files.VERSION, 'save_id': save_id,
                       'body': body_tree}).encode()
    entries = {'a%d' % i: a for i, a in enumerate(arrays)}
    entries['header'] = np.frombuffer(text, np.uint8) if header is None else header
    with open(path, 'wb') as out:
        np.savez(out, **entries)


def object_array(value):
    array = np.empty(1, dtype=object)
    array[0] = value
    return array


def trainer_index(fname, parts, save_id='forged', version=files.VERSION):
    body = {'num_workers': 1, 'schedule': {'step': 0, 'delay': 2, 'warmup_steps': 1},
            'kvstore': os.path.basename(fname) + '.kvstore', 'save_id': save_id,
            'parts': parts, 'format': files.TRAINER_INDEX, 'version': version}
    with open(fname, 'w') as out:
        json.dump(body, out)


FAKE_KV = types.SimpleNamespace(rank=0, num_workers=1)


def read_worker(fname, trusted=False):
    return worker_state.read(fname, FAKE_KV, None, None, None, None, None, trusted)


# -- 1. pickle bombs ---------------------------------------------------------------------------
def test_a_version1_pickle_bomb_worker_file_is_refused_unread(tmp_path):
    marker = tmp_path / 'marker'
    fname = str(tmp_path / 'ckpt')
    legacy_file(fname + '.worker0', files.WORKER, {'weights': Bomb(str(marker))})
    # The index of version 1: refused before any worker file is opened.
    trainer_index(fname, {}, version=files.LEGACY_VERSION)
    with pytest.raises(ValueError, match=r'ckpt is an mxdelay trainer state file of version 1, '
                                         r'a pickle: .*load_states\(fname, trusted=True\)'):
        read_worker(fname)
    # An index of version 2 naming it: the pickle is recognised and refused unread.
    parts = {'worker0': files.file_sha256(fname + '.worker0'), 'kvstore': '0'}
    trainer_index(fname, parts)
    with pytest.raises(ValueError, match=r'ckpt.worker0 is not an mxdelay worker state file '
                                         r'of version 2: it is a pickle'):
        read_worker(fname)
    assert not marker.exists()
    # Only the explicit opt-in unpickles (and so runs the bomb): what trusted=True means.
    trainer_index(fname, {}, version=files.LEGACY_VERSION)
    with pytest.raises((ValueError, KeyError, TypeError)):
        read_worker(fname, trusted=True)
    assert marker.exists()


@pytest.mark.parametrize('where', ['array', 'header'])
def test_a_forged_version2_worker_file_with_pickled_objects_runs_nothing(tmp_path, where):
    marker = tmp_path / 'marker'
    fname = str(tmp_path / 'ckpt')
    bomb = object_array(Bomb(str(marker)))
    if where == 'array':
        forged_archive(fname + '.worker0', files.WORKER, {'weights': {'$array': 0}}, [bomb])
    else:
        forged_archive(fname + '.worker0', files.WORKER, None, [], header=bomb)
    # The index lists its true sha256 and save id: every check but the pickle passes.
    trainer_index(fname, {'worker0': files.file_sha256(fname + '.worker0'), 'kvstore': '0'})
    for trusted in (False, True):       # trusted=True does not unpickle version 2 either
        with pytest.raises(ValueError, match=r'ckpt.worker0 is not a readable mxdelay worker '
                                             r'state \(ValueError: .*allow_pickle=False'):
            read_worker(fname, trusted)
    assert not marker.exists()


def registered_server(num_workers=1):
    server = DelayServer.offline(rank=0, num_workers=num_workers)
    server.command(Command.HELLO, {'rank': 0, 'protocol': commands.PROTOCOL_VERSION,
                                   'slots': 2, 'config': {}})
    server.command(Command.REGISTER, {'chunks': [[0, 0, 0, 'w', 1.0, 1.0, 3]]})
    return server


def install(server, optimizer):
    server.command(Command.OPTIMIZER, {'rank': 0, 'optimizer': commands.encode_optimizer(optimizer)})


def one_round(server, grad=(0.5, 0.5, 0.5), weight=(1.0, 2.0, 3.0)):
    server.complete_round(KeyLayout(1, 2).slot_key(0, 0, 0), mx.nd.array(grad),
                          mx.nd.array(weight))


def test_pickle_bomb_server_files_are_refused_unread(tmp_path):
    marker = tmp_path / 'marker'
    server = registered_server()
    legacy = str(tmp_path / 'legacy.server0')
    legacy_file(legacy, files.SERVER, {'server': 0, 'chunks': Bomb(str(marker))})
    forged = str(tmp_path / 'forged.server0')
    forged_archive(forged, files.SERVER, {'server': 0, 'chunks': {'$array': 0},
                                               'updater': None},
                   [object_array(Bomb(str(marker)))])
    cases = [
        ({'paths': [legacy]}, r'legacy.server0 is not an mxdelay server state file of version '
                              r'2: it is a pickle'),
        # A version-1 load asked for without trusted=True: the server does not read it.
        ({'paths': [legacy], 'version': 1}, r'version-1 \(pickled\) server state, which is read '
                                            r'only with trusted=True'),
        ({'paths': [legacy], 'version': 1, 'trusted': 'yes'},
         r"command field 'trusted' must be true or false, got 'yes'"),
        # trusted=True, but the server's own environment does not allow unpickling.
        ({'paths': [legacy], 'version': 1, 'trusted': True},
         r'reads one only with MXDELAY_ALLOW_PICKLE=1 in its environment'),
        ({'paths': [forged], 'save_id': 'forged',
          'sha256': [files.file_sha256(forged)]},
         r'forged.server0 is not a readable mxdelay server state \(ValueError: .*allow_pickle'),
    ]
    for body, pattern in cases:
        for check_only in (True, False):
            with pytest.raises(ValueError, match=pattern):
                server.command(Command.LOAD, dict(body, rank=0, check_only=check_only))
    assert not marker.exists()
    assert server.applied_rounds(0) == 0


def test_a_version1_server_file_loads_with_trusted(tmp_path, monkeypatch):
    monkeypatch.setenv('MXDELAY_ALLOW_PICKLE', '1')   # the server's own opt-in
    # A server file as mxdelay before version 2 wrote it (the updater's own pickle inside).
    source = registered_server()
    install(source, mx.optimizer.create('sgd', learning_rate=0.1, momentum=0.9))
    one_round(source)
    path = str(tmp_path / 'old.server0')
    legacy_file(path, files.SERVER, {
        'server': 0, 'num_workers': 1,
        'chunks': {c: source._chunks.saved(c, source._rounds.chunk_state(c))  # pylint: disable=W0212
                   for c in source._chunks.ids()},  # pylint: disable=W0212
        'updater': source.updater.get_states(dump_optimizer=True)})
    server = registered_server()
    install(server, mx.optimizer.create('sgd', learning_rate=0.5, momentum=0.9))
    server.command(Command.LOAD, {'rank': 0, 'paths': [path], 'version': 1, 'trusted': True})
    assert server.applied_rounds(0) == 1
    assert server.optimizer.lr == 0.1                  # the saved optimizer, as set_states
    np.testing.assert_array_equal(server.weight(0).asnumpy(), source.weight(0).asnumpy())
    np.testing.assert_array_equal(server.updater.states[0].asnumpy(),
                                  source.updater.states[0].asnumpy())


# -- 2. exact values -------------------------------------------------------------------------
def test_the_archive_keeps_every_value_exactly(tmp_path):
    dense = mx.nd.array([[1.5, -2.0], [3.25, 4.0]], dtype='float16')
    sparse = mx.nd.sparse.row_sparse_array((np.ones((1, 2), np.float32), [1]), shape=(3, 2))
    body = {'int keys': {0: np.arange(3, dtype=np.int64), 7: None},
            'tuple': (np.float32(0.1), [1, 2.5, 'x'], (True, None)),
            '$dollar': {'$array': 'not a marker'}, 'nan': float('nan'),
            'big': 2 ** 62, 'dense': dense, 'sparse': sparse,
            'f16': np.array([65504, 1e-7], np.float16)}
    path = str(tmp_path / 'part')
    digest = files.write_archive(path, files.WORKER, body, 'abc')
    assert digest == files.file_sha256(path)
    got = files.read_archive(path, files.WORKER, 'abc', digest)
    assert set(got) == set(body)
    assert list(got['int keys']) == [0, 7] and got['int keys'][7] is None
    assert got['int keys'][0].dtype == np.int64
    np.testing.assert_array_equal(got['int keys'][0], [0, 1, 2])
    assert isinstance(got['tuple'], tuple) and isinstance(got['tuple'][2], tuple)
    assert type(got['tuple'][0]) is np.float32 and got['tuple'][0] == np.float32(0.1)
    assert got['tuple'][1:] == ([1, 2.5, 'x'], (True, None))
    assert got['$dollar'] == {'$array': 'not a marker'}
    assert np.isnan(got['nan']) and got['big'] == 2 ** 62
    assert got['dense'].dtype == np.float16
    np.testing.assert_array_equal(got['dense'].asnumpy(), dense.asnumpy())
    assert got['sparse'].stype == 'row_sparse'
    np.testing.assert_array_equal(got['sparse'].indices.asnumpy(), [1])
    np.testing.assert_array_equal(got['sparse'].asnumpy(), sparse.asnumpy())
    assert got['f16'].dtype == np.float16 and got['f16'].tobytes() == body['f16'].tobytes()


def test_values_an_archive_cannot_hold_are_refused_at_save(tmp_path):
    path = str(tmp_path / 'part')
    with pytest.raises(TypeError, match=r"body.rule\[1\] is a set, which a checkpoint does "
                                        r"not store"):
        files.write_archive(path, files.WORKER, {'rule': [1, {2}]}, 'x')
    with pytest.raises(TypeError, match=r'body.x is an array of Python objects'):
        files.write_archive(path, files.WORKER, {'x': object_array(1)}, 'x')
    assert not os.listdir(str(tmp_path))               # nothing written, no temporary left


def trained_updater(optimizer, steps=3):
    updater = mx.optimizer.get_updater(optimizer)
    weights = {i: mx.nd.array(np.linspace(-1, 1, 4) * (i + 1), dtype='float16'
                              if optimizer.multi_precision else 'float32') for i in range(2)}
    for step in range(steps):
        for i, weight in weights.items():
            grad = mx.nd.array(np.cos(np.arange(4) + step + i), dtype=weight.dtype)
            updater(i, grad, weight)
    return updater, weights


@pytest.mark.parametrize('name,kwargs', [
    ('adam', {'learning_rate': 0.01, 'wd': 1e-3,
              'lr_scheduler': mx.lr_scheduler.FactorScheduler(step=2, factor=0.5)}),
    ('sgd', {'learning_rate': 0.1, 'momentum': 0.9, 'multi_precision': True,
             'lr_scheduler': mx.lr_scheduler.MultiFactorScheduler([2, 4], factor=0.1)}),
    ('rmsprop', {'learning_rate': 0.01, 'centered': True, 'clip_gradient': 1.0}),
])
def test_a_rebuilt_optimizer_and_states_update_bit_for_bit(tmp_path, name, kwargs):
    # Saved mid-training (update counts, scheduler progress, states), rebuilt from the
    # archive, then both go on: the same weights, bit for bit, and the same description.
    original, weights = trained_updater(mx.optimizer.create(name, **kwargs))
    path = str(tmp_path / 'part')
    files.write_archive(path, files.SERVER,
                             {'states': original.states, 'optimizer': original.optimizer}, 'x')
    saved = files.read_archive(path, files.SERVER)
    rebuilt = mx.optimizer.get_updater(saved['optimizer'])
    rebuilt.states = saved['states']
    rebuilt.states_synced = dict.fromkeys(saved['states'], False)
    assert describe_optimizer(saved['optimizer']) == describe_optimizer(original.optimizer)
    copies = {i: w.copy() for i, w in weights.items()}
    for step in range(3, 7):
        for i in weights:
            grad = np.cos(np.arange(4) + step + i)
            original(i, mx.nd.array(grad, dtype=weights[i].dtype), weights[i])
            rebuilt(i, mx.nd.array(grad, dtype=copies[i].dtype), copies[i])
    for i in weights:
        assert weights[i].asnumpy().tobytes() == copies[i].asnumpy().tobytes()
    assert rebuilt.optimizer.num_update == original.optimizer.num_update
    counts = rebuilt.optimizer._index_update_count  # pylint: disable=protected-access
    assert counts is rebuilt.optimizer._all_index_update_counts[0]  # pylint: disable=W0212
    if 'lr_scheduler' in kwargs:
        assert vars(rebuilt.optimizer.lr_scheduler) == vars(original.optimizer.lr_scheduler)


class UnregisteredScheduler(mx.lr_scheduler.LRScheduler):
    def __call__(self, num_update):
        return self.base_lr / (1 + num_update)


class HalvingScheduler(mx.lr_scheduler.LRScheduler):
    def __call__(self, num_update):
        return self.base_lr * 0.5 ** num_update


class UnregisteredOptimizer(mx.optimizer.SGD):
    pass


def test_unregistered_optimizers_and_schedulers_are_refused_with_the_fix(tmp_path):
    with pytest.raises(ValueError, match=r"optimizer test_checkpoint_format.UnregisteredOptimizer"
                                         r" is not registered with MXNet under the name "
                                         r"'unregisteredoptimizer'.*@mx.optimizer.register"):
        optimizer_record(UnregisteredOptimizer())
    with_scheduler = mx.optimizer.create('sgd', lr_scheduler=UnregisteredScheduler())
    with pytest.raises(ValueError, match=r'scheduler test_checkpoint_format.UnregisteredScheduler'
                                         r" is neither one of mx.lr_scheduler's nor registered.*"
                                         r'@kvstore_ext.optim.optimizers.register_lr_scheduler'):
        files.write_archive(str(tmp_path / 'p'), files.WORKER,
                                 {'optimizer': with_scheduler}, 'x')
    # Registered, it travels, with its fields.
    register_lr_scheduler(HalvingScheduler)
    scheduled = mx.optimizer.create('sgd', learning_rate=0.4, lr_scheduler=HalvingScheduler())
    rebuilt = build_optimizer(optimizer_record(scheduled))
    assert type(rebuilt.lr_scheduler) is HalvingScheduler
    assert rebuilt.lr_scheduler.base_lr == 0.4
    # A record naming a class this process does not know.
    record = optimizer_record(mx.optimizer.create('sgd'))
    with pytest.raises(ValueError, match=r"the checkpoint's optimizer 'mysgd' is not registered "
                                         r'with MXNet in this process: import the module'):
        build_optimizer(dict(record, name='mysgd'))
    with pytest.raises(ValueError, match=r"the checkpoint's learning-rate scheduler 'Mine' is "
                                         r"neither one of mx.lr_scheduler's nor registered"):
        build_optimizer(dict(record, lr_scheduler={'name': 'Mine', 'fields': {}}))
    with pytest.raises(TypeError, match=r'register_lr_scheduler takes a subclass'):
        register_lr_scheduler(dict)


# -- 3. saves that can't mix -----------------------------------------------------------------
def test_a_part_of_another_save_or_changed_since_is_refused(tmp_path):
    path = str(tmp_path / 'ckpt.worker0')
    digest = files.write_archive(path, files.WORKER, {'rank': 0}, 'first')
    with pytest.raises(ValueError, match=r'ckpt.worker0 belongs to save first, but its index to '
                                         r'save second: a later save to the same name did not '
                                         r'finish .* resume from an earlier one'):
        files.read_archive(path, files.WORKER, 'second', digest)
    with pytest.raises(ValueError, match=r'ckpt.worker0 differs from the worker state file that '
                                         r'was saved with this checkpoint'):
        files.read_archive(path, files.WORKER, 'first', '0' * 64)
    index = str(tmp_path / 'ckpt')
    files.write_json(index, files.TRAINER_INDEX, {'num_workers': 1})
    with pytest.raises(ValueError, match=r'ckpt differs from the trainer state file'):
        files.read_json(index, files.TRAINER_INDEX, '0' * 64)


def test_a_server_refuses_a_file_of_another_save_or_round(tmp_path):
    server = registered_server()
    install(server, mx.optimizer.create('sgd', learning_rate=0.1, momentum=0.9))
    one_round(server)
    path = str(tmp_path / 'kv.server0')
    digest = server.command(Command.SAVE, {'rank': 0, 'paths': [path], 'save_id': 's1'})['sha256']
    assert digest == files.file_sha256(path)
    good = {'rank': 0, 'paths': [path], 'save_id': 's1', 'sha256': [digest],
            'rounds': {'0': 1}, 'finish_rounds': 0, 'check_only': True}
    assert server.command(Command.LOAD, good) == {'path': path, 'valid': True}
    with pytest.raises(ValueError, match=r'kv.server0 belongs to save s1, but its index to save '
                                         r's0'):
        server.command(Command.LOAD, dict(good, save_id='s0'))
    with pytest.raises(ValueError, match=r'kv.server0 differs from the server state file'):
        server.command(Command.LOAD, dict(good, sha256=['f' * 64]))
    with pytest.raises(ValueError, match=r"kv.server0: chunk 0 \(parameter 'w'\) was saved at "
                                         r'round 1, but the kvstore index says round 2'):
        server.command(Command.LOAD, dict(good, rounds={'0': 2}, check_only=False))
    assert server.applied_rounds(0) == 1


@pytest.mark.parametrize('umask', [0o022, 0o002, 0o077])
def test_files_follow_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        files.write_json(str(tmp_path / 'j'), files.TRAINER_INDEX, {})
        files.write_archive(str(tmp_path / 'a'), files.WORKER, {}, 'x')
    finally:
        os.umask(old)
    for name in ('j', 'a'):
        assert os.stat(str(tmp_path / name)).st_mode & 0o777 == 0o666 & ~umask


def test_the_folder_is_flushed_after_the_rename(tmp_path, monkeypatch):
    synced = []
    real = os.fsync

    def fsync(handle):
        synced.append(os.path.realpath('/proc/self/fd/%d' % handle))
        return real(handle)
    monkeypatch.setattr(os, 'fsync', fsync)
    path = tmp_path / 'part'
    files.write_archive(str(path), files.WORKER, {}, 'x')
    assert len(synced) == 2
    assert os.path.basename(synced[0]).startswith('.part.')    # the temporary, before
    assert synced[1] == os.path.realpath(str(tmp_path))          # the folder, after the rename


def test_stale_temporaries_are_removed_at_the_next_save_and_ignored_by_loads(tmp_path, caplog):
    path = str(tmp_path / 'ckpt.worker0')
    stale = str(tmp_path / '.ckpt.worker0.4f2a.tmp')
    other = str(tmp_path / '.ckpt.worker1.77aa.tmp')     # another writer's: left alone
    for name in (stale, other):
        with open(name, 'wb') as out:
            out.write(b'half a file')
    with caplog.at_level(logging.WARNING, logger='kvstore_ext.checkpoint.files'):
        files.write_archive(path, files.WORKER, {'rank': 0}, 'x')
    assert not os.path.exists(stale) and os.path.exists(other)
    assert any('removing %s' % stale in r.getMessage() and 'did not finish' in r.getMessage()
               for r in caplog.records)
    caplog.clear()
    other_path = str(tmp_path / 'ckpt.worker1')
    files.write_archive(other_path, files.WORKER, {'rank': 1}, 'x')
    with open(str(tmp_path / '.ckpt.worker1.0000.tmp'), 'wb') as out:
        out.write(b'half')
    with caplog.at_level(logging.WARNING, logger='kvstore_ext.checkpoint.files'):
        assert files.read_archive(other_path, files.WORKER)['rank'] == 1
    assert any('ignoring' in r.getMessage() and '.ckpt.worker1.0000.tmp' in r.getMessage()
               for r in caplog.records)


# -- 3b. in real jobs: a second save to one name, SIGKILLed between its parts ------------------
BASE = {'steps': 14, 'batch': 6, 'lr': 0.1, 'momentum': 0.9, 'delay': 3, 'warmup_steps': 3,
        'save_after': [5, 9]}
JOB_TIMEOUT = 60


def run_ckpt_job(out, config, expect_ok=True, env=None):
    out.mkdir(parents=True, exist_ok=True)
    pids = PidFile(out / 'pids')
    result = run_job(pids.wrap([sys.executable, SCRIPT, json.dumps(config), str(out)]),
                     num_workers=2, timeout=JOB_TIMEOUT + 15, env=env,
                     extra_launcher_args=('--timeout', str(JOB_TIMEOUT)))
    pids.assert_all_dead()
    if expect_ok:
        assert_ok(result)
    return result


def histories(out):
    result = {}
    for rank in range(2):
        with np.load(str(out / ('worker%d.npz' % rank))) as npz:
            result[rank] = {key: npz[key] for key in npz.files}
    return result


def load_outcome(out, rank):
    with open(str(out / ('load.worker%d.json' % rank)), encoding='utf-8') as src:
        return json.load(src)


@pytest.fixture(scope='module')
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp('uninterrupted')
    run_ckpt_job(out, BASE)
    return histories(out)


@pytest.mark.jobs
@pytest.mark.parametrize('kill,refused', [
    ({'rank': 1, 'save': 1, 'when': 'after_own_part'}, 'latest.worker1 belongs to save'),
    ({'rank': 0, 'save': 1, 'when': 'after_servers'}, 'latest.worker0 belongs to save'),
    ({'rank': 1, 'save': 1, 'when': 'before_save'}, None),
], ids=['worker1-after-its-part', 'worker0-after-the-servers', 'worker1-before-the-save'])
def test_a_second_save_killed_midway_is_refused_or_loads_the_first(tmp_path, uninterrupted,
                                                                   kill, refused):
    killed = tmp_path / 'killed'
    result = run_ckpt_job(killed, dict(BASE, kill=kill), expect_ok=False)
    assert result.returncode != 0, 'the SIGKILLed job exited 0'
    latest = str(killed / 'ckpt' / 'latest')
    resumed = tmp_path / 'resumed'
    run_ckpt_job(resumed, dict(BASE, save_after=[], resume_from=latest))
    if refused is not None:
        for rank in range(2):   # every worker raises the same ValueError: nothing loaded
            outcome = load_outcome(resumed, rank)
            assert outcome['type'] == 'ValueError', (rank, outcome)
            assert 'cannot load %s.kvstore, nothing was changed' % latest in outcome['message']
            assert refused in outcome['message'] and 'did not finish' in outcome['message']
        return
    # Nothing of the second save was written: the first loads and continues bit for bit.
    for rank in range(2):
        assert load_outcome(resumed, rank) == {'type': None, 'message': None}
    got = histories(resumed)
    for rank in range(2):
        assert int(got[rank]['first']) == 6
        for name, trajectory in got[rank].items():
            if name != 'first':
                np.testing.assert_array_equal(trajectory, uninterrupted[rank][name][6:],
                                              err_msg='worker %d %s' % (rank, name))


def test_trusted_must_be_a_bool(tmp_path):
    net = mx.gluon.nn.Dense(2, in_units=3)
    net.initialize()
    trainer = mxdelay.DelayedTrainer(net.collect_params(), 'sgd',
                                     {'learning_rate': 0.1}, kvstore=None)
    with pytest.raises(TypeError, match=r"trusted must be True or False, got 'yes' \(str\)"):
        trainer.load_states(str(tmp_path / 'ckpt'), trusted='yes')


def as_version1(v2, v1):
    """Write the version-2 checkpoint `v2` (2 workers, 1 server) as mxdelay before version 2
    wrote it, under the name `v1`: JSON indexes of version 1 and pickles."""
    with open(v2, encoding='utf-8') as src:
        index = json.load(src)
    for name in ('save_id', 'parts'):
        del index[name]
    with open(v1, 'w', encoding='utf-8') as out:
        json.dump(dict(index, version=1), out)
    with open(v2 + '.kvstore', encoding='utf-8') as src:
        store = json.load(src)
    for name in ('save_id', 'servers_sha256'):
        del store[name]
    with open(v1 + '.kvstore', 'w', encoding='utf-8') as out:
        json.dump(dict(store, version=1), out)
    for rank in range(2):
        body = files.read_archive(files.worker_file(v2, rank), files.WORKER)
        legacy_file(files.worker_file(v1, rank), files.WORKER, body)
    server = files.read_archive(v2 + '.kvstore.server0', files.SERVER)
    updater = server['updater']
    server['updater'] = pickle.dumps((updater['states'], updater['optimizer']))
    legacy_file(v1 + '.kvstore.server0', files.SERVER, server)


@pytest.mark.jobs
def test_a_version1_checkpoint_resumes_bit_for_bit_only_with_trusted(tmp_path, uninterrupted):
    saved = tmp_path / 'saved'
    run_ckpt_job(saved, dict(BASE, save_after=[5]))
    old = str(tmp_path / 'old')
    as_version1(str(saved / 'ckpt' / 'latest'), old)
    refused = tmp_path / 'refused'
    run_ckpt_job(refused, dict(BASE, save_after=[], resume_from=old))
    for rank in range(2):
        outcome = load_outcome(refused, rank)
        assert outcome['type'] == 'ValueError', (rank, outcome)
        assert ('%s is an mxdelay trainer state file of version 1, a pickle' % old
                in outcome['message']) and 'trusted=True' in outcome['message']
    resumed = tmp_path / 'resumed'
    # trusted=True, and the servers' own opt-in to unpickle version-1 server files
    run_ckpt_job(resumed, dict(BASE, save_after=[], resume_from=old, trusted=True),
                 env={'MXDELAY_ALLOW_PICKLE': '1'})
    got = histories(resumed)
    for rank in range(2):
        assert int(got[rank]['first']) == 6
        for name, trajectory in got[rank].items():
            if name != 'first':
                np.testing.assert_array_equal(trajectory, uninterrupted[rank][name][6:],
                                              err_msg='worker %d %s' % (rank, name))


@pytest.fixture(scope='module')
def saved_checkpoint(tmp_path_factory):
    """A real job's checkpoint after step 5 (2 workers, 1 server)."""
    out = tmp_path_factory.mktemp('saved')
    run_ckpt_job(out, dict(BASE, steps=6, save_after=[5]))
    return str(out / 'ckpt' / 'latest')


def copy_parts(source, target):
    for suffix in ('', '.kvstore', '.kvstore.server0', '.worker0', '.worker1'):
        with open(source + suffix, 'rb') as src, open(target + suffix, 'wb') as dst:
            dst.write(src.read())


def rehash(prefix):
    """Make the indexes of checkpoint `prefix` list its files' true sha256 (what a forger
    would do): only the content of a part can then refuse it."""
    with open(prefix + '.kvstore', encoding='utf-8') as src:
        store = json.load(src)
    store['servers_sha256'] = [files.file_sha256(prefix + '.kvstore.server0')]
    with open(prefix + '.kvstore', 'w', encoding='utf-8') as out:
        json.dump(store, out)
    with open(prefix, encoding='utf-8') as src:
        index = json.load(src)
    index['parts'] = {'worker0': files.file_sha256(prefix + '.worker0'),
                      'worker1': files.file_sha256(prefix + '.worker1'),
                      'kvstore': files.file_sha256(prefix + '.kvstore')}
    with open(prefix, 'w', encoding='utf-8') as out:
        json.dump(index, out)


@pytest.mark.jobs
@pytest.mark.parametrize('part,forgery', [
    ('.worker1', 'version1'), ('.worker1', 'version2'),
    ('.kvstore.server0', 'version1'), ('.kvstore.server0', 'version2'),
    ('all', 'version1')])
def test_pickle_bombs_loaded_by_a_real_job_raise_everywhere_and_run_nothing(
        tmp_path, saved_checkpoint, part, forgery):
    marker = tmp_path / 'marker'
    prefix = str(tmp_path / 'bombed')
    copy_parts(saved_checkpoint, prefix)
    kind = files.SERVER if part == '.kvstore.server0' else files.WORKER
    if part == 'all':   # a whole version-1 checkpoint, every pickle a bomb
        as_version1(saved_checkpoint, prefix)
        for name in ('.worker0', '.worker1', '.kvstore.server0'):
            legacy_file(prefix + name, files.WORKER, {'x': Bomb(str(marker))})
    elif forgery == 'version1':
        legacy_file(prefix + part, kind, {'server': 0, 'rank': 1, 'x': Bomb(str(marker))})
    else:
        with open(prefix, encoding='utf-8') as src:
            save_id = json.load(src)['save_id']
        forged_archive(prefix + part, kind, {'server': 0, 'rank': 1, 'x': {'$array': 0}},
                       [object_array(Bomb(str(marker)))], save_id=save_id)
    if part != 'all':
        rehash(prefix)
    out = tmp_path / 'job'
    run_ckpt_job(out, dict(BASE, save_after=[], resume_from=prefix))
    patterns = {'version1': 'it is a pickle', 'version2': 'allow_pickle=False'}
    if part == 'all':
        patterns['version1'] = 'of version 1, a pickle'
    for rank in range(2):
        outcome = load_outcome(out, rank)
        assert outcome['type'] == 'ValueError', (rank, outcome)
        assert 'nothing was changed' in outcome['message']
        assert patterns[forgery] in outcome['message'], (rank, outcome)
        if part != 'all':
            assert prefix + part in outcome['message'], (rank, outcome)
    assert not marker.exists()


def test_delayed_module_load_takes_trusted(tmp_path):
    data = mx.sym.Variable('data')
    net = mx.sym.FullyConnected(data, num_hidden=2, name='fc')
    prefix = str(tmp_path / 'model')
    mx.model.save_checkpoint(prefix, 0, net, {'fc_weight': mx.nd.ones((2, 3)),
                                             'fc_bias': mx.nd.zeros(2)}, {})
    with pytest.raises(TypeError, match=r"trusted must be True or False, got 1 \(int\)"):
        mxdelay.DelayedModule.load(prefix, 0, load_optimizer_states=True, trusted=1,
                                   label_names=None)
    mod = mxdelay.DelayedModule.load(prefix, 0, load_optimizer_states=True, trusted=True,
                                     label_names=None)
    assert mod._preload_trusted is True  # pylint: disable=protected-access
