"""Shared fakes and job helpers of the tests; pytest loads it first.

Two kinds of tests (``./dev test -m "not jobs"`` runs the fast kind alone):

- fast, single-process tests: MXNet fakes several devices with ``mx.cpu(0), mx.cpu(1)``,
  and a ``DistDelay`` built on :class:`OfflineNative` (no network) stands in for a job:
  :func:`offline_store` refuses every network use, :class:`FakeDistDelay` serves one worker
  in-process with the server's own update kernels;
- real multi-process jobs (marked ``jobs``): scheduler, servers and workers over sockets,
  started through ``mxdelay-launch`` with a hard timeout, a free port, loopback binding,
  and killed by PID. :func:`run_job` refuses to run in a test that is not marked ``jobs``.

Typical job test::

    from conftest import PidFile, assert_ok, python_command, run_job, worker_lines

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
import glob
import json
import os
import pickle
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time
import types

import numpy as np

import mxdelay  # noqa: F401  before mxnet, as the job scripts do
import mxnet as mx
from mxnet import autograd, gluon, nd

import reference
from kvstore_ext import protocol
from kvstore_ext.dist_delay import DistDelay
from kvstore_ext.optimizers import describe_optimizer, flatten_state
from kvstore_ext.protocol import Command
from kvstore_ext.rounds import is_plain_sgd, sgd_step
from scripts import mlp_model

_PREFIX = re.compile(r'^\[(scheduler|server \d+|worker \d+)\] ', re.MULTILINE)
_CURRENT = {'jobs': True}   # whether the running test is marked 'jobs'


def pytest_configure(config):
    config.addinivalue_line('markers', 'jobs: runs real multi-process jobs (scheduler, servers, '
                                       'workers); deselect with -m "not jobs"')
    config.addinivalue_line('markers', 'big: needs several GB of memory and minutes; runs only '
                                       'when asked for by name: -m big')


def pytest_collection_modifyitems(config, items):
    # 'big' tests are left out unless the -m expression names them (-m jobs alone does not).
    if 'big' in (config.getoption('markexpr') or ''):
        return
    big = [item for item in items if item.get_closest_marker('big') is not None]
    if big:
        config.hook.pytest_deselected(items=big)
        items[:] = [item for item in items if item.get_closest_marker('big') is None]


class UnmarkedJobError(RuntimeError):
    """A test that is not marked ``jobs`` started a job (not an AssertionError, so that no
    ``xfail(raises=AssertionError)`` can swallow it)."""


def pytest_runtest_setup(item):
    # Before any of the item's fixtures, module-scoped ones included, are set up.
    _CURRENT['jobs'] = item.get_closest_marker('jobs') is not None


def _require_jobs_marker():
    if not _CURRENT['jobs']:
        raise UnmarkedJobError('this test starts a job: mark it @pytest.mark.jobs, so that the '
                               'fast set (-m "not jobs") stays single-process')


# -- jobs -----------------------------------------------------------------------------------
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(REPO, 'tests')
SCRIPTS = os.path.join(TESTS, 'scripts')
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
        ``os.environ`` with the repository first on ``PYTHONPATH`` (the package need not be
        installed), ``DMLC_NODE_HOST=127.0.0.1``, ``OMP_NUM_THREADS=1``,
        ``PYTHONUNBUFFERED=1``, no ``MXNET_CPU_WORKER_NTHREADS`` and no ``DMLC_ROLE``
        (so that the launcher is not a role itself), then `env` applied.
    """
    result = dict(os.environ)
    result['PYTHONPATH'] = os.pathsep.join(
        [REPO] + [path for path in result.get('PYTHONPATH', '').split(os.pathsep) if path])
    result.update(DMLC_NODE_HOST='127.0.0.1', OMP_NUM_THREADS='1', PYTHONUNBUFFERED='1')
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
    """
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


# -- the distributed trainer tests' job (scripts/mlp_job.py) ---------------------------------
#: Tolerance of the reference comparisons. The update kernels match MXNet's arithmetic, but
#: Gluon's backward (BLAS) and numpy's matmul round differently; over 16 steps the largest
#: difference measured is 3e-7 (weights are O(0.1-1)), far below what a wrong phase, pull
#: timing or rule makes (a stale initial pull moved them by 5e-2).
RTOL, ATOL = 1e-5, 1e-6
#: The common settings of mlp_job configs.
MLP_BASE = {'steps': 16, 'batch': 6, 'lr': 0.1, 'momentum': 0.9, 'wd': 1e-3}


def run_mlp_job(tmp_path, num_workers, config, num_servers=1, timeout=120, env=None):
    """Run scripts/mlp_job.py under mxdelay-launch; return {rank: npz} of the workers."""
    out = tmp_path / 'out'
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, os.path.join(SCRIPTS, 'mlp_job.py'), json.dumps(config), str(out)]
    result = run_job(command, num_workers=num_workers, num_servers=num_servers,
                     timeout=timeout, env=env)
    assert_ok(result)
    return {rank: np.load(str(out / ('worker%d.npz' % rank))) for rank in range(num_workers)}


def simulate_mlp_job(config, num_workers):
    """The numpy reference's trajectory of an mlp_job `config` with `num_workers` workers."""
    def grad_fn(weights, rank, step):
        x, y = mlp_model.batch(rank, step, config['batch'])
        return mlp_model.numpy_grad(weights, x, y)
    return reference.simulate(
        mlp_model.init_params(), grad_fn, num_workers, config['steps'], config['delay'],
        config['warmup_steps'], config['lr'], momentum=config.get('momentum', 0.0),
        wd=config.get('wd', 0.0), rescale_grad=1.0 / config['batch'],
        local_lr=config.get('local_lr'), rule=config.get('local_rule', 'mirror'),
        dc_lambda=config.get('dc_lambda'), optimizer=config.get('optimizer', 'sgd'),
        fp16=config.get('compression') == {'type': 'fp16'},
        overflow={tuple(pair) for pair in config.get('overflow', [])},
        scale_window=config.get('scale_window', 2000), **config.get('optimizer_params', {}))


