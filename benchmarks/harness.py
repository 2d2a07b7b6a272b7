"""The benchmarks' harness: one launcher job, its clean environment, its run and its record.

Every benchmark starts its jobs through :class:`Job`: ``mxdelay/launcher.py`` run as a plain
file (``-m mxdelay.launcher`` would import the mxdelay package, which sets mxdelay's MXNet
defaults in the launcher's environment, which local roles inherit; a baseline job must see
MXNet's defaults), with the explicit environment of :func:`job_env` (the driver's minus every
``DMLC_*``, ``MXNET_*`` and ``MXDELAY_*`` variable, plus ``OMP_NUM_THREADS=1``:
docs/benchmarks/README.md, rule 3). Each process of a job records what it imported
(``provenance.py``); :func:`stock_check` reads those records, so a stock baseline that had
mxdelay in any process says so in its row.

The training benchmarks run ``bench_worker.py`` (:data:`WORKER`): :func:`run_method` runs one
job of a method of ``methods.py`` (re-exported here: :data:`METHODS`, :data:`NETWORKS`) with
its CPU per role (``monitor.py``), and :func:`window` reads the samples/s and the cores each
role used over a window run's timed steps. A run's results record :func:`start_meta` and
:func:`finish_meta` (commit, machine, load, dates); ``report.py`` writes the tables.

The shared modules: ``methods.py`` (what runs), ``monitor.py`` (CPU per role, bytes per link),
``provenance.py`` (what each process imported; commit and machine), ``report.py`` (results
files, tables, plots) and ``netns.py`` (shaped links). The scripts are run as files
(``python benchmarks/NAME.py``), so this folder is first on ``sys.path``; :data:`REPO` is the
repository.
"""
import argparse
import contextlib
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time

from methods import METHODS, NETWORKS, TWO_BIT_THRESHOLD, Method, Network, methods
from monitor import CpuMonitor
import netns
from provenance import code_version, machine, now, read_records

__all__ = ['REPO', 'HERE', 'LAUNCHER', 'WORKER', 'NUM_WORKERS', 'BATCH', 'Method', 'METHODS',
           'TWO_BIT_THRESHOLD', 'methods', 'Network', 'NETWORKS', 'job_env', 'Job', 'stop',
           'run_worker', 'run_method', 'window', 'shaped_network', 'parser', 'names', 'ints',
           'ordered', 'Interrupted', 'handle_signals', 'interruptible', 'run_stoppable',
           'command_line', 'start_meta', 'finish_meta', 'read_roles', 'stock_check', 'worker_env']

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
LAUNCHER = os.path.join(REPO, 'mxdelay', 'launcher.py')
WORKER = os.path.join(HERE, 'bench_worker.py')
NUM_WORKERS, BATCH = 2, 128
_STRIPPED = ('DMLC_', 'MXNET_', 'MXDELAY_')


# -- one job ---------------------------------------------------------------------------------
def job_env(**extra):
    """The explicit environment of a job: no DMLC_, MXNET_ or MXDELAY_ variable of this
    process (a delayed job's ``import mxdelay`` sets its own defaults, a baseline keeps
    MXNet's), ``OMP_NUM_THREADS=1``, unbuffered output, and `extra`."""
    env = {name: value for name, value in os.environ.items() if not name.startswith(_STRIPPED)}
    env.update(OMP_NUM_THREADS='1', PYTHONUNBUFFERED='1', **extra)
    return env


