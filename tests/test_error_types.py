"""Calls that MXNet's kvstore rejects raise ``mx.MXNetError`` on 'dist_delay' too
(kvstore_ext/worker/store_errors.py), each also the Python type a user expects.

The same calls (tests/scripts/bad_calls_job.py) run in a stock job (MXNet's 'dist_sync' and
servers, nothing of mxdelay) and in a 'dist_delay' job, one worker and one server each. Where
stock raises ``MXNetError``, 'dist_delay' must too; a call stock accepts, 'dist_delay'
accepts; where stock raises a Python error (an ``AssertionError``, an ``AttributeError``),
'dist_delay' raises a ``TypeError``. One call is made on 'dist_delay' only: a dense push to a
row_sparse key kills MXNet's server (SIGABRT), and 'dist_delay' refuses it with an
``MXNetError``. The stock job's results are asserted as well, so that a change of MXNet's
behaviour shows here rather than passing unseen.
"""
import json
import os
import sys

import pytest

from support.jobs import SCRIPTS, assert_ok, run_job, stock_env, worker_lines

JOB = os.path.join(SCRIPTS, 'bad_calls_job.py')

#: Calls and what stock 'dist_sync' raises for them (the first class of the exception's MRO
#: that is MXNet's or Python's; None: accepted).
STOCK = {
    'pull_unknown': 'MXNetError',
    'push_unknown': 'MXNetError',
    'row_sparse_pull_unknown': 'MXNetError',
    'init_twice': 'MXNetError',
    'pull_sparse_not_ignored': 'MXNetError',
    'row_sparse_pull_dense_out': 'MXNetError',
    'row_sparse_pull_dense_key': 'MXNetError',
    'pull_wrong_shape': 'MXNetError',
    'push_wrong_shape': None,            # the key's size in another shape: accepted
    'row_sparse_pull_without_row_ids': 'AssertionError',
    'set_optimizer_not_an_optimizer': 'AttributeError',
}
#: Calls made on 'dist_delay' only (MXNet's server dies of them), and the class expected.
DELAY_ONLY = {'push_dense_to_row_sparse': 'MXNetError'}

#: The Python type each call's error must also be on 'dist_delay' (what code catching
#: MXNet's or Python's usual type expects).
ALSO = {'pull_unknown': KeyError, 'push_unknown': KeyError, 'row_sparse_pull_unknown': KeyError,
        'row_sparse_pull_dense_out': TypeError, 'row_sparse_pull_dense_key': TypeError,
        'push_dense_to_row_sparse': TypeError}

#: What each call's message on 'dist_delay' must name: the key (each call has its own) or
#: the argument.
NAMED = {'pull_unknown': 'never_initialised', 'push_unknown': 'never_initialised',
         'row_sparse_pull_unknown': 'never_initialised', 'init_twice': "'twice'",
         'pull_sparse_not_ignored': 'ignore_sparse=False',
         'row_sparse_pull_dense_out': "'rsp_dense_out'",
         'row_sparse_pull_dense_key': "'dense_rsp_pull'", 'pull_wrong_shape': "'pull_shape'",
         'row_sparse_pull_without_row_ids': 'row_ids=',
         'set_optimizer_not_an_optimizer': 'optimizer',
         'push_dense_to_row_sparse': "'rsp_dense_push'"}


def _results(store, calls, env):
    result = run_job([sys.executable, JOB, store] + list(calls), num_workers=1, num_servers=1,
                     env=env, timeout=120)
    assert_ok(result)
    lines = [line for line in worker_lines(result.stdout, 0) if line.startswith('RESULT ')]
    assert len(lines) == 1, result.stdout
    return json.loads(lines[0][len('RESULT '):])


@pytest.fixture(scope='module')
def stock():
    return _results('dist_sync', STOCK, stock_env())


@pytest.fixture(scope='module')
def delay():
    return _results('dist_delay', list(STOCK) + list(DELAY_ONLY), None)


def _classes(result):
    return [] if result is None else result[0]


@pytest.mark.jobs
def test_stock_rejects_these_calls(stock):
    for call, expected in STOCK.items():
        got = stock[call]
        assert (got is None) == (expected is None), (call, got)
        if expected is not None:
            assert expected in _classes(got), (call, got)


@pytest.mark.jobs
@pytest.mark.parametrize('call', sorted(set(STOCK) | set(DELAY_ONLY)))
def test_dist_delay_raises_what_stock_raises(stock, delay, call):
    got = delay[call]
    expected = DELAY_ONLY.get(call) or STOCK[call]
    if expected is None:
        assert got is None, 'stock accepts %s; dist_delay raised %s' % (call, got)
        return
    assert got is not None, 'stock raises %s for %s; dist_delay accepted it' % (expected, call)
    if expected == 'MXNetError':
        assert 'MXNetError' in _classes(got), (call, got)
        if call in ALSO:
            assert ALSO[call].__name__ in _classes(got), (call, got)
    else:
        assert 'TypeError' in _classes(got), (call, got)
    assert NAMED[call] in got[1], (call, got)
