"""Loads are all-or-nothing (issue 22 item 3, docs/design.md §6.3).

What is tested, in real jobs (2 workers, 1 server, tests/scripts/ckpt_kill_job.py, a hard
timeout each; the checkpoint of a real job after step 5, one part forged and the indexes
given its true sha256, as a forger would): a worker file without one parameter's weight (a
model with one more parameter than saved: a KeyError before), with ``schedule`` None (a
TypeError before), a directory in place of the worker file, a rule state (the mirror's
momentum) of another shape, a float64 weight (no silent cast), a server file whose chunk
weight has one element less than registered. Each makes ``load_states`` raise the same ValueError on every worker,
naming the file and the field, with nothing changed: the job then trains from step 0 bit
for bit as a job whose load found no file (no half-apply anywhere). And a server that refuses
the apply after every check passed (worker 0 sends it another save id) makes every worker raise,
not only worker 0 (before, worker 1 waited in the barrier until the job's timeout).

Offline: the worker file's arrays and AMP fields, the collective apply on a stand-in store,
and a server's check of every field of its file (weight dtype and size, counters, storage
type, optimizer states of another shape or chunk) with nothing changed, and its apply of the
objects it validated even when the file is gone by then. (A PermissionError case is not run: the tests run as root, which reads any file.)
"""
import json
import os
import re
import types

import numpy as np
import pytest

import mxdelay  # noqa: F401
import mxnet as mx

from kvstore_ext.checkpoint import files
from kvstore_ext.worker import store_checkpoint
from kvstore_ext.protocol.keys import KeyLayout
from mxdelay import worker_state
from test_checkpoint_format import (BASE, copy_parts, histories, install, load_outcome,
                                    one_round, registered_server, rehash, run_ckpt_job)


@pytest.fixture(scope='module')
def fresh(tmp_path_factory):
    """A job of 6 steps that saves after step 5 (the checkpoint the cases forge)."""
    out = tmp_path_factory.mktemp('fresh')
    run_ckpt_job(out, dict(BASE, steps=6, save_after=[5]))
    return out


@pytest.fixture(scope='module')
def untouched(tmp_path_factory):
    """What a refused load must leave: a job whose load_states found no file at all (so it
    read nothing) and then trained 6 steps. (Not a job that never called load_states: that
    one says hello at its first step, with rescale_grad 1/batch; load_states says it before,
    with 1.0, and gradients are scaled relative to it: the last bits differ, 2e-7.)"""
    out = tmp_path_factory.mktemp('untouched')
    run_ckpt_job(out, dict(BASE, steps=6, save_after=[], train_after_refusal=True,
                           resume_from=str(out / 'no-such-checkpoint')))
    assert 'does not exist' in load_outcome(out, 0)['message']
    return out


def forge(path, kind, change):
    """Rewrite the archive `path` with `change(body)` applied, keeping its save id."""
    with np.load(path) as archive:
        save_id = json.loads(archive['header'].tobytes().decode())['save_id']
    body = files.read_archive(path, kind)
    change(body)
    files.write_archive(path, kind, body, save_id)


def drop_weight(body):
    del body['weights'][max(body['weights'])]


def no_schedule(body):
    body['schedule'] = None


def bad_rule_state(body):
    # (The mirror keeps no pre_weight: it does not read grad_sync, docs/design.md §2.3.)
    assert body['pre_weight'] == {}
    index = min(body['rule_state'])
    body['rule_state'][index] = body['rule_state'][index][:1]


def float64_weight(body):
    body['weights'][0] = body['weights'][0].astype(np.float64)


def short_server_weight(body):
    chunk = min(body['chunks'])
    body['chunks'][chunk]['weight'] = body['chunks'][chunk]['weight'][:-1]


CASES = {
    'one_more_parameter': ('.worker1', files.WORKER, drop_weight,
                           r'field weights holds parameters \[0, 1, 2\], this trainer has 4'),
    'missing_field': ('.worker1', files.WORKER, no_schedule,
                      r'\(TypeError: '),
    'directory': ('.worker1', None, None, r'cannot be read \(\[Errno 21\] Is a directory'),
    'rule_state_shape': ('.worker1', files.WORKER, bad_rule_state, r'field rule_state\['),
    'weight_dtype': ('.worker1', files.WORKER, float64_weight,
                     r'field weights\[0\]: parameter .* is float32 .*, saved float64'),
    'server_weight_size': ('.kvstore.server0', files.SERVER, short_server_weight,
                           r"field 'weight' has \d+ elements, the registered chunk \d+"),
}


