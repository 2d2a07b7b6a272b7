"""The benchmarks' harness: one launcher job, its clean environment, the methods and networks.

Every benchmark script starts its jobs through :class:`Job`: ``mxdelay/launcher.py`` run as a
plain file (``-m mxdelay.launcher`` would import the mxdelay package, which sets mxdelay's
MXNet defaults in the launcher's environment, which local roles inherit; a baseline job must
see MXNet's defaults), with the explicit environment of :func:`job_env` (the driver's minus
every ``DMLC_*``, ``MXNET_*`` and ``MXDELAY_*`` variable, plus ``OMP_NUM_THREADS=1``:
docs/benchmarks/README.md, rule 3). :data:`METHODS` declares every method once (trainer kind,
delay, compression, extra worker arguments; a stock baseline is ``--mode sync``), and
:data:`NETWORKS` every link. A run's results record :func:`start_meta` and
:func:`finish_meta` (from ``provenance.py``: commit, machine, dates), its rows the role
records of its processes (:func:`stock_check`, :func:`worker_env`).

The scripts are run as files (``python benchmarks/NAME.py``), so this folder is first on
``sys.path`` and ``import harness`` finds this module; :data:`REPO` is the repository.
"""
import argparse
import contextlib
import dataclasses
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple, Optional, Tuple

from cpu_monitor import CpuMonitor
import netns
from provenance import code_version, machine, now, read_records
import report

__all__ = ['REPO', 'HERE', 'LAUNCHER', 'WORKER', 'NUM_WORKERS', 'BATCH', 'Method', 'METHODS',
           'TWO_BIT_THRESHOLD', 'methods', 'Network', 'NETWORKS', 'Job', 'run_worker', 'stop',
           'started', 'wait_all', 'run_window',
           'shaped_network', 'job_env', 'command_line', 'start_meta', 'finish_meta',
           'read_roles', 'stock_check', 'worker_env', 'run_method', 'parser', 'names', 'ints',
           'ordered', 'Interrupted', 'handle_signals', 'interruptible']

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
LAUNCHER = os.path.join(REPO, 'mxdelay', 'launcher.py')
WORKER = os.path.join(HERE, 'bench_worker.py')
NUM_WORKERS, BATCH = 2, 128
_STRIPPED = ('DMLC_', 'MXNET_', 'MXDELAY_')


# -- methods and networks --------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Method:
    """One method of ``bench_worker.py``: its label and what it runs; :attr:`args` are the
    worker arguments it implies.

    `warmup` is the number of synchronous warm-up steps of a delayed method's training runs,
    None for the script's own default (``tta.py``: 200). It is not in :attr:`args`: each
    script passes ``--warmup-steps`` itself (its short timing runs shorten the warm-up), and
    two methods that differ only in it run the same job per step (:attr:`job`).
    """
    label: str
    trainer: str = 'delayed'          # bench_worker's --mode: sync or delayed
    delay: Optional[int] = None
    extra: Tuple[str, ...] = ()       # further worker arguments (e.g. the local rule)
    compression: Optional[str] = None
    env: Tuple[Tuple[str, str], ...] = ()   # variables added to the job's environment
    warmup: Optional[int] = None      # warm-up steps of training runs; None: the script's

    def __post_init__(self):
        if self.warmup is not None and (not isinstance(self.warmup, int) or self.warmup < 0
                                        or self.stock):
            raise ValueError('Method %r: warmup=%r; give a whole number of steps >= 0 for a '
                             'delayed method, or None for the script\'s default'
                             % (self.label, self.warmup))

    @property
    def args(self):
        """The worker arguments: mode, delay, `extra`, compression, in that order."""
        return (['--mode', self.trainer] + (['--delay', str(self.delay)] if self.delay else [])
                + list(self.extra)
                + (['--compression', self.compression] if self.compression else []))

    @property
    def stock(self):
        """Whether this is a stock baseline: no process of its job may import mxdelay."""
        return self.trainer == 'sync'

    @property
    def job(self):
        """What a step runs: worker arguments and environment (the warm-up's length and the
        label left out). Methods with equal jobs have the same per-phase step times."""
        return tuple(self.args), self.env


