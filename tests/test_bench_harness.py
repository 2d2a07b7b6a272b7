"""benchmarks/harness.py: every scenario's job argv and environment, without running a job.

The expected values were captured from the scripts before they moved onto the harness.
"""
import json
import os
import signal
import subprocess
import sys
from unittest import mock

import pytest

from support.jobs import PidFile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, 'benchmarks'))

# pylint: disable=wrong-import-position
import accuracy_cnn  # noqa: E402
import accuracy_gaps  # noqa: E402
import amp_cost  # noqa: E402
import compress  # noqa: E402
import faults  # noqa: E402
import fp16_bytes  # noqa: E402
import harness  # noqa: E402
import kvstore_roundtrip  # noqa: E402
import memory  # noqa: E402
import netns as bench_netns  # noqa: E402
import overlap  # noqa: E402
import positional  # noqa: E402
import provenance  # noqa: E402
import report  # noqa: E402
import scaling  # noqa: E402
import tta  # noqa: E402
import tta_combine  # noqa: E402
import wire_bytes  # noqa: E402
import worker_cpu  # noqa: E402
# pylint: enable=wrong-import-position

LAUNCHER = os.path.join(REPO, 'mxdelay', 'launcher.py')
WORKER = os.path.join(REPO, 'benchmarks', 'bench_worker.py')
DELAYED = ['--mode', 'delayed', '--delay']
#: scenario -> {method: (label, worker arguments)}, as the scripts had them
EXPECTED = {
    'tta': {'sync': ('dist_sync (stock)', ['--mode', 'sync']), 'k2': ('k=2', DELAYED + ['2']),
            'k4': ('k=4', DELAYED + ['4']), 'k8': ('k=8', DELAYED + ['8']),
            'drift-k4': ("rule 'drift', k=4", DELAYED + ['4', '--local-rule', 'drift']),
            'drift-k8': ("rule 'drift', k=8", DELAYED + ['8', '--local-rule', 'drift'])},
    'compress': {
        'sync': ('dist_sync (stock)', ['--mode', 'sync']),
        'sync-2bit': ('dist_sync + 2bit (stock)', ['--mode', 'sync', '--compression', '2bit:0.5']),
        'k4': ('k=4', DELAYED + ['4']),
        'k4-fp16': ('k=4 + fp16', DELAYED + ['4', '--compression', 'fp16']),
        'k4-2bit': ('k=4 + 2bit', DELAYED + ['4', '--compression', '2bit:0.5'])},
    'accuracy_cnn': {
        'sync': ('dist_sync (stock)', ['--mode', 'sync']), 'k4': ('k=4', DELAYED + ['4']),
        'k8': ('k=8', DELAYED + ['8']), 'k16': ('k=16', DELAYED + ['16']),
        'sgd-k4': ("literal 'sgd' rule, k=4", DELAYED + ['4', '--local-rule', 'sgd']),
        'k4-aux': ('k=4, mean BatchNorm statistics', DELAYED + ['4', '--aux-states']),
        'k8-aux': ('k=8, mean BatchNorm statistics', DELAYED + ['8', '--aux-states']),
        'k4-ternary-pull-int8': ('k=4 + ternary + pull int8', DELAYED + [
            '4', '--pull-compression', 'int8', '--compression', 'ternary']),
        'k4-fv': ('k=4, v frozen', DELAYED + ['4', '--freeze-second-moment']),
        'k8-fv': ('k=8, v frozen', DELAYED + ['8', '--freeze-second-moment']),
        'k16-fv': ('k=16, v frozen', DELAYED + ['16', '--freeze-second-moment']),
        'k4-ternary-pull-int8-fv': ('k=4 + ternary + pull int8, v frozen', DELAYED + [
            '4', '--pull-compression', 'int8', '--freeze-second-moment', '--compression',
            'ternary']),
        'drift-k4': ("rule 'drift', k=4", DELAYED + ['4', '--local-rule', 'drift']),
        'drift-k8': ("rule 'drift', k=8", DELAYED + ['8', '--local-rule', 'drift']),
        'drift-k16': ("rule 'drift', k=16", DELAYED + ['16', '--local-rule', 'drift']),
        'k4-int8-pull-int8': ('k=4 + int8 + pull int8', DELAYED + [
            '4', '--pull-compression', 'int8', '--compression', 'int8']),
        'k4-int4-pull-int8': ('k=4 + int4 + pull int8', DELAYED + [
            '4', '--pull-compression', 'int8', '--compression', 'int4']),
        'k8-ternary-pull-int8': ('k=8 + ternary + pull int8', DELAYED + [
            '8', '--pull-compression', 'int8', '--compression', 'ternary'])},
    'scaling': {
        'sync': ('dist_sync (stock)', ['--mode', 'sync']),
        'k4': ('k=4', DELAYED + ['4', '--local-rule', 'mirror']),
        'k4-fp16': ('k=4 + fp16', DELAYED + ['4', '--local-rule', 'mirror',
                                             '--compression', 'fp16']),
        'k4-ternary-pull-int8': ('k=4 + ternary + pull int8', DELAYED + [
            '4', '--pull-compression', 'int8', '--compression', 'ternary'])},
}
SCENARIOS = {'tta': tta, 'compress': compress, 'accuracy_cnn': accuracy_cnn,
             'scaling': scaling}


@pytest.fixture(name='driver_env')
def fixture_driver_env(monkeypatch):
    """The driver's environment holds variables that no job may inherit."""
    for name in ('DMLC_ROLE', 'MXNET_ENGINE_TYPE', 'MXDELAY_RANK'):
        monkeypatch.setenv(name, 'x')
    monkeypatch.setenv('OMP_NUM_THREADS', '8')


def _assert_clean(env):
    assert not [k for k in env if k.startswith(('DMLC_', 'MXNET_', 'MXDELAY_'))]
    assert env['OMP_NUM_THREADS'] == '1' and env['PYTHONUNBUFFERED'] == '1'


def test_accuracy_cnn_plots_every_method():
    assert set(accuracy_cnn.PLOT_STYLES) == set(accuracy_cnn.METHODS)


@pytest.mark.parametrize('scenario', sorted(EXPECTED))
def test_methods(scenario):
    table = SCENARIOS[scenario].METHODS
    assert list(table) == list(EXPECTED[scenario])
    for name, (label, args) in EXPECTED[scenario].items():
        assert (table[name].label, table[name].args) == (label, args)
        assert table[name].stock == (args[:2] == ['--mode', 'sync'])


@pytest.mark.parametrize('scenario', sorted(EXPECTED))
@pytest.mark.parametrize('hostfile', [None, '/tmp/hosts'])
def test_job_of_every_method(scenario, hostfile, driver_env):  # pylint: disable=unused-argument
    for method in SCENARIOS[scenario].METHODS.values():
        job = harness.Job([sys.executable, WORKER] + method.args, 100.7, 4, 2, hostfile)
        netns = ['--launcher', 'netns', '-H', hostfile] if hostfile else []
        # The launcher as a plain file (never -m: importing mxdelay would set its defaults).
        assert job.argv == ([sys.executable, LAUNCHER, '-n', '4', '-s', '2', '--timeout', '100']
                            + netns + ['--', sys.executable, WORKER] + method.args)
        _assert_clean(job.env)


def test_run_worker(tmp_path, monkeypatch, driver_env):  # pylint: disable=unused-argument
    seen = {}

    def fake_popen(argv, **kwargs):
        seen.update(argv=argv, **kwargs)
        return mock.Mock(pid=2 ** 22 - 7, poll=lambda: 1,
                         wait=lambda timeout=None: seen.update(timeout=timeout) or 1)
    monkeypatch.setattr(subprocess, 'Popen', fake_popen)
    folder = str(tmp_path / 'run')
    code, results, _, roles = harness.run_worker(folder, tta.METHODS['k4'].args, 2640, '/h')
    assert (code, results, roles) == (1, [], {})
    assert seen['argv'] == [
        sys.executable, LAUNCHER, '-n', '2', '-s', '1', '--timeout', '2640', '--launcher',
        'netns', '-H', '/h', '--', sys.executable, WORKER, '--mode', 'delayed', '--delay', '4',
        '--out', os.path.join(folder, 'worker-{rank}.json')]
    assert seen['cwd'] == REPO and seen['timeout'] == 2700 and seen['start_new_session']
    _assert_clean(seen['env'])
    with open(os.path.join(folder, 'log.txt'), encoding='utf-8') as src:
        assert src.readline().startswith('$ %s %s -n 2' % (sys.executable, LAUNCHER))


def test_faults_env(driver_env):  # pylint: disable=unused-argument
    env = harness.Job([], 60, env={'PYTHONPATH': REPO}).env
    _assert_clean(env)
    assert env['PYTHONPATH'] == REPO
    assert faults.JOB_TIMEOUT == 60


