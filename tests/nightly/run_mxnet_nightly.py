"""Run MXNet 1.9.1's own distributed kvstore test on stock ``dist_sync`` and on ``'dist_delay'``.

MXNet's CI (``ci/docker/runtime_functions.sh``, ``integrationtest_ubuntu_cpu_dist_kvstore``
at tag 1.9.1) runs ``tests/nightly/dist_sync_kvstore.py`` under ``tools/launch.py`` in 7
modes, the compressed one with and without multi-precision: the 8 jobs of :data:`MODES`.
This runner runs each through mxdelay's launcher, once with the stock store and stock
servers (the baseline) and once with the store switched to ``'dist_delay'`` under
``mxdelay-run`` (mxdelay's servers), each with a hard timeout, and prints one table: mode ->
outcome on each store, with the failure's last exception line.

MXNet's files are not part of mxdelay. Get them from the apache/mxnet repository at tag
1.9.1 (the compressed modes import ``test_kvstore.py`` from the same folder)::

    git clone --depth 1 --branch 1.9.1 https://github.com/apache/mxnet mxnet-1.9.1
    PYTHONPATH=$PWD python tests/nightly/run_mxnet_nightly.py \\
        --source mxnet-1.9.1/tests/nightly/dist_sync_kvstore.py

(or fetch only ``tests/nightly/dist_sync_kvstore.py`` and ``tests/nightly/test_kvstore.py``
into one folder). MXNet's CI runs 7 workers and 7 servers; the default here is 3 workers and
2 servers (``-n``, ``-s``). ``--mode`` and ``--store`` pick a subset, ``--log-dir`` keeps every
job's output, ``--timeout`` is the hard limit per job in seconds. ``--out DIR`` writes the
results file, ``DIR/results.json`` and the Markdown made from it, ``DIR/results.md``, with the
command, dates, commit, machine, the test file's sha256 and ``--source-rev`` (where it came
from: say the tag and commit). Exit code 0 when every job run passed.

How the store is switched: the runner runs itself on every role as the job's command
(``--wrap``); on a worker it replaces ``mx.kv.create`` by a function that creates once
``'dist_delay'`` where the test asks for ``'dist_sync'``, then runs MXNet's file with
:mod:`runpy` as ``__main__``, in a fresh temporary folder (the test writes files there).
Nothing of MXNet's test is copied. Two more things the wrapper does, for both stores alike:
a worker whose test raises prints the traceback and leaves with ``os._exit(1)`` (else it
would hang in ps-lite's exit barrier until the timeout), and ``NDArray.reshape`` accepts
integral floats, which the test passes and Python >= 3.10 refuses
(:func:`_accept_integral_float_shapes`).

MXNet's test sets MXNet's own ``Test`` optimizer on the store in the ``default`` modes, and
its update raises on every row_sparse key (``state[:] = weight`` with the row_sparse weight
MXNet's server hands it) after it has updated the weight: MXNet's server prints the error
and goes on, and the test passes. mxdelay's servers stop the job on such an error unless
``MXDELAY_UPDATER_ERRORS=log`` (docs/design.md §3.2), which the runner sets for the
``dist_delay`` jobs of those modes (:data:`DELAY_ENV`; ``--delay-env NAME=VALUE`` adds to or
overrides it for every ``dist_delay`` job, e.g. ``--delay-env MXDELAY_UPDATER_ERRORS=stop``).

Cleanup: each job's launcher runs in a session of its own; on the timeout the runner
sends SIGTERM to the launcher's process group (the launcher then stops every role, which
it started in process groups of their own, and each role dies with the launcher through
``PR_SET_PDEATHSIG``), and SIGKILL to that group after a grace period.
"""
import argparse
import hashlib
import json
import os
import re
import runpy
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import traceback

__all__ = ['MODES', 'DELAY_ENV', 'STORES', 'main']

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_LAUNCHER = os.path.join(_REPO, 'mxdelay', 'launcher.py')

#: name -> the test's arguments, as MXNet 1.9.1's CI runs them (in this order).
MODES = {
    'gluon_step': ['--type=gluon_step_cpu'],
    'gluon_sparse_step': ['--type=gluon_sparse_step_cpu'],
    'invalid': ['--type=invalid_cpu'],
    'gluon_type': ['--type=gluon_type_cpu'],
    'default': [],
    'default --no-multiprecision': ['--no-multiprecision'],
    'compressed': ['--type=compressed_cpu'],
    'compressed --no-multiprecision': ['--type=compressed_cpu', '--no-multiprecision'],
}
#: mode -> what the runner sets for its 'dist_delay' jobs: MXNet's Test optimizer raises on
#: row_sparse keys on MXNet's servers too, which log it and go on (see the docstring).
DELAY_ENV = {'default': {'MXDELAY_UPDATER_ERRORS': 'log'},
             'default --no-multiprecision': {'MXDELAY_UPDATER_ERRORS': 'log'}}
