"""A server must apply exactly the optimizer the workers set (issue 6, "a server started with
a different optimizer than the workers expect").

What is tested:

1. ``describe_optimizer``: the update-relevant fields (type, learning rate,
   momentum, wd, rescale_grad, clip_gradient, multi_precision, the lr scheduler's type and
   parameters, an optimizer's own hyper-parameters) and nothing else (update counters); the
   same dict after pickling (what the server sees) and after JSON (what the reply carries);
   ``optimizer_differences`` names each differing field once.
2. mxdelay's server in this process (``DelayServer.offline``: its commands through
   ``command``, its rounds through ``complete_round``, no network): an OPTIMIZER from a worker whose optimizer differs from
   another worker's is refused naming both values; the same one is accepted and the reply
   describes the installed optimizer; the hand-shake refuses workers whose optimizers
   differ; a LOAD whose saved optimizer has another type than the trainer's is refused in
   the check phase and changes nothing, one of the same type passes.
3. The worker's side: ``DistDelay.set_optimizer`` raises ``ValueError`` naming both values
   when the servers' reply describes another optimizer (a ``DistDelay`` whose ``_command``
   answers as a server would).
4. Real jobs (scheduler, server, workers; ``mxdelay-launch`` with hard timeouts; no process
   left): workers with a different momentum or optimizer type fail at start, before any
   step, naming both values; on a bare kvstore (optimizer set after the hand-shake) the
   server refuses the second worker's optimizer; a single worker that sets another optimizer
   after training started is told the server keeps its own; ``set_learning_rate``
   (SET_HYPER) and a new batch size mid-training (scaled on the worker) are not mismatches;
   ``load_states`` of a checkpoint saved with SGD by a trainer using NAG raises ValueError on
   every worker, changes no weight, and training goes on.
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

from support.jobs import PidFile, assert_ok, run_job
from support.stores import started_store
from kvstore_ext.protocol import commands
from kvstore_ext.protocol.keys import KeyLayout
from kvstore_ext.optim.optimizers import describe_optimizer, optimizer_differences
from kvstore_ext.protocol.commands import Command
from kvstore_ext.server.controller import DelayServer

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, 'scripts', 'optimizer_job.py')
JOB_TIMEOUT = 60
LIMIT = ('--timeout', str(JOB_TIMEOUT))
SGD = {'learning_rate': 0.1, 'momentum': 0.9, 'wd': 1e-3}


def sgd(**changes):
    return mx.optimizer.create('sgd', **dict(SGD, **changes))


# -- 1. the description -----------------------------------------------------------------------

def test_description_holds_the_update_fields():
    scheduler = mx.lr_scheduler.FactorScheduler(step=10, factor=0.5)
    described = describe_optimizer(sgd(clip_gradient=5.0, rescale_grad=0.25,
                                       lr_scheduler=scheduler))
    assert described['type'] == 'SGD'
    assert (described['learning_rate'], described['momentum'], described['wd']) == \
        (0.1, 0.9, 1e-3)
    assert (described['clip_gradient'], described['rescale_grad']) == (5.0, 0.25)
    assert described['multi_precision'] is False
    assert described['lr_scheduler']['type'] == 'FactorScheduler'
    assert (described['lr_scheduler']['step'], described['lr_scheduler']['factor']) == (10, 0.5)
    assert 'num_update' not in described and 'count' not in described['lr_scheduler']
    assert json.loads(json.dumps(described)) == described
    assert describe_optimizer(None) is None


def test_description_survives_pickling_and_ignores_update_counters():
    optimizer = sgd(lr_scheduler=mx.lr_scheduler.MultiFactorScheduler([5, 10], 0.5))
    fresh = describe_optimizer(optimizer)
    assert describe_optimizer(pickle.loads(pickle.dumps(optimizer))) == fresh
    optimizer._update_count(0)     # what an update does to the optimizer's bookkeeping
    optimizer.lr_scheduler(1)
    assert describe_optimizer(optimizer) == fresh


@pytest.mark.parametrize('changes,field,values', [
    (dict(momentum=0.5), 'momentum', (0.9, 0.5)),
    (dict(learning_rate=0.2), 'learning_rate', (0.1, 0.2)),
    (dict(wd=0.0), 'wd', (1e-3, 0.0)),
    (dict(rescale_grad=0.5), 'rescale_grad', (1.0, 0.5)),
    (dict(clip_gradient=1.0), 'clip_gradient', (None, 1.0)),
    (dict(multi_precision=True), 'multi_precision', (False, True)),
    (dict(lr_scheduler=mx.lr_scheduler.FactorScheduler(10)), 'lr_scheduler',
     (None, describe_optimizer(sgd(lr_scheduler=mx.lr_scheduler.FactorScheduler(10)))
      ['lr_scheduler'])),
], ids=lambda v: v if isinstance(v, str) else None)
def test_each_update_field_is_a_difference(changes, field, values):
    assert optimizer_differences(describe_optimizer(sgd()),
                                 describe_optimizer(sgd(**changes))) == [(field,) + values]


def test_scheduler_parameters_and_type_are_differences():
    def with_scheduler(scheduler):
        return describe_optimizer(sgd(lr_scheduler=scheduler))
    factor = with_scheduler(mx.lr_scheduler.FactorScheduler(10, 0.5))
    assert optimizer_differences(factor, with_scheduler(
        mx.lr_scheduler.FactorScheduler(10, 0.1))) == [('lr_scheduler.factor', 0.5, 0.1)]
    assert optimizer_differences(factor, with_scheduler(
        mx.lr_scheduler.MultiFactorScheduler([10], 0.5))) == \
        [('lr_scheduler', 'FactorScheduler', 'MultiFactorScheduler')]


def test_another_type_is_one_difference():
    adam = describe_optimizer(mx.optimizer.create('adam', learning_rate=0.1))
    assert optimizer_differences(describe_optimizer(sgd()), adam) == [('type', 'SGD', 'Adam')]
    assert optimizer_differences(describe_optimizer(sgd()), describe_optimizer(sgd())) == []


# -- 2. the server ----------------------------------------------------------------------------

def make_server(num_workers=2):
    return DelayServer.offline(rank=0, num_workers=num_workers)


def hello(server, rank, config, **fields):
    server.command(Command.HELLO, dict({'rank': rank, 'protocol': commands.PROTOCOL_VERSION,
                                       'slots': 2, 'config': config}, **fields))


def optimizer_command(rank, optimizer):
    return {'rank': rank, 'optimizer': commands.encode_optimizer(optimizer)}


def test_server_refuses_a_second_workers_different_optimizer():
    server = make_server()
    reply = server.command(Command.OPTIMIZER, optimizer_command(0, sgd()))
    assert reply == {'optimizer': describe_optimizer(sgd())}
    with pytest.raises(ValueError, match=r"workers disagree on the optimizer: momentum: "
                                         r"worker 0 has 0\.9, worker 1 has 0\.5\. Every worker "
                                         r"must create the same optimizer"):
        server.command(Command.OPTIMIZER, optimizer_command(1, sgd(momentum=0.5)))
    assert server.optimizer.momentum == 0.9          # the refused one was not installed
    with pytest.raises(ValueError, match=r"type: worker 0 has 'SGD', worker 1 has 'NAG'"):
        server.command(Command.OPTIMIZER, optimizer_command(1, mx.optimizer.create('nag', **SGD)))
    assert server.command(Command.OPTIMIZER, optimizer_command(1, sgd())) == reply


def test_every_installed_optimizer_applies_the_jobs_rescale_grad():
    # The hand-shake fixes the job's rescale_grad (worker 0's, 1/6 after its first step);
    # worker 1 joins before any step of its own (rescale_grad still 1.0). Its optimizer is
    # accepted, and installing it keeps 1/6: the arrival order must not decide the update.
    server = make_server()
    for rank, optimizer in enumerate([sgd(rescale_grad=1 / 6.), sgd()]):
        hello(server, rank, {'optimizer': describe_optimizer(optimizer)})
    ok, payload = server.handshake_reply()
    assert ok and payload['rescale_grad'] == 1 / 6.
    server.command(Command.OPTIMIZER, optimizer_command(0, sgd(rescale_grad=1 / 6.)))
    reply = server.command(Command.OPTIMIZER, optimizer_command(1, sgd()))
    assert server.optimizer.rescale_grad == 1 / 6.
    assert reply['optimizer'] == describe_optimizer(sgd(rescale_grad=1 / 6.))
    with pytest.raises(ValueError, match=r"momentum: worker 0 has 0\.9, worker 1 has 0\.5\."):
        server.command(Command.OPTIMIZER, optimizer_command(1, sgd(momentum=0.5, rescale_grad=1 / 6.)))


def test_server_lets_a_worker_replace_its_own_optimizer_before_training():
    server = make_server(num_workers=1)
    server.command(Command.OPTIMIZER, optimizer_command(0, sgd()))
    reply = server.command(Command.OPTIMIZER, optimizer_command(0, sgd(learning_rate=0.5)))
    assert reply['optimizer']['learning_rate'] == 0.5


def test_hand_shake_refuses_workers_with_different_optimizers():
    server = make_server()
    for rank, optimizer in enumerate([sgd(), sgd(momentum=0.5)]):
        hello(server, rank, {'delay': 2, 'optimizer': describe_optimizer(optimizer)},
              launcher_rank=str(1 - rank))
    ok, message = server.handshake_reply()
    assert not ok
    assert re.search(r"workers disagree on the optimizer: momentum: worker 0 \(mxdelay-launch's "
                     r"worker 1\) has 0\.9, worker 1 \(mxdelay-launch's worker 0\) has 0\.5",
                     message), message
    # (A fresh server each: one hello per rank, a second one is refused.)
    # A worker that has not stepped yet (trainer.join() first) still has rescale_grad 1.0.
    for second in (sgd(), sgd(rescale_grad=1 / 6.)):
        server = make_server()
        hello(server, 0, {'delay': 2, 'optimizer': describe_optimizer(sgd())},
              launcher_rank='1')
        hello(server, 1, {'delay': 2, 'optimizer': describe_optimizer(second)},
              launcher_rank='0')
        assert server.handshake_reply()[0]
    with pytest.raises(ValueError, match='worker rank 1 said hello twice'):
        hello(server, 1, {'delay': 2, 'optimizer': describe_optimizer(sgd())},
              launcher_rank='0')


def saved_server_state(tmp_path, optimizer):
    """A server (one chunk, one round applied with `optimizer`) and the state file it saved."""
    server = make_server(num_workers=1)
    hello(server, 0, {})                                       # 1 server, 2 slots
    server.command(Command.REGISTER, {'chunks': [[0, 0, 0, 'w', 1.0, 1.0, 3]]})
    server.command(Command.OPTIMIZER, optimizer_command(0, optimizer))
    server.complete_round(KeyLayout(1, 2).slot_key(0, 0, 0), mx.nd.array([0.5, 0.5, 0.5]),
                          mx.nd.array([1.0, 2.0, 3.0]))    # round 0 from W_0 = [1, 2, 3]
    path = str(tmp_path / 'state.server0')
    server.command(Command.SAVE, {'paths': [path]})
    return server, path


def server_snapshot(server):
    chunks = [int(c) for c in server.stats()['chunks']]
    return (server.optimizer, server.updater, {c: server.applied_rounds(c) for c in chunks},
            {c: server.weight(c).asnumpy().copy() for c in chunks},
            {c: s.asnumpy().copy() for c, s in server.updater.states.items()})


def test_load_check_refuses_a_checkpoint_of_another_optimizer_type_and_changes_nothing(tmp_path):
    _, path = saved_server_state(tmp_path, sgd())
    (tmp_path / 'other').mkdir()
    server, _ = saved_server_state(tmp_path / 'other', mx.optimizer.create('nag', **SGD))
    before = server_snapshot(server)
    body = {'rank': 0, 'paths': [path], 'check_only': True,
            'optimizer': describe_optimizer(server.optimizer)}
    with pytest.raises(ValueError, match=r"%s was saved with optimizer SGD, but the trainer "
                                         r"loading it uses NAG.*Create the trainer with the "
                                         r"checkpoint's optimizer \('sgd'\)" % re.escape(path)):
        server.command(Command.LOAD, body)
    after = server_snapshot(server)
    assert after[0] is before[0] and after[1] is before[1] and after[2] == before[2]
    for a, b in zip(after[3:], before[3:]):
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])


def test_load_check_accepts_the_same_optimizer_type(tmp_path):
    _, path = saved_server_state(tmp_path, sgd())
    (tmp_path / 'other').mkdir()
    server, _ = saved_server_state(tmp_path / 'other', sgd(learning_rate=0.5))
    body = {'rank': 0, 'paths': [path], 'check_only': True,
            'optimizer': describe_optimizer(server.optimizer)}
    assert server.command(Command.LOAD, body) == {'path': path, 'valid': True}
    assert server.optimizer.lr == 0.5                 # check only: nothing replaced yet


# -- 3. the worker ----------------------------------------------------------------------------

def answering_store(installed):
    """A started ``DistDelay`` of one worker whose servers answer OPTIMIZER with `installed`;
    ``store.sent`` lists the commands sent."""
    store, channel = started_store(lambda command, body: {'optimizer':
                                                          describe_optimizer(installed)})
    store.sent = channel.sent
    return store


def test_worker_raises_when_the_server_applies_another_optimizer():
    store = answering_store(installed=sgd())
    with pytest.raises(ValueError, match=r"mxdelay server 0 applies another optimizer than "
                                         r"worker 0 set: momentum: the server has 0\.9, this "
                                         r"worker has 0\.5\. A server keeps the optimizer"):
        store.set_optimizer(sgd(momentum=0.5))
    assert store.sent == [commands.Command.OPTIMIZER]


def test_worker_accepts_the_same_optimizer():
    store = answering_store(installed=sgd())
    store.set_optimizer(sgd())
    assert store.sent == [commands.Command.OPTIMIZER]


def test_worker_ignores_only_the_servers_rescale_grad():
    # The servers apply the job's rescale_grad; the worker scales its pushes relative to it.
    store = answering_store(installed=sgd(rescale_grad=0.25))
    store.set_optimizer(sgd())
    store = answering_store(installed=sgd(rescale_grad=0.25, wd=0.5))
    with pytest.raises(ValueError, match=r"wd: the server has 0\.5, this worker has 0\.001"):
        store.set_optimizer(sgd())


# -- 4. real jobs -----------------------------------------------------------------------------

BASE = {'mode': 'trainer', 'optimizer': 'sgd', 'optimizer_params': SGD, 'steps': 3, 'batch': 6,
        'delay': 2, 'warmup_steps': 1}


def run(tmp_path, config, num_workers=2):
    pids = PidFile(tmp_path / 'pids')
    command = [sys.executable, SCRIPT, json.dumps(config), str(tmp_path)]
    result = run_job(pids.wrap(command), num_workers=num_workers, timeout=JOB_TIMEOUT + 15,
                     extra_launcher_args=LIMIT)
    pids.assert_all_dead()
    return result


def assert_failed_at_start(result, pattern):
    assert result.returncode == 1, result.stderr
    assert re.search(r'mxdelay-launch: worker \d exited with code 1; stopping the job',
                     result.stderr), result.stderr
    assert 'step 0 done' not in result.stdout
    assert re.search(pattern, result.stderr), result.stderr


@pytest.mark.jobs
@pytest.mark.parametrize('override,pattern', [
    ({'optimizer_params': dict(SGD, momentum=0.5)},
     r"momentum: worker 0 \(mxdelay-launch's worker \d\) has (0\.9|0\.5), worker 1 "
     r"\(mxdelay-launch's worker \d\) has (0\.5|0\.9)"),
    ({'optimizer': 'nag'},
     r"type: worker 0 \(mxdelay-launch's worker \d\) has '(SGD|NAG)', worker 1 "
     r"\(mxdelay-launch's worker \d\) has '(NAG|SGD)'"),
], ids=['momentum', 'type'])
def test_workers_with_different_optimizers_fail_at_start(tmp_path, override, pattern):
    # local_rule 'sgd' on both: the default 'mirror' refuses NAG at construction already.
    result = run(tmp_path, dict(BASE, local_rule='sgd', by_launcher_rank={'1': override}))
    assert_failed_at_start(result, r'ValueError: mxdelay server 0 refused the hand-shake: '
                                   r'workers disagree on the optimizer: ' + pattern +
                           r'\. Every worker must create the same optimizer')
    values = set(re.search(pattern, result.stderr).groups())
    assert len(values) == 2, values                  # both values named, one per worker


@pytest.mark.jobs
def test_bare_kvstore_refuses_a_different_optimizer_set_after_the_hand_shake(tmp_path):
    config = {'mode': 'kvstore', 'optimizer': 'sgd', 'optimizer_params': {'learning_rate': 0.1},
              'by_launcher_rank': {'1': {'optimizer': 'adam'}}}
    result = run(tmp_path, config)
    assert_failed_at_start(result, r"ValueError: mxdelay server 0: optimizer failed: workers "
                                   r"disagree on the optimizer: type: worker \d has "
                                   r"'(SGD|Adam)', worker \d has '(Adam|SGD)'")
    assert 'pulled' not in result.stdout


@pytest.mark.jobs
def test_optimizer_set_after_training_started_is_refused_by_the_worker(tmp_path):
    result = run(tmp_path, dict(BASE, reset_optimizer=dict(SGD, momentum=0.5)), num_workers=1)
    assert result.returncode == 1, result.stderr
    assert 'step 2 done' in result.stdout
    assert re.search(r"ValueError: mxdelay server 0 applies another optimizer than worker 0 "
                     r"set: momentum: the server has 0\.9, this worker has 0\.5", result.stderr), \
        result.stderr


@pytest.mark.jobs
def test_learning_rate_and_batch_size_changes_are_not_mismatches(tmp_path):
    # set_learning_rate and a new batch size change the servers' optimizer (SET_HYPER); the
    # optimizer comparison happens only when an optimizer is set, so training goes on.
    config = dict(BASE, steps=6, change_at=2, change_lr=0.05, change_batch=4)
    result = run(tmp_path, config)
    assert_ok(result)
    assert 'step 5 done' in result.stdout


@pytest.mark.jobs
def test_load_states_of_another_optimizer_type_is_refused_and_changes_nothing(tmp_path):
    (tmp_path / 'save').mkdir()
    (tmp_path / 'load').mkdir()
    ckpt = str(tmp_path / 'save' / 'ckpt')
    assert_ok(run(tmp_path / 'save', dict(BASE, save_to=ckpt)))
    result = run(tmp_path / 'load', dict(BASE, optimizer='nag', local_rule='sgd', load_from=ckpt))
    assert_ok(result)                     # the refused load changed nothing; training went on
    assert 'step 2 done' in result.stdout
    for rank in range(2):
        with open(str(tmp_path / 'load' / ('load.worker%d.json' % rank)),
                  encoding='utf-8') as src:
            outcome = json.load(src)
        assert outcome['type'] == 'ValueError', outcome
        assert outcome['weights_unchanged'], outcome
        # The worker's own file says so first (DelayedTrainer); the server's file would too.
        assert re.search(r"cannot load .*nothing was changed: .*%s was saved with optimizer "
                         r"SGD, this trainer uses NAG" % re.escape(ckpt),
                         outcome['message']), outcome
