"""Forged commands to mxdelay's server are refused, and the server stays up (issue 22 item 2,
docs/design.md §4.1).

What is tested, on the server's offline surface (``DelayServer.offline``) through its real
controller (the function MXNet calls, replies written into the status key) and in a real job
(tests/scripts/forged_commands_job.py, a hard timeout): a pickled object as a raw command (a
"bomb" whose unpickling creates a file: it is not created; with the server's own
``MXDELAY_ALLOW_PICKLE=1`` a stock client's pickled optimizer is served as before), the old
base64 pickle in an OPTIMIZER body, SAVE and LOAD paths that are not this server's own
``<index>.server<j>`` (nothing is written), NaN / inf / negative / string learning rates (the
rate is unchanged), claimed ranks outside the job (no reply segment is written), a second
hello or a second vote for one rank, ``slots=0`` and other out-of-range hello fields, bad
REGISTER entries. Each gets an error reply naming the field, and a good command afterwards
is answered.
"""
import json
import os
import pickle
import re
import sys

import numpy as np
import pytest

import mxdelay  # noqa: F401
import mxnet as mx

from kvstore_ext.protocol import commands
from kvstore_ext.protocol.keys import KeyLayout
from kvstore_ext.protocol.commands import Command
from kvstore_ext.server.controller import DelayServer
from support.jobs import PidFile, assert_ok, run_job, worker_lines

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, 'scripts', 'forged_commands_job.py')


class Bomb(object):
    """Unpickling it creates the file `marker` (what a forged command would do)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, 'w'))


def hello(rank, **fields):
    return dict({'rank': rank, 'protocol': commands.PROTOCOL_VERSION, 'slots': 2,
                 'config': {}}, **fields)


class Served(object):
    """An offline server of a 2-worker job after its hand-shake, driven through its real
    controller; ``send`` returns each worker's decoded reply segment."""

    def __init__(self, num_workers=2):
        self.server = DelayServer.offline(rank=0, num_workers=num_workers)
        self.controller = self.server._controller()  # pylint: disable=protected-access
        for rank in range(num_workers):
            self.controller(0, self.text(Command.HELLO, hello(rank)), None)
        length = commands.reply_len(num_workers) * num_workers
        self.status = mx.nd.zeros(length)
        self.server.complete_round(KeyLayout(1, 2).status_key(0), mx.nd.zeros(length),
                                   self.status)
        self.num_workers = num_workers
        self.controller(0, self.text(Command.REGISTER,
                                     {'rank': 0, 'chunks': [[0, 0, 0, 'w', 1.0, 1.0, 3]]}),
                        None)
        self.controller(0, self.text(Command.OPTIMIZER, {
            'rank': 0, 'optimizer': commands.encode_optimizer(
                mx.optimizer.SGD(learning_rate=0.5))}), None)

    @staticmethod
    def text(command, body):
        return commands.encode_command(command, body).encode('utf-8')

    def segments(self):
        length = commands.reply_len(self.num_workers)
        status = self.status.asnumpy()
        return [commands.decode_reply(status[r * length:(r + 1) * length])
                for r in range(self.num_workers)]

    def send(self, raw):
        self.controller(0, raw, None)   # must not raise: MXNet calls it through ctypes
        return self.segments()

    def command(self, command, body, rank=0, seq=7):
        return self.send(self.text(command, dict(body, rank=rank, seq=seq)))[rank]

    def assert_up(self, seq=99):
        ok, payload, got = self.command(Command.STATS, {}, seq=seq)
        assert ok and got == seq and payload['chunks'] == {'0': {'rounds': 0, 'held': 0}}


@pytest.fixture
def served():
    return Served()


def test_a_pickled_object_is_refused_unread(served, tmp_path, monkeypatch):
    monkeypatch.delenv('MXDELAY_ALLOW_PICKLE', raising=False)
    marker = tmp_path / 'marker'
    for protocol_number in (0, 4):
        served.send(pickle.dumps(Bomb(str(marker)), protocol_number))
    assert not marker.exists()
    served.assert_up()
    # The old OPTIMIZER body (a base64 pickle of a bomb) is refused as well, unread.
    import base64
    old = base64.b64encode(pickle.dumps(Bomb(str(marker)))).decode('ascii')
    ok, payload, seq = served.command(Command.OPTIMIZER, {'optimizer': old}, seq=8)
    assert (ok, seq) == (False, 8)
    assert "command field 'optimizer' must be a JSON object" in payload
    assert not marker.exists()
    assert served.server.optimizer.learning_rate == 0.5
    served.assert_up()