TWO_BIT_THRESHOLD = 0.5
_TWO_BIT = '2bit:%g' % TWO_BIT_THRESHOLD
_MIRROR = ('--local-rule', 'mirror')
_FROZEN = ('--freeze-second-moment',)
_BOUND_2M = (('MXNET_KVSTORE_BIGARRAY_BOUND', '2000000'),)
#: name -> Method: every method of every benchmark, declared once.
METHODS = {
    'sync': Method('dist_sync (stock)', trainer='sync'),
    'sync-2bit': Method('dist_sync + 2bit (stock)', trainer='sync', compression=_TWO_BIT),
    'k2': Method('k=2', delay=2),
    'k4': Method('k=4', delay=4),
    'k8': Method('k=8', delay=8),
    'k16': Method('k=16', delay=16),
    'k4-fp16': Method('k=4 + fp16', delay=4, compression='fp16'),
    'k4-2bit': Method('k=4 + 2bit', delay=4, compression=_TWO_BIT),
    'mirror-k4': Method('k=4', delay=4, extra=_MIRROR),
    'mirror-k4-fp16': Method('k=4 + fp16', delay=4, extra=_MIRROR, compression='fp16'),
    'sgd-k4': Method("literal 'sgd' rule, k=4", delay=4, extra=('--local-rule', 'sgd')),
    # The global model with the workers' mean BatchNorm statistics (docs/design.md §2.13).
    'k4-aux': Method('k=4, mean BatchNorm statistics', delay=4, extra=('--aux-states',)),
    'k8-aux': Method('k=8, mean BatchNorm statistics', delay=8, extra=('--aux-states',)),
    'drift-k4': Method("rule 'drift', k=4", delay=4, extra=('--local-rule', 'drift')),
    'drift-k8': Method("rule 'drift', k=8", delay=8, extra=('--local-rule', 'drift')),
    'drift-k16': Method("rule 'drift', k=16", delay=16, extra=('--local-rule', 'drift')),
    # Compressed pulls (docs/design.md §2.12); 2bit at 0.05, the best fixed threshold for
    # SGD-momentum measured earlier (0.5, the stock default above, trained to 0.38).
    'k4-pull-fp16': Method('k=4 + pull fp16', delay=4, extra=('--pull-compression', 'fp16')),
    'k4-pull-int8': Method('k=4 + pull int8', delay=4, extra=('--pull-compression', 'int8')),
    'k4-2bit-pull-int8': Method('k=4 + 2bit 0.05 + pull int8', delay=4,
                                extra=('--pull-compression', 'int8'), compression='2bit:0.05'),
    # float16 pushes with int8 pulls: the fewest bytes of the exact-sum settings (§2.11).
    'k4-fp16-pull-int8': Method('k=4 + fp16 + pull int8', delay=4,
                                extra=('--pull-compression', 'int8'), compression='fp16'),
    # Blockwise quantized pushes with error feedback, one row per worker (§2.14), at the
    # default block of 256 values.
    'k4-int8': Method('k=4 + int8', delay=4, compression='int8'),
    'k4-int4': Method('k=4 + int4', delay=4, compression='int4'),
    'k4-ternary': Method('k=4 + ternary', delay=4, compression='ternary'),
    'k4-int8-pull-int8': Method('k=4 + int8 + pull int8', delay=4,
                                extra=('--pull-compression', 'int8'), compression='int8'),
    'k4-int4-pull-int8': Method('k=4 + int4 + pull int8', delay=4,
                                extra=('--pull-compression', 'int8'), compression='int4'),
    'k4-ternary-pull-int8': Method('k=4 + ternary + pull int8', delay=4,
                                   extra=('--pull-compression', 'int8'), compression='ternary'),
    'k8-ternary-pull-int8': Method('k=8 + ternary + pull int8', delay=8,
                                   extra=('--pull-compression', 'int8'), compression='ternary'),
    'k8-fp16-pull-int8': Method('k=8 + fp16 + pull int8', delay=8,
                                extra=('--pull-compression', 'int8'), compression='fp16'),
    # Adam with its second moment frozen at the switch (mxdelay.FrozenVarianceAdam, §1.4).
    'k4-fv': Method('k=4, v frozen', delay=4, extra=_FROZEN),
    'k8-fv': Method('k=8, v frozen', delay=8, extra=_FROZEN),
    'k16-fv': Method('k=16, v frozen', delay=16, extra=_FROZEN),
    'k4-ternary-pull-int8-fv': Method('k=4 + ternary + pull int8, v frozen', delay=4,
                                      extra=('--pull-compression', 'int8') + _FROZEN,
                                      compression='ternary'),
    # Whole-tensor optimizers (LAMB) on the MLP, whose 1024 x 1024 weight reaches MXNet's
    # default bound of a million elements: mxdelay keeps tensors whole only below it.
    'k4-bound2m': Method('k=4, bound 2M', delay=4, env=_BOUND_2M),
    'k8-bound2m': Method('k=8, bound 2M', delay=8, env=_BOUND_2M),
}
# The same with shorter warm-ups (issue 20: the shortest warm-up that keeps accuracy).
for _name, _label in (('k4-fp16-pull-int8', 'k=4 + fp16 + pull int8'),
                      ('k8-fp16-pull-int8', 'k=8 + fp16 + pull int8'),
                      ('k4-ternary-pull-int8', 'k=4 + ternary + pull int8')):
    for _w in (0, 50, 100):
        METHODS['%s-w%d' % (_name, _w)] = dataclasses.replace(
            METHODS[_name], warmup=_w, label='%s, warm-up %d' % (_label, _w))
