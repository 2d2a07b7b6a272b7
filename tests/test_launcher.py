"""mxdelay-launch with real processes: stock MXNet jobs, fail-fast, bad options, ssh and
netns modes.

Every job has a hard timeout, picks a fresh free port, and records its processes' PIDs so
that the test can kill exactly one and check that none is left behind.
"""
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from mxdelay.launching import job as launch_job, options as launch_options, role as launch_role

from support.jobs import (LAUNCHER, JobResult, PidFile, assert_ok, job_env, pid_alive,
                          python_command, role_lines, run_job, started_job, worker_lines)

pytestmark = pytest.mark.timeout(60)

# The scheduler and the servers run MXNet's stock roles inside `import mxnet` and exit
# there; only workers get past it. Every role first prints its environment.
STOCK_HEADER = '''
import os, sys, time
role, rank = os.environ['DMLC_ROLE'], int(os.environ['MXDELAY_RANK'])
print('env', role, rank, os.environ.get('ONLY_SERVERS'), os.environ.get('ONLY_WORKERS'))
import mxnet as mx
kv = mx.kv.create('dist_sync')
'''

# Each worker pushes (rank + 1) * SCALE; stock dist_sync without an optimizer stores the
# sum of a round's pushes, so every worker pulls SCALE * N * (N + 1) / 2.
SUM_JOB = STOCK_HEADER + '''
scale = float(os.environ.get('SCALE', '1'))
shape = (100,)  # above MXNET_KVSTORE_BIGARRAY_BOUND=10: split over every server
kv.init(7, mx.nd.zeros(shape))
kv.push(7, mx.nd.ones(shape) * (rank + 1) * scale)
out = mx.nd.zeros(shape)
kv.pull(7, out=out)
print('pulled', rank, out.min().asscalar(), out.max().asscalar())
'''

# Worker 1 misbehaves (argv[2]) after the kvstore exists; worker 0 then waits for it in a
# pull. Each worker touches argv[1]/ready-RANK once the kvstore exists.
STALL_JOB = STOCK_HEADER + '''
kv.init(3, mx.nd.zeros((2,)))
open(os.path.join(sys.argv[1], 'ready-%d' % rank), 'w').close()
if rank == 1:
    if sys.argv[2] == 'exit3':
        print('failing at', time.time())
        # os._exit: sys.exit would hang in ps-lite's exit barrier, waiting for worker 0.
        os._exit(3)
    time.sleep(1000)
kv.push(3, mx.nd.ones((2,)))
out = mx.nd.zeros((2,))
kv.pull(3, out=out)
print('pulled', out.asnumpy().tolist())
'''

PREFIX = re.compile(r'^\[(scheduler|server \d+|worker \d+)\] ')


SUM_ARGS = ['--env-server', 'ONLY_SERVERS:s', '--env-worker', 'ONLY_WORKERS:w',
            '--env-worker', 'MXNET_KVSTORE_BIGARRAY_BOUND:10']


def scheduler_port(stderr):
    return int(re.search(r'scheduler at 127\.0\.0\.1:(\d+)', stderr).group(1))


def check_sum_job(result, num_workers, num_servers, scale=1):
    """Check a finished SUM_JOB: exit 0, prefixes, per-role environment, pulled sums."""
    assert_ok(result)
    for line in result.stdout.splitlines():
        assert PREFIX.match(line), 'line without a role prefix: %r' % line
    assert role_lines(result.stdout, 'scheduler') == ['env scheduler 0 None None']
    for rank in range(num_servers):
        assert role_lines(result.stdout, 'server', rank) == ['env server %d s None' % rank]
    total = scale * num_workers * (num_workers + 1) / 2
    for rank in range(num_workers):
        assert worker_lines(result.stdout, rank) == [
            'env worker %d None w' % rank, 'pulled %d %r %r' % (rank, total, total)]


@pytest.mark.jobs
@pytest.mark.parametrize('num_servers', [1, 2])
def test_stock_mxnet_job(tmp_path, num_servers):
    pids = PidFile(tmp_path / 'pids')
    result = run_job(pids.wrap(python_command(SUM_JOB)), num_workers=2, num_servers=num_servers,
                     extra_launcher_args=SUM_ARGS, timeout=45)
    check_sum_job(result, 2, num_servers)
    assert len(pids.read()) == 1 + num_servers + 2
    pids.assert_all_dead()