class Job:
    """One job of `command` under the launcher: its argv, environment and run.

    Parameters
    ----------
    command : list of str
        The argv of every role (the launcher's arguments after ``--``).
    timeout : float or None
        The launcher's ``--timeout`` (seconds, truncated to an int); None: its default.
    num_workers, num_servers : int
    hostfile : str, optional
        A hostfile of network namespaces (``netns.ShapedNetwork.write_hostfile``): the job
        runs under ``--launcher netns``; None: local processes on loopback.
    env : dict, optional
        Variables added to :func:`job_env` (a method's own, :attr:`Method.env`).
    """

    def __init__(self, command, timeout, num_workers=NUM_WORKERS, num_servers=1,
                 hostfile=None, env=None):
        self.command = list(command)
        self.timeout = timeout
        self.num_workers, self.num_servers = num_workers, num_servers
        self.hostfile = hostfile
        self.extra_env = dict(env or {})

    @property
    def argv(self):
        """The launcher run as a plain file, then ``--`` and the command."""
        argv = [sys.executable, LAUNCHER, '-n', str(self.num_workers), '-s',
                str(self.num_servers)]
        if self.timeout is not None:
            argv += ['--timeout', str(int(self.timeout))]
        if self.hostfile:
            argv += ['--launcher', 'netns', '-H', self.hostfile]
        return argv + ['--'] + self.command

    @property
    def env(self):
        return job_env(**self.extra_env)

    def run(self, log_path, monitor=None):
        """Run to the end, output into `log_path` (its first line: the command); returns the
        exit code. `monitor`: a context manager entered for the job's duration.

        The launcher runs in a session of its own. Whatever ends the wait early (the
        launcher's timeout plus 60 s: :class:`subprocess.TimeoutExpired`; a signal that
        :func:`interruptible` turned into :class:`Interrupted`; KeyboardInterrupt) first
        stops the job (:func:`stop`: SIGTERM, on which the launcher stops its roles), then
        propagates, so that the caller's namespaces can go too.
        """
        with open(log_path, 'wb') as log, (monitor or contextlib.nullcontext()):
            log.write(('$ %s\n' % shlex.join(self.argv)).encode())
            log.flush()
            popen = self.start(stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
            try:
                return popen.wait(None if self.timeout is None else self.timeout + 60)
            finally:
                stop(popen)  # nothing to do once it has exited

    def start(self, **popen_args):
        """Start the job; ``popen_args``: Popen's output, cwd, ... (default: a session of
        its own, so that a signal to the driver's group does not reach the job)."""
        popen_args.setdefault('start_new_session', True)
        return subprocess.Popen(  # pylint: disable=consider-using-with
            self.argv, stdin=subprocess.DEVNULL, env=self.env, **popen_args)


def stop(popen, grace=15.0):
    """End `popen`, the leader of its own process group (:meth:`Job.start`), if it still runs.

    The launcher stops its job on SIGTERM (and its roles die with it on SIGKILL: they have
    a parent-death signal).
    """
    if popen.poll() is not None:
        return
    popen.send_signal(signal.SIGTERM)
    try:
        popen.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(popen.pid, signal.SIGKILL)  # the leader is alive: the group is ours
        popen.wait()


# -- jobs of bench_worker.py -----------------------------------------------------------------
def run_worker(folder, worker_args, timeout, hostfile=None, env=None,
               num_workers=NUM_WORKERS, num_servers=1, monitor=None):
    """Run one launcher job of bench_worker.py with `worker_args` (``--out`` added) in the
    emptied `folder` (its log, the workers' results and the role records go there); `env`:
    variables added to the job's environment (:attr:`Method.env`); `num_workers` workers and
    `num_servers` servers; `monitor`: another context manager entered for the job's duration
    (e.g. ``monitor.PortCounters``).

    Returns (exit code, worker results, the CpuMonitor of the job, the role records).
    """
    os.makedirs(folder, exist_ok=True)
    for stale in os.listdir(folder):
        os.remove(os.path.join(folder, stale))
    out = os.path.join(folder, 'worker-{rank}.json')
    job = Job([sys.executable, WORKER] + worker_args + ['--out', out], timeout,
              num_workers, num_servers, hostfile=hostfile, env=env)
    cpu = CpuMonitor({os.getpid(): 'driver'})
    with monitor or contextlib.nullcontext():
        code = job.run(os.path.join(folder, 'log.txt'), cpu)
    results = []
    if code == 0:
        for rank in range(job.num_workers):
            with open(out.format(rank=rank), encoding='utf-8') as src:
                results.append(json.load(src))
    return code, results, cpu, read_roles(folder)


def run_method(folder, method, worker_args, timeout, hostfile=None,
               num_workers=NUM_WORKERS, num_servers=1, monitor=None):
    """:func:`run_worker` of `method` (a :class:`Method`: its arguments first, then
    `worker_args`, and its environment), and what every row of such a run records.

    Returns (exit code, worker results, CpuMonitor, info): `info` holds ``load_before``,
    ``load_after`` (1-minute load average), ``job_s``, ``stock_check`` and ``worker_env``.
    """
    load, started = os.getloadavg()[0], time.time()
    code, results, cpu, roles = run_worker(folder, method.args + list(worker_args), timeout,
                                           hostfile, dict(method.env) or None, num_workers,
                                           num_servers, monitor)
    return code, results, cpu, dict(
        load_before=load, load_after=os.getloadavg()[0], job_s=time.time() - started,
        stock_check=stock_check(method.stock, roles, 1 + num_servers + num_workers),
        worker_env=worker_env(roles))


def window(results, cpu, batch=BATCH):
    """What a window run (bench_worker without ``--epochs``) measured over its timed steps:
    the job's samples/s (from the first worker's window start to the last one's end, so the
    drain of queued pushes counts), ms per step, the cores each role and the rest of the
    machine used in the window (from `cpu`, the job's CpuMonitor), and worker 0's step
    times."""
    steps = results[0]['steps']
    start = min(result['start'] for result in results)
    end = max(result['end'] for result in results)
    usage = cpu.usage(start, end)
    # Step times of worker 0 by position in the pull period (delayed: the pull is issued at
    # position k-1 and waited for at position 0 of the next period).
    ends = [results[0]['start']] + results[0]['step_ends']
    return dict(samples_per_s=len(results) * steps * batch / (end - start),
                ms_per_step=1000 * (end - start) / steps, window_s=end - start,
                cpu_workers=sum(v for k, v in usage.items() if k.startswith('worker')),
                cpu_server=sum((v for k, v in usage.items() if k.startswith('server')), 0.0),
                cpu_scheduler=usage.get('scheduler', 0.0),
                cpu_launcher=usage.get('launcher', 0.0) + usage.get('driver', 0.0),
                cpu_other=usage['other'],
                step_ms=' '.join('%.1f' % (1000 * (b - a)) for a, b in zip(ends, ends[1:])))


@contextlib.contextmanager
def shaped_network(nodes, rate, prefix='mxbench-'):
    """Yield ``(net, hostfile)``: `nodes` network namespaces with each link shaped to `rate`
    (``netns.ShapedNetwork``) and their hostfile for :class:`Job`; ``(None, None)`` for
    loopback (`rate` None)."""
    if not rate:
        yield None, None
        return
    with netns.ShapedNetwork(nodes, rate) as net, tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        hostfile = os.path.join(tmp, 'hosts')
        net.write_hostfile(hostfile)
        yield net, hostfile


# -- arguments, run order, signals ------------------------------------------------------------
def parser(doc, **kwargs):
    """The argument parser of a benchmark: the first paragraph of `doc` as its description,
    the whole docstring's layout kept in ``--help``."""
    return argparse.ArgumentParser(description=doc.split('\n\n', maxsplit=1)[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)


def names(known=None):
    """An argparse type: a comma-separated list of names, each one of `known` (if given)."""
    def parse(text):
        chosen = [name for name in text.split(',') if name]
        unknown = [name for name in chosen if known is not None and name not in known]
        if unknown:
            raise argparse.ArgumentTypeError('unknown %s; choose from %s' % (
                ', '.join(unknown), ', '.join(known)))
        return chosen
    return parse


def ints(text):
    """An argparse type: comma-separated integers."""
    return [int(value) for value in names()(text)]


def ordered(items, round_index):
    """`items` in round `round_index` (1-based) of interleaved runs: odd rounds in their order,
    even rounds reversed, so that slow drifts of the shared machine hit every item alike."""
    return list(items) if round_index % 2 else list(items)[::-1]


class Interrupted(Exception):
    """A stop signal arrived; the clean-up runs while this propagates."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_STOPPING = []


def _on_signal(signum, _frame):
    if _STOPPING:  # the first one is being handled: let the clean-up finish
        logging.getLogger('harness').warning('%s again: still cleaning up',
                                             signal.Signals(signum).name)
        return
    _STOPPING.append(signum)
    raise Interrupted(signum)


def handle_signals(signums=(signal.SIGINT, signal.SIGTERM, signal.SIGHUP)):
    """Turn `signums` into :class:`Interrupted`, so that namespaces and jobs are cleaned up
    (``with`` blocks and ``finally`` clauses run); a second signal during that is ignored."""
    for signum in signums:
        signal.signal(signum, _on_signal)


@contextlib.contextmanager
def interruptible(signums=(signal.SIGINT, signal.SIGTERM, signal.SIGHUP)):
    """:func:`handle_signals` for the ``with`` block, then the handlers there were before
    (a driver called from another program, e.g. a test, leaves that program's handlers)."""
    previous = {signum: signal.getsignal(signum) for signum in signums}
    handle_signals(signums)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _STOPPING.clear()


def run_stoppable(main):
    """``main()``'s exit status, a stop signal turned into :class:`Interrupted` meanwhile (its
    ``with`` blocks delete the namespaces and stop the jobs): then 128 + the signal."""
    with interruptible():
        try:
            return main()
        except Interrupted as stop:
            logging.getLogger('harness').error('stopped by %s; jobs and namespaces cleaned up',
                                               stop)
            return 128 + stop.signum


# -- a run's record -------------------------------------------------------------------------
def command_line(start, argv=None):
    """The command a results file records: `start` (e.g. ``'python benchmarks/tta.py'``) and
    `argv` (default: this process's arguments), quoted for a shell."""
    return start + ' ' + shlex.join(sys.argv[1:] if argv is None else argv)


def start_meta(command, **more):
    """A run's provenance at its start: command, date, load, commit, machine, paths and the
    ``MXNET_*`` variables of :func:`job_env` (none), then `more`."""
    return dict(command=command, started=now(), load_before=os.getloadavg(),
                code_start=code_version(), machine=machine(), repo=REPO,
                pythonpath=os.environ.get('PYTHONPATH', ''),
                job_env_mxnet={k: v for k, v in job_env().items() if k.startswith('MXNET_')},
                **more)


def finish_meta(meta):
    """Add the end of the run to `meta` (date, load, commit) and return it."""
    meta.update(finished=now(), load_after=os.getloadavg(), code_end=code_version())
    return meta


# -- the role records of a job (provenance.py) ----------------------------------------------
def read_roles(folder):
    """``{'<role>-<rank>': [records]}``: the records a job's processes left in `folder`."""
    return read_records(folder)[0]


def stock_check(stock, roles, num_roles=2 + NUM_WORKERS):
    """'ok' if every process of the job recorded itself and, for a stock baseline (`stock`),
    none had mxdelay: none imported it, and none saw an ``MXNET_*`` variable (the job's
    environment has none, so one there was set by ``import mxdelay``: a scheduler or server
    leaves that import only to exit, without it in ``sys.modules``); else why not.
    `num_roles`: the job's processes (scheduler, servers, workers).
    """
    problems = []
    if len(roles) != num_roles:
        problems.append('%d role records' % len(roles))
    for name, records in roles.items() if stock else ():
        seen = sorted({k for r in records for k in r['env'] if k.startswith('MXNET_')})
        if any(r['mxdelay_imported'] or r['kvstore_ext_imported'] for r in records):
            problems.append('%s imported mxdelay' % name)
        elif seen:
            problems.append('%s saw %s' % (name, ', '.join(seen)))
    return 'ok' if not problems else '; '.join(problems)


def worker_env(roles):
    """The MXNET_* variables the workers saw (at exit: after any import of mxdelay)."""
    seen = set()
    for name, records in roles.items():
        if name.startswith('worker'):
            env = records[-1]['env']
            seen.add(' '.join('%s=%s' % (k, v) for k, v in env.items() if k.startswith('MXNET_'))
                     or '(none)')
    return ' | '.join(sorted(seen))