def test_a_stock_clients_pickle_without_the_opt_in_stops_its_rounds(monkeypatch):
    monkeypatch.delenv('MXDELAY_ALLOW_PICKLE', raising=False)
    server = DelayServer.offline(rank=0, num_workers=1)
    controller = server._controller()  # pylint: disable=protected-access
    controller(0, pickle.dumps(mx.optimizer.SGD(learning_rate=0.1), 0), None)  # logged
    # Its rounds would apply gradients as weights: the server stops instead (the native
    # updater ends the process; offline, complete_round raises).
    with pytest.raises(RuntimeError, match='MXDELAY_ALLOW_PICKLE=1'):
        server.complete_round(3, mx.nd.ones(2), mx.nd.zeros(2))


def test_a_stock_clients_pickle_with_the_opt_in_is_served_as_mxnet_does(monkeypatch):
    monkeypatch.setenv('MXDELAY_ALLOW_PICKLE', '1')
    server = DelayServer.offline(rank=0, num_workers=1)
    controller = server._controller()  # pylint: disable=protected-access
    controller(0, pickle.dumps(mx.optimizer.SGD(learning_rate=0.1), 0), None)
    stored = mx.nd.ones(2)
    server.complete_round(3, mx.nd.ones(2), stored)
    np.testing.assert_array_equal(stored.asnumpy(), np.float32([0.9, 0.9]))  # 1 - 0.1 * 1


@pytest.mark.parametrize('paths', [
    ['/etc/passwd'], ['{dir}/ckpt'], ['{dir}/ckpt.server1'], ['relative.server0'],
    ['{dir}/.server0'], ['{dir}/a.server0', '{dir}/b.server1'], [], 'x.server0', [3]])
def test_save_and_load_touch_only_this_servers_own_file(served, tmp_path, paths):
    if isinstance(paths, list):
        paths = [p.format(dir=tmp_path) if isinstance(p, str) else p for p in paths]
    before = sorted(os.listdir(str(tmp_path)))
    for command in (Command.SAVE, Command.LOAD):
        ok, payload, _ = served.command(command, {'paths': paths})
        assert not ok
        assert "command field 'paths' must" in payload, payload
    assert sorted(os.listdir(str(tmp_path))) == before   # nothing written
    served.assert_up()
    ok, payload, _ = served.command(Command.SAVE, {'paths': [str(tmp_path / 'ckpt.server0')]})
    assert ok and payload['path'] == str(tmp_path / 'ckpt.server0')


@pytest.mark.parametrize('lr', [float('nan'), float('inf'), -float('inf'), -0.1, '0.1', True,
                                None, [0.1]])
def test_set_hyper_refuses_a_bad_learning_rate(served, lr):
    ok, payload, _ = served.command(Command.SET_HYPER, {'lr': lr})
    if lr is None:   # no lr: a query, answered
        assert ok and payload == {'lr': 0.5}
        return
    assert not ok and "command field 'lr' must" in payload, payload
    assert served.server.optimizer.learning_rate == 0.5
    ok, payload, _ = served.command(Command.SET_HYPER, {'lr': 0.25})
    assert ok and payload == {'lr': 0.25}


@pytest.mark.parametrize('rank', [-1, 2, 10 ** 6, '0', 0.0, None])
def test_a_rank_outside_the_job_gets_no_reply_segment(served, rank):
    before = served.segments()
    segments = served.send(Served.text(Command.STATS, {'rank': rank, 'seq': 55}))
    assert segments == before     # neither another worker's segment nor past them
    served.assert_up()