def test_networks():
    assert tta.NETWORKS == {'loopback': ('loopback', None, 100, 304, 1.0),
                            '1gbit': ('1 Gbit/s links', '1gbit', 40, 80, 2.0),
                            '100mbit': ('100 Mbit/s links', '100mbit', 12, 32, 10.0)}


def test_stock_check():
    clean = [{'mxdelay_imported': False, 'kvstore_ext_imported': False}]
    dirty = [{'mxdelay_imported': True, 'kvstore_ext_imported': False}]
    roles = {'scheduler-0': clean, 'server-0': clean, 'worker-0': clean, 'worker-1': dirty}
    assert harness.stock_check(False, roles) == 'ok'
    assert harness.stock_check(True, roles) == 'worker-1 imported mxdelay'
    assert harness.stock_check(False, roles, 5) == '4 role records'


def test_meta(driver_env):  # pylint: disable=unused-argument
    meta = harness.start_meta(harness.command_line('python benchmarks/x.py', ['--a', 'b c']),
                              settings={'k': 1})
    assert list(meta) == ['command', 'started', 'load_before', 'code_start', 'machine', 'repo',
                          'pythonpath', 'job_env_mxnet', 'settings']
    assert meta['command'] == "python benchmarks/x.py --a 'b c'" and meta['job_env_mxnet'] == {}
    assert meta['repo'] == REPO
    assert meta['code_start']['commit'] == provenance.git('rev-parse', 'HEAD')
    harness.finish_meta(meta)
    assert {'finished', 'load_after', 'code_end'} <= set(meta)
    assert provenance.meta_line(meta).startswith("`python benchmarks/x.py --a 'b c'`: ")


def test_loopback_needs_no_namespaces():
    with harness.shaped_network(4, None) as (net, hostfile):
        assert (net, hostfile) == (None, None)


# -- every scenario's jobs, as each script builds them (captured before the scripts shrank) ---
class _Launched:
    """Records what the scripts would start: subprocess.run and Popen do nothing, exit 1."""

    def __init__(self):
        self.calls = []

    def run(self, argv, **kwargs):
        if argv[0] in ('git', 'uname'):
            return subprocess.CompletedProcess(argv, 0, stdout='', stderr='')
        if argv[0] == 'ip':  # scaling's port counters: one idle port per node
            return subprocess.CompletedProcess(argv, 0, stdout=json.dumps([
                {'ifname': 'p%d' % i, 'stats64': {'rx': {'bytes': 0}, 'tx': {'bytes': 0}}}
                for i in range(16)]))
        self.calls.append((list(argv), kwargs))
        return subprocess.CompletedProcess(argv, 1 if LAUNCHER in argv else 0, stdout=json.dumps(
            {'cpu_ms': 1.0, 'check': 0.5}) + '\n', stderr='')

    def popen(self, argv, **kwargs):
        kwargs = dict(kwargs)
        self.calls.append((list(argv), kwargs))

        def wait(timeout=None):  # Job.run's wait: its timeout goes with the call's arguments
            kwargs.setdefault('timeout', timeout)
            return 1
        return mock.Mock(pid=2 ** 22 - 7, returncode=1, poll=lambda: 1, wait=wait)

    def only(self):
        """The argv and the environment's changes of the one job started."""
        (argv, kwargs), = self.calls
        return argv, _changes(kwargs.get('env'))


def _changes(env):
    """What `env` sets differently from the driver's environment, and what it drops."""
    return ({k: v for k, v in env.items() if os.environ.get(k) != v},
            sorted(k for k in os.environ if k not in env))


class _Net:
    """A shaped network without namespaces (netns.ShapedNetwork's interface); :attr:`log`
    has every network's rate when it was created and closed."""
    switch = 'sw'
    log = []

    def __init__(self, count=4, rate=None):
        self.nodes = [('ns%d' % i, '10.77.0.%d' % (i + 1)) for i in range(count)]
        self.rate = rate

    def __enter__(self):
        self.log.append(('created', self.rate))
        return self

    def __exit__(self, *exc):
        self.log.append(('closed', self.rate))

    def write_hostfile(self, path):
        with open(path, 'w', encoding='ascii') as dst:
            dst.write('\n')


@pytest.fixture(name='launched')
def fixture_launched(monkeypatch, driver_env):  # pylint: disable=unused-argument
    # The driver's environment: driver_env's variables, no other DMLC_/MXNET_/MXDELAY_ one
    # (an earlier test's `import mxdelay` sets its MXNet defaults in this process).
    for name in list(os.environ):
        if name.startswith(('DMLC_', 'MXNET_', 'MXDELAY_', 'PYTHONUNBUFFERED')) and name not in (
                'DMLC_ROLE', 'MXNET_ENGINE_TYPE', 'MXDELAY_RANK'):
            monkeypatch.delenv(name)
    monkeypatch.setenv('PYTHONPATH', '/driver/path')
    launched = _Launched()
    monkeypatch.setattr(subprocess, 'run', launched.run)
    monkeypatch.setattr(subprocess, 'Popen', launched.popen)
    monkeypatch.setattr(bench_netns, 'ShapedNetwork', _Net)
    monkeypatch.setattr(bench_netns, 'netns_available', lambda: None)
    monkeypatch.setattr(bench_netns, 'remove_stale', lambda: [])
    return launched


CLEAN = ({'OMP_NUM_THREADS': '1', 'PYTHONUNBUFFERED': '1'},
         ['DMLC_ROLE', 'MXDELAY_RANK', 'MXNET_ENGINE_TYPE'])
DATA = ['--data-dir', '/usr/share/datasets/fashion-mnist']


def _launch(*args):
    return [sys.executable, LAUNCHER, '-n'] + [str(a) for a in args] + ['--']


def test_tta_full_and_phases_jobs(tmp_path, launched):
    out, scratch = str(tmp_path / 'out'), str(tmp_path / 's')
    assert tta.main(['--part', 'full', '--out', out, '--scratch', scratch, '--seeds', '1,2',
                     '--epochs', '3', '--methods', 'sync,k4']) == 1
    full = [(argv, kwargs['timeout']) for argv, kwargs in launched.calls]
    assert [argv[argv.index('--mode'):argv.index('--epochs')] for argv, _ in full] == [
        ['--mode', 'sync'], DELAYED + ['4'], DELAYED + ['4'], ['--mode', 'sync']]
    assert full[0] == (_launch(2, '-s', 1, '--timeout', 1002) + [
        sys.executable, WORKER, '--mode', 'sync', '--epochs', '3', '--seed', '1',
        '--warmup-steps', '200', '--eval-every', '78'] + DATA + [
            '--out', os.path.join(scratch, 'full', 'sync-s1', 'worker-{rank}.json')], 1062)
    launched.calls.clear()
    assert tta.main(['--part', 'phases', '--out', out, '--scratch', scratch, '--rounds', '2',
                     '--networks', 'loopback,1gbit', '--methods', 'sync,k8']) == 1
    names = [argv[-1].split(os.sep)[-2] for argv, _ in launched.calls]
    assert names == ['loopback-sync-r1', 'loopback-k8-r1', 'loopback-k8-r2', 'loopback-sync-r2',
                     'loopback-as-1gbit-sync-r1', 'loopback-as-1gbit-k8-r1', '1gbit-sync-r1',
                     '1gbit-k8-r1', '1gbit-k8-r2', '1gbit-sync-r2']
    argv, kwargs = launched.calls[7]
    hosts = argv[argv.index('-H') + 1]
    assert argv == _launch(2, '-s', 1, '--timeout', 362, '--launcher', 'netns', '-H', hosts) + [
        sys.executable, WORKER] + DELAYED + ['8', '--warmup-steps', '40', '--steps', '80',
                                             '--seed', '1'] + DATA + [
            '--out', os.path.join(scratch, 'phases', '1gbit-k8-r1', 'worker-{rank}.json')]
    assert kwargs['timeout'] == 422 and _changes(kwargs['env']) == CLEAN
    assert launched.calls[4][0][6:8] == ['--timeout', '241']  # loopback with 1gbit's steps


