"""Inputs that used to be taken silently fail early, naming the value and the fix.

What is tested, one case each (issue 22, "Unchecked inputs"):

- ``mxdelay-launch --timeout`` NaN or infinite: refused (it turned the timeout off);
- ``MXDELAY_SHUTDOWN_WAIT`` NaN, infinite or negative: refused by ``env`` and the launcher;
- ``--env-worker``, ``--env-server`` and ``--env`` naming a variable the launcher sets for
  each role (``DMLC_ROLE`` and the rest): refused; the list is the launcher's own;
- a hostfile host that starts with ``-`` (an ssh or ip option) or holds a space or a
  control character: refused before ssh runs; ssh gets ``--`` before the host (the
  stand-in ssh of tests/test_launcher.py checks that);
- ``DMLC_NUM_SERVER=0`` (and below the minimum of every numeric variable): refused, not
  taken for 1, also when a store is built;
- ``MXDELAY_LOG_LEVEL=nonsense``: one check (``env.log_level``) for the launcher and the
  servers; a server process with it exits with the message instead of logging at INFO;
- ``delay`` and ``slack`` above ``checks.MAX_ROUNDS``: refused at construction, naming the
  value, the bound, why and the fix.

Every launcher case exits 2 within seconds and starts nothing. Tolerance: none.
"""
import os
import subprocess
import time
import types

import pytest

from support.jobs import LAUNCHER, job_env
from support.stores import OfflineNative, _no_channel
from kvstore_ext import checks, env
from kvstore_ext.worker.dist_delay import DistDelay
from mxdelay.launching import job as launch_job, options as launch_options, role as launch_role
from mxdelay.schedule import DelaySchedule

pytestmark = pytest.mark.timeout(60)


def launch(tmp_path, args, environ=None):
    """Run mxdelay-launch with `args` and a command that would leave a marker; check that it
    failed at once (exit 2) without starting anything; return its stderr."""
    started = time.monotonic()
    result = subprocess.run(list(LAUNCHER) + list(args) + ['touch', 'started'], cwd=tmp_path,
                            env=job_env(environ), capture_output=True, text=True, timeout=15,
                            check=False)
    assert result.returncode == 2, result.stderr
    assert time.monotonic() - started < 5
    assert not (tmp_path / 'started').exists()
    return result.stderr


@pytest.mark.parametrize('value', ['nan', 'inf', '-inf', 'NaN'])
def test_timeout_must_be_finite(tmp_path, value):
    stderr = launch(tmp_path, ['-n', '1', '--timeout=' + value])
    assert '--timeout must be a positive number of seconds, got %s' % value.lower() in stderr
    assert 'drop --timeout for no limit' in stderr


@pytest.mark.parametrize('value', ['nan', 'inf', '-inf', '-1', '-0.5'])
def test_shutdown_wait_must_be_finite_and_not_negative(tmp_path, monkeypatch, value):
    monkeypatch.setenv('MXDELAY_SHUTDOWN_WAIT', value)
    message = ("environment variable MXDELAY_SHUTDOWN_WAIT=%r must be a finite number >= 0 "
               '(seconds; 0 kills the servers as soon as the workers are done); unset it or '
               'set e.g. MXDELAY_SHUTDOWN_WAIT=30' % value)
    with pytest.raises(ValueError) as info:
        env.get_float('MXDELAY_SHUTDOWN_WAIT')
    assert str(info.value) == message
    assert message in launch(tmp_path, ['-n', '1'], {'MXDELAY_SHUTDOWN_WAIT': value})


@pytest.mark.parametrize('value', ['0', '0.0', '2.5'])
def test_shutdown_wait_accepts_zero_and_more(monkeypatch, value):
    monkeypatch.setenv('MXDELAY_SHUTDOWN_WAIT', value)
    assert env.get_float('MXDELAY_SHUTDOWN_WAIT') == float(value)


def test_the_launchers_own_variables_are_those_it_sets():
    job = launch_job.Job.__new__(launch_job.Job)  # only role_env, no job
    job.config = types.SimpleNamespace(root_uri='127.0.0.1', port=1, num_workers=1,
                                       num_servers=1, env_server={}, env_worker={},
                                       checkpoint_env={}, job_key='k3y')
    job.port = 1
    job._local = {0: (0, 1)}  # worker 0: local rank 0 of 1
    workers_only = {'MXDELAY_LOCAL_RANK', 'MXDELAY_LOCAL_SIZE'}  # only workers pick a device
    for role in ('scheduler', 'server', 'worker'):
        expected = set(launch_options.OWN_VARIABLES) - (workers_only if role != 'worker' else set())
        assert set(job.role_env(launch_role.Role(role, 0))) == expected