#: The stores compared: MXNet's own, and mxdelay's.
STORES = ('dist_sync', 'dist_delay')

#: What MXNet's CI exports for these jobs.
_CI_ENV = {'MXNET_STORAGE_FALLBACK_LOG_VERBOSE': '0', 'MXNET_SUBGRAPH_VERBOSE': '0',
           'MXNET_USE_OPERATOR_TUNING': '0', 'DMLC_LOG_STACK_TRACE_DEPTH': '10'}
_KILL_GRACE = 15.0  # the launcher's own stop takes KILL_GRACE (3 s) plus draining
_EXCEPTION_LINE = re.compile(r'^[\w.]*(Error|Exception|Exit)\b')  # a traceback's last line
_ERROR_LINE = re.compile(r'(Error|error:)')


def _wrap(store, source, test_args):
    """Run MXNet's test file `source` as ``__main__`` with ``'dist_sync'`` meaning `store`."""
    import mxnet as mx  # pylint: disable=import-outside-toplevel
    # On the stock servers and scheduler `import mxnet` ran the role and exited above.
    if store != 'dist_sync':
        create = mx.kv.create

        def create_switched(name='local'):
            if name == 'dist_sync':  # the test's store, created once at import
                mx.kv.create = create  # 'dist_delay' builds on a native 'dist_sync' store
                name = store
            return create(name)
        mx.kv.create = create_switched
    _accept_integral_float_shapes(mx.nd.NDArray)
    folder = os.path.dirname(os.path.abspath(source))
    sys.path.insert(0, folder)  # the compressed modes import test_kvstore from there
    sys.argv = [source] + test_args
    with tempfile.TemporaryDirectory(prefix='mxnet-nightly-') as work:
        os.chdir(work)
        try:
            runpy.run_path(source, run_name='__main__')
        except Exception:  # pylint: disable=broad-except
            # A worker that raises would hang in ps-lite's exit barrier while the others
            # wait for it (docs/design.md §7.4): report and leave at once.
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)  # pylint: disable=protected-access


def _accept_integral_float_shapes(ndarray):
    """Let ``NDArray.reshape`` take ``4.0`` for ``4``, as it did before Python 3.10.

    The test reshapes to ``(num_rows/2, 2)``, a float in Python 3; since Python 3.10 ctypes
    refuses floats for integers, and the test fails on stock ``dist_sync`` before it reaches
    the store. Only integral floats are converted, for both stores alike.
    """
    reshape = ndarray.reshape

    def reshape_integral(self, *shape, **kwargs):
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        shape = tuple(int(d) if isinstance(d, float) and d.is_integer() else d for d in shape)
        return reshape(self, shape, **kwargs)
    ndarray.reshape = reshape_integral


def _command(store, source, test_args, workers, servers, timeout):
    """The launcher command of one job."""
    wrapper = [sys.executable, os.path.abspath(__file__), '--wrap', store, '--source',
               os.path.abspath(source), '--'] + test_args
    if store == 'dist_delay':  # mxdelay's scheduler and servers; workers exec the wrapper
        wrapper = [sys.executable, '-m', 'mxdelay.run'] + wrapper
    return ([sys.executable, _LAUNCHER, '-n', str(workers), '-s', str(servers),
             '--timeout', '%g' % timeout] + wrapper)


def _run_job(command, timeout, log_path, extra_env):
    """Run one job with `extra_env` set; return (outcome, message). Every process started
    is gone on return."""
    environ = {**os.environ, **_CI_ENV, **extra_env}
    environ['PYTHONPATH'] = os.pathsep.join(
        [_REPO] + [p for p in environ.get('PYTHONPATH', '').split(os.pathsep) if p])
    started = time.monotonic()
    with open(log_path, 'w+b') as log:
        # pylint: disable-next=consider-using-with
        launcher = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=environ,
                                    start_new_session=True)
        try:
            # The launcher's own --timeout normally ends the job; this is the hard limit.
            code = launcher.wait(timeout + 2 * _KILL_GRACE)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            _stop_group(launcher)
        log.seek(0)
        output = log.read().decode('utf-8', 'replace')
    seconds = time.monotonic() - started
    if code == 0:
        return 'pass', '%.0f s' % seconds
    if code is None or code == 124:
        return 'TIMEOUT', 'no result after %.0f s' % seconds
    return 'FAIL', '%s (exit %d, %.0f s)' % (_last_error(output), code, seconds)