def test_a_rank_that_votes_twice_is_refused(served):
    ok, _, _ = served.command(Command.VOTE, {'ballot': 1, 'error': None}, rank=1)
    assert ok
    ok, payload, _ = served.command(Command.VOTE, {'ballot': 1, 'error': 'forged'}, rank=1)
    assert not ok and 'worker rank 1 has already voted on ballot 1' in payload
    for body, pattern in [({'ballot': 0, 'error': None}, "'ballot' must be >= 1"),
                          ({'ballot': '1', 'error': None}, "'ballot' must be an integer"),
                          ({'ballot': 1, 'error': 5}, "'error' must be a string")]:
        ok, payload, _ = served.command(Command.VOTE, body)
        assert not ok and pattern in payload, payload
    # The first vote stands: worker 0's vote completes the ballot without 'forged'.
    assert served.command(Command.VOTE, {'ballot': 1, 'error': None})[0]
    ok, payload, _ = served.command(Command.TALLY, {'ballot': 1})
    assert ok and payload == {'errors': {}, 'more': 0}
    # A vote must name its rank (without one it is refused; there is no segment to answer).
    with pytest.raises(ValueError, match="command field 'rank' is missing"):
        served.server.command(Command.VOTE, {'ballot': 2, 'error': None})


@pytest.mark.parametrize('fields,pattern', [
    ({'slots': 0}, "'slots' must be >= 1, got 0"),
    ({'slots': -2}, "'slots' must be >= 1"),
    ({'slots': 10 ** 9}, "'slots' must be <= 1024"),
    ({'slots': '2'}, "'slots' must be an integer"),
    ({'slots': 2.0}, "'slots' must be an integer"),
    ({'state_keys': -1}, "'state_keys' must be >= 0"),
    ({'rank': -1}, "'rank' must be >= 0"),
    ({'rank': 2}, "'rank' must be <= 1"),
    ({'num_workers': 3}, "'num_workers' is 3, this job has 2 workers"),
    ({'config': []}, "'config' must be a JSON object"),
    ({'config': {'optimizer': 'sgd'}}, "'optimizer' must be a JSON object"),
    ({'pull_keys': '2'}, "'pull_keys' must be an integer"),
    ({'pull_keys': -1}, "'pull_keys' must be >= 0"),
])
def test_a_bad_hello_is_refused_before_it_changes_anything(fields, pattern):
    server = DelayServer.offline(rank=0, num_workers=2)
    with pytest.raises(ValueError, match=pattern):
        server.command(Command.HELLO, dict(hello(0), **fields))
    assert server._handshake.layout is None and server._handshake._hellos == {}  # pylint: disable=protected-access
    server.command(Command.HELLO, hello(0))
    with pytest.raises(ValueError, match='worker rank 0 said hello twice'):
        server.command(Command.HELLO, hello(0))


@pytest.mark.parametrize('version', [4, 6, None, '5'])
def test_a_hello_of_another_protocol_version_is_refused(version):
    # 4 is the version before the hello's pull_keys: such a worker and this server would
    # silently disagree on the keys of compressed pulls.
    assert commands.PROTOCOL_VERSION == 5
    server = DelayServer.offline(rank=0, num_workers=2)
    message = ('worker 1 speaks protocol %r, server 0 speaks 5: install the same mxdelay '
               'version everywhere' % version)
    with pytest.raises(ValueError) as refused:
        server.command(Command.HELLO, hello(1, protocol=version))
    assert str(refused.value) == message
    assert server._handshake._hellos == {}  # pylint: disable=protected-access
    # The hand-shake round tells every worker, also those whose hello was good.
    server.command(Command.HELLO, hello(0))
    assert server.handshake_reply() == (False, message)


def test_slots_0_through_the_controller_leaves_the_server_up():
    server = DelayServer.offline(rank=0, num_workers=1)
    controller = server._controller()  # pylint: disable=protected-access
    controller(0, Served.text(Command.HELLO, hello(0, slots=0)), None)   # logged, no crash
    controller(0, Served.text(Command.HELLO, hello(0)), None)
    assert server.handshake_reply()[0]


