"""Real multi-process jobs of the tests: started through ``mxdelay-launch`` with a hard
timeout, a free port and loopback binding, killed by PID, and their output read per role.

:func:`started_job` (and so :func:`run_job`) refuses to run in a test that is not marked
``jobs`` (conftest.py's ``pytest_runtest_setup`` records the mark in :data:`_CURRENT`).

Typical job test::

    from support.jobs import PidFile, assert_ok, python_command, run_job, worker_lines

    @pytest.mark.jobs
    def test_sum(tmp_path):
        pids = PidFile(tmp_path / 'pids')
        result = run_job(pids.wrap(python_command(WORKER_SOURCE)), num_workers=2)
        assert_ok(result)
        assert worker_lines(result.stdout, 1) == ['sum 3.0']
        pids.assert_all_dead()

Expected values should be closed-form in the rank (``MXDELAY_RANK`` in each process).

MXNet trap: a worker that leaves through ``sys.exit`` or an uncaught exception while
another worker still waits for it hangs in ps-lite's exit barrier instead of exiting, so
the launcher never sees it fail. To make a worker fail on purpose, use ``os._exit(code)``
(a script that imports mxdelay and creates a ``'dist_delay'`` store exits at once anyway).
"""
import contextlib
import ctypes
import dataclasses
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time

__all__ = ['UnmarkedJobError', 'REPO', 'TESTS', 'SCRIPTS', 'SITE', 'LAUNCHER', 'KV_JOB',
           'JobResult', 'job_env', 'stock_env', 'started_job', 'run_job', 'role_lines',
           'worker_lines', 'assert_ok', 'python_command', 'pid_alive', 'PidFile', 'kv_results']

_PREFIX = re.compile(r'^\[(scheduler|server \d+|worker \d+)\] ', re.MULTILINE)
_CURRENT = {'jobs': True}   # whether the running test is marked 'jobs'


class UnmarkedJobError(RuntimeError):
    """A test that is not marked ``jobs`` started a job (not an AssertionError, so that no
    ``xfail(raises=AssertionError)`` can swallow it)."""



def _require_jobs_marker():
    if not _CURRENT['jobs']:
        raise UnmarkedJobError('this test starts a job: mark it @pytest.mark.jobs, so that the '
                               'fast set (-m "not jobs") stays single-process')


# -- jobs -----------------------------------------------------------------------------------
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = os.path.join(REPO, 'tests')
SCRIPTS = os.path.join(TESTS, 'scripts')
#: Its sitecustomize, in every role of a test job, memoises ``import mxnet``'s generated
#: operator functions and defers ``requests`` to its first use: the import's CPU time per
#: role goes from 0.95 s to 0.47 s.
SITE = os.path.join(TESTS, 'support', 'site')
#: The launcher runs as a file, as MXNet's tools/launch.py does (it loads no MXNet).
LAUNCHER = (sys.executable, os.path.join(REPO, 'mxdelay', 'launcher.py'))


@dataclasses.dataclass(frozen=True)
class JobResult:
    """What a finished job left: the launcher's exit code and output, and its wall time."""

    returncode: int
    stdout: str
    stderr: str
    duration: float


def job_env(env=None):
    """Return the environment for a job: this one, adjusted for small tests, then `env`.

    Parameters
    ----------
    env : dict, optional
        Variables to set; a value of None removes the variable.

    Returns
    -------
    dict
        ``os.environ`` with the repository and then :data:`SITE` first on ``PYTHONPATH`` (the
        package need not be installed), ``DMLC_NODE_HOST=127.0.0.1``, ``OMP_NUM_THREADS=1``,
        ``PYTHONUNBUFFERED=1``, ``SETUPTOOLS_USE_DISTUTILS=stdlib`` on Python < 3.12, no
        ``MXNET_CPU_WORKER_NTHREADS`` and no ``DMLC_ROLE`` (so that the launcher is not a role
        itself), then `env` applied.
    """
    result = dict(os.environ)
    result['PYTHONPATH'] = os.pathsep.join(
        [REPO, SITE] + [path for path in result.get('PYTHONPATH', '').split(os.pathsep)
                        if path not in ('', SITE)])
    result.update(DMLC_NODE_HOST='127.0.0.1', OMP_NUM_THREADS='1', PYTHONUNBUFFERED='1')
    if sys.version_info < (3, 12):
        # `import mxnet` imports distutils.version (LooseVersion, StrictVersion: numpy's
        # version), which setuptools' distutils shim serves by importing all of setuptools
        # and pkg_resources: 0.15 s of the 1.3 s of CPU each role spends importing MXNet,
        # over the suite's ~1000 roles. The standard library's distutils (gone in 3.12)
        # compares versions alike; no mxdelay code imports distutils.
        result.setdefault('SETUPTOOLS_USE_DISTUTILS', 'stdlib')
    for name in ('MXNET_CPU_WORKER_NTHREADS', 'DMLC_ROLE'):
        result.pop(name, None)
    for name, value in (env or {}).items():
        if value is None:
            result.pop(name, None)
        else:
            result[name] = str(value)
    return result