@pytest.mark.jobs
def test_two_jobs_at_once_do_not_meet(tmp_path):
    pids = [PidFile(tmp_path / 'pids-a'), PidFile(tmp_path / 'pids-b')]
    command = [pid_file.wrap(python_command(SUM_JOB)) for pid_file in pids]
    started = time.monotonic()
    with started_job(command[0], num_workers=2, env={'SCALE': 1},
                     extra_launcher_args=SUM_ARGS) as job_a, \
            started_job(command[1], num_workers=2, env={'SCALE': 10},
                        extra_launcher_args=SUM_ARGS) as job_b:
        outputs = [job.communicate(timeout=45) for job in (job_a, job_b)]
    results = [JobResult(job.returncode, stdout, stderr, time.monotonic() - started)
               for job, (stdout, stderr) in zip((job_a, job_b), outputs)]
    check_sum_job(results[0], 2, 1, scale=1)
    check_sum_job(results[1], 2, 1, scale=10)
    assert scheduler_port(results[0].stderr) != scheduler_port(results[1].stderr)
    for pid_file in pids:
        pid_file.assert_all_dead()


@pytest.mark.jobs
def test_output_lines_stay_whole_and_on_their_stream(tmp_path):
    # Four processes write 2000 long lines each to stdout and to stderr at once.
    source = '''
    import os, sys
    name = os.environ['DMLC_ROLE'] + os.environ['MXDELAY_RANK']
    for i in range(2000):
        print('out', name, i, 'x' * 300)
        print('err', name, i, 'y' * 300, file=sys.stderr)
    sys.stdout.write('no newline at the end')
    '''
    result = run_job(python_command(source), num_workers=2, timeout=30)
    assert_ok(result)
    out_line = re.compile(
        r'^\[(scheduler|server 0|worker [01])\] (out \w+ \d+ x{300}|no newline at the end)$')
    err_line = re.compile(r'^\[(scheduler|server 0|worker [01])\] err \w+ \d+ y{300}$')
    stdout = result.stdout.splitlines()
    assert len(stdout) == 4 * 2001 and all(out_line.match(line) for line in stdout)
    stderr = [line for line in result.stderr.splitlines() if PREFIX.match(line)]
    assert len(stderr) == 4 * 2000 and all(err_line.match(line) for line in stderr)
    assert worker_lines(result.stdout, 1)[-1] == 'no newline at the end'


@pytest.mark.jobs
def test_worker_exit_code_ends_the_job(tmp_path):
    pids = PidFile(tmp_path / 'pids')
    result = run_job(pids.wrap(python_command(STALL_JOB, tmp_path, 'exit3')), num_workers=2,
                     timeout=30)
    ended = time.time()
    failed = float(worker_lines(result.stdout, 1)[-1].split()[-1])
    assert result.returncode == 3, result.stderr
    assert 'mxdelay-launch: worker 1 exited with code 3; stopping the job' in result.stderr
    assert ended - failed < 10, 'the job took %.1f s to end after the failure' % (ended - failed)
    pids.assert_all_dead()


def kill_one(tmp_path, victim):
    """Run STALL_JOB, SIGKILL `victim` once both workers are ready; return (result, seconds)."""
    pids = PidFile(tmp_path / 'pids')
    with started_job(pids.wrap(python_command(STALL_JOB, tmp_path, 'hang')),
                     num_workers=2) as popen:
        pid_of = pids.wait(4)
        deadline = time.monotonic() + 30
        while not all((tmp_path / ('ready-%d' % rank)).exists() for rank in (0, 1)):
            if popen.poll() is not None:
                raise AssertionError('the job ended early: %r' % (popen.communicate(),))
            assert time.monotonic() < deadline, 'the workers were not ready within 30 s'
            time.sleep(0.05)
        killed = time.monotonic()
        if victim == 'launcher':
            os.kill(popen.pid, signal.SIGKILL)
        else:
            os.kill(pid_of[victim], signal.SIGKILL)
        stdout, stderr = popen.communicate(timeout=20)
        seconds = time.monotonic() - killed
    pids.assert_all_dead()
    return popen.returncode, stdout, stderr, seconds


@pytest.mark.jobs
@pytest.mark.parametrize('role, rank', [('worker', 1), ('scheduler', 0), ('server', 0)])
def test_killed_role_ends_the_job(tmp_path, role, rank):
    returncode, _, stderr, seconds = kill_one(tmp_path, (role, rank))
    label = role if role == 'scheduler' else '%s %d' % (role, rank)
    assert returncode == 128 + signal.SIGKILL, stderr
    assert ('mxdelay-launch: %s died with signal SIGKILL (exit -9); stopping the job' % label
            in stderr)
    assert seconds < 10


@pytest.mark.jobs
def test_killed_launcher_takes_its_job_along(tmp_path):
    returncode, _, _, _ = kill_one(tmp_path, 'launcher')  # checks that every role died
    assert returncode == -signal.SIGKILL