@pytest.mark.jobs
@pytest.mark.parametrize('case', sorted(CASES))
def test_a_bad_part_refuses_the_load_on_every_worker_and_changes_nothing(tmp_path, fresh,
                                                                        untouched, case):
    part, kind, change, pattern = CASES[case]
    prefix = str(tmp_path / 'ckpt')
    copy_parts(str(fresh / 'ckpt' / 'latest'), prefix)
    if change is None:
        os.remove(prefix + part)
        os.mkdir(prefix + part)
    else:
        forge(prefix + part, kind, change)
        rehash(prefix)
    out = tmp_path / 'job'
    run_ckpt_job(out, dict(BASE, steps=6, save_after=[], resume_from=prefix,
                           train_after_refusal=True))
    for rank in range(2):
        outcome = load_outcome(out, rank)
        assert outcome['type'] == 'ValueError', (rank, outcome)
        assert outcome['message'].startswith('cannot load'), outcome
        assert 'nothing was changed' in outcome['message']
        assert prefix + part in outcome['message'], outcome
        assert re.search(pattern, outcome['message']), (pattern, outcome['message'])
    # Nothing applied anywhere: the job trains from step 0 exactly as one that read nothing.
    got, expected = histories(out), histories(untouched)
    for rank in range(2):
        assert int(got[rank]['first']) == 0
        for name in expected[rank]:
            np.testing.assert_array_equal(got[rank][name], expected[rank][name],
                                          err_msg='worker %d %s' % (rank, name))


@pytest.mark.jobs
def test_a_server_that_refuses_the_apply_makes_every_worker_raise(tmp_path, fresh):
    out = tmp_path / 'job'
    run_ckpt_job(out, dict(BASE, steps=6, save_after=[], break_apply=True,
                           resume_from=str(fresh / 'ckpt' / 'latest')))
    for rank in range(2):
        outcome = load_outcome(out, rank)
        assert outcome['type'] == 'ValueError', (rank, outcome)
        assert 'the servers could not apply' in outcome['message'], outcome
        assert 'belongs to save' in outcome['message'] and 'restart the job' in \
            outcome['message'], outcome


# -- offline -------------------------------------------------------------------------------
class Param(object):
    def __init__(self, name, shape, dtype='float32'):
        self.name, self.shape, self.dtype = name, shape, dtype


def body(**changes):
    state = {'weights': {0: np.zeros((2, 3), np.float32)}, 'pre_weight': {},
             'pulled': {}, 'rule_state': {0: (np.zeros((2, 3), np.float32), None)}}
    state.update(changes)
    return state


@pytest.mark.parametrize('state,pattern', [
    (body(weights={0: np.zeros((3, 2), np.float32)}), r'weights\[0\]: parameter p is float32 '
                                                     r'\(2, 3\), saved float32 \(3, 2\)'),
    (body(weights={0: [1.0]}), r'saved a list'),
    (body(pulled={0: np.zeros((2, 3), np.float16)}), r'field pulled\[0\]'),
    (body(pulled={1: np.zeros((2, 3), np.float32)}), r'field pulled holds parameter 1'),
    (body(rule_state={0: (np.zeros(6, np.float32),)}), r'field rule_state\[0\]'),
    (body(pre_weight=None), r'field pre_weight is None'),
])
def test_worker_arrays_are_checked(state, pattern):
    with pytest.raises(ValueError, match=pattern):
        worker_state._check_arrays('f.worker0', state, [Param('p', (2, 3))])  # pylint: disable=W0212


@pytest.mark.parametrize('saved,pattern', [
    (None, 'field amp.scaler'), ({'scaler': {}, 'overflows': {}}, 'field amp.scaler'),
    ({'scaler': {'loss_scale': 1.0, 'next_loss_scale': 1.0, 'max_loss_scale': 2.0,
                 'scale_seq_len': 2000, 'unskipped': 0}, 'overflows': {'applied': -1,
                                                                      'skipped': 0}},
     'field amp.overflows')])