del _name, _label, _w
# The same evaluated as the global model: every worker calls sync_weights() at each
# evaluation (tta.py otherwise evaluates worker 0's own weights, a pull plus up to k local
# steps).
for _name in ('k4', 'k4-ternary-pull-int8'):
    METHODS[_name + '-gm'] = dataclasses.replace(
        METHODS[_name], extra=METHODS[_name].extra + ('--global-model',),
        label=METHODS[_name].label + ', global model')
del _name
# Stock dist_sync with MXNet's 2bit at thresholds below its documented 0.5 (which does not
# train the MLP): the search for stock's best threshold (issue 20).
for _t in ('0.1', '0.05', '0.02', '0.01', '0.005', '0.002'):
    METHODS['sync-2bit-' + _t] = Method('dist_sync + 2bit %s (stock)' % _t, trainer='sync',
                                        compression='2bit:' + _t)
del _t


def methods(*names):
    """``{name: Method}`` of `names`, in order; ``'name=registry-name'`` takes a registry
    method under another name, e.g. ``methods('sync', 'k4=mirror-k4')``."""
    chosen = {}
    for name in names:
        name, _, source = name.partition('=')
        chosen[name] = METHODS[source or name]
    return chosen


class Network(NamedTuple):
    """One network of the benchmarks: label and ``tc`` rate (None: loopback)."""
    label: str
    rate: Optional[str] = None