def test_tta_workers_and_servers_reach_every_job(tmp_path, launched, monkeypatch):
    # --workers 4 --servers 2: the launcher's -n and -s, a third of 117 steps between kept
    # weights, one namespace per role, the meta's settings; the report names the job.
    nodes = []
    monkeypatch.setattr(bench_netns, 'ShapedNetwork',
                        lambda count, rate: nodes.append(count) or _Net(count, rate))
    out, scratch = str(tmp_path / 'out'), str(tmp_path / 's')
    shape = ['--workers', '4', '--servers', '2']
    assert tta.main(['--part', 'full', '--out', out, '--scratch', scratch, '--seeds', '1',
                     '--epochs', '3', '--methods', 'sync'] + shape) == 1
    assert tta.main(['--part', 'phases', '--out', out, '--scratch', scratch, '--rounds', '1',
                     '--networks', '100mbit', '--methods', 'k4'] + shape) == 1
    (full, _), (phase, _) = launched.calls
    assert full[:8] == _launch(4, '-s', 2, '--timeout', 1002)[:8]  # 300 + 3 x 117 x 2 s
    assert full[full.index('--eval-every') + 1] == '39'
    assert phase[2:6] == ['-n', '4', '-s', '2'] and nodes == [7]
    settings = tta.report_lib.read_json(os.path.join(out, 'meta-full.json'))['settings']
    assert (settings['workers'], settings['servers'], settings['eval_every']) == (4, 2, 39)
    assert tta._job_shape({'full': {'settings': settings}}) == [4, 2]
    assert tta._job_shape({'full': {'settings': {}}}) == [2, 1]  # folders from before
    with pytest.raises(ValueError, match='ran different jobs'):
        tta._job_shape({'full': {'settings': settings}, 'phases': {'settings': {}}})
    with pytest.raises(SystemExit):
        tta.parse_args(['--part', 'full', '--workers', '0'])


def test_tta_optimizer_reaches_every_method(tmp_path, launched):
    # --optimizer lamb: the same arguments for the stock and the delayed job, after the
    # method's own (the default, sgd, adds none: bench_worker's defaults, as before).
    out, scratch = str(tmp_path / 'out'), str(tmp_path / 's')
    assert tta.main(['--part', 'full', '--out', out, '--scratch', scratch, '--seeds', '1',
                     '--epochs', '1', '--methods', 'sync,k4', '--optimizer', 'lamb']) == 1
    lamb = ['--optimizer', 'lamb', '--lr', '0.005', '--wd', '0']
    for argv, _ in launched.calls:
        assert argv[argv.index('--data-dir') + 2:argv.index('--out')] == lamb
    with open(os.path.join(out, 'meta-full.json'), encoding='utf-8') as src:
        assert json.load(src)['settings']['optimizer'] == 'lamb'
    with pytest.raises(SystemExit):
        tta.parse_args(['--part', 'full', '--optimizer', 'nadam'])


def _signal_during_job(number, launched, monkeypatch):
    """Make job `number` (from 1) still run when the driver waits for it, and SIGTERM arrive
    then (the driver's handler runs); returns the list of signals sent to that launcher."""
    stopped, popen = [], launched.popen

    def popen_then_signal(argv, **kwargs):
        job = popen(argv, **kwargs)
        if len(launched.calls) == number:
            job.poll = lambda: None  # still running

            def wait(timeout=None):
                if timeout == 15.0:  # harness.stop's grace: the launcher ends on SIGTERM
                    return 143
                return signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)  # raises
            job.wait = wait
            job.send_signal = stopped.append
        return job
    monkeypatch.setattr(subprocess, 'Popen', popen_then_signal)
    return stopped


def test_accuracy_cnn_stops_the_job_on_a_signal(tmp_path, launched, monkeypatch):
    # A signal while the driver waits for the first job: its launcher gets SIGTERM, the
    # driver returns 128 + SIGTERM with its meta file written and no report (no run made),
    # and the caller's signal handlers are back.
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    stopped = _signal_during_job(1, launched, monkeypatch)
    out = str(tmp_path / 'out')
    assert accuracy_cnn.main(['--out', out, '--scratch', str(tmp_path / 's'),
                              '--runs', 'adam/sync,adam/k8-fv']) == 128 + signal.SIGTERM
    assert stopped == [signal.SIGTERM] and len(launched.calls) == 1
    assert os.path.exists(os.path.join(out, 'meta.json'))
    assert not os.path.exists(os.path.join(out, 'results.md'))
    assert {s: signal.getsignal(s) for s in handlers} == handlers


def _cnn_folder(path, runs):
    """A results folder of accuracy_cnn with `runs`: (optimizer, method, seed, exit, acc)."""
    os.makedirs(path)
    report.write_csv(os.path.join(path, 'runs.csv'), [
        dict(optimizer=o, method=m, seed=s, exit=e, load_before=0.5, load_after=0.5,
             stock_check='ok') for o, m, s, e, _ in runs])
    report.write_csv(os.path.join(path, 'accuracy.csv'), [
        dict(optimizer=o, method=m, seed=s, epoch=i + 1, test_acc=a)
        for o, m, s, _, acc in runs for i, a in enumerate(acc)])


def test_accuracy_cnn_include(tmp_path, monkeypatch):
    # --include adds the named runs of another folder (exit 0 only, named pairs only); a run
    # found in two folders is reported once if its accuracies are the same, and is an error
    # if they differ (with 2 workers a run repeats exactly: a difference is a changed run).
    monkeypatch.setattr(accuracy_cnn, 'REPO', str(tmp_path))
    _cnn_folder(str(tmp_path / 'out'), [('adam', 'k8', 1, 0, [0.8, 0.9])])
    _cnn_folder(str(tmp_path / 'a'), [('adam', 'sync', 1, 0, [0.85, 0.91]),
                                      ('adam', 'sync', 2, 134, []),
                                      ('sgd', 'sync', 1, 0, [0.7, 0.8])])
    _cnn_folder(str(tmp_path / 'b'), [('adam', 'sync', 1, 0, [0.85, 0.91]),
                                      ('adam', 'sync', 2, 0, [0.86, 0.92])])
    include = accuracy_cnn.parse_args(['--include', 'a:adam/sync', '--include',
                                       'b:adam/sync']).include
    evals, runs = accuracy_cnn.read_results(str(tmp_path / 'out'), include)
    assert [(r['folder'], r['optimizer'], r['method'], r['seed']) for r in runs] == [
        ('.', 'adam', 'k8', 1), ('a', 'adam', 'sync', 1), ('b', 'adam', 'sync', 2)]
    summary = accuracy_cnn.summarize(evals)
    assert summary['adam', 'k8']['gaps'] == pytest.approx({1: -5.0, 2: -1.0})
    _cnn_folder(str(tmp_path / 'c'), [('adam', 'sync', 1, 0, [0.85, 0.9])])
    with pytest.raises(RuntimeError, match='differs between a and c'):
        accuracy_cnn.read_results(str(tmp_path / 'out'), include[:1] + [
            accuracy_cnn.parse_include('c:adam/sync')])
    for bad, message in (('a', 'not FOLDER:'), ('a:adam/nope', 'not FOLDER:'),
                         ('missing:adam/sync', 'has no accuracy.csv')):
        with pytest.raises(ValueError, match=message):
            accuracy_cnn.parse_include(bad)


def test_accuracy_cnn_report_of_a_stopped_invocation(tmp_path, monkeypatch):
    # Seeds planned but not run are listed run by run; a method run on fewer seeds than
    # dist_sync is compared with dist_sync over its seeds, in the table and in the plot.
    monkeypatch.setattr(accuracy_cnn, 'REPO', str(tmp_path))
    out = str(tmp_path / 'out')
    _cnn_folder(out, [('sgd', 'k4', 1, 0, [0.80, 0.90])])
    _cnn_folder(str(tmp_path / 'a'), [('sgd', 'sync', 1, 0, [0.81, 0.89]),
                                      ('sgd', 'sync', 2, 0, [0.71, 0.79])])
    report.write_json(os.path.join(out, 'meta.json'), dict(
        command='python benchmarks/accuracy_cnn.py', started='t0', machine={'cores': 2,
        'cpu': 'x'}, load_before=[0.5], code_start={'commit': 'abc'}, settings=dict(
            runs=[['sgd', 'k4'], ['sgd', 'k8']], seeds=[1, 2], epochs=2,
            include=[['a', [['sgd', 'sync']]]])))
    plotted = []
    monkeypatch.setattr(accuracy_cnn, 'plot', lambda path, summary: plotted.append(summary))
    accuracy_cnn.build_report(out)
    text = (tmp_path / 'out' / 'results.md').read_text()
    assert ('Planned but not run (the invocation was stopped before them): sgd/k8 seed 1, '
            'sgd/k4 seed 2, sgd/k8 seed 2.') in text
    entry = plotted[0]['sgd', 'k4']
    assert entry['base_acc'] == pytest.approx({1: 0.81, 2: 0.89})
    assert entry['gaps'] == pytest.approx({1: -1.0, 2: 1.0})
    monkeypatch.undo()  # the real plot: one optimizer's panel, dist_sync over seed 1 beside
    accuracy_cnn.plot(str(tmp_path / 'a.png'), plotted[0])
    assert (tmp_path / 'a.png').stat().st_size > 0