def assert_matches_reference(histories, trajectory, first=0):
    """Every worker's recorded weights equal the reference's local weights, step by step."""
    for rank, history in histories.items():
        for name in ('w1', 'b1', 'w2', 'b2'):
            got = history[name]
            for t in range(len(got)):
                want = trajectory.local[first + t][rank][name]
                np.testing.assert_allclose(
                    got[t], want, rtol=RTOL, atol=ATOL,
                    err_msg='worker %d, step %d, parameter %s' % (rank, first + t, name))


# -- uneven data: mlp_job's plans of batches per worker (tests/test_uneven_data.py) -------
def has_data(config, rank, t):
    """Worker `rank` has a batch in round `t` (mlp_job's plan)."""
    batches = config['batches']
    if config.get('join'):
        return t % max(batches) < batches[rank]
    return t < config['epochs'] * batches[rank]


def batch_size(config, rank, t):
    """The size of worker `rank`'s batch in round `t` (mlp_job's plan)."""
    size = config.get('batch_sizes', {}).get(str(rank), config['batch'])
    batches, last = config['batches'][rank], config.get('last_batch')
    index = t % max(config['batches']) if config.get('join') else t % batches
    return last if last and index == batches - 1 else size


def simulate_uneven(config, num_workers, warmup_steps, **kw):
    """The reference: zero gradients where a worker has no data; the servers apply worker 0's
    first rescale_grad, and every worker's gradient is scaled by its own batch size. `kw`
    goes to ``reference.simulate`` (e.g. ``compression_threshold``)."""
    rounds = config['epochs'] * max(config['batches'])
    job_batch = batch_size(config, 0, 0)

    def grad_fn(weights, rank, t):
        if not has_data(config, rank, t):
            return {name: np.zeros_like(w) for name, w in weights.items()}
        size = batch_size(config, rank, t)
        x, y = mlp_model.batch(rank, t, size)
        factor = np.float32(job_batch / size)
        return {name: g.astype(np.float32) * factor
                for name, g in mlp_model.numpy_grad(weights, x, y).items()}
    return reference.simulate(
        mlp_model.init_params(), grad_fn, num_workers, rounds, config['delay'], warmup_steps,
        config['lr'], momentum=config['momentum'], wd=config['wd'],
        rescale_grad=1.0 / job_batch, rule=config.get('local_rule', 'mirror'), **kw)