#: name -> Network: every link the benchmarks shape (benchmarks/netns.py).
NETWORKS = {
    'loopback': Network('loopback'),
    '1gbit': Network('1 Gbit/s links', '1gbit'),
    '100mbit': Network('100 Mbit/s links', '100mbit'),
}


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
        Variables added to :func:`job_env`.
    environ : dict, optional
        The whole environment instead (the few benchmarks whose jobs keep some of the
        driver's MXNet settings); stock baselines never use it.
    """

    def __init__(self, command, timeout, num_workers=NUM_WORKERS, num_servers=1,
                 hostfile=None, env=None, environ=None):
        self.command = list(command)
        self.timeout = timeout
        self.num_workers, self.num_servers = num_workers, num_servers
        self.hostfile = hostfile
        self.extra_env = dict(env or {})
        self.environ = environ

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
        if self.environ is not None:
            return dict(self.environ, **self.extra_env)
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


def run_worker(folder, worker_args, timeout, hostfile=None, env=None,
               num_workers=NUM_WORKERS, num_servers=1):
    """Run one launcher job of bench_worker.py with `worker_args` (``--out`` added) in the
    emptied `folder` (its log, the workers' results and the role records go there); `env`:
    variables added to the job's environment (:attr:`Method.env`); `num_workers` workers and
    `num_servers` servers.

    Returns (exit code, worker results, the CpuMonitor of the job, the role records).
    """
    _empty(folder)
    out = os.path.join(folder, 'worker-{rank}.json')
    job = Job([sys.executable, WORKER] + worker_args + ['--out', out], timeout,
              num_workers, num_servers, hostfile=hostfile, env=env)
    monitor = CpuMonitor({os.getpid(): 'driver'})
    code = job.run(os.path.join(folder, 'log.txt'), monitor)
    results = []
    if code == 0:
        for rank in range(job.num_workers):
            with open(out.format(rank=rank), encoding='utf-8') as src:
                results.append(json.load(src))
    return code, results, monitor, read_roles(folder)


@contextlib.contextmanager
def started(argvs, log_path):
    """Start each argv (a launcher job's) with :func:`job_env` in a
    session of its own, output to `log_path` (each preceded by its command line); yield the
    Popens, and :func:`stop` them on exit."""
    popens = []
    with open(log_path, 'ab') as log:
        try:
            for argv in argvs:
                log.write(('$ %s\n' % shlex.join(argv)).encode())
                log.flush()
                popens.append(subprocess.Popen(  # pylint: disable=consider-using-with
                    argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    env=job_env(), cwd=REPO, start_new_session=True))
            yield popens
        finally:
            for popen in popens:
                stop(popen)


def wait_all(popens, timeout):
    """The exit codes of `popens` (or 'timeout after ...'), waiting `timeout` s in all."""
    deadline = time.monotonic() + timeout
    codes = []
    for popen in popens:
        try:
            codes.append(popen.wait(max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append('timeout after %g s' % timeout)
    return codes


def run_window(row, folder, worker, hostfile, timeout,
               num_workers=NUM_WORKERS, num_servers=1, batch=BATCH, monitor=None):
    """Run one window job of bench_worker.py (`worker`: its argv without ``--out``) in the
    emptied `folder`; `hostfile`: as :class:`Job`'s.

    `row` (with ``steps``) gains the load, the wall time, the job's samples/s over the
    window (from the first worker's window start to the last one's end), the cores each
    role and the rest of the machine used in the window, and worker 0's step times; or
    ``error``. `monitor`: another context manager entered for the job's duration (e.g. counters).
    Returns ``(row, the workers' results)`` (no results after an error).
    """
    steps = row['steps']
    _empty(folder)
    out = os.path.join(folder, 'worker-{rank}.json')
    worker = worker + ['--out', out]
    row['load_before'] = os.getloadavg()[0]
    log_path = os.path.join(folder, 'log.txt')
    argvs = [Job(worker, timeout, num_workers, num_servers, hostfile).argv]
    begun = time.time()
    with started(argvs, log_path) as popens, (monitor or contextlib.nullcontext()):
        with CpuMonitor({os.getpid(): 'driver'}) as cpu:
            codes = wait_all(popens, timeout + 30)
    row['wall_s'] = time.time() - begun
    if any(code != 0 for code in codes):
        row['error'] = 'exit %s; see %s' % (codes, log_path)
        return row, []
    results = [report.read_json(out.format(rank=rank)) for rank in range(num_workers)]
    start = min(result['start'] for result in results)
    end = max(result['end'] for result in results)
    row.update(samples_per_s=num_workers * steps * batch / (end - start),
               ms_per_step=1000 * (end - start) / steps, window_s=end - start)
    usage = cpu.usage(start, end)
    row.update(cpu_workers=sum(v for k, v in usage.items() if k.startswith('worker')),
               cpu_server=sum((v for k, v in usage.items() if k.startswith('server')), 0.0),
               cpu_scheduler=usage.get('scheduler', 0.0),
               cpu_launcher=usage.get('launcher', 0.0) + usage.get('driver', 0.0),
               cpu_other=usage['other'])
    # Step times of worker 0 by position in the pull period (delayed: the pull is issued at
    # position k-1 and waited for at position 0 of the next period).
    ends = [results[0]['start']] + results[0]['step_ends']
    row['step_ms'] = ' '.join('%.1f' % (1000 * (b - a)) for a, b in zip(ends, ends[1:]))
    report.write_json(os.path.join(folder, 'row.json'), row, indent=None)
    return row, results


def _empty(folder):
    os.makedirs(folder, exist_ok=True)
    for stale in os.listdir(folder):
        os.remove(os.path.join(folder, stale))


def run_method(folder, method, worker_args, timeout, hostfile=None,
               num_workers=NUM_WORKERS, num_servers=1):
    """:func:`run_worker` of `method` (a :class:`Method`: its arguments first, then
    `worker_args`) with `num_workers` workers and `num_servers` servers, and what every row of
    such a run records.

    Returns (exit code, worker results, CpuMonitor, info): `info` holds ``load_before``,
    ``load_after`` (1-minute load average), ``job_s``, ``stock_check`` and ``worker_env``.
    """
    load, started = os.getloadavg()[0], time.time()
    code, results, monitor, roles = run_worker(folder, method.args + list(worker_args), timeout,
                                               hostfile, dict(method.env) or None,
                                               num_workers, num_servers)
    return code, results, monitor, dict(
        load_before=load, load_after=os.getloadavg()[0], job_s=time.time() - started,
        stock_check=stock_check(method.stock, roles, 1 + num_servers + num_workers),
        worker_env=worker_env(roles))


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
    """``{'<role>-<rank>': [records]}``: the records bench_worker.py left in `folder`."""
    return read_records(folder)[0]


def stock_check(stock, roles, num_roles=2 + NUM_WORKERS):
    """'ok' if the job's processes imported mxdelay exactly when they should; else why not.

    `stock`: whether the job is a stock baseline; `num_roles`: the job's processes
    (scheduler, servers, workers).
    """
    problems = []
    if len(roles) != num_roles:
        problems.append('%d role records' % len(roles))
    for name, records in roles.items():
        imported = any(r['mxdelay_imported'] or r['kvstore_ext_imported'] for r in records)
        if stock and imported:
            problems.append('%s imported mxdelay' % name)
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