def _tta_evals(folder, runs):
    """A tta.py folder's full-evals.csv with `runs`: {(method, seed): epoch-end accuracies}
    (plus one evaluation between epoch ends, which the gaps must ignore)."""
    os.makedirs(folder)
    rows = []
    for (method, seed), acc in runs.items():
        rows.append(dict(method=method, seed=seed, step=1, epoch=0.5, test_acc=0.0,
                         epoch_end=False))
        rows += [dict(method=method, seed=seed, step=2 * (i + 1), epoch=i + 1, test_acc=a,
                      epoch_end=True) for i, a in enumerate(acc)]
    report.write_csv(os.path.join(folder, 'full-evals.csv'), rows)


def test_accuracy_gaps(tmp_path):
    # Means over the method's seeds minus the baseline's over the same seeds, per epoch;
    # a run found twice must repeat; the files written name the folders and the command.
    a, b, c = (str(tmp_path / n) for n in 'abc')
    _tta_evals(a, {('sync', 1): [0.80, 0.90], ('sync', 2): [0.70, 0.80],
                   ('sync', 3): [0.60, 0.60]})
    _tta_evals(b, {('k4', 1): [0.81, 0.88], ('k4', 2): [0.70, 0.78], ('sync', 1): [0.80, 0.90]})
    table = accuracy_gaps.gaps(accuracy_gaps.read_runs([a, b]))
    assert table['sync']['seeds'] == [1, 2, 3] and 'gaps' not in table['sync']
    assert table['k4']['gaps'] == pytest.approx([0.5, -2.0])
    assert (table['k4']['worst_epoch'], table['k4']['worst_points']) == (2, pytest.approx(-2.0))
    _tta_evals(c, {('sync', 2): [0.70, 0.81], ('k4', 1): [0.5, 0.5]})
    with pytest.raises(RuntimeError, match='sync seed 2 differs'):
        accuracy_gaps.read_runs([a, c])
    # FOLDER:METHODS reads those methods only: c's k4 without its differing sync.
    want = accuracy_gaps.read_runs([a])
    want['k4', 1] = [0.5, 0.5]
    assert accuracy_gaps.read_runs([a, c + ':k4']) == want
    for bad in (c + ':', ':k4'):
        with pytest.raises(ValueError, match='is not FOLDER or FOLDER:METHOD'):
            accuracy_gaps.read_runs([bad])
    assert accuracy_gaps.main(['--out', str(tmp_path), a, b]) == 0
    written = report.read_json(str(tmp_path / 'gaps.json'))
    assert written['methods']['k4']['worst_points'] == pytest.approx(-2.0)
    assert '| k4 | 1, 2 |' in (tmp_path / 'gaps.md').read_text()


def _tta_part(folder, part, rows, **settings):
    """A tta.py folder's `part`: its runs file with `rows` (and, for full, an evaluation
    per run), and its meta file with `settings`."""
    os.makedirs(folder, exist_ok=True)
    files, _ = tta_combine.PARTS[part]
    report.write_csv(os.path.join(folder, files[-1]), rows)
    if part == 'full':
        report.write_csv(os.path.join(folder, files[0]), [dict(r, step=1) for r in rows])
    report.write_json(os.path.join(folder, 'meta-%s.json' % part), dict(
        command='python benchmarks/tta.py --part %s' % part, started='t0', finished='t1',
        machine={'cores': 2, 'cpu': 'x'}, load_before=[0.5], load_after=[0.5],
        code_start={'commit': 'abc'}, code_end={'commit': 'abc'}, settings=settings))


def test_tta_combine(tmp_path):
    # Rows in the order given, FOLDER:METHOD,... filters, every source in the meta file;
    # a run in two sources and sources of different jobs are refused.
    a, b, c, out = (str(tmp_path / n) for n in ('a', 'b', 'c', 'out'))
    _tta_part(a, 'full', [dict(method='sync', seed=1), dict(method='k4', seed=1)])
    _tta_part(b, 'full', [dict(method='k4', seed=1), dict(method='k8', seed=1)])
    _tta_part(b, 'phases', [dict(network='100mbit', method='k8', round=1)])
    assert tta_combine.combine(out, {'full': [a + ':sync', b], 'phases': [b]}) == {
        'full': 3, 'phases': 1}
    assert [(r['method'], r['seed']) for r in report.read_csv(os.path.join(
        out, 'full-evals.csv'))] == [('sync', 1), ('k4', 1), ('k8', 1)]
    meta = report.read_json(os.path.join(out, 'meta-full.json'))
    assert [(s['folder'], s['methods']) for s in meta['sources']] == [(a, ['sync']), (b, None)]
    assert meta['sources'][1]['line'].startswith('`python benchmarks/tta.py --part full`: t0')
    with pytest.raises(ValueError, match="full run {'method': 'k4', 'seed': 1} is in .*a and"):
        tta_combine.combine(out, {'full': [a, b]})
    _tta_part(c, 'full', [dict(method='k16', seed=1)], workers=4)
    with pytest.raises(ValueError, match='workers 4, but .*a has 2'):
        tta_combine.combine(out, {'full': [a, c]})
    with pytest.raises(SystemExit):
        tta_combine.main(['--out', out, '--phases', b])  # no accuracy runs


def test_tta_real_jobs(tmp_path, launched):
    # full's runs (same worker arguments), in one set of namespaces per network, interleaved
    # seed by seed as full; the launcher's timeout with the network's bound per step.
    out, scratch = str(tmp_path / 'out'), str(tmp_path / 's')
    _Net.log.clear()
    assert tta.main(['--part', 'real', '--out', out, '--scratch', scratch, '--seeds', '1,2',
                     '--epochs', '1', '--methods', 'sync,k4', '--networks', '1gbit,100mbit']) == 1
    names = [argv[-1].split(os.sep)[-2] for argv, _ in launched.calls]
    assert names == ['1gbit-sync-s1', '1gbit-k4-s1', '1gbit-k4-s2', '1gbit-sync-s2',
                     '100mbit-sync-s1', '100mbit-k4-s1', '100mbit-k4-s2', '100mbit-sync-s2']
    assert _Net.log == [('created', '1gbit'), ('closed', '1gbit'), ('created', '100mbit'),
                        ('closed', '100mbit')]
    argv, kwargs = launched.calls[5]
    hosts = argv[argv.index('-H') + 1]
    assert argv == _launch(2, '-s', 1, '--timeout', 2640, '--launcher', 'netns', '-H', hosts) + [
        sys.executable, WORKER] + DELAYED + ['4', '--epochs', '1', '--seed', '1',
                                             '--warmup-steps', '200', '--eval-every', '78'] + (
        DATA + ['--out', os.path.join(scratch, 'real', '100mbit-k4-s1', 'worker-{rank}.json')])
    assert kwargs['timeout'] == 2700 and _changes(kwargs['env']) == CLEAN
    assert kwargs['start_new_session']
    assert launched.calls[0][0][6:8] == ['--timeout', '768']  # 300 + 234 steps x 2 s (1gbit)
    rows = tta.report_lib.read_csv(os.path.join(out, 'real-runs.csv'))
    assert [(r['network'], r['method'], r['seed'], r['exit']) for r in rows] == [
        (n.split('-')[0], n.split('-')[1], int(n[-1]), 1) for n in names]
    meta = tta.report_lib.read_json(os.path.join(out, 'meta-real.json'))
    assert meta['command'].startswith('python benchmarks/tta.py --part real ')
    assert not os.path.exists(os.path.join(out, 'real-evals.csv'))  # no run succeeded


def test_tta_stops_the_job_and_removes_the_namespaces_on_a_signal(tmp_path, launched,
                                                                  monkeypatch):
    # The signal arrives while the driver waits for the second job: that launcher gets
    # SIGTERM (it stops its roles), the namespaces go, the meta file is written, the driver
    # returns 128 + SIGTERM, and the caller's signal handlers are back.
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    stopped = _signal_during_job(2, launched, monkeypatch)
    _Net.log.clear()
    out = str(tmp_path / 'out')
    assert tta.main(['--part', 'real', '--out', out, '--scratch', str(tmp_path / 's'),
                     '--seeds', '1', '--epochs', '1', '--methods', 'sync,k4',
                     '--networks', '100mbit']) == 128 + signal.SIGTERM
    assert stopped == [signal.SIGTERM] and len(launched.calls) == 2
    assert _Net.log == [('created', '100mbit'), ('closed', '100mbit')]
    assert os.path.exists(os.path.join(out, 'meta-real.json'))
    assert {s: signal.getsignal(s) for s in handlers} == handlers


# A driver that runs one launcher job under harness.interruptible(): argv 1 is benchmarks/,
# 2 the job's log, the rest the roles' command.
SIGNALLED_DRIVER = '''
import sys
sys.path.insert(0, sys.argv[1])
import harness
with harness.interruptible():
    try:
        harness.Job(sys.argv[3:], 600, num_workers=2).run(sys.argv[2])
    except harness.Interrupted as stop:
        sys.exit(128 + stop.signum)
'''


