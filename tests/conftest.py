"""The tests' pytest hooks; pytest loads it first. What the tests share is in
:mod:`support` (tests/support/), one module per concern.

Two kinds of tests (``./dev test -m "not jobs"`` runs the fast kind alone):

- fast, single-process tests: MXNet fakes several devices with ``mx.cpu(0), mx.cpu(1)``,
  and a ``DistDelay`` over an in-process store (support/stores.py) stands in for a job;
- real multi-process jobs (marked ``jobs``, support/jobs.py): scheduler, servers and
  workers over sockets. :func:`support.jobs.run_job` refuses to run in a test that is not
  marked ``jobs``: :func:`pytest_runtest_setup` records the mark before each test.
"""
import mxdelay  # noqa: F401  before any test module imports mxnet, as the job scripts do

from support.jobs import _CURRENT


def pytest_configure(config):
    config.addinivalue_line('markers', 'jobs: runs real multi-process jobs (scheduler, servers, '
                                       'workers); deselect with -m "not jobs"')
    config.addinivalue_line('markers', 'big: needs several GB of memory and minutes; runs only '
                                       'when asked for by name: -m big')
    # pytest-xdist registers it too; registered here so that a run without xdist (-p no:xdist,
    # or a Python without it) does not warn about tests that share a module-scoped job.
    config.addinivalue_line('markers', 'xdist_group(name): pytest-xdist runs the tests of one '
                                       'group in one worker, in order (./dev test: --dist '
                                       'loadgroup)')


def pytest_collection_modifyitems(config, items):
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