def stock_env():
    """Return `env` overrides (see :func:`job_env`) that leave a job MXNet's own defaults.

    Every ``MXNET_*`` variable of this environment is removed: ``import mxdelay`` before
    ``import mxnet`` (as this process does) sets ``MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN_BWD``
    in ``os.environ``, which children inherit, and a baseline job must not run with it. A job
    of mxdelay's given this environment gets what its own ``import mxdelay`` sets, as a
    user's would.
    """
    return {name: None for name in os.environ if name.startswith('MXNET_')}


def _stop_when_pytest_dies(pytest_pid):
    """A preexec_fn: the launcher gets SIGTERM when this process dies, even by SIGKILL, and
    stops its job (its roles have parent-death signals of their own), so that a killed test
    run leaves no job behind."""
    libc = ctypes.CDLL(None, use_errno=True)

    def preexec():
        libc.prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG (<linux/prctl.h>)
        if os.getppid() != pytest_pid:  # pytest died before prctl: nothing would signal us
            os.kill(os.getpid(), signal.SIGTERM)
    return preexec


@contextlib.contextmanager
def started_job(command, num_workers, num_servers=1, env=None, cwd=None, extra_launcher_args=()):
    """Start ``mxdelay-launch`` on `command` in a session of its own; yield its Popen.

    For tests that act on a job while it runs (kill one of its processes, say). On leaving
    the ``with`` block, a launcher still running is killed with its process group (its
    children then die of their parent-death signal).

    Parameters
    ----------
    command : list of str
        The command every role runs.
    num_workers, num_servers : int
        ``-n`` and ``-s``.
    env : dict, optional
        See :func:`job_env`.
    cwd : str, optional
        Working directory of the launcher and so of every role.
    extra_launcher_args : sequence of str
        More launcher options, placed before the command.

    Yields
    ------
    subprocess.Popen
        With text-mode stdout and stderr pipes.
    """
    _require_jobs_marker()
    argv = list(LAUNCHER) + ['-n', str(num_workers), '-s', str(num_servers)]
    argv += list(extra_launcher_args) + ['--'] + list(command)
    with subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=job_env(env), cwd=cwd,
                          start_new_session=True,
                          preexec_fn=_stop_when_pytest_dies(os.getpid())) as popen:
        try:
            yield popen
        finally:
            if popen.poll() is None:
                os.killpg(popen.pid, signal.SIGKILL)


def run_job(command, num_workers, num_servers=1, env=None, timeout=120, cwd=None,
            extra_launcher_args=()):
    """Run a job to its end through ``mxdelay-launch``; see :func:`started_job`.

    Parameters
    ----------
    timeout : float
        Hard limit in seconds. Past it the launcher gets SIGTERM (it stops its job and
        prints what it has), then 10 s later its process group gets SIGKILL (its children
        then die of their parent-death signal).

    Returns
    -------
    JobResult

    Raises
    ------
    AssertionError
        If the job outlives `timeout`; the message has everything the job printed.

    Notes
    -----
    A job whose scheduler could not bind its port (ps-lite's ``bind failed``: another
    process took the free port the launcher picked before the scheduler bound it, a race on
    a busy machine) is run once more, on a new port; nothing of it ran past the start.
    """
    result = _run_job_once(command, num_workers, num_servers, env, timeout, cwd,
                           extra_launcher_args)
    if result.returncode != 0 and any(
            'bind failed' in line for line in role_lines(result.stderr, 'scheduler')):
        sys.stderr.write('job %r: the scheduler could not bind its port; run again\n'
                         % (command,))
        result = _run_job_once(command, num_workers, num_servers, env, timeout, cwd,
                               extra_launcher_args)
    return result


def _run_job_once(command, num_workers, num_servers, env, timeout, cwd, extra_launcher_args):
    started = time.monotonic()
    with started_job(command, num_workers, num_servers, env, cwd, extra_launcher_args) as popen:
        try:
            stdout, stderr = popen.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(popen.pid, signal.SIGTERM)
            try:
                stdout, stderr = popen.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(popen.pid, signal.SIGKILL)
                stdout, stderr = popen.communicate()
            raise AssertionError('job %r did not finish within %g s\n--- stdout\n%s--- stderr\n%s'
                                 % (command, timeout, stdout, stderr)) from None
    return JobResult(popen.returncode, stdout, stderr, time.monotonic() - started)