@pytest.mark.jobs
@pytest.mark.parametrize('signum', ['SIGTERM', 'SIGINT'])
def test_a_signal_to_the_driver_stops_its_launcher_and_roles(tmp_path, signum):
    signum = getattr(signal, signum)
    pids = PidFile(tmp_path / 'pids')
    log = str(tmp_path / 'log.txt')
    driver = subprocess.Popen(  # pylint: disable=consider-using-with
        [sys.executable, '-c', SIGNALLED_DRIVER, os.path.join(REPO, 'benchmarks'), log]
        + pids.wrap(['sleep', '1000']), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, start_new_session=True)
    try:
        pids.wait(4)                     # scheduler, server, 2 workers
        driver.send_signal(signum)       # to the driver alone, not to its launcher
        _, stderr = driver.communicate(timeout=30)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
    assert driver.returncode == 128 + signum, stderr
    pids.assert_all_dead(timeout=5)
    with open(log, encoding='utf-8') as src:
        assert 'received SIGTERM; stopping the job' in src.read()


def test_accuracy_cnn_job(tmp_path, launched):
    args = accuracy_cnn.parse_args(['--out', str(tmp_path / 'o'), '--scratch', str(tmp_path)])
    row, evals = accuracy_cnn.run_one('adam', 'k8', 2, args)
    assert (row['exit'], evals) == (1, [])
    argv, env = launched.only()
    assert argv == _launch(2, '-s', 1, '--timeout', 7620) + [
        sys.executable, WORKER] + DELAYED + ['8', '--optimizer', 'adam', '--lr', '0.001', '--wd',
                                             '0', '--model', 'cnn-bn', '--epochs', '10',
                                             '--seed', '2', '--warmup-steps', '200',
                                             '--eval-every', '234', '--global-model'] + DATA + [
        '--out', str(tmp_path / 'adam-k8-s2' / 'worker-{rank}.json')]
    assert env == CLEAN


def test_scaling_job(tmp_path, launched, monkeypatch):
    monkeypatch.setattr(scaling.fp16_bytes, 'counters',
                        lambda net: {name: (0, 0) for name, _ in net.nodes})
    args = scaling.parse_args(['--scratch', str(tmp_path)])
    row = scaling.run_one(args, _Net(7), '/tmp/h', 'resnet18', 4, 2, 'k4-fp16', 1)
    assert row['error'].startswith('exit [1]')
    argv, env = launched.only()
    assert argv == _launch(4, '-s', 2, '--timeout', 272, '--launcher', 'netns', '-H',
                           '/tmp/h') + [
        sys.executable, WORKER] + DELAYED + ['4', '--local-rule', 'mirror', '--compression',
                                             'fp16', '--model', 'resnet18', '--batch-size',
                                             '32', '--lr', '0.01', '--warmup-steps', '3',
                                             '--steps', '8', '--seed', '1'] + DATA + [
        '--out', str(tmp_path / 'resnet18-n4-s2-k4-fp16-r1' / 'worker-{rank}.json')]
    assert env == CLEAN and launched.calls[0][1]['start_new_session']


def test_other_jobs(tmp_path, launched, monkeypatch):
    """overlap, memory, faults, kvstore_roundtrip, fp16_bytes, amp_cost, worker_cpu."""
    with pytest.raises(RuntimeError):
        overlap.run_job('1gbit', 'after_grads', 15, 20, '/h', str(tmp_path / 'log'))
    (argv, kwargs), = launched.calls
    assert argv[:-2] == _launch(2, '-s', 1, '--timeout', 180, '--launcher', 'netns', '-H',
                                '/h') + [sys.executable, os.path.join(
                                    REPO, 'tests', 'scripts', 'timeline_job.py'), 'after_grads']
    # overlap keeps the driver's MXNET_* settings but the worker threads, sets the bulk size.
    assert _changes(kwargs['env']) == ({'OMP_NUM_THREADS': '1', 'PYTHONUNBUFFERED': '1',
                                        'MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN_BWD': '15'},
                                       ['DMLC_ROLE', 'MXDELAY_RANK'])
    launched.calls.clear()
    with pytest.raises(RuntimeError):
        memory.run('big', 'delay', 8, str(tmp_path))
    assert launched.only() == (_launch(2, '-s', 2, '--timeout', 1500) + [
        sys.executable, os.path.join(REPO, 'benchmarks', 'memory_worker.py'), 'delay', '8',
        'big', '21', str(tmp_path)], CLEAN)
    launched.calls.clear()
    faults.run_case('misuse', str(tmp_path / 'misuse'))
    argv, (env, dropped) = launched.only()
    assert argv[:11] == _launch(2, '-s', 1, '--timeout', 60) + ['sh', '-c']
    assert argv[12:15] == ['sh', sys.executable, os.path.join(REPO, 'tests', 'scripts',
                                                              'mlp_job.py')]
    assert json.loads(argv[15]) == faults.MISUSE and argv[16] == str(tmp_path / 'misuse')
    assert (env['PYTHONPATH'], dropped) == (REPO + os.pathsep + '/driver/path', CLEAN[1])
    launched.calls.clear()
    with pytest.raises(RuntimeError):
        kvstore_roundtrip.run('dist_delay', 30, str(tmp_path), 'sgd', 'big')
    assert launched.only() == (_launch(2, '-s', 1, '--timeout', 600) + [
        sys.executable, os.path.join(REPO, 'benchmarks', 'kv_worker.py'), 'dist_delay', '30',
        str(tmp_path / 'rank0.json'), 'sgd', 'big'], CLEAN)
    launched.calls.clear()
    monkeypatch.setattr(fp16_bytes, 'counters', lambda net: {n: (0, 0) for n, _ in net.nodes})
    fp16_bytes.run(_Net(4), '/h', ['x'])
    argv, (env, dropped) = launched.only()
    assert argv == _launch(2, '-s', 1, '--launcher', 'netns', '-H', '/h') + ['x']
    assert (env['PYTHONPATH'], dropped) == (REPO, ['MXNET_ENGINE_TYPE'])
    launched.calls.clear()
    with pytest.raises(OSError):
        amp_cost.run('delay4-amp', 80, str(tmp_path))
    assert launched.only() == (_launch(2, '-s', 1) + [
        sys.executable, os.path.join(REPO, 'benchmarks', 'mlp_speed.py'), 'delay4-amp', '80',
        str(tmp_path / 'delay4-amp')], ({'DMLC_NODE_HOST': '127.0.0.1', 'OMP_NUM_THREADS': '1',
                                         'PYTHONPATH': REPO}, []))
    launched.calls.clear()
    worker_cpu.main(['--trees', 'a=/x/old,b=/y', '--rounds', '2', '--modes', 'fp16',
                     '--out', str(tmp_path / 'cpu')])
    assert [(argv[3], kwargs['env']['PYTHONPATH']) for argv, kwargs in launched.calls] == [
        ('fp16', '/x/old'), ('fp16', '/y'), ('fp16', '/y'), ('fp16', '/x/old')]
    assert launched.calls[0][0] == [sys.executable, os.path.join(
        REPO, 'benchmarks', 'worker_cpu.py'), '--run', 'fp16', '--skip', '8', '--steps', '48']


# -- compressed pulls (issue 20): methods of harness.METHODS only, run through tta.py ---------
#: method -> (label, worker arguments), written down when the methods were added
PULL = {
    'k4-pull-fp16': ('k=4 + pull fp16', DELAYED + ['4', '--pull-compression', 'fp16']),
    'k4-pull-int8': ('k=4 + pull int8', DELAYED + ['4', '--pull-compression', 'int8']),
    'k4-2bit-pull-int8': ('k=4 + 2bit 0.05 + pull int8', DELAYED + [
        '4', '--pull-compression', 'int8', '--compression', '2bit:0.05']),
    'k4-fp16-pull-int8': ('k=4 + fp16 + pull int8', DELAYED + [
        '4', '--pull-compression', 'int8', '--compression', 'fp16'])}


def test_pull_compression_methods(tmp_path, launched, monkeypatch):
    for name, (label, args) in PULL.items():
        method = harness.METHODS[name]
        assert (method.label, method.args, method.stock, method.env) == (label, args, False, ())
    # tta.py runs them with its table extended (docs/benchmarks/tta-pull/procedure.md).
    monkeypatch.setattr(tta, 'METHODS', dict(tta.METHODS, **harness.methods(*PULL)))
    scratch = str(tmp_path / 's')
    assert tta.main(['--part', 'full', '--out', str(tmp_path / 'out'), '--scratch', scratch,
                     '--seeds', '1', '--epochs', '5', '--methods', ','.join(PULL)]) == 1
    for (argv, kwargs), (name, (_, args)) in zip(launched.calls, PULL.items()):
        assert argv == _launch(2, '-s', 1, '--timeout', 1470) + [
            sys.executable, WORKER] + args + ['--epochs', '5', '--seed', '1',
                                              '--warmup-steps', '200', '--eval-every', '78'] + (
            DATA + ['--out', os.path.join(scratch, 'full', name + '-s1', 'worker-{rank}.json')])
        assert _changes(kwargs['env']) == CLEAN
    assert len(launched.calls) == len(PULL)