def assert_uneven_matches_reference(histories, config, trajectory):
    """Each worker trained exactly its rounds with data, and its weights after each equal
    the reference's local weights."""
    for rank, history in histories.items():
        want_rounds = [t for t in range(len(trajectory.glob)) if has_data(config, rank, t)]
        assert list(history['rounds']) == want_rounds, 'worker %d trained other rounds' % rank
        for name in ('w1', 'b1', 'w2', 'b2'):
            for index, t in enumerate(want_rounds):
                np.testing.assert_allclose(
                    history[name][index], trajectory.local[t][rank][name], rtol=RTOL, atol=ATOL,
                    err_msg='worker %d, round %d, parameter %s' % (rank, t, name))


# -- stock MXNet's job (scripts/stock_job.py) --------------------------------------------------
#: Stock MXNet's gluon.Trainer on dist_sync in every role (scripts/stock_job.py).
STOCK_SCRIPT = os.path.join(SCRIPTS, 'stock_job.py')


def run_stock_job(out, config, num_workers=2, num_servers=1):
    """Run scripts/stock_job.py; return ({rank: npz}, [role records]) after checking that no
    role of the job imported mxdelay or kvstore_ext and none saw an MXNET_* variable."""
    out.mkdir(parents=True)
    command = [sys.executable, STOCK_SCRIPT, json.dumps(config), str(out)]
    result = run_job(command, num_workers=num_workers, num_servers=num_servers, timeout=90,
                     env=stock_env())
    assert_ok(result)
    records = []
    for path in sorted(glob.glob(str(out / 'role-*.json'))):
        with open(path, encoding='utf-8') as src:
            records.append(json.load(src))
    roles = sorted((r['role'], r['rank']) for r in records)
    assert roles == sorted([('scheduler', '0')] + [('server', str(i)) for i in range(num_servers)]
                           + [('worker', str(i)) for i in range(num_workers)]), roles
    for record in records:
        where = '%s %s' % (record['role'], record['rank'])
        for stage in ('imported_at_start', 'imported_at_exit'):
            assert record[stage] == {'mxdelay': False, 'kvstore_ext': False}, (where, record)
        assert record['env'] == {}, (where, record['env'])
        if record['role'] == 'worker':
            assert record['kvstore'] == 'mxnet.kvstore.kvstore.KVStore dist_sync', record
            assert record['update_on_kvstore'] is True, record
    histories = {rank: np.load(str(out / ('worker%d.npz' % rank))) for rank in range(num_workers)}
    return histories


# -- in-process stores ------------------------------------------------------------------------
class OfflineNative(object):
    """A native store of one worker with no network: a barrier fails the test."""
    rank = 0
    num_workers = 1

    def _barrier(self):
        raise AssertionError('a barrier was entered')


def _no_channel(native, layout):
    raise AssertionError('the hand-shake was started')


class FakeChannel(object):
    """A command channel to servers that answer every command with ``answer(command, body)``
    (default: an empty reply); the commands sent are recorded in :attr:`sent`."""

    def __init__(self, answer=None):
        self.answer = answer or (lambda command, body: {})
        self.sent = []
        self.hello = None

    def handshake(self, hello):
        self.hello = hello
        return [{'rescale_grad': None}]

    def command(self, command, body, refusal=RuntimeError):
        self.sent.append(command)
        return [self.answer(command, body)]


class WorkersNative(OfflineNative):
    """A native store of `num_workers` workers that accepts init and pull (and does nothing);
    a barrier fails the test."""

    def __init__(self, num_workers):
        self.num_workers = num_workers

    def init(self, keys, values):
        pass

    def pull(self, keys, out=None, priority=0):
        pass


def servers():
    """A FakeChannel that answers OPTIMIZER as a server would; returns (channel, sent), sent:
    [(command, body)]."""
    sent = []

    def answer(command, body):
        sent.append((command, body))
        if command == Command.OPTIMIZER:
            return {'optimizer': describe_optimizer(protocol.unpack_object(body['optimizer']))}
        return {}
    return FakeChannel(answer), sent


def started_store(answer=None):
    """A ``DistDelay`` of one worker after its hand-shake with a :class:`FakeChannel`;
    returns ``(store, channel)``."""
    channel = FakeChannel(answer)
    store = DistDelay(native=OfflineNative(), channel_factory=lambda native, layout: channel)
    store._ensure_started()
    return store, channel