def _stop_group(popen):
    """End the launcher's process group: SIGTERM, then SIGKILL after a grace period."""
    if popen.poll() is None:
        _signal_group(popen.pid, signal.SIGTERM)
        try:
            popen.wait(_KILL_GRACE)
        except subprocess.TimeoutExpired:
            pass
    _signal_group(popen.pid, signal.SIGKILL)  # also what the exited leader left behind
    popen.wait()


def _signal_group(pgid, signum):
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        pass


def _last_error(output):
    """The last exception a worker reports, else a server, else the launcher's verdict."""
    lines = output.splitlines()
    for role in ('[worker', '[server', '[scheduler'):
        texts = [line.split('] ', 1)[-1] for line in lines if line.startswith(role)]
        for pattern in (_EXCEPTION_LINE, _ERROR_LINE):
            found = [text for text in texts if pattern.search(text)]
            if found:
                return '%s: %s' % (role[1:], found[-1].strip()[:300])
    verdicts = [line for line in lines if line.startswith('mxdelay-launch:')]
    return (verdicts or lines or ['no output'])[-1]


def _table(modes, stores, results, delay_env):
    """The Markdown table: mode -> outcome per store, and the dist_delay jobs' environment."""
    lines = ['| mode | %s | dist_delay environment |' % ' | '.join(stores),
             '|---|%s---|' % ('---|' * len(stores))]
    for mode in modes:
        extra = {**DELAY_ENV.get(mode, {}), **delay_env} if 'dist_delay' in stores else {}
        lines.append('| %s | %s | %s |' % (mode, ' | '.join(
            results[mode, store][0] if results[mode, store][0] == 'pass'
            else '%s: %s' % results[mode, store] for store in stores),
            ' '.join('`%s=%s`' % item for item in sorted(extra.items())) or '-'))
    return '\n'.join(lines) + '\n'


def _provenance():
    sys.path.insert(0, os.path.join(_REPO, 'benchmarks'))
    import provenance  # pylint: disable=import-outside-toplevel,import-error
    return provenance


def _start_meta(args, modes, stores, delay_env):
    provenance = _provenance()
    with open(args.source, 'rb') as src:
        digest = hashlib.sha256(src.read()).hexdigest()
    return {'command': 'PYTHONPATH=$PWD python tests/nightly/run_mxnet_nightly.py '
                       + shlex.join(sys.argv[1:]),
            'started': provenance.now(), 'load_before': os.getloadavg(),
            'code': provenance.code_version(), 'machine': provenance.machine(),
            'source': os.path.abspath(args.source), 'source_sha256': digest,
            'source_rev': args.source_rev, 'workers': args.num_workers,
            # What every job inherits: MXNet's, DMLC's and mxdelay's variables of the runner
            # (e.g. MXNET_ENGINE_TYPE), then MXNet's CI settings.
            'environment': {**{k: v for k, v in sorted(os.environ.items())
                               if k.startswith(('MXNET_', 'DMLC_', 'MXDELAY_'))}, **_CI_ENV},
            'servers': args.num_servers, 'timeout': args.timeout, 'modes': modes,
            'stores': stores, 'delay_env': {m: {**DELAY_ENV.get(m, {}), **delay_env}
                                            for m in modes}}


def _write_results(folder, meta, modes, stores, results, table):
    """Write the results file: `folder`/results.json, and results.md made from it."""
    provenance = _provenance()
    meta.update(finished=provenance.now(), load_after=os.getloadavg())
    rows = [{'mode': mode, 'args': MODES[mode], 'store': store,
             'outcome': results[mode, store][0], 'detail': results[mode, store][1]}
            for mode in modes for store in stores]
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, 'results.json'), 'w', encoding='utf-8') as dst:
        json.dump({'meta': meta, 'rows': rows}, dst, indent=1)
        dst.write('\n')
    code = meta['code']
    with open(os.path.join(folder, 'results.md'), 'w', encoding='utf-8') as dst:
        dst.write('# MXNet 1.9.1\'s nightly kvstore test on `dist_sync` and `dist_delay`\n\n'
                  'Generated by `%s` (do not edit) from results.json: %s to %s, commit `%s`%s; '
                  '%d cores (%s); load average (1 min) %.2f before, %.2f after.\n\n'
                  'Test file: `tests/nightly/dist_sync_kvstore.py` of %s (sha256 `%s`), with '
                  '`test_kvstore.py` beside it. %d workers, %d servers, %g s timeout per job; '
                  'each mode as MXNet\'s CI runs it (`--type=...`), once on stock `dist_sync` '
                  '(MXNet\'s servers) and once with the store switched to `dist_delay` under '
                  '`mxdelay-run` (mxdelay\'s servers). A failure shows its last exception line '
                  '(`mxdelay-launch`\'s exit code and the time). Every job\'s environment '
                  'has %s.\n\n%s'
                  % (meta['command'], meta['started'], meta['finished'], code['commit'][:10],
                     ' (dirty: %s)' % ', '.join(code['dirty_files']) if code['dirty'] else '',
                     meta['machine']['cores'], meta['machine']['cpu'], meta['load_before'][0],
                     meta['load_after'][0], meta['source_rev'] or 'unknown origin',
                     meta['source_sha256'], meta['workers'], meta['servers'], meta['timeout'],
                     ', '.join('`%s=%s`' % item for item in sorted(meta['environment'].items())),
                     table))
        passed = ['%s on %s %s' % (row['mode'], row['store'], row['detail']) for row in rows
                  if row['outcome'] == 'pass']
        dst.write('\nTime per job: %s.\n' % (', '.join(passed) or 'none, no job passed'))