@pytest.mark.parametrize('entry,pattern', [
    ([0, 0, 0, 'w', 1.0, 1.0, -5], "'size' must be >= 1"),
    ([0, 0, 0, 'w', float('nan'), 1.0, 3], "'lr_mult' must be finite"),
    ([-1, 0, 0, 'w', 1.0, 1.0, 3], "'chunk_id' must be >= 0"),
    ([0, 0, 1.5, 'w', 1.0, 1.0, 3], "'param_index' must be an integer"),
    ([0, 0, 0, 7, 1.0, 1.0, 3], "'name' must be a string"),
])
def test_register_refuses_bad_entries(entry, pattern):
    server = DelayServer.offline(rank=0, num_workers=1)
    server.command(Command.HELLO, hello(0))
    with pytest.raises(ValueError, match=pattern):
        server.command(Command.REGISTER, {'chunks': [entry]})
    assert len(server._chunks) == 0  # pylint: disable=protected-access


def test_load_fields_are_checked(served, tmp_path):
    path = str(tmp_path / 'ckpt.server0')
    assert served.command(Command.SAVE, {'paths': [path]})[0]
    for body, pattern in [({'version': 3}, "'version' must be 2 or 1"),
                          ({'check_only': 1}, "'check_only' must be true or false"),
                          ({'sha256': [5]}, "'sha256' must list strings"),
                          ({'rounds': {'0': -1}}, "field '0' must be >= 0"),
                          ({'finish_rounds': 'x'}, "'finish_rounds' must be an integer")]:
        ok, payload, _ = served.command(Command.LOAD, dict(body, paths=[path]))
        assert not ok and pattern in payload, (body, payload)
    ok, payload, _ = served.command(Command.LOAD, {'paths': [path]})
    assert ok and payload == {'path': path, 'chunks': 1}


@pytest.mark.jobs
def test_forged_commands_in_a_real_job_are_refused_and_the_job_trains_on(tmp_path):
    pids = PidFile(tmp_path / 'pids')
    result = run_job(pids.wrap([sys.executable, SCRIPT, str(tmp_path)]), num_workers=2,
                     timeout=75, extra_launcher_args=('--timeout', '60'))
    pids.assert_all_dead()
    assert_ok(result)
    assert not (tmp_path / 'marker').exists()                  # the pickle was not loaded
    assert not any(name.startswith('outside') for name in os.listdir(str(tmp_path)))
    outcome = [json.load(open(str(tmp_path / ('worker%d.json' % r)), encoding='utf-8'))
               for r in range(2)]
    replies = outcome[0]['replies']
    expected = {
        'nan_lr': "'lr' must be finite, got nan", 'inf_lr': "'lr' must be finite",
        'negative_lr': "'lr' must be >= 0", 'string_lr': "'lr' must be a number",
        'save_outside': "'paths' must be", 'save_other_server': "'paths' must be",
        'save_relative': "'paths' must be", 'load_outside': "'paths' must be",
        'load_pickle_trusted': 'only with MXDELAY_ALLOW_PICKLE=1',
        'pickled_optimizer_body': "'optimizer' must be a JSON object",
        'hello_slots_0': 'said hello twice', 'hello_again': 'said hello twice',
        'vote_bad_ballot': "'ballot' must be >= 1", 'register_bad_size': "'size' must be >= 1"}
    seqs = {case: 1000 + i for i, case in enumerate(sorted(expected))}
    for case, pattern in expected.items():
        ok, payload, seq = replies[case]
        assert (ok, seq) == (False, seqs[case]), (case, replies[case])
        assert pattern in payload, (case, payload)
    # The claimed ranks outside the job wrote no reply: worker 0's segment still answers
    # the last forged case.
    last = max(seqs.values())
    for case in ('rank_-1', 'rank_2', 'rank_1000000'):
        assert replies[case][2] == last, (case, replies[case])
    # The servers are up and right: lr unchanged (0.5), the round applied once.
    for rank in range(2):
        assert outcome[rank]['lr'] == 0.5
        np.testing.assert_array_equal(outcome[rank]['pulled'], [-1.5] * 4)   # 0 - 0.5 * 3


