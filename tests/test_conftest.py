"""The suite's own set-up (tests/conftest.py): how pytest-xdist splits the tests."""
import ast
import glob
import os

import pytest

import conftest

TESTS = os.path.dirname(os.path.abspath(__file__))


def _shares_state(path):
    """Whether the module at `path` has a fixture of wider scope than a test."""
    with open(path, encoding='utf-8') as src:
        tree = ast.parse(src.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and any(
                keyword.arg == 'scope' and getattr(keyword.value, 'value', 'function')
                != 'function' for keyword in node.keywords):
            return True
    return False


def test_shared_job_modules_are_the_modules_with_wider_fixtures():
    # A module-scoped job split over two xdist workers would run twice, and a test that
    # resumes another's checkpoint would lose it: every such module must be one unit.
    found = {'tests/' + os.path.basename(path)
             for path in glob.glob(os.path.join(TESTS, 'test_*.py')) if _shares_state(path)}
    assert found == conftest.SHARED_JOB_MODULES


class _Config:
    """What pytest-xdist's scheduler reads of a config, for `dist`."""

    def __init__(self, dist):
        self.values = {'dist': dist, 'tx': ['2*popen']}   # what -n 2 sets

    def getvalue(self, name):
        return self.values.get(name)


def test_xdist_runs_a_shared_job_module_as_one_unit_and_other_tests_alone():
    pytest.importorskip('xdist')
    scheduler = conftest.pytest_xdist_make_scheduler(_Config('load'), None)
    split = scheduler._split_scope   # pylint: disable=protected-access
    assert split('tests/test_faults.py::test_a') == split('tests/test_faults.py::test_b[x]') \
        == 'tests/test_faults.py'
    assert split('tests/test_launcher.py::test_a') == 'tests/test_launcher.py::test_a'
    assert split('tests/test_launcher.py::test_b[1]') == 'tests/test_launcher.py::test_b[1]'
    # Another --dist, asked for by name, is xdist's own.
    assert conftest.pytest_xdist_make_scheduler(_Config('loadfile'), None) is None