def build_parser():
    """Return the runner's argument parser."""
    parser = argparse.ArgumentParser(description=__doc__.split('\n', 1)[0])
    parser.add_argument('--source', required=True, metavar='PATH',
                        help="MXNet 1.9.1's tests/nightly/dist_sync_kvstore.py")
    parser.add_argument('--mode', action='append', choices=sorted(MODES),
                        help='run only this mode (repeatable; default: all, in CI order)')
    parser.add_argument('--store', action='append', choices=STORES,
                        help='run only on this store (repeatable; default: both)')
    parser.add_argument('-n', '--num-workers', type=int, default=3)
    parser.add_argument('-s', '--num-servers', type=int, default=2)
    parser.add_argument('--timeout', type=float, default=600.0,
                        help='hard limit per job in seconds (default 600)')
    parser.add_argument('--log-dir', help="keep each job's output in this folder")
    parser.add_argument('--out', metavar='DIR',
                        help='write DIR/results.json and DIR/results.md (the results file)')
    parser.add_argument('--source-rev', default='', metavar='TEXT',
                        help="where --source comes from, for the results file, e.g. 'apache/mxnet "
                             "tag 1.9.1, commit 3f8f3be'")
    parser.add_argument('--delay-env', action='append', default=[], metavar='NAME=VALUE',
                        help="set this in every dist_delay job's environment (repeatable; "
                             'over DELAY_ENV)')
    parser.add_argument('--wrap', choices=STORES, help=argparse.SUPPRESS)
    parser.add_argument('test_args', nargs='*', help=argparse.SUPPRESS)
    return parser


def main(argv=None):
    """Run the modes; print the table; return 0 if every job passed, else 1."""
    args = build_parser().parse_args(argv)
    if args.wrap:
        _wrap(args.wrap, args.source, args.test_args)
        return 0
    if not os.path.isfile(args.source):
        sys.exit('--source %r is not a file; get tests/nightly/dist_sync_kvstore.py of MXNet '
                 '1.9.1 (see this file\'s docstring)' % args.source)
    # SIGTERM ends the runner through SystemExit, so that the running job is stopped too.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    delay_env = {}
    for item in args.delay_env:
        name, equals, value = item.partition('=')
        if not equals or not name:
            sys.exit('--delay-env %r is not NAME=VALUE' % item)
        delay_env[name] = value
    modes = args.mode or list(MODES)
    stores = args.store or list(STORES)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix='mxnet-nightly-logs-')
    os.makedirs(log_dir, exist_ok=True)
    meta = _start_meta(args, modes, stores, delay_env) if args.out else None
    results = {}
    for mode in modes:
        for store in stores:
            log_path = os.path.join(log_dir, '%s.%s.log' % (mode.replace(' ', ''), store))
            command = _command(store, args.source, MODES[mode], args.num_workers,
                               args.num_servers, args.timeout)
            extra_env = {} if store == 'dist_sync' else {**DELAY_ENV.get(mode, {}), **delay_env}
            results[mode, store] = _run_job(command, args.timeout, log_path, extra_env)
            sys.stdout.write('%-32s %-10s %-7s %s\n' % ((mode, store) + results[mode, store]))
            sys.stdout.flush()
    table = _table(modes, stores, results, delay_env)
    sys.stdout.write('\n' + table + '\nlogs: %s\n' % log_dir)
    if args.out:
        _write_results(args.out, meta, modes, stores, results, table)
    return 0 if all(outcome == 'pass' for outcome, _ in results.values()) else 1


if __name__ == '__main__':
    sys.exit(main())