def test_every_process_of_a_launch_gets_one_job_key_new_per_launch_or_the_users(monkeypatch):
    monkeypatch.delenv('MXDELAY_JOB_KEY', raising=False)
    parser = launch_options.build_parser()

    def key_of_a_launch():
        config = launch_options.Config(parser.parse_args(['-n', '2', '-s', '1', 'true']), parser)
        job = launch_job.Job.__new__(launch_job.Job)
        job.config, job.port, job._local = config, 1, {0: (0, 2), 1: (1, 2)}
        keys = {job.role_env(launch_role.Role(role, rank))['MXDELAY_JOB_KEY']
                for role, rank in (('scheduler', 0), ('server', 0), ('worker', 0), ('worker', 1))}
        assert len(keys) == 1
        return keys.pop()
    first, second = key_of_a_launch(), key_of_a_launch()
    assert first != second and len(first) == 64 and int(first, 16) >= 0   # 32 random bytes
    monkeypatch.setenv('MXDELAY_JOB_KEY', 'chosen by the user')
    assert key_of_a_launch() == 'chosen by the user'


@pytest.mark.parametrize('name', sorted(launch_options.OWN_VARIABLES))
@pytest.mark.parametrize('option', ['--env-worker', '--env-server', '--env'])
def test_the_launchers_own_variables_cannot_be_overridden(tmp_path, option, name):
    value = name if option == '--env' else '%s:server' % name
    # Refused before --env looks the name up (unset here: with DMLC_ROLE=server in its own
    # environment the launcher, which imports kvstore_ext, would become a server).
    stderr = launch(tmp_path, ['-n', '1', option, value], {name: None})
    assert ('%s %s: mxdelay-launch sets %s for every process (%s); drop %s %s'
            % (option, value, name, launch_options.OWN_VARIABLES[name], option, value)) in stderr


@pytest.mark.jobs
def test_other_dmlc_variables_pass(tmp_path):
    # DMLC_INTERFACE and the like are the user's to set: the worker gets it.
    command = ['sh', '-c', 'test "$DMLC_ROLE" != worker || test "$DMLC_INTERFACE" = lo']
    result = subprocess.run(list(LAUNCHER) + ['-n', '1', '--env-worker', 'DMLC_INTERFACE:lo']
                            + command,
                            cwd=tmp_path, env=job_env(), capture_output=True, text=True,
                            timeout=30, check=False)
    assert result.returncode == 0, result.stderr


MARKER_SSH = '''#!/bin/sh
touch "$SSH_CALLED"
exit 1
'''


@pytest.mark.parametrize('host', ['-oProxyCommand=touch pwned', '-p', 'two words', 'tab\there',
                                  'bell\x07', 'esc\x1b[0m'])
def test_hostfile_host_names_that_are_no_host_are_refused(tmp_path, host):
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir()
    (bin_dir / 'ssh').write_text(MARKER_SSH)
    (bin_dir / 'ssh').chmod(0o755)
    (tmp_path / 'hosts').write_text('127.0.0.1\n%s\n' % host)
    stderr = launch(tmp_path, ['-n', '1', '-H', str(tmp_path / 'hosts')],
                    {'PATH': '%s:%s' % (bin_dir, os.environ['PATH']),
                     'SSH_CALLED': str(tmp_path / 'ssh-called')})
    assert ('-H/--hostfile %r line 2: %r is not a host name (it is empty, starts with "-" or '
            'holds a space or control character)' % (str(tmp_path / 'hosts'), host)) in stderr
    assert not (tmp_path / 'ssh-called').exists() and not (tmp_path / 'pwned').exists()


def test_netns_names_that_are_options_are_refused(tmp_path):
    if os.geteuid() != 0 or subprocess.run(['which', 'ip'], capture_output=True).returncode:
        pytest.skip('--launcher netns needs root and the ip command')
    (tmp_path / 'hosts').write_text('-all 10.0.0.1\n')
    stderr = launch(tmp_path, ['-n', '1', '--launcher', 'netns', '-H', str(tmp_path / 'hosts')])
    assert "line 1: '-all' is not a host name" in stderr


@pytest.mark.parametrize('name,value', [('DMLC_NUM_SERVER', '0'), ('DMLC_NUM_SERVER', '-1'),
                                        ('DMLC_NUM_WORKER', '0'), ('MXDELAY_SLACK', '0'),
                                        ('MXDELAY_CHUNK_SIZE', '-5'), ('MXDELAY_RANK', '-1'),
                                        ('MXNET_KVSTORE_BIGARRAY_BOUND', '0')])
