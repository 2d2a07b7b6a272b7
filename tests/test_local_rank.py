"""Local rank: what mxdelay-launch gives each worker (MXDELAY_LOCAL_RANK/SIZE), the helpers
that read it (mxdelay.local_rank, mxdelay.local_size), and the example's choice of context.

The launcher's assignment is checked on the command lines and environments it would use
(no process started) and in one real local job; no GPU is needed: a context is only named.
"""
import importlib
import os
import sys

import pytest

import mxdelay
from mxdelay.launching import job as launch_job, options as launch_options, role as launch_role
from support.jobs import REPO, assert_ok, run_job, worker_lines


@pytest.fixture
def unset(monkeypatch):
    for name in ('MXDELAY_LOCAL_RANK', 'MXDELAY_LOCAL_SIZE'):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_not_launched_is_rank_0_of_1(unset):
    assert (mxdelay.local_rank(), mxdelay.local_size()) == (0, 1)


def test_helpers_read_the_launcher_variables(unset):
    unset.setenv('MXDELAY_LOCAL_RANK', '2')
    unset.setenv('MXDELAY_LOCAL_SIZE', '3')
    assert (mxdelay.local_rank(), mxdelay.local_size()) == (2, 3)


@pytest.mark.parametrize('rank, size, message', [
    ('3', '3', 'MXDELAY_LOCAL_RANK=3 must be below MXDELAY_LOCAL_SIZE=3'),
    ('1', None, 'MXDELAY_LOCAL_RANK=1 must be below MXDELAY_LOCAL_SIZE=1'),
    ('-1', '2', "MXDELAY_LOCAL_RANK='-1' must be an integer >= 0"),
    ('one', '2', "MXDELAY_LOCAL_RANK='one' is not a valid integer"),
    ('0', '0', "MXDELAY_LOCAL_SIZE='0' must be an integer >= 1"),
])
def test_bad_values_are_refused(unset, rank, size, message):
    unset.setenv('MXDELAY_LOCAL_RANK', rank)
    if size is not None:
        unset.setenv('MXDELAY_LOCAL_SIZE', size)
    with pytest.raises(ValueError, match=message.replace('(', r'\(').replace(')', r'\)')):
        mxdelay.local_rank()


def _job(args):
    """The launcher's job for `args` (options only), built but not run."""
    parser = launch_options.build_parser()
  
    return launch_job.Job(launch_options.Config(parser.parse_args(args + ['true']), parser))


def _workers(job):
    """``[(host, MXDELAY_LOCAL_RANK, MXDELAY_LOCAL_SIZE)]`` of the job's workers, in rank order."""
    result = []
    for role in job.roles:
        variables = job.role_env(role)
        if role.role == 'worker':
            result.append((role.host and role.host[0], variables['MXDELAY_LOCAL_RANK'],
                           variables['MXDELAY_LOCAL_SIZE']))
        else:  # only workers train on a device
            assert 'MXDELAY_LOCAL_RANK' not in variables
    return result


def test_local_mode_numbers_every_worker():
    assert _workers(_job(['-n', '3', '-s', '1'])) == [(None, '0', '3'), (None, '1', '3'),
                                                      (None, '2', '3')]


def test_ssh_mode_numbers_the_workers_of_each_host(tmp_path):
    hosts = tmp_path / 'hosts'
    hosts.write_text('127.0.0.1\nlocalhost\n')
    # Round-robin over 2 hosts: servers 0, 1 on 127.0.0.1, localhost; then workers 0..4.
    assert _workers(_job(['-n', '5', '-s', '2', '-H', str(hosts)])) == [
        ('127.0.0.1', '0', '3'), ('localhost', '0', '2'), ('127.0.0.1', '1', '3'),
        ('localhost', '1', '2'), ('127.0.0.1', '2', '3')]


def test_ssh_command_line_carries_the_local_rank(tmp_path, monkeypatch):
    hosts = tmp_path / 'hosts'
    hosts.write_text('127.0.0.1\nlocalhost:2222\n')
    job = _job(['-n', '2', '-s', '2', '-H', str(hosts)])
    started = []

    class Popen:  # pylint: disable=too-few-public-methods
        def __init__(self, argv, **_):
            started.append(argv)
            raise OSError('not started')  # the launcher stops at once, as on a failed start

    monkeypatch.setattr(launch_role.subprocess, 'Popen', Popen)
    for role in job.roles[3:]:  # the workers: on 127.0.0.1, then on localhost:2222
        with pytest.raises(OSError):
            job.start(role)
    assert started[0][-2] == '127.0.0.1' and started[1][-2] == 'localhost'
    assert '-p' not in started[0] and started[1][started[1].index('-p') + 1] == '2222'
    for argv in started:
        assert ' MXDELAY_LOCAL_RANK=0 MXDELAY_LOCAL_SIZE=1 ' in argv[-1]


@pytest.mark.jobs
@pytest.mark.timeout(60)
def test_local_job_gives_local_ranks_0_1_2():
    result = run_job(['sh', '-c', 'echo local $MXDELAY_LOCAL_RANK $MXDELAY_LOCAL_SIZE'],
                     num_workers=3, timeout=30)
    assert_ok(result)
    assert [worker_lines(result.stdout, rank) for rank in range(3)] == [
        ['local 0 3'], ['local 1 3'], ['local 2 3']]


@pytest.fixture(scope='module')
def example():
    sys.path.insert(0, os.path.join(REPO, 'examples'))
    try:
        yield importlib.import_module('train_fashion_mnist')
    finally:
        sys.path.remove(os.path.join(REPO, 'examples'))


@pytest.mark.parametrize('gpus, local_rank, expected', [
    (0, 0, ('cpu', 0)), (0, 3, ('cpu', 0)),
    (2, 0, ('gpu', 0)), (2, 1, ('gpu', 1)), (2, 3, ('gpu', 1)), (4, 2, ('gpu', 2)),
])
def test_example_context(example, gpus, local_rank, expected):
    ctx = example.choose_context(gpus, local_rank)
    assert (ctx.device_type, ctx.device_id) == expected


def test_example_gpus_option(example, capsys):
    assert example.parse_args([]).gpus == 0  # the CPU unless asked
    assert example.parse_args(['--gpus', '4']).gpus == 4
    with pytest.raises(SystemExit):
        example.parse_args(['--gpus', '-1'])
    assert '--gpus must be 0 (train on the CPU) or the number of GPUs per host, got -1' in \
        capsys.readouterr().err