def role_lines(text, role, rank=None):
    """Return the lines of `role` (and `rank`) in a job's `text`, prefixes removed.

    Parameters
    ----------
    text : str
        A job's stdout or stderr.
    role : str
        'scheduler', 'server' or 'worker'.
    rank : int, optional
        The role's ``MXDELAY_RANK``; required for servers and workers.
    """
    return _lines_of(text, role if role == 'scheduler' else '%s %d' % (role, rank))


def worker_lines(text, rank):
    """Return the lines of worker `rank` in a job's `text` (stdout or stderr), prefixes removed."""
    return role_lines(text, 'worker', rank)


def assert_ok(result):
    """Raise AssertionError with the launcher's verdict and each role's stderr unless exit 0."""
    if result.returncode == 0:
        return
    sections = ['--- %s stderr\n%s' % (name, '\n'.join(_lines_of(result.stderr, name)))
                for name in sorted(set(_PREFIX.findall(result.stderr)))]
    launcher = [line for line in result.stderr.splitlines() if not _PREFIX.match(line)]
    raise AssertionError('job failed with exit code %d after %.1f s\n--- launcher\n%s\n%s\n'
                         '--- stdout\n%s' % (result.returncode, result.duration,
                                             '\n'.join(launcher), '\n'.join(sections),
                                             result.stdout))


def python_command(source, *args):
    """Return the command that runs Python `source` (dedented) with this interpreter."""
    return [sys.executable, '-c', textwrap.dedent(source)] + [str(arg) for arg in args]


def pid_alive(pid):
    """Return whether process `pid` exists and is not a zombie."""
    try:
        with open('/proc/%d/stat' % pid, encoding='ascii') as stat:
            # The state follows the parenthesised command name, which may contain spaces.
            return stat.read().rpartition(')')[2].split()[0] != 'Z'
    except FileNotFoundError:
        return False


class PidFile:
    """Record the PID of every role of a job in a file, to kill one or to check none is left.

    Parameters
    ----------
    path : str or path-like
        The file, which should be in the test's ``tmp_path``. Each role appends
        ``PID ROLE RANK``.
    """

    def __init__(self, path):
        self.path = os.fspath(path)

    def wrap(self, command):
        """Return `command` run by a shell that records its PID first, then ``exec``\\ s it.

        ``exec`` keeps the PID, so the recorded PID is the command's own process.
        """
        record = 'echo "$$ $DMLC_ROLE $MXDELAY_RANK" >> %s; exec "$@"' % shlex.quote(self.path)
        return ['sh', '-c', record, 'sh'] + list(command)

    def read(self):
        """Return ``{(role, rank): pid}`` for every role recorded so far."""
        if not os.path.exists(self.path):
            return {}
        pids = {}
        with open(self.path, encoding='ascii') as file:
            for line in file:
                fields = line.split()
                if len(fields) == 3:  # a line being written may be incomplete
                    pids[(fields[1], int(fields[2]))] = int(fields[0])
        return pids

    def wait(self, count, timeout=30.0):
        """Wait until `count` roles are recorded; return :meth:`read`'s dict."""
        deadline = time.monotonic() + timeout
        while len(self.read()) < count:
            if time.monotonic() > deadline:
                raise AssertionError('only %d of %d roles recorded their PID in %s within %g s: %r'
                                     % (len(self.read()), count, self.path, timeout, self.read()))
            time.sleep(0.05)
        return self.read()

    def assert_all_dead(self, timeout=5.0):
        """Raise AssertionError if a recorded process is still alive after `timeout` seconds."""
        pids = self.read()
        assert pids, 'no PID was recorded in %s' % self.path
        deadline = time.monotonic() + timeout
        while True:
            alive = {role: pid for role, pid in pids.items() if pid_alive(pid)}
            if not alive:
                return
            if time.monotonic() > deadline:
                raise AssertionError('processes left behind: %r' % alive)
            time.sleep(0.05)


def _lines_of(text, name):
    prefix = '[%s] ' % name
    return [line[len(prefix):] for line in text.splitlines() if line.startswith(prefix)]


# -- the store's own tests' job (scripts/kv_job.py) ---------------------------------------------
KV_JOB = os.path.join(SCRIPTS, 'kv_job.py')


def kv_results(result):
    """{rank: RESULT dict} from the workers' output of a KV_JOB job."""
    results = {}
    for line in result.stdout.splitlines():
        if 'RESULT ' in line:
            data = json.loads(line.split('RESULT ', 1)[1])
            results[data['rank']] = data
    return results