def offline_store(placed=True):
    """A ``DistDelay`` with slack 1 and chunk size 1000 that fails the test on any network use
    (hand-shake, command, barrier); key 0 of shape (2, 3) is placed unless not `placed`
    (configure() works only before)."""
    from kvstore_ext.layout import Tensor  # pylint: disable=import-outside-toplevel
    store = DistDelay(native=OfflineNative(), channel_factory=_no_channel)
    store.configure(slack=1, chunk_size=1000)
    if placed:
        store._tensors[0] = Tensor(0, (2, 3), np.float32, [])
    return store


class FakeDistDelay(DistDelay):
    """``DistDelay`` with the job replaced by this process: one worker, one server.

    The "server" keeps the weights and applies the optimizer with MXNet's updater to each
    pushed gradient at once (with one worker a round is one push), as mxdelay's server does
    (``kvstore_ext/server.py``: ``mx.optimizer.get_updater`` on an unpickled copy of the
    worker's optimizer; without an optimizer it stores the pushed sum, as MXNet's server
    does). A pull returns the weights after the last pushed round. Pushes and pulls are
    recorded per key.
    """

    def __init__(self):
        super(FakeDistDelay, self).__init__(native=OfflineNative(), channel_factory=_no_channel)
        self.server_optimizer = self.server_updater = None
        self.store = {}
        self.log = []          # ('push' | 'pull', key)
        self.priorities = []   # (key, priority) of every push, in issue order
        self._rescale_grad = self._job_rescale_grad = None

    @property
    def rank(self):
        return 0

    @property
    def num_workers(self):
        return 1

    def set_optimizer(self, optimizer):
        super(FakeDistDelay, self).set_optimizer(optimizer)  # no hand-shake: nothing sent
        self.server_optimizer = pickle.loads(pickle.dumps(optimizer))
        self.server_updater = mx.optimizer.get_updater(self.server_optimizer)

    def _server_optimizer(self, what):
        if self.server_optimizer is None:   # mxdelay's server refuses, the worker raises
            raise RuntimeError('mxdelay server 0: set_hyper failed: cannot %s: no optimizer '
                               'installed on server 0 (call set_optimizer first)' % what)
        return self.server_optimizer

    def set_learning_rate(self, lr):
        self._server_optimizer('change the optimizer').set_learning_rate(lr)

    def init(self, key, value):
        assert key not in self.store
        if self._job_rescale_grad is None and self.server_optimizer is not None:
            # The hand-shake (at the first init): the job's rescale_grad is this worker's.
            self._job_rescale_grad = self._rescale_grad or self.server_optimizer.rescale_grad
            self.server_optimizer.rescale_grad = self._job_rescale_grad
        self.store[key] = value.copyto(mx.cpu())
        self._tensors[key] = None

    def broadcast(self, key, value, out, priority=0):
        self.init(key, value)
        self.log.append(('broadcast', key))
        for o in (out if isinstance(out, (list, tuple)) else [out]):
            self.store[key].copyto(o)

    def push(self, key, value, priority=0):
        assert not isinstance(value, (list, tuple)), 'the trainer sums devices itself'
        self.log.append(('push', key))
        self.priorities.append((key, priority))
        grad = value.copyto(mx.cpu())
        factor = self._gradient_factor()   # as DistDelay scales a push
        if factor is not None:
            grad = nd._internal._mul_scalar(grad, scalar=factor)
        if self.server_updater is None:
            self.store[key][:] = grad
        elif not is_plain_sgd(self.server_optimizer):
            self.server_updater(key, grad, self.store[key])
        else:
            # mxdelay's server applies plain SGD with the single-tensor kernels.
            sgd_step(self.server_optimizer, self.server_updater, key, grad, self.store[key])

    def send_buffer(self, key):
        return self.store[key]

    def pull(self, key, out=None, priority=0, ignore_sparse=True):
        self.log.append(('pull', key))
        for o in (out if isinstance(out, (list, tuple)) else [out]):
            self.store[key].copyto(o)

    def fetch_optimizer_states(self, states):
        # The server's updater keys its state by parameter index here (by chunk id in a job);
        # array j of flatten_state, as mxdelay's server writes it into state key j.
        for key, arrays in states.items():
            assert len(arrays) <= self._state_keys, 'configure(state_keys=...) too small'
            served = flatten_state(self.server_updater.states[key])
            for j, array in enumerate(arrays):
                served[j].copyto(array)
        self.log.append(('fetch_states', tuple(sorted(states))))

    def barrier(self):
        pass

    def finish_round(self, leaving=False):
        self.log.append(('finish', None))
        return True   # one worker: when it has finished, every worker has

    def save_optimizer_states(self, fname, dump_optimizer=False):
        with open(fname, 'wb') as out:
            pickle.dump({'store': {k: v.asnumpy() for k, v in self.store.items()},
                         'updater': self.server_updater.get_states(dump_optimizer=True)}, out)

    def check_states(self, fname, error=None):
        # One worker: the "agreement" is this worker's own verdict.
        if error is not None:
            raise ValueError('cannot load %s, nothing was changed: worker 0: %s' % (fname, error))
        try:
            with open(fname, 'rb') as src:
                return pickle.load(src)
        except Exception as err:  # pylint: disable=broad-except
            raise ValueError('cannot load %s: %s' % (fname, err)) from None

    def apply_states(self, state):
        for key, value in state['store'].items():
            self.store[key][:] = value
        self.server_updater.set_states(state['updater'])
        self.server_optimizer = self.server_updater.optimizer
        self._job_rescale_grad = self.server_optimizer.rescale_grad