def test_numbers_below_their_minimum_are_refused(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    minimum, meaning = env.MINIMUMS[name]
    with pytest.raises(ValueError) as info:
        env.get_int(name)
    message = str(info.value)
    assert message.startswith('environment variable %s=%r must be an integer >= %d (%s)'
                              % (name, value, minimum, meaning))


def test_zero_servers_is_not_one(monkeypatch):
    monkeypatch.setenv('DMLC_NUM_SERVER', '0')
    with pytest.raises(ValueError, match=r"DMLC_NUM_SERVER='0' must be an integer >= 1 \(the "
                                         r'number of server processes, and a parameter-server '
                                         r'job needs one; launch with mxdelay-launch -s S'):
        DistDelay(native=OfflineNative(), channel_factory=_no_channel)
    monkeypatch.delenv('DMLC_NUM_SERVER')  # unset (no job): one server, as before
    assert DistDelay(native=OfflineNative(),
                     channel_factory=_no_channel)._session.num_servers == 1


@pytest.mark.parametrize('raw,level', [('INFO', 20), ('debug', 10), (' Warning ', 30),
                                       ('error', 40), ('CRITICAL', 50)])
def test_log_level(monkeypatch, raw, level):
    monkeypatch.setenv('MXDELAY_LOG_LEVEL', raw)
    assert env.log_level() == level


@pytest.mark.parametrize('raw', ['nonsense', '', '10', 'Level 10'])
def test_log_level_refused(monkeypatch, raw):
    monkeypatch.setenv('MXDELAY_LOG_LEVEL', raw)
    with pytest.raises(ValueError, match=r'environment variable MXDELAY_LOG_LEVEL=%r is not a '
                                         r'log level; use DEBUG, INFO, WARNING or ERROR' % raw):
        env.log_level()


def test_server_refuses_a_bad_log_level():
    # A server process, as mxdelay-run or `import mxdelay` starts it: it fails with the
    # message before it joins any job (no scheduler exists here; it would wait forever).
    environ = job_env({'DMLC_ROLE': 'server', 'MXDELAY_LOG_LEVEL': 'nonsense',
                       'DMLC_NUM_SERVER': '1', 'DMLC_NUM_WORKER': '1'})
    result = subprocess.run([LAUNCHER[0], '-c', 'import mxdelay'], env=environ,
                            capture_output=True, text=True, timeout=45, check=False)
    assert result.returncode != 0
    assert ("environment variable MXDELAY_LOG_LEVEL='nonsense' is not a log level"
            in result.stderr), result.stderr


BOUND = r'must be at most 256, got %d: every worker keeps slack \+ 1 copies of the model'


@pytest.mark.parametrize('delay', [257, 10000])
def test_delay_has_an_upper_bound(delay):
    with pytest.raises(ValueError, match=r'delay %s .*docs/design\.md §2\.3, §2\.6, §3\.5\); '
                                         r'use delay <= 256' % (BOUND % delay)):
        DelaySchedule(delay, 0)
    assert DelaySchedule(checks.MAX_ROUNDS, 0).delay == 256


def test_delayed_trainer_refuses_a_huge_delay_at_construction():
    import mxdelay  # pylint: disable=import-outside-toplevel
    from mxnet import gluon  # pylint: disable=import-outside-toplevel
    params = gluon.nn.Dense(2).collect_params()
    with pytest.raises(ValueError, match='delay ' + BOUND % 10000):
        mxdelay.DelayedTrainer(params, 'sgd', kvstore=None, delay=10000)


@pytest.mark.parametrize('slack', [257, 10000])
def test_slack_has_an_upper_bound(monkeypatch, slack):
    store = DistDelay(native=OfflineNative(), channel_factory=_no_channel)
    with pytest.raises(ValueError, match=r"slack %s.*use slack <= 256" % (BOUND % slack)):
        store.delayed.settings.configure(slack=slack)
    store.delayed.settings.configure(slack=256)
    assert store.delayed.settings.slack == 256
    monkeypatch.setenv('MXDELAY_SLACK', str(slack))  # the environment's default alike
    with pytest.raises(ValueError, match='slack ' + BOUND % slack):
        DistDelay(native=OfflineNative(), channel_factory=_no_channel)


def test_delayed_trainer_and_module_refuse_a_huge_slack_at_construction():
    import mxdelay  # pylint: disable=import-outside-toplevel
    import mxnet as mx  # pylint: disable=import-outside-toplevel
    from mxnet import gluon  # pylint: disable=import-outside-toplevel
    params = gluon.nn.Dense(2).collect_params()
    with pytest.raises(ValueError, match='slack ' + BOUND % 1000):
        mxdelay.DelayedTrainer(params, 'sgd', kvstore=None, delay=4, slack=1000)
    net = mx.sym.FullyConnected(mx.sym.Variable('data'), num_hidden=2)
    with pytest.raises(ValueError, match='slack ' + BOUND % 1000):
        mxdelay.DelayedModule(net, delay=4, slack=1000)