@pytest.mark.jobs
def test_commands_without_the_jobs_key_are_refused_and_the_job_trains_on(tmp_path):
    # Every process of the job holds MXDELAY_JOB_KEY; worker 0 sends well-formed SET_HYPER
    # commands (lr 0.25) as a process without the key could: unsigned, signed with another
    # key, and a signed one whose body was changed (lr 0.75). Every one is refused with an
    # error reply, the servers stay up, the learning rate stays 0.5 and the next round is
    # exact; the job's own signed commands (hand-shake, optimizer, stats) go through.
    pids = PidFile(tmp_path / 'pids')
    result = run_job(pids.wrap([sys.executable, SCRIPT, str(tmp_path), 'keyed']),
                     num_workers=2, env={'MXDELAY_JOB_KEY': 'a3f1c9e0d2b7'}, timeout=75,
                     extra_launcher_args=('--timeout', '60'))
    pids.assert_all_dead()
    assert_ok(result)
    outcome = [json.load(open(str(tmp_path / ('worker%d.json' % r)), encoding='utf-8'))
               for r in range(2)]
    replies = outcome[0]['replies']
    expected = {'no_key': (3000, 'carries no authenticator'),
                'other_key': (3001, 'does not match its text'),
                'body_changed': (3002, 'does not match its text')}
    for case, (seq, pattern) in expected.items():
        ok, payload, replied_seq = replies[case]
        assert (ok, replied_seq) == (False, seq), (case, replies[case])
        assert pattern in payload and 'refused' in payload, (case, payload)
    assert 'MXDELAY_JOB_KEY is not set' not in result.stderr
    for rank in range(2):
        assert outcome[rank]['lr'] == 0.5
        np.testing.assert_array_equal(outcome[rank]['pulled'], [-1.5] * 4)   # 0 - 0.5 * 3


@pytest.mark.jobs
def test_a_stock_client_without_the_opt_in_ends_its_job_with_the_reason(tmp_path):
    # tests/scripts/sparse_gluon_job.py's stock_client: a stock gluon.Trainer on 'dist_sync'
    # with mxdelay's servers, which sends its optimizer pickled; here the servers are told
    # MXDELAY_ALLOW_PICKLE=0 (the script opts in only where unset).
    from test_sparse_gluon import CASES, JOB
    case = sorted(CASES)[0]
    config = dict(CASES[case], kind='weight', steps=2)
    config.pop('chunk_size', None)
    pids = PidFile(tmp_path / 'pids')
    result = run_job(pids.wrap([sys.executable, JOB, 'stock_client', json.dumps(config),
                                str(tmp_path)]), num_workers=2, timeout=75,
                     env={'MXDELAY_ALLOW_PICKLE': '0'}, extra_launcher_args=('--timeout', '60'))
    pids.assert_all_dead()
    assert result.returncode not in (0, 124), result   # failed, and not by the timeout
    assert 'unpickles only with MXDELAY_ALLOW_PICKLE=1' in result.stderr + result.stdout


@pytest.mark.jobs
def test_workers_of_another_protocol_version_are_refused_in_a_real_job(tmp_path):
    # tests/scripts/old_protocol_job.py: workers whose hello says protocol 3. Every worker
    # raises the server's refusal (before protocol 4 they were told "not mxdelay's server").
    pids = PidFile(tmp_path / 'pids')
    result = run_job(pids.wrap([sys.executable, os.path.join(HERE, 'scripts',
                                                             'old_protocol_job.py')]),
                     num_workers=2, timeout=75, extra_launcher_args=('--timeout', '60'))
    pids.assert_all_dead()
    assert result.returncode not in (0, 124), result   # failed, and not by the timeout
    # The server refuses each worker's hello; each worker raises the refusal, unless the
    # launcher's fail-fast stopped it first when the other worker's error ended the job (a
    # race: the job ends at the first failing worker).
    for rank in range(2):
        assert ('server 0: command failed: worker %d speaks protocol 3, server 0 speaks 5: '
                'install the same mxdelay version everywhere' % rank) in result.stderr, result
    refusal = re.compile(r"^ValueError: mxdelay server 0 refused the hand-shake: worker [01] "
                         r"speaks protocol 3, server 0 speaks 5: install the same mxdelay "
                         r"version everywhere$")
    raised = []
    for rank in range(2):
        lines = worker_lines(result.stderr, rank)
        errors = [line for line in lines if re.match(r'^\w*(Error|Exception):', line)]
        assert all(refusal.search(line) for line in errors), result.stderr
        raised.append(bool(errors))
        assert 'initialised' not in worker_lines(result.stdout, rank)
    assert any(raised), result.stderr
