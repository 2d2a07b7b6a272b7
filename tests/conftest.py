"""The tests' pytest hooks; pytest loads it first. What the tests share is in
:mod:`support` (tests/support/), one module per concern.

Two kinds of tests (``./dev test -m "not jobs"`` runs the fast kind alone):

- fast, single-process tests: MXNet fakes several devices with ``mx.cpu(0), mx.cpu(1)``,
  and a ``DistDelay`` over an in-process store (support/stores.py) stands in for a job;
- real multi-process jobs (marked ``jobs``, support/jobs.py): scheduler, servers and
  workers over sockets. :func:`support.jobs.run_job` refuses to run in a test that is not
  marked ``jobs``: :func:`pytest_runtest_setup` records the mark before each test.
"""
import contextlib
import fcntl
import os

import mxdelay  # noqa: F401  before any test module imports mxnet, as the job scripts do
import pytest

from support.jobs import _CURRENT

#: Test modules whose tests share a module-scoped job (a fixture) or module state: under
#: pytest-xdist (``./dev test`` runs 2 workers) one worker runs each of them whole, in order,
#: so that the job runs once (test_example.py's second test also resumes the first's
#: checkpoint, and test_faults.py's table collects every fault's row). Every other test is
#: a unit of its own. test_conftest.py checks that this set names every such module.
SHARED_JOB_MODULES = frozenset(['tests/test_checkpoint_format.py', 'tests/test_codec_kernels.py',
                                'tests/test_docs.py', 'tests/test_error_types.py',
                                'tests/test_example.py', 'tests/test_faults.py',
                                'tests/test_load_atomic.py', 'tests/test_local_rank.py',
                                'tests/test_stock_pin.py', 'tests/test_updater_errors.py',
                                'tests/test_wheel.py'])


def pytest_configure(config):
    config.addinivalue_line('markers', 'jobs: runs real multi-process jobs (scheduler, servers, '
                                       'workers); deselect with -m "not jobs"')
    config.addinivalue_line('markers', 'big: needs several GB of memory and minutes; runs only '
                                       'when asked for by name: -m big')
    config.addinivalue_line('markers', 'alone: asserts on wall time within a few ms; under '
                                       'pytest-xdist no other test runs meanwhile')


def pytest_collection_modifyitems(config, items):
    # pytest-xdist's workers must collect the same ids: an id made from an object's repr
    # ('<... object at 0x...>') differs from process to process and stops the whole suite.
    unstable = [item.nodeid for item in items if ' at 0x' in item.nodeid]
    if unstable:
        raise pytest.UsageError('test ids that differ between processes (give parametrize '
                                'ids=...): %s' % ', '.join(unstable))
    # 'big' tests are left out unless the -m expression names them (-m jobs alone does not).
    if 'big' in (config.getoption('markexpr') or ''):
        return
    big = [item for item in items if item.get_closest_marker('big') is not None]
    if big:
        config.hook.pytest_deselected(items=big)
        items[:] = [item for item in items if item.get_closest_marker('big') is None]


def pytest_runtest_setup(item):
    # Before any of the item's fixtures, module-scoped ones included, are set up.
    _CURRENT['jobs'] = item.get_closest_marker('jobs') is not None


@pytest.fixture(autouse=True)
def _cores(request, tmp_path_factory):
    """Under pytest-xdist, an ``alone`` test runs while no other test does (its bounds, e.g.
    rounds that must not wait take < 50 ms, assume the job has the cores to itself): a
    readers-writer lock over the workers, ``alone`` tests the writers. The writer takes the
    gate first and keeps new readers out until it has the cores, so that it is not starved.
    """
    if 'PYTEST_XDIST_WORKER' not in os.environ:
        yield
        return
    alone = request.node.get_closest_marker('alone') is not None
    shared = tmp_path_factory.getbasetemp().parent   # one folder for every worker
    with contextlib.ExitStack() as stack:
        gate, cores = (stack.enter_context(open(shared / name, 'a', encoding='ascii'))
                       for name in ('gate.lock', 'cores.lock'))
        mode = fcntl.LOCK_EX if alone else fcntl.LOCK_SH
        fcntl.flock(gate, mode)
        fcntl.flock(cores, mode)
        fcntl.flock(gate, fcntl.LOCK_UN)
        yield      # closing the files releases the lock


@pytest.hookimpl(optionalhook=True)   # a hook of pytest-xdist's: unknown to pytest without it
def pytest_xdist_make_scheduler(config, log):
    # xdist's own grouping (--dist loadgroup and the xdist_group mark) rewrites node ids,
    # which pytest 9.2 no longer takes (pytest-xdist issue #1386): the groups silently split.
    # A scope per test, and one per module of SHARED_JOB_MODULES, read from the node id alone.
    if config.getvalue('dist') != 'load':
        return None   # another --dist asked for by name: xdist's own
    from xdist.scheduler import LoadScopeScheduling   # pylint: disable=import-outside-toplevel

    class SharedJobScheduling(LoadScopeScheduling):
        """Like ``--dist load``, but each module of SHARED_JOB_MODULES is one unit."""

        def _split_scope(self, nodeid):
            module = nodeid.split('::', 1)[0]
            return module if module in SHARED_JOB_MODULES else nodeid

    return SharedJobScheduling(config, log)