def test_compress_phases_take_any_registry_method(tmp_path, launched):
    # compress.py's own methods by default; --methods may add the registry's (e.g. float16
    # pushes with int8 pulls), labelled and launched as the registry says.
    assert compress.main(['--part', 'phases', '--out', str(tmp_path / 'out'), '--scratch',
                          str(tmp_path / 's'), '--rounds', '1', '--networks', 'loopback',
                          '--methods', 'sync,k4-fp16-pull-int8']) == 1
    runs = [argv[argv.index(WORKER) + 1:argv.index('--warmup-steps')]
            for argv, _ in launched.calls]
    assert runs == [['--mode', 'sync'], PULL['k4-fp16-pull-int8'][1]]
    assert tta.METHODS['k4-fp16-pull-int8'] is harness.METHODS['k4-fp16-pull-int8']
    assert list(compress.METHODS) == list(EXPECTED['compress'])


def test_worker_pull_compression_option():
    import bench_worker  # pylint: disable=import-outside-toplevel
    base = ['--mode', 'delayed', '--out', 'x.json']
    parsed = {text: bench_worker.parse_args(base + ['--pull-compression', text]).pull_compression
              for text in ('none', 'fp16', 'int8', 'int8:64')}
    assert parsed == {'none': None, 'fp16': {'type': 'fp16'}, 'int8': {'type': 'int8'},
                      'int8:64': {'type': 'int8', 'block_size': 64}}
    assert bench_worker.parse_args(base).pull_compression is None
    for bad in ('int8:', 'int8:x', 'fp16:2', 'int4'):
        with pytest.raises(ValueError, match=r"--pull-compression must be .*got %r" % bad):
            bench_worker.parse_args(base + ['--pull-compression', bad])
    with pytest.raises(SystemExit):  # stock dist_sync has no compressed pulls
        bench_worker.parse_args(['--mode', 'sync', '--out', 'x', '--pull-compression', 'fp16'])


