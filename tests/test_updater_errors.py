"""What a server does when a user-defined optimizer's update raises (docs/design.md §3.2),
in real jobs against stock MXNet, and how such an optimizer reaches mxdelay's servers.

The optimizer (tests/scripts/user_optimizer.py) adds the gradient, then raises on row_sparse
weights, as MXNet's own ``Test`` optimizer does in MXNet's nightly kvstore test. Each job
(tests/scripts/updater_errors_job.py: 2 workers, 1 server, 3 rounds) trains a dense key and
a row_sparse key ``'emb'``:

- stock MXNet (its store and servers): the server prints each error and goes on; every
  round's update stands (it was written before the error). Its weights are asserted in
  closed form;
- 'dist_delay' by default: the job ends (the server exits 3) with the error, naming the
  optimizer, the parameter and the round;
- 'dist_delay' with ``MXDELAY_UPDATER_ERRORS=log``: the server logs each error and goes on,
  and every worker's weights equal stock's exactly;
- the servers know the optimizer only through ``MXDELAY_SERVER_IMPORTS`` (a server runs none
  of the script): without it the worker is told so; a module that cannot be imported stops
  the job naming it. On an offline server: the refusal names an unknown optimizer, or an
  unknown learning-rate scheduler, and the fix.
"""
import os
import sys

import mxnet as mx
import pytest

from kvstore_ext.optim import optimizers
from kvstore_ext.protocol import commands
from kvstore_ext.protocol.commands import Command
from kvstore_ext.server.controller import DelayServer
from support.jobs import SCRIPTS, JobResult, assert_ok, kv_results, run_job, stock_env

JOB = os.path.join(SCRIPTS, 'updater_errors_job.py')
ROUNDS = 3
NUM_WORKERS = 2
#: The weights after ROUNDS rounds with every update applied (rescale_grad 0.5, ones at
#: first; worker r pushes r + 1 + t in round t, into row r of 'emb').
EXPECTED_DENSE = [[1 + 0.5 * sum(r + 1 + t for r in range(NUM_WORKERS) for t in range(ROUNDS))]
                  * 3] * 4
EXPECTED_EMB = [[1 + 0.5 * sum(r + 1 + t for t in range(ROUNDS))] * 3 if r < NUM_WORKERS
                else [1.0] * 3 for r in range(4)]


def _job(store, env):
    return run_job([sys.executable, JOB, store, str(ROUNDS)], num_workers=NUM_WORKERS,
                   num_servers=1, env=env, timeout=120)


def _output(result: JobResult):
    return result.stdout + result.stderr


def _failed(env):
    """The output of a 'dist_delay' job with `env` that must fail."""
    result = _job('dist_delay', env)
    assert result.returncode != 0, _output(result)
    return _output(result)


@pytest.fixture(scope='module')
def stock():
    result = _job('dist_sync', stock_env())
    assert_ok(result)
    # MXNet's server printed each round's error of 'emb' and went on.
    assert _output(result).count('TypeError: FailsOnRowSparse does not take row_sparse '
                                 'weights') == ROUNDS
    return kv_results(result)


@pytest.mark.jobs
def test_stock_mxnet_goes_on_with_each_round_as_far_as_the_update_got(stock):
    assert sorted(stock) == list(range(NUM_WORKERS))
    for data in stock.values():
        assert data['dense'] == EXPECTED_DENSE
        assert data['emb'] == EXPECTED_EMB


@pytest.mark.jobs
def test_by_default_the_job_ends_naming_the_optimizer_the_parameter_and_the_round():
    output = _failed({'MXDELAY_SERVER_IMPORTS': 'user_optimizer'})
    assert 'server 0 exited with code 3' in output, output
    assert ("optimizer FailsOnRowSparse raised on chunk 2 (parameter 'emb') in round 0: "
            'TypeError: FailsOnRowSparse does not take row_sparse weights' in output), output
    assert 'MXDELAY_UPDATER_ERRORS=log' in output


@pytest.mark.jobs
def test_with_log_the_server_goes_on_as_mxnets_does(stock):
    result = _job('dist_delay', {'MXDELAY_SERVER_IMPORTS': 'user_optimizer',
                                 'MXDELAY_UPDATER_ERRORS': 'log'})
    assert_ok(result)
    output = _output(result)
    for t in range(ROUNDS):
        assert ("optimizer FailsOnRowSparse raised on chunk 2 (parameter 'emb') in round %d; "
                'going on (MXDELAY_UPDATER_ERRORS=log)' % t in output), output
    assert output.count('TypeError: FailsOnRowSparse does not take row_sparse weights') == ROUNDS
    results = kv_results(result)
    assert sorted(results) == list(range(NUM_WORKERS))
    for rank, data in results.items():
        assert data == stock[rank]


@pytest.mark.jobs
def test_a_user_defined_optimizer_needs_server_imports():
    output = _failed({'MXDELAY_UPDATER_ERRORS': 'log'})
    assert ("server 0 does not know optimizer 'failsonrowsparse': it is not registered in the "
            'server, which runs none of the training script; name the module that registers it '
            'in MXDELAY_SERVER_IMPORTS' in output), output


@pytest.mark.jobs
def test_a_server_import_that_fails_stops_the_job_naming_the_module():
    output = _failed({'MXDELAY_SERVER_IMPORTS': 'user_optimizer, no_such_module'})
    assert ("MXDELAY_SERVER_IMPORTS names module 'no_such_module', which this server cannot "
            "import (No module named 'no_such_module'); put its folder on the servers' "
            'PYTHONPATH' in output), output


class _OnlyOnWorkers(mx.optimizer.SGD):
    """An optimizer the workers registered and the server does not know."""


class _OnlyOnWorkersScheduler(mx.lr_scheduler.FactorScheduler):
    """A learning-rate scheduler the workers registered and the server does not know."""


@pytest.mark.parametrize('kind, name', [('optimizer', "'_onlyonworkers'"),
                                        ('learning-rate scheduler', "'_OnlyOnWorkersScheduler'")])
def test_a_server_names_what_it_does_not_know_and_the_fix(monkeypatch, kind, name):
    registry = mx.optimizer.Optimizer.opt_registry
    monkeypatch.setitem(registry, '_onlyonworkers', _OnlyOnWorkers)
    monkeypatch.setitem(optimizers._LR_SCHEDULERS, '_OnlyOnWorkersScheduler',  # pylint: disable=protected-access
                        _OnlyOnWorkersScheduler)
    sent = commands.encode_optimizer(_OnlyOnWorkers(
        learning_rate=0.1, lr_scheduler=_OnlyOnWorkersScheduler(step=2)))
    # The server's process: what the workers registered is not there.
    if kind == 'optimizer':
        monkeypatch.delitem(registry, '_onlyonworkers')
    else:
        monkeypatch.delitem(optimizers._LR_SCHEDULERS, '_OnlyOnWorkersScheduler')  # pylint: disable=protected-access
    server = DelayServer.offline(rank=0, num_workers=1)
    with pytest.raises(ValueError, match=r"^server 0 does not know %s %s: it is not registered in "
                                         r"the server, which runs none of the training script; "
                                         r"name the module that registers it in "
                                         r"MXDELAY_SERVER_IMPORTS in the servers' environment$"
                                         % (kind, name)):
        server.command(Command.OPTIMIZER, {'rank': 0, 'optimizer': sent})
    assert server.optimizer is None