class FakeDistDelayWithMultipliers(FakeDistDelay):
    """FakeDistDelay whose server applies the Parameters' multipliers, as mxdelay's does.

    The worker side is DistDelay's own (``_mults`` reads each key's Parameter from the
    optimizer's ``param_dict``; its values travel in the REGISTER command); the server side
    is ``DelayServer._attach_param_dict``: a ``param_dict`` of the server's optimizer keyed
    like its updater, holding only the two multipliers (the optimizer it received was
    unpickled, which empties ``param_dict``).
    """

    def init(self, key, value):
        super(FakeDistDelayWithMultipliers, self).init(key, value)
        lr_mult, wd_mult, _ = self._mults(key)
        self.server_optimizer.param_dict[key] = types.SimpleNamespace(lr_mult=lr_mult,
                                                                      wd_mult=wd_mult)


def small_params():
    """The parameters of a fresh Dense(2, in_units=3)."""
    net = gluon.nn.Dense(2, in_units=3)
    net.initialize()
    return net.collect_params()


# -- one worker in this process: mlp_model's parameters and gradients -------------------------
#: The batch of the in-process MLP tests (mlp_model's data of rank 0 unless told).
BATCH = 6
#: mlp_model's parameter names in the trainer's key order.
MLP_NAMES = tuple(sorted(mlp_model.init_params()))   # b1, b2, w1, w2


def contexts(n):
    """`n` CPU contexts: MXNet fakes `n` devices with them."""
    return [mx.cpu(i) for i in range(n)]


def mlp_params(ctxs, dtype='float32', lr_mult=None, wd_mult=None):
    """mlp_model's initial weights as bare Parameters on `ctxs`, in key order; `lr_mult` and
    `wd_mult` map names to multipliers (1.0 for the others)."""
    init = mlp_model.init_params()
    params = []
    for name in MLP_NAMES:
        param = gluon.Parameter(name, shape=init[name].shape, dtype=dtype,
                                lr_mult=(lr_mult or {}).get(name, 1.0),
                                wd_mult=(wd_mult or {}).get(name, 1.0))
        param.initialize(ctx=ctxs)
        param.set_data(nd.array(init[name], dtype=dtype))
        params.append(param)
    return params


def numpy_grad(weights, rank, step, batch=BATCH):
    """mlp_model's gradient (numpy, summed over the batch) of rank's batch at `step`."""
    x, y = mlp_model.batch(rank, step, batch)
    return mlp_model.numpy_grad(weights, x, y)


def backward_with(params, ctxs, grads):
    """Make Gluon's backward produce exactly `grads` (split evenly over the devices, in each
    Parameter's dtype): the gradient of sum(p * c) is c, and halving is exact in binary."""
    with autograd.record():
        losses = [(p.data(ctx) * nd.array(grads[p.name] / len(ctxs), ctx=ctx,
                                          dtype=p.dtype)).sum()
                  for p in params for ctx in ctxs]
    autograd.backward(losses)


def backward_at(params, ctxs, step, rank=0):
    """Gluon's backward producing mlp_model's gradient at the current weights (in float32,
    read from the first device)."""
    weights = {p.name: p.data(ctxs[0]).astype('float32').asnumpy() for p in params}
    backward_with(params, ctxs, numpy_grad(weights, rank, step))