def test_positional_scripts_answer_help_and_missing_arguments(capsys):
    doc = 'Usage: ``python w.py A B``\n'
    with pytest.raises(SystemExit) as stop:
        positional.positional(doc, 2, ['--help'])
    assert stop.value.code == 0 and capsys.readouterr().out == doc
    with pytest.raises(SystemExit) as stop:
        positional.positional(doc, 2, ['a'])
    assert '2 argument(s) required, 1 given' in stop.value.code and doc in stop.value.code
    assert positional.positional(doc, 2, ['a', 'b', 'c']) == ['a', 'b', 'c']
    for script in ('kv_worker.py', 'memory_worker.py', 'mlp_speed.py', 'amp_cost.py'):
        done = subprocess.run([sys.executable, os.path.join(REPO, 'benchmarks', script), '-h'],
                              capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0 and 'Usage' in done.stdout, (script, done.stderr[-500:])


# -- blockwise pushes (issue 20 item 3, docs/design.md §2.14) ----------------------------------
#: method -> (label, worker arguments), written down when the methods were added
BLOCKWISE = {
    'k4-int8': ('k=4 + int8', DELAYED + ['4', '--compression', 'int8']),
    'k4-int4': ('k=4 + int4', DELAYED + ['4', '--compression', 'int4']),
    'k4-ternary': ('k=4 + ternary', DELAYED + ['4', '--compression', 'ternary']),
    'k4-int8-pull-int8': ('k=4 + int8 + pull int8', DELAYED + [
        '4', '--pull-compression', 'int8', '--compression', 'int8']),
    'k4-int4-pull-int8': ('k=4 + int4 + pull int8', DELAYED + [
        '4', '--pull-compression', 'int8', '--compression', 'int4']),
    'k4-ternary-pull-int8': ('k=4 + ternary + pull int8', DELAYED + [
        '4', '--pull-compression', 'int8', '--compression', 'ternary'])}


def test_blockwise_methods_and_the_worker_compression_option():
    import bench_worker  # pylint: disable=import-outside-toplevel
    for name, (label, args) in BLOCKWISE.items():
        method = harness.METHODS[name]
        assert (method.label, method.args, method.stock, method.env) == (label, args, False, ())
    base = ['--mode', 'delayed', '--out', 'x.json']
    parsed = {text: bench_worker.parse_args(base + ['--compression', text]).compression
              for text in ('int8', 'int4', 'ternary', 'ternary:64', 'fp16', '2bit:0.5')}
    assert parsed == {'int8': {'type': 'int8'}, 'int4': {'type': 'int4'},
                      'ternary': {'type': 'ternary'},
                      'ternary:64': {'type': 'ternary', 'block_size': 64},
                      'fp16': {'type': 'fp16'}, '2bit:0.5': {'type': '2bit', 'threshold': 0.5}}
    for bad in ('int8:', 'int8:x', 'fp16:2', 'ternary:-1'):
        with pytest.raises(ValueError, match="'int8', 'int4' or 'ternary' with an optional "
                                             "':BLOCK'"):
            bench_worker.compression_params(bad)


# -- tta.py's report of the real runs on shaped links (issue 20 item 5) ------------------------
def _accuracy(method, seed, step):
    """The synthetic runs' test accuracy: 0.01 per evaluation, seed 2 0.005 above, k=4 0.01
    below dist_sync."""
    return round(0.80 + 0.01 * (step // 78) + 0.005 * (seed - 1) - 0.01 * (method == 'k4'), 4)


def _tta_folder(out, real=True):
    """full (2 seeds, 5 epochs), phases (1gbit) and, with `real`, real runs (1gbit, seed 1,
    1 epoch; k=4's accuracy at step 156 is 0.01 above its full run's)."""
    def evals(key, seeds, epochs, wall):
        return [dict(key, method=m, seed=seed, step=step, epoch=round(step / 234, 4),
                     test_acc=round(_accuracy(m, seed, step) + (
                         0.01 if key and m == 'k4' and step == 156 else 0), 4),
                     wall_s=wall(step), epoch_end=step % 234 == 0)
                for seed in seeds for m in ('sync', 'k4')
                for step in range(78, 234 * epochs + 1, 78)]
    run = dict(exit=0, load_before=1.0, load_after=2.0, job_s=9.0, stock_check='ok',
               worker_env='(none)', steps=234, train_s=8.0, first_step_s=1.0, eval_s=1.0,
               cpu_other=0.5, mean_loss=0.4)
    os.makedirs(out)
    tta.report_lib.write_csv(os.path.join(out, 'full-evals.csv'),
                             evals({}, (1, 2), 5, lambda step: 0.01 * step))
    tta.report_lib.write_csv(os.path.join(out, 'full-runs.csv'), [
        dict(method=m, seed=s, **run) for s in (1, 2) for m in ('sync', 'k4')])
    tta.report_lib.write_csv(os.path.join(out, 'phases-runs.csv'), [dict(
        network='1gbit', method=m, round=1, exit=0, warmup=40, steps=80, load_before=1.0,
        load_after=1.0, stock_check='ok', worker_env='(none)', first_step_s=1.0, sync_steps=40,
        sync_step_ms=100.0, delayed_steps=80, delayed_step_ms=50.0, drain_s=0.1,
        window_samples_per_s=1000.0, cpu_other=0.1, noisy=False, loss_digest='x')
        for m in ('sync', 'k4')])
    if real:
        tta.report_lib.write_csv(os.path.join(out, 'real-evals.csv'), evals(
            {'network': '1gbit'}, (1,), 1, lambda step: 2 + 0.1 * step))
        tta.report_lib.write_csv(os.path.join(out, 'real-runs.csv'), [
            dict(network='1gbit', method=m, seed=1, **run) for m in ('sync', 'k4')])


def test_tta_report_of_real_runs(tmp_path):
    out = str(tmp_path / 'out')
    _tta_folder(out)
    result = tta.build_report(out, real_target=('accuracy', 0.82))
    real = result['real']
    assert (real['target'], real['target_definition']) == (0.82, 'test accuracy 0.82 '
                                                                  '(--real-target)')
    sync, k4 = real['runs']
    # dist_sync: 0.82 at step 156 in both runs; derived 1 s + 155 synchronous steps x 0.1 s
    assert (sync['real_step'], sync['full_step'], sync['max_acc_diff']) == (156, 156, 0)
    assert sync['real_s'] == pytest.approx(2 + 15.6, abs=1e-9)
    assert sync['derived_s'] == pytest.approx(1 + 155 * 0.1, abs=1e-9)
    assert sync['ratio'] == pytest.approx(16.5 / 17.6, abs=1e-9)
    # k=4: 0.82 at step 156 in the real run, at 234 in the full run: the full run's step
    # gives the derived time, 200 synchronous and 33 delayed steps after the first step
    assert (k4['real_step'], k4['full_step']) == (156, 234)
    assert k4['max_acc_diff'] == pytest.approx(0.01, abs=1e-9)
    assert k4['derived_s'] == pytest.approx(1 + 200 * 0.1 + 33 * 0.05, abs=1e-9)
    assert k4['ratio'] == pytest.approx(22.65 / 17.6, abs=1e-9)
    assert [(e['step'], e['derived_s']) for e in k4['evals']] == [
        (78, pytest.approx(8.7)), (156, pytest.approx(16.5)), (234, pytest.approx(22.65))]
    with open(os.path.join(out, 'results.md'), encoding='utf-8') as src:
        text = src.read()
    assert '## Check of the derivation on shaped links: real runs to 0.8200' in text
    assert ('| 1 Gbit/s links | dist_sync (stock) | 1 | 17.6 s (step 156) | 16.5 s (step 156) | '
            '0.94 | 0.50 (noisy) | yes |') in text
    assert '| 1 Gbit/s links | k=4 | 1 | 17.6 s (step 156) | 22.6 s (step 234) | 1.29 |' in text
    assert 'no: up to 0.0100 apart' in text and '### Real runs (shaped links)' in text
    # The default target, dist_sync's mean at the end of epoch 1 (0.83, 0.835): 0.8325 is
    # after the real runs' only epoch.
    real = tta.build_report(out)['real']
    assert real['target'] == pytest.approx(0.8325, abs=1e-12)
    assert real['target_definition'] == ("mean over seeds 1, 2 of dist_sync's test accuracy "
                                         'after epoch 1 (full runs)')
    assert [(c['real_step'], c['full_step'], c['last_step']) for c in real['runs']] == [
        (None, 312, 234), (None, 390, 234)]
    with open(os.path.join(out, 'results.md'), encoding='utf-8') as src:
        assert 'not reached (0.8300 at step 234)' in src.read()
    with pytest.raises(ValueError, match='--real-target epoch6: the full runs'):
        tta.build_report(out, real_target=('epoch', 6))


def test_tta_report_without_real_runs_is_unchanged(tmp_path):
    out = str(tmp_path / 'out')
    _tta_folder(out, real=False)
    result = tta.build_report(out)
    assert 'real' not in result and 'real' not in result['metas']
    with open(os.path.join(out, 'results.md'), encoding='utf-8') as src:
        text = src.read()
    assert 'shaped links: real runs' not in text and 'Real runs' not in text


def test_tta_real_target_option():
    assert tta.parse_args(['--part', 'report']).real_target == ('epoch', 1)
    assert tta.parse_args(['--part', 'report', '--real-target', 'epoch12']).real_target == (
        'epoch', 12)
    assert tta.parse_args(['--part', 'report', '--real-target', '0.85']).real_target == (
        'accuracy', 0.85)
    for bad in ('epoch0', '1.5', '0', 'x', 'epoch'):
        with pytest.raises(ValueError, match=r'--real-target must be epochN .* got %r' % bad):
            tta.real_target(bad)


def test_tta_report_leaves_out_methods_of_fewer_seeds(tmp_path):
    # A method with full runs of seed 1 only (of seeds 1, 2) has no mean over the seeds: it is
    # named, and left out of the tables over seeds, instead of failing the report.
    out = str(tmp_path / 'out')
    _tta_folder(out, real=False)
    evals = tta.report_lib.read_csv(os.path.join(out, 'full-evals.csv'))
    extra = [dict(e, method='k8') for e in evals if e['method'] == 'k4' and e['seed'] == 1]
    tta.report_lib.write_csv(os.path.join(out, 'full-evals.csv'), evals + extra)
    saved = dict(tta.METHODS)
    tta.METHODS.update(harness.methods('k8'))
    try:
        result = tta.build_report(out)
    finally:
        tta.METHODS.clear()
        tta.METHODS.update(saved)
    assert result['partial'] == {'k8': [1]}
    assert sorted(result['accuracy']) == ['k4', 'sync']
    with open(os.path.join(out, 'results.md'), encoding='utf-8') as src:
        assert 'Left out of every table over seeds (full runs of fewer seeds): k=8 (seed 1).' in (
            src.read())


# -- the warm-up's length, a property of a method (issue 20: how short can it be) ------------
#: method -> (label, warm-up steps of tta.py's full runs); the worker arguments are those of
#: k4-fp16-pull-int8 (PULL) or of k=8 with the same compression
WARMUPS = {
    'k4-fp16-pull-int8': ('k=4 + fp16 + pull int8', 200),
    'k4-fp16-pull-int8-w0': ('k=4 + fp16 + pull int8, warm-up 0', 0),
    'k4-fp16-pull-int8-w50': ('k=4 + fp16 + pull int8, warm-up 50', 50),
    'k4-fp16-pull-int8-w100': ('k=4 + fp16 + pull int8, warm-up 100', 100),
    'k8-fp16-pull-int8': ('k=8 + fp16 + pull int8', 200),
    'k8-fp16-pull-int8-w0': ('k=8 + fp16 + pull int8, warm-up 0', 0),
    'k8-fp16-pull-int8-w50': ('k=8 + fp16 + pull int8, warm-up 50', 50),
    'k8-fp16-pull-int8-w100': ('k=8 + fp16 + pull int8, warm-up 100', 100)}
K8_FP16_INT8 = DELAYED + ['8', '--pull-compression', 'int8', '--compression', 'fp16']


def test_warmup_methods(tmp_path, launched, monkeypatch):
    for name, (label, _) in WARMUPS.items():
        method = harness.METHODS[name]
        args = PULL['k4-fp16-pull-int8'][1] if name.startswith('k4') else K8_FP16_INT8
        assert (method.label, method.args, method.env) == (label, args, ())
        assert method.job == harness.METHODS[name.split('-w')[0]].job
    assert harness.METHODS['k4-fp16-pull-int8'].job != harness.METHODS['k8-fp16-pull-int8'].job
    for w in (0, 50, 100):
        method = harness.METHODS['k4-ternary-pull-int8-w%d' % w]
        assert method.label == 'k=4 + ternary + pull int8, warm-up %d' % w
        assert (method.warmup, method.args) == (w, harness.METHODS['k4-ternary-pull-int8'].args)
    # Every other method keeps the script's default warm-up.
    assert [n for n, m in harness.METHODS.items() if m.warmup is not None] == [
        n for n in WARMUPS if '-w' in n] + ['k4-ternary-pull-int8-w%d' % w for w in (0, 50, 100)]
    monkeypatch.setattr(tta, 'METHODS', dict(tta.METHODS))
    scratch = str(tmp_path / 's')
    assert tta.main(['--part', 'full', '--out', str(tmp_path / 'out'), '--scratch', scratch,
                     '--seeds', '1', '--epochs', '5', '--methods',
                     'sync,' + ','.join(WARMUPS)]) == 1
    ran = {argv[-1].split(os.sep)[-2]: argv for argv, _ in launched.calls}
    assert list(ran) == ['sync-s1'] + [n + '-s1' for n in WARMUPS]
    assert '--warmup-steps' in ran['sync-s1']  # bench_worker ignores it in --mode sync
    for name, (_, warmup) in WARMUPS.items():
        argv = ran[name + '-s1']
        assert argv[argv.index(WORKER) + 1:argv.index('--out')] == list(
            harness.METHODS[name].args) + ['--epochs', '5', '--seed', '1', '--warmup-steps',
                                           str(warmup), '--eval-every', '78'] + DATA
    meta = json.load(open(os.path.join(str(tmp_path / 'out'), 'meta-full.json'),
                          encoding='utf-8'))
    assert meta['settings']['warmups'] == {n: w for n, (_, w) in WARMUPS.items()}


def test_warmup_in_derived_time(monkeypatch):
    monkeypatch.setattr(tta, 'METHODS', dict(tta.METHODS, **harness.methods(*WARMUPS)))
    times = {'first_step_s': 10.0, 'sync_step_ms': 800.0, 'delayed_step_ms': 700.0}
    # step n: first step + (min(n, W + 1) - 1) synchronous steps + the rest delayed
    assert tta.derived_time(1170, 'k4-fp16-pull-int8', times) == pytest.approx(
        10 + 200 * 0.8 + 969 * 0.7)
    assert tta.derived_time(1170, 'k4-fp16-pull-int8-w50', times) == pytest.approx(
        10 + 50 * 0.8 + 1119 * 0.7)
    assert tta.derived_time(1170, 'k8-fp16-pull-int8-w0', times) == pytest.approx(
        10 + 1169 * 0.7)
    assert tta.derived_time(30, 'k4-fp16-pull-int8-w100', times) == pytest.approx(10 + 29 * 0.8)
    assert tta.derived_time(1170, 'sync', times) == pytest.approx(10 + 1169 * 0.8)


def test_report_takes_phases_of_the_same_job(tmp_path, monkeypatch):
    # Accuracy runs of k=4 with W=200 and W=50, phase runs of W=200 only: W=50's derived time
    # uses W=200's step times, and the report says so.
    monkeypatch.setattr(tta, 'METHODS', dict(tta.METHODS, **harness.methods(*WARMUPS)))
    out = str(tmp_path)
    evals, runs, phases = [], [], []
    for method, accs in (('sync', (0.80, 0.90)), ('k4-fp16-pull-int8', (0.81, 0.89)),
                         ('k4-fp16-pull-int8-w50', (0.82, 0.91))):
        for seed in (1, 2):
            runs.append(dict(method=method, seed=seed, exit=0, load_before=0.1,
                             load_after=0.1, stock_check='ok', worker_env='(none)'))
            for epoch in range(1, 6):
                evals.append(dict(method=method, seed=seed, step=234 * epoch, epoch=epoch,
                                  test_acc=accs[epoch == 5], wall_s=float(epoch),
                                  epoch_end=True))
        if method != 'k4-fp16-pull-int8-w50':
            phases.append(dict(network='100mbit', method=method, round=1, exit=0, warmup=12,
                               steps=32, first_step_s=2.0, sync_step_ms=1000.0,
                               delayed_step_ms=500.0, window_samples_per_s=100.0, noisy=False,
                               loss_digest='x', load_before=0.1, load_after=0.1,
                               stock_check='ok', worker_env='-', cpu_other=0.0))
    report.write_csv(os.path.join(out, 'full-evals.csv'), evals)
    report.write_csv(os.path.join(out, 'full-runs.csv'), runs)
    report.write_csv(os.path.join(out, 'phases-runs.csv'), phases)
    result = tta.build_report(out)
    assert result['target'] == pytest.approx(0.90)
    assert result['steps_to_target'] == {
        'sync': [dict(step=1170, epoch=5, test_acc=0.90)] * 2,
        'k4-fp16-pull-int8': [None, None],
        'k4-fp16-pull-int8-w50': [dict(step=1170, epoch=5, test_acc=0.91)] * 2}
    assert result['times']['100mbit/k4-fp16-pull-int8-w50'] == dict(
        result['times']['100mbit/k4-fp16-pull-int8'], phases_of='k4-fp16-pull-int8')
    assert [p['derived_s'] for p in result['tta']['100mbit/k4-fp16-pull-int8-w50']] == [
        pytest.approx(2 + 50 * 1.0 + 1119 * 0.5)] * 2
    text = open(os.path.join(out, 'results.md'), encoding='utf-8').read()
    assert ('warm-up 200 steps (k=4 + fp16 + pull int8), 50 steps (k=4 + fp16 + pull int8, '
            'warm-up 50).') in text
    assert '| 100 Mbit/s links | k=4 + fp16 + pull int8, warm-up 50 | 1, those of k=4 + fp16 ' \
           '+ pull int8 (same job) |' in text
    assert '| lowest | -1.00 | +1.00 |' in text  # the least of the per-epoch differences
    assert '| k=4 + fp16 + pull int8, warm-up 50 | 50 | 1170 (5) | 1170 (5) | 1170, 2 of 2 |' \
        in text


def test_method_warmup_is_checked():
    with pytest.raises(ValueError, match='warmup=-1'):
        harness.Method('k=4', delay=4, warmup=-1)
    with pytest.raises(ValueError, match='delayed method'):
        harness.Method('stock', trainer='sync', warmup=0)


# -- wire_bytes.py: bytes per delayed step of the real job (docs/benchmarks/wire-bytes) -------
def _ceil(a, b):
    return -(-a // b)


def test_wire_bytes_expected_from_the_format():
    """The format's bytes of the MLP's chunks (at most 524288 values), written out by hand:
    ternary packs 20 levels per float32 word plus a float32 scale per block of 256 and an
    int64 row id per chunk; an int8 pull is a float32 header, a scale per block and a byte
    per value rounded up to whole blocks."""
    chunks = [524288, 278528, 1024, 524288, 524288, 1024, 10240, 10]
    assert wire_bytes.chunks() == chunks and sum(chunks) == 1863690
    ternary = sum(4 * (_ceil(n, 256) + _ceil(n, 20)) + 8 for n in chunks)
    int8_pull = sum(4 * (1 + _ceil(n, 256) + 64 * _ceil(n, 256)) for n in chunks)
    assert (ternary, int8_pull) == (401944, 1893092)
    assert wire_bytes.expected(harness.METHODS['sync']) == (4 * 1863690, 4 * 1863690)
    assert wire_bytes.expected(harness.METHODS['k4-ternary-pull-int8']) == (
        ternary, int8_pull / 4)
    assert wire_bytes.expected(harness.METHODS['k4']) == (4 * 1863690, 1863690)
    assert wire_bytes.expected(harness.METHODS['k4-int4']) == (
        sum(4 * (_ceil(n, 256) + _ceil(n, 8)) + 8 for n in chunks), 1863690)


def _wire_rows():
    """Two methods, one round: a 16-step and an 80-step job each; nodes a (scheduler),
    b (server), c and d (workers)."""
    def row(method, steps, worker_tx, worker_rx):
        return {'method': method, 'round': 1, 'steps': steps,
                'eth0': {'a': [0, 0], 'b': [7, 9], 'c': [worker_tx, worker_rx],
                         'd': [worker_tx + 64 * steps, worker_rx]}}
    return [row('sync', 16, 1000, 2000), row('sync', 80, 1000 + 64 * 800, 2000 + 64 * 800),
            row('k4-ternary-pull-int8', 80, 50 + 64 * 40, 64 * 50),
            row('k4-ternary-pull-int8', 16, 50, 0)]


def test_wire_bytes_per_step_is_the_difference_of_the_two_jobs():
    summary = wire_bytes.summarize(_wire_rows(), ['sync', 'k4-ternary-pull-int8'],
                                   ['a', 'b', 'c', 'd'])
    sync, headline = summary
    # worker d sends 64 bytes per step more than c: the mean is c's + 32
    assert sync['rounds'] == [dict(round=1, worker_tx=832.0, worker_rx=800.0, server_tx=0.0,
                                   server_rx=0.0, workers=[[800.0, 800.0], [864.0, 800.0]])]
    assert (headline['worker_tx'], headline['worker_rx']) == (72.0, 50.0)
    assert headline['worker_tx_range'] == [72.0, 72.0]
    assert headline['worker_tx_ratio'] == pytest.approx(832 / 72, abs=1e-12)
    assert headline['worker_rx_ratio'] == pytest.approx(16.0, abs=1e-12)
    assert headline['worker_both_ratio'] == pytest.approx(1632 / 122, abs=1e-12)
    assert sync['worker_both_ratio'] == 1.0
    assert headline['expected_tx'] == 401944


def test_wire_bytes_job(tmp_path, launched, monkeypatch):
    monkeypatch.setattr(fp16_bytes, 'counters', lambda net: {n: (0, 0) for n, _ in net.nodes})
    args = wire_bytes.parse_args(['--scratch', str(tmp_path)])
    row = wire_bytes.run_one(args, _Net(4), '/h', 'k4-ternary-pull-int8', 16, 2)
    assert row['error'].startswith('exit [1]')
    argv, env = launched.only()
    assert argv == _launch(2, '-s', 1, '--timeout', 300, '--launcher', 'netns', '-H', '/h') + [
        sys.executable, WORKER] + DELAYED + ['4', '--pull-compression', 'int8', '--compression',
                                             'ternary', '--warmup-steps', '8', '--steps', '16',
                                             '--seed', '1'] + DATA + [
        '--out', str(tmp_path / 'k4-ternary-pull-int8-16-r2' / 'worker-{rank}.json')]
    assert env == CLEAN
    assert row['eth0'] == {'ns%d' % i: [0, 0] for i in range(4)}


def test_wire_bytes_refuses_windows_off_the_pull_period(capsys):
    with pytest.raises(SystemExit):
        wire_bytes.parse_args(['--steps', '16,46'])
    assert "B - A = 30 must be a multiple of every method's delay (1, 4)" in (
        capsys.readouterr().err)
    with pytest.raises(SystemExit):
        wire_bytes.parse_args(['--steps', '48,16'])
    assert wire_bytes.parse_args(['--steps', '8,24', '--methods', 'sync,k8']).steps == [8, 24]