@pytest.mark.jobs
@pytest.mark.parametrize('signum, code', [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_to_launcher_stops_the_job(tmp_path, signum, code):
    pids = PidFile(tmp_path / 'pids')
    with started_job(pids.wrap(['sleep', '1000']), num_workers=2) as popen:
        pids.wait(4)
        popen.send_signal(signum)
        _, stderr = popen.communicate(timeout=15)
    assert popen.returncode == code
    assert 'received %s; stopping the job' % signal.Signals(signum).name in stderr
    pids.assert_all_dead()


# A test run that dies holding a job: started_job's launcher must stop that job on its own.
DYING_RUNNER = '''
import sys, time
sys.path.insert(0, sys.argv[1])
from support import jobs
jobs._CURRENT['jobs'] = True
with jobs.started_job(jobs.PidFile(sys.argv[2]).wrap(['sleep', '1000']), 2):
    time.sleep(1000)
'''


@pytest.mark.jobs
def test_a_killed_test_run_leaves_no_job_behind(tmp_path):
    pids = PidFile(tmp_path / 'pids')
    runner = subprocess.Popen([sys.executable, '-c', DYING_RUNNER,  # pylint: disable=consider-using-with
                               os.path.dirname(os.path.abspath(__file__)), pids.path],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    try:
        pids.wait(4)                     # scheduler, server, 2 workers
    finally:
        runner.kill()                    # SIGKILL: no clean-up of its own can run
        runner.wait()
    pids.assert_all_dead(timeout=15)


@pytest.mark.jobs
def test_servers_that_stay_are_killed_after_the_workers_finish(tmp_path):
    pids = PidFile(tmp_path / 'pids')
    command = ['sh', '-c', '[ "$DMLC_ROLE" = worker ] || exec sleep 1000']
    result = run_job(pids.wrap(command), num_workers=2, env={'MXDELAY_SHUTDOWN_WAIT': '1'},
                     timeout=20)
    assert result.returncode == 0, result.stderr
    assert ('every worker finished, but scheduler, server 0 still running 1 s later'
            in result.stderr)
    pids.assert_all_dead()


@pytest.mark.jobs
def test_launcher_idles_while_children_are_silent():
    # Children that closed their output must not make the launcher poll in a busy loop.
    before = os.times()
    result = run_job(['sh', '-c', 'exec >/dev/null 2>&1; sleep 2'], num_workers=1, timeout=20)
    after = os.times()
    assert_ok(result)
    cpu = (after.children_user - before.children_user
           + after.children_system - before.children_system)
    assert cpu < 0.2 * result.duration, 'the launcher used %.2f s of CPU in %.2f s' % (
        cpu, result.duration)


@pytest.mark.jobs
def test_timeout_stops_the_job(tmp_path):
    pids = PidFile(tmp_path / 'pids')
    result = run_job(pids.wrap(['sleep', '1000']), num_workers=1,
                     extra_launcher_args=['--timeout', '1'], timeout=20)
    assert result.returncode == 124
    assert 'the job ran longer than --timeout 1 s; stopping it' in result.stderr
    assert result.duration < 10
    pids.assert_all_dead()


# case -> (launcher arguments, environment, expected message); {tmp} is the test's tmp_path.
BAD_INPUT = {
    'unknown option': (['-n', '2', '--bogus', '1'], {},
                       'unknown option --bogus before the command'),
    'zero workers': (['-n', '0'], {}, '-n/--num-workers must be at least 1, got 0'),
    'negative workers': (['-n', '-2'], {}, '-n/--num-workers must be at least 1, got -2'),
    'zero servers': (['-n', '2', '-s', '0'], {}, '-s/--num-servers must be at least 1, got 0'),
    'missing hostfile': (['-n', '2', '-H', '{tmp}/missing'], {},
                         "-H/--hostfile '{tmp}/missing' cannot be read"),
    'empty hostfile': (['-n', '2', '-H', '{tmp}/empty-hosts'], {},
                       "-H/--hostfile '{tmp}/empty-hosts' lists no host"),
    'bad host port': (['-n', '2', '-H', '{tmp}/bad-hosts'], {},
                      "line 2: '127.0.0.1:ssh' is not host or host:port"),
    'horovod host:slots': (['-n', '2', '-H', '{tmp}/horovod-hosts'], {},
                           "line 1: '127.0.0.1:4' is ambiguous: here host:N is ssh port N, while "
                           "Horovod reads it as N process slots; write '127.0.0.1 slots=4'"),
    'zero slots': (['-n', '2', '-H', '{tmp}/zero-slots'], {},
                   "line 1: '127.0.0.1 slots=0' is not 'host slots=N' (N a positive integer); "
                   "write e.g. '127.0.0.1 slots=4'"),
    'two words': (['-n', '2', '-H', '{tmp}/two-words'], {},
                  "line 2: 'localhost:2222 4' is not a host name (it is empty, starts with "
                  '"-" or holds a space or control character); write one host name or address '
                  "a line; for N processes on one host write 'host slots=N'"),
    'bad slots word': (['-n', '2', '-H', '{tmp}/bad-slots'], {},
                       "line 1: 'localhost:2222 slots=4 slots=5' is not 'host slots=N'"),
    'max_slots': (['-n', '2', '-H', '{tmp}/max-slots'], {},
                  "line 1: 'localhost max_slots=2': max_slots is not supported"),
    'pair without colon': (['-n', '2', '--env-worker', 'FOO'], {},
                           "--env-worker 'FOO' is not NAME:VALUE; write e.g. "
                           '--env-worker OMP_NUM_THREADS:4'),
    'mpi': (['-n', '2', '--launcher', 'mpi'], {},
            '--launcher mpi is not supported; mxdelay-launch supports local and ssh'),
    'ssh without hosts': (['-n', '2', '--launcher', 'ssh'], {},
                          '--launcher ssh needs -H/--hostfile'),
    'netns without hosts': (['-n', '2', '--launcher', 'netns'], {},
                            '--launcher netns needs -H/--hostfile'),
    'hostfile with local': (['-n', '2', '--launcher', 'local', '-H', '{tmp}/empty-hosts'], {},
                            '-H/--hostfile is only used with --launcher ssh'),
    'unset --env': (['-n', '2', '--env', 'MXDELAY_TEST_UNSET'], {'MXDELAY_TEST_UNSET': None},
                    "MXDELAY_TEST_UNSET is not set in the launcher's environment"),
    'zero timeout': (['-n', '2', '--timeout', '0'], {}, '--timeout must be a positive number'),
    'bad port': (['-n', '2', '--port', '70000'], {}, '--port must be in 1..65535, got 70000'),
    'bad shutdown wait': (['-n', '2'], {'MXDELAY_SHUTDOWN_WAIT': 'soon'},
                          "environment variable MXDELAY_SHUTDOWN_WAIT='soon'"),
    'bad log level': (['-n', '2'], {'MXDELAY_LOG_LEVEL': 'loud'},
                      "environment variable MXDELAY_LOG_LEVEL='loud' is not a log level"),
}


@pytest.mark.timeout(20)
@pytest.mark.parametrize('case', list(BAD_INPUT))
def test_bad_input_fails_at_once(tmp_path, case):
    (tmp_path / 'empty-hosts').write_text('# nothing\n\n')
    (tmp_path / 'bad-hosts').write_text('127.0.0.1\n127.0.0.1:ssh\n')
    (tmp_path / 'horovod-hosts').write_text('127.0.0.1:4\n')
    (tmp_path / 'zero-slots').write_text('127.0.0.1 slots=0\n')
    (tmp_path / 'two-words').write_text('127.0.0.1\nlocalhost:2222 4\n')
    (tmp_path / 'max-slots').write_text('localhost max_slots=2\n')
    (tmp_path / 'bad-slots').write_text('localhost:2222 slots=4 slots=5\n')
    args, env, message = BAD_INPUT[case]
    args = [arg.format(tmp=tmp_path) for arg in args]
    started = time.monotonic()
    result = subprocess.run(list(LAUNCHER) + args + ['touch', 'started'], cwd=tmp_path,
                            env=job_env(env), capture_output=True, text=True, timeout=15,
                            check=False)
    assert result.returncode == 2, result.stderr
    assert message.format(tmp=tmp_path) in result.stderr
    assert time.monotonic() - started < 5
    assert not (tmp_path / 'started').exists()


@pytest.mark.jobs
def test_port_option(tmp_path):
    with socket.socket() as busy:
        busy.bind(('', 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run(list(LAUNCHER) + ['-n', '1', '--port', str(port), 'touch',
                                                  'started'], cwd=tmp_path, env=job_env(),
                                capture_output=True, text=True, timeout=15, check=False)
    assert result.returncode == 2
    assert '--port %d is not free' % port in result.stderr
    assert not (tmp_path / 'started').exists()
    result = run_job(['true'], num_workers=1, extra_launcher_args=['--port', str(port)], timeout=20)
    assert_ok(result)
    assert scheduler_port(result.stderr) == port


@pytest.mark.parametrize('scheduler_says, runs', [
    ('Check failed: my_node_.port != -1 : bind failed', 2),   # a lost race for the port
    ('some other failure', 1),
])
def test_run_job_runs_again_only_when_the_scheduler_could_not_bind(monkeypatch, scheduler_says,
                                                                   runs):
    from support import jobs  # pylint: disable=import-outside-toplevel
    failed = JobResult(1, '', '[scheduler] MXNetError: %s\n' % scheduler_says, 0.5)
    results = [failed, JobResult(0, 'done', '', 1.0)]
    want = results[runs - 1]
    monkeypatch.setattr(jobs, '_run_job_once', lambda *args: results.pop(0))
    assert run_job(['true'], num_workers=1) is want
    assert len(results) == 2 - runs


@pytest.mark.timeout(20)
@pytest.mark.parametrize('command, message', [
    ([], 'no command given'),
    (['--'], 'no command given'),
    (['no-such-command-mxdelay'], "command 'no-such-command-mxdelay' not found on PATH"),
])
def test_missing_command_fails_at_once(command, message):
    result = subprocess.run(list(LAUNCHER) + ['-n', '2'] + command, env=job_env(),
                            capture_output=True, text=True, timeout=15, check=False)
    assert result.returncode == 2
    assert message in result.stderr


@pytest.mark.jobs
def test_options_after_the_command_belong_to_it():
    result = run_job(['sh', '-c', 'echo args "$@"', 'sh', '-n', '5', '--bogus'], num_workers=1,
                     timeout=20)
    assert_ok(result)
    assert worker_lines(result.stdout, 0) == ['args -n 5 --bogus']


def test_runs_as_a_module():
    result = subprocess.run([sys.executable, '-m', 'mxdelay.launcher', '--help'], env=job_env(),
                            capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith('usage: mxdelay-launch')


# --- ssh mode -----------------------------------------------------------------------------

FAKE_SSH = '''#!/bin/sh
# Stands in for ssh: records its arguments, then runs the remote command here with an
# environment as bare as an ssh session's.
echo "$@" >> "$FAKE_SSH_LOG"
while [ "$1" = -o ] || [ "$1" = -p ]; do shift 2; done
[ "$1" = -- ] || exit 90  # the launcher ends the options before the host
shift 2
exec env -i PATH=/usr/bin:/bin sh -c "$1"
'''


@pytest.mark.jobs
def test_ssh_mode_with_a_stand_in_ssh(tmp_path):
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir()
    (bin_dir / 'ssh').write_text(FAKE_SSH)
    (bin_dir / 'ssh').chmod(0o755)
    hostfile = tmp_path / 'hosts'
    hostfile.write_text('# two names of this machine\n127.0.0.1\n\nlocalhost:2222  # port\n')
    env = {'PATH': '%s:%s' % (bin_dir, os.environ['PATH']), 'FAKE_SSH_LOG': tmp_path / 'ssh.log',
           'PASSED': 'p v'}
    command = ['sh', '-c', 'echo $DMLC_ROLE $MXDELAY_RANK $DMLC_NODE_HOST $DMLC_PS_ROOT_URI '
               '"$PASSED" $ONLY_WORKERS; pwd']
    result = run_job(command, num_workers=2, env=env, cwd=tmp_path, timeout=20,
                     extra_launcher_args=['-H', hostfile, '--env', 'PASSED', '--env-worker',
                                          'ONLY_WORKERS:w', '--ssh-option', 'ConnectTimeout=5'])
    assert_ok(result)
    # Round-robin over the hosts: server 0, worker 0, worker 1.
    assert role_lines(result.stdout, 'server', 0) == ['server 0 127.0.0.1 127.0.0.1 p v',
                                                      str(tmp_path)]
    assert worker_lines(result.stdout, 0) == ['worker 0 localhost 127.0.0.1 p v w', str(tmp_path)]
    assert worker_lines(result.stdout, 1) == ['worker 1 127.0.0.1 127.0.0.1 p v w', str(tmp_path)]
    calls = (tmp_path / 'ssh.log').read_text().splitlines()
    assert len(calls) == 3  # the scheduler runs on the launcher's machine
    assert all(call.startswith('-o StrictHostKeyChecking=no -o BatchMode=yes -o ConnectTimeout=5 ')
               for call in calls)
    assert sum(' -p 2222 -- localhost sh -c ' in call for call in calls) == 1


def built_job(args):
    """The launcher's job for `args` (options only), built but not started."""
    parser = launch_options.build_parser()
  
    return launch_job.Job(launch_options.Config(parser.parse_args(args + ['true']), parser))


def test_hostfile_slots_are_consecutive_places(tmp_path):
    hosts = tmp_path / 'hosts'
    hosts.write_text('127.0.0.1 slots=2  # two processes\nlocalhost:2222   slots=3\n')
    job = built_job(['-n', '5', '-s', '1', '-H', str(hosts)])
    placed = [(role.label, role.host) for role in job.roles]
    assert placed == [('scheduler', None),
                      ('server 0 (on 127.0.0.1)', ('127.0.0.1', None)),
                      ('worker 0 (on 127.0.0.1)', ('127.0.0.1', None)),
                      ('worker 1 (on localhost)', ('localhost', 2222)),
                      ('worker 2 (on localhost)', ('localhost', 2222)),
                      ('worker 3 (on localhost)', ('localhost', 2222)),
                      ('worker 4 (on 127.0.0.1)', ('127.0.0.1', None))]  # round-robin wraps
    local = [job.role_env(role)['MXDELAY_LOCAL_RANK'] + '/' +
             job.role_env(role)['MXDELAY_LOCAL_SIZE']
             for role in job.roles if role.role == 'worker']
    assert local == ['0/2', '0/3', '1/3', '2/3', '1/2']


@pytest.mark.parametrize('options, expected', [
    ([], ['-o', 'StrictHostKeyChecking=no', '-o', 'BatchMode=yes']),
    (['--ssh-option', 'StrictHostKeyChecking=yes'],
     ['-o', 'BatchMode=yes', '-o', 'StrictHostKeyChecking=yes']),
    (['--ssh-option', 'stricthostkeychecking = accept-new', '--ssh-option', 'ConnectTimeout=5'],
     ['-o', 'BatchMode=yes', '-o', 'stricthostkeychecking = accept-new', '-o',
      'ConnectTimeout=5']),
])
def test_ssh_option_replaces_a_default_of_the_same_key(tmp_path, monkeypatch, options, expected):
    hosts = tmp_path / 'hosts'
    hosts.write_text('127.0.0.1\n')
    job = built_job(['-n', '1', '-s', '1', '-H', str(hosts)] + options)
    started = []

    def popen(argv, **_):
        started.append(argv)
        raise OSError('not started')

    monkeypatch.setattr(launch_role.subprocess, 'Popen', popen)
    with pytest.raises(OSError):
        job.start(job.roles[1])
    assert started[0][:started[0].index('--')] == ['ssh'] + expected


SSHD = '/usr/sbin/sshd'


def free_port():
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        return sock.getsockname()[1]


@pytest.fixture
def sshd(tmp_path):
    """Start a real sshd on a free loopback port; yield (port, client key path)."""
    if not os.path.exists(SSHD) or not shutil.which('ssh'):
        pytest.skip('the ssh test needs %s and ssh (apt-get install openssh-server)' % SSHD)
    if not os.path.isdir('/run/sshd'):
        if os.geteuid() != 0:
            pytest.skip('sshd needs its privilege separation directory /run/sshd')
        os.makedirs('/run/sshd', mode=0o755)  # what the openssh-server service creates at boot
    keys = tmp_path / 'keys'
    keys.mkdir()
    for name in ('host', 'client'):
        subprocess.run(['ssh-keygen', '-q', '-t', 'ed25519', '-N', '', '-f', keys / name],
                       check=True, timeout=30)
    shutil.copy(keys / 'client.pub', keys / 'authorized_keys')
    port = free_port()
    config = keys / 'sshd_config'
    config.write_text('\n'.join([
        'ListenAddress 127.0.0.1', 'Port %d' % port, 'HostKey %s' % (keys / 'host'),
        'AuthorizedKeysFile %s' % (keys / 'authorized_keys'), 'PidFile none', 'StrictModes no',
        'UsePAM no', 'PasswordAuthentication no', 'KbdInteractiveAuthentication no',
        'PermitRootLogin prohibit-password', 'LogLevel ERROR', '']))
    daemon = subprocess.Popen(  # pylint: disable=consider-using-with
        [SSHD, '-D', '-e', '-f', config], start_new_session=True, stderr=subprocess.PIPE,
        text=True)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(('127.0.0.1', port), timeout=1).close()
                break
            except OSError:
                assert daemon.poll() is None, daemon.communicate()[1]
                assert time.monotonic() < deadline, 'sshd did not listen within 10 s'
                time.sleep(0.05)
        yield port, keys / 'client'
    finally:
        daemon.terminate()
        daemon.communicate(timeout=10)


def assert_no_remote_helper(tmp_path, pids, timeout=5.0):
    """Check that ssh mode's remote shells and watchers of this job have all ended."""
    markers = ['kill -KILL -$0 %d' % pid for pid in pids.read().values()]
    deadline = time.monotonic() + timeout
    while True:
        helpers = []
        for entry in filter(str.isdigit, os.listdir('/proc')):
            try:
                with open('/proc/%s/cmdline' % entry, 'rb') as file:
                    text = file.read().replace(b'\0', b' ').decode(errors='replace').strip()
            except OSError:
                continue
            if ((('exec 3<&0' in text and str(tmp_path) in text) or
                 any(text.endswith(marker) for marker in markers)) and pid_alive(int(entry))):
                helpers.append((int(entry), text[:100]))
        if not helpers:
            return
        assert time.monotonic() < deadline, 'remote helpers left behind: %r' % helpers
        time.sleep(0.05)


def ssh_args(tmp_path, sshd, num_hosts):
    port, key = sshd
    hostfile = tmp_path / 'hosts'
    hostfile.write_text('127.0.0.1:%d\n' % port * num_hosts)
    return ['-H', hostfile, '--env', 'PYTHONPATH', '--env', 'OMP_NUM_THREADS',
            '--ssh-option', 'IdentityFile=%s' % key, '--ssh-option', 'UserKnownHostsFile=/dev/null',
            '--ssh-option', 'LogLevel=ERROR']


@pytest.mark.jobs
def test_ssh_mode_runs_a_stock_mxnet_job(tmp_path, sshd):
    pids = PidFile(tmp_path / 'pids')
    result = run_job(pids.wrap(python_command(SUM_JOB)), num_workers=2, num_servers=2, cwd=tmp_path,
                     extra_launcher_args=ssh_args(tmp_path, sshd, 2) + SUM_ARGS, timeout=45)
    check_sum_job(result, 2, 2)
    pids.assert_all_dead()
    assert_no_remote_helper(tmp_path, pids)


@pytest.mark.jobs
def test_ssh_mode_failure_stops_the_remote_processes(tmp_path, sshd):
    pids = PidFile(tmp_path / 'pids')
    result = run_job(pids.wrap(python_command(STALL_JOB, tmp_path, 'exit3')), num_workers=2,
                     cwd=tmp_path, extra_launcher_args=ssh_args(tmp_path, sshd, 1), timeout=45)
    assert result.returncode == 3, result.stderr
    assert 'worker 1 (on 127.0.0.1) exited with code 3; stopping the job' in result.stderr
    # Worker 0 waited in a pull on the far side of ssh: it must not outlive the job.
    pids.assert_all_dead()
    assert_no_remote_helper(tmp_path, pids)


# --- netns mode ---------------------------------------------------------------------------


@pytest.fixture
def netns_nodes():
    """Return a function that creates network namespaces linked by a bridge; delete them after.

    ``make(count)`` creates `count` namespaces, each with an interface ``eth0`` and one
    address of 10.231.0.0/24, linked by veth pairs to a bridge in one more namespace (so that
    deleting the namespaces removes every interface too), and returns ``[(name, ip), ...]``.
    """
    if os.geteuid() != 0:
        pytest.skip('--launcher netns needs root (ip netns exec); run the tests as root')
    if not shutil.which('ip'):
        pytest.skip('--launcher netns needs the ip command (apt-get install iproute2)')
    created = []
    prefix = 'mxdt%d-%d' % (os.getpid(), time.monotonic_ns() % 100000)

    def ip(*args):
        subprocess.run(('ip',) + args, check=True, capture_output=True, timeout=10)

    def make(count):
        switch = '%s-sw' % prefix
        added = subprocess.run(['ip', 'netns', 'add', switch], capture_output=True, text=True,
                               timeout=10, check=False)
        if added.returncode:
            pytest.skip('ip netns does not work here: %s' % added.stderr.strip())
        created.append(switch)
        ip('-n', switch, 'link', 'add', 'br0', 'type', 'bridge')
        ip('-n', switch, 'link', 'set', 'br0', 'up')
        nodes = []
        for index in range(count):
            name, address = '%s-%d' % (prefix, index), '10.231.0.%d' % (index + 1)
            ip('netns', 'add', name)
            created.append(name)
            ip('link', 'add', 'eth0', 'netns', name, 'type', 'veth', 'peer', 'name',
               'v%d' % index, 'netns', switch)
            ip('-n', switch, 'link', 'set', 'v%d' % index, 'master', 'br0', 'up')
            ip('-n', name, 'addr', 'add', address + '/24', 'dev', 'eth0')
            ip('-n', name, 'link', 'set', 'eth0', 'up')
            ip('-n', name, 'link', 'set', 'lo', 'up')
            nodes.append((name, address))
        return nodes

    try:
        yield make
    finally:
        for name in reversed(created):
            subprocess.run(['ip', 'netns', 'del', name], capture_output=True, timeout=10,
                           check=False)
        listed = subprocess.run(['ip', 'netns', 'list'], capture_output=True, text=True,
                                timeout=10, check=False).stdout
        assert prefix not in listed, 'network namespaces left behind: %s' % listed


def netns_args(tmp_path, nodes):
    hostfile = tmp_path / 'netns-hosts'
    hostfile.write_text('# scheduler, then servers and workers\n' +
                        ''.join('%s %s\n' % node for node in nodes))
    return ['--launcher', 'netns', '-H', hostfile]


# Each role says, on stderr, which namespace it runs in and the addresses it was given.
WHERE = ['sh', '-c', 'echo where $(ip netns identify $$) $DMLC_NODE_HOST $DMLC_PS_ROOT_URI >&2; '
         'exec "$@"', 'sh']


@pytest.mark.jobs
def test_netns_mode_runs_a_stock_mxnet_job(tmp_path, netns_nodes):
    nodes = netns_nodes(4)  # one a role: scheduler, server 0, worker 0, worker 1
    pids = PidFile(tmp_path / 'pids')
    result = run_job(pids.wrap(WHERE + python_command(SUM_JOB)), num_workers=2, timeout=45,
                     extra_launcher_args=netns_args(tmp_path, nodes) + SUM_ARGS)
    check_sum_job(result, 2, 1)
    root = nodes[0][1]
    for (role, rank), (name, address) in zip(
            [('scheduler', 0), ('server', 0), ('worker', 0), ('worker', 1)], nodes):
        assert role_lines(result.stderr, role, rank)[0] == 'where %s %s %s' % (name, address, root)
    assert 'scheduler at %s:' % root in result.stderr
    pids.assert_all_dead()


@pytest.mark.jobs
def test_netns_mode_assigns_the_other_lines_round_robin(tmp_path, netns_nodes):
    nodes = netns_nodes(3)
    result = run_job(WHERE + ['true'], num_workers=3, num_servers=2, timeout=20,
                     extra_launcher_args=netns_args(tmp_path, nodes))
    assert_ok(result)
    # The first line hosts the scheduler; servers, then workers, take turns on the others.
    expected = {('scheduler', 0): 0, ('server', 0): 1, ('server', 1): 2, ('worker', 0): 1,
                ('worker', 1): 2, ('worker', 2): 1}
    for (role, rank), index in expected.items():
        name, address = nodes[index]
        assert role_lines(result.stderr, role, rank) == [
            'where %s %s %s' % (name, address, nodes[0][1])]


@pytest.mark.jobs
def test_netns_mode_failure_names_the_namespace(tmp_path, netns_nodes):
    nodes = netns_nodes(4)
    pids = PidFile(tmp_path / 'pids')
    result = run_job(pids.wrap(python_command(STALL_JOB, tmp_path, 'exit3')), num_workers=2,
                     extra_launcher_args=netns_args(tmp_path, nodes), timeout=45)
    assert result.returncode == 3, result.stderr
    assert ('worker 1 (in netns %s) exited with code 3; stopping the job' % nodes[3][0]
            in result.stderr)
    pids.assert_all_dead()


@pytest.mark.parametrize('case', ['bad line', 'bad address', 'unknown namespace',
                                  'address of another namespace'])
def test_netns_mode_bad_hostfile_fails_at_once(tmp_path, netns_nodes, case):
    (name, address), (other, _) = netns_nodes(2)
    line, message = {
        'bad line': ('%s' % name, "line 2: '%s' is not 'NETNS_NAME IP'" % name),
        'bad address': ('%s 10.231.0' % name, "line 2: '%s 10.231.0' is not 'NETNS_NAME IP'"
                        % name),
        'unknown namespace': ('%s-none %s' % (name, address),
                              "network namespace '%s-none' is not usable" % name),
        'address of another namespace': ('%s %s' % (other, address),
                                         "%s is not an address of network namespace '%s' (it "
                                         'has 10.231.0.2, 127.0.0.1)' % (address, other)),
    }[case]
    hostfile = tmp_path / 'netns-hosts'
    hostfile.write_text('%s %s\n%s\n' % (name, address, line))
    result = subprocess.run(list(LAUNCHER) + ['-n', '1', '--launcher', 'netns', '-H', hostfile,
                                              'touch', 'started'], cwd=tmp_path, env=job_env(),
                            capture_output=True, text=True, timeout=15, check=False)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert not (tmp_path / 'started').exists()


# --- restarts with ssh and netns (tests/test_restarts.py has the rest) ------------------------

# Attempt 1 (no marker yet): once the 4 roles have recorded their PIDs, worker 0 SIGKILLs
# itself, the others wait; attempt 2: all exit 0.
KILLED_ONCE = ('[ -e {marker} ] && exit 0; '
               'if [ "$DMLC_ROLE" = worker ] && [ "$MXDELAY_RANK" = 0 ]; then '
               'while [ $(wc -l < {pids}) -lt 4 ]; do sleep 0.02; done; '
               'touch {marker}; kill -9 $$; fi; exec sleep 30')


def restarted_once(tmp_path, launcher_args, label):
    pids = PidFile(tmp_path / 'pids')
    script = KILLED_ONCE.format(marker=tmp_path / 'marker', pids=pids.path)
    result = run_job(pids.wrap(['sh', '-c', script]),
                     num_workers=2, cwd=tmp_path, timeout=45,
                     extra_launcher_args=launcher_args + ['--max-restarts', '1'])
    assert_ok(result)
    assert re.search(r'attempt 1 of at most 2 ended after [0-9.]+ s: %s; starting every role '
                     r'again in 1 s' % re.escape(label), result.stderr), result.stderr
    assert 'the job finished in attempt 2, after surviving 1 failure(s)' in result.stderr
    every = [int(line.split()[0]) for line in open(pids.path, encoding='ascii')]
    assert len(every) == 2 * 4, every   # both attempts' roles
    deadline = time.monotonic() + 5
    while any(pid_alive(pid) for pid in every):
        assert time.monotonic() < deadline, [pid for pid in every if pid_alive(pid)]
        time.sleep(0.05)
    return pids


@pytest.mark.jobs
def test_ssh_mode_restarts_a_failed_job(tmp_path, sshd):
    # The remote shell reports the killed command as exit code 137, which ssh passes on.
    pids = restarted_once(tmp_path, ssh_args(tmp_path, sshd, 2),
                          'worker 0 (on 127.0.0.1) exited with code 137')
    assert_no_remote_helper(tmp_path, pids)


@pytest.mark.jobs
def test_netns_mode_restarts_a_failed_job(tmp_path, netns_nodes):
    nodes = netns_nodes(4)
    restarted_once(tmp_path, netns_args(tmp_path, nodes),
                   'worker 0 (in netns %s) died with signal SIGKILL (exit -9)' % nodes[2][0])