def test_amp_state_is_checked(saved, pattern):
    with pytest.raises(ValueError, match=pattern):
        worker_state._check_amp('f.worker0', saved)  # pylint: disable=protected-access


class Store(store_checkpoint.StoreCheckpoint):
    """What ``StoreCheckpoint.apply_states`` uses of its session and job: rank 0's LOAD fails
    on a server."""

    def __init__(self, rank, failures):
        session = types.SimpleNamespace(rank=rank, optimizer=None, command=self._command)
        super(Store, self).__init__(session, types.SimpleNamespace(agree=self.agree))
        self._failures, self.votes, self.restored = failures, [], False

    def _command(self, command, body):
        raise RuntimeError('mxdelay server 1: load failed: it broke')

    def agree(self, error):
        self.votes.append(error)
        return self._failures

    def _restore_job_index(self, state):
        self.restored = True


@pytest.mark.parametrize('rank', [0, 1])
def test_apply_is_collective(rank):
    failures = [(0, 'mxdelay server 1: load failed: it broke')]
    store = Store(rank, failures)
    state = {'load': {}, 'rounds': {}, 'servers': ['/x/ckpt.kvstore.server0']}
    with pytest.raises(ValueError, match=r'the servers could not apply /x/ckpt.kvstore after '
                                         r'validating it: worker 0: mxdelay server 1'):
        store.apply_states(state)
    assert store.votes == ([failures[0][1]] if rank == 0 else [None])
    assert not store.restored


def saved_server(tmp_path):
    """A registered offline server after one SGD-momentum round, and the file it saved."""
    server = registered_server()
    install(server, mx.optimizer.create('sgd', learning_rate=0.1, momentum=0.9))
    one_round(server)
    path = str(tmp_path / 'ckpt.server0')
    server.command('save', {'paths': [path], 'save_id': 's'})
    return server, path


@pytest.mark.parametrize('change,pattern', [
    (lambda b: b['chunks'][0].update(weight=b['chunks'][0]['weight'].astype(np.int32)),
     "field 'weight' is int32, not a float array"),
    (lambda b: b['chunks'][0].update(weight=b['chunks'][0]['weight'].astype(np.float64)),
     r"field 'weight' is float64 \(3,\), this server holds float32 \(3,\) \(no silent cast\)"),
    (lambda b: b['chunks'][0].update(next_round=-1), "field 'next_round' must be an integer"),
    (lambda b: b['chunks'][0].update(stype='csr'), "field 'stype' is 'csr'"),
    (lambda b: b['updater']['states'].update({0: mx.nd.zeros(2)}),
     r"chunk 0's optimizer state has an array of shape \(2,\), its weight \(3,\)"),
    (lambda b: b['updater']['states'].update({5: None}), 'a state of chunk 5'),
    (lambda b: b.pop('chunks'), "field 'chunks' is missing"),
])
def test_a_server_checks_every_field_before_it_applies(tmp_path, change, pattern):
    server, path = saved_server(tmp_path)
    before = server.weight(0).asnumpy().copy()
    forge(path, files.SERVER, change)
    for check_only in (True, False):
        with pytest.raises(ValueError, match=pattern):
            server.command('load', {'rank': 0, 'paths': [path], 'check_only': check_only})
    np.testing.assert_array_equal(server.weight(0).asnumpy(), before)
    assert server.applied_rounds(0) == 1


def test_a_server_applies_the_objects_it_validated(tmp_path):
    server, path = saved_server(tmp_path)
    saved = server.weight(0).asnumpy().copy()
    (tmp_path / 'other').mkdir()
    other = saved_server(tmp_path / 'other')[0]
    other.complete_round(KeyLayout(1, 2).slot_key(0, 1, 0), mx.nd.array([9.0, 9.0, 9.0]),
                         other.weight(0))   # its round 1: it differs from the file now
    body = {'rank': 0, 'paths': [path], 'save_id': 's'}
    assert other.command('load', dict(body, check_only=True))['valid']
    # The file is gone between check and apply: the apply takes what was validated.
    os.remove(path)
    assert other.command('load', body) == {'path': path, 'chunks': 1}
    np.testing.assert_array_equal(other.weight(0).asnumpy(), saved)
    assert other.applied_rounds(0) == 1
