"""benchmarks/harness.py: every scenario's job argv and environment, without running a job.

The expected values were captured from the scripts before they moved onto the harness.
"""
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, 'benchmarks'))

import accuracy_cnn  # noqa: E402  pylint: disable=wrong-import-position
import benchmark  # noqa: E402  pylint: disable=wrong-import-position
import compress  # noqa: E402  pylint: disable=wrong-import-position
import faults  # noqa: E402  pylint: disable=wrong-import-position
import harness  # noqa: E402  pylint: disable=wrong-import-position
import provenance  # noqa: E402  pylint: disable=wrong-import-position
import scaling  # noqa: E402  pylint: disable=wrong-import-position
import tta  # noqa: E402  pylint: disable=wrong-import-position

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
        'sgd-k4': ("literal 'sgd' rule, k=4", DELAYED + ['4', '--local-rule', 'sgd'])},
    'scaling': {
        'sync': ('dist_sync (stock)', ['--mode', 'sync']),
        'k4': ('k=4', DELAYED + ['4', '--local-rule', 'mirror']),
        'k4-fp16': ('k=4 + fp16', DELAYED + ['4', '--local-rule', 'mirror',
                                             '--compression', 'fp16'])},
    'benchmark': {
        'compute': ('compute-only', ['--mode', 'compute']),
        'sync': ('dist_sync (stock)', ['--mode', 'sync']),
        'k1': ('delayed k=1', DELAYED + ['1']), 'k2': ('delayed k=2', DELAYED + ['2']),
        'k4': ('delayed k=4', DELAYED + ['4']), 'k8': ('delayed k=8', DELAYED + ['8'])},
}
SCENARIOS = {'tta': tta, 'compress': compress, 'accuracy_cnn': accuracy_cnn,
             'scaling': scaling, 'benchmark': benchmark}


@pytest.fixture(name='driver_env')
def fixture_driver_env(monkeypatch):
    """The driver's environment holds variables that no job may inherit."""
    for name in ('DMLC_ROLE', 'MXNET_ENGINE_TYPE', 'MXDELAY_RANK'):
        monkeypatch.setenv(name, 'x')
    monkeypatch.setenv('OMP_NUM_THREADS', '8')


def _assert_clean(env):
    assert not [k for k in env if k.startswith(('DMLC_', 'MXNET_', 'MXDELAY_'))]
    assert env['OMP_NUM_THREADS'] == '1' and env['PYTHONUNBUFFERED'] == '1'


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

    def fake_run(argv, **kwargs):
        seen.update(argv=argv, **kwargs)
        return subprocess.CompletedProcess(argv, 1)
    monkeypatch.setattr(subprocess, 'run', fake_run)
    folder = str(tmp_path / 'run')
    code, results, _, roles = harness.run_worker(folder, tta.METHODS['k4'].args, 2640, '/h')
    assert (code, results, roles) == (1, [], {})
    assert seen['argv'] == [
        sys.executable, LAUNCHER, '-n', '2', '-s', '1', '--timeout', '2640', '--launcher',
        'netns', '-H', '/h', '--', sys.executable, WORKER, '--mode', 'delayed', '--delay', '4',
        '--out', os.path.join(folder, 'worker-{rank}.json')]
    assert seen['cwd'] == REPO and seen['timeout'] == 2700
    _assert_clean(seen['env'])
    with open(os.path.join(folder, 'log.txt'), encoding='utf-8') as src:
        assert src.readline().startswith('$ %s %s -n 2' % (sys.executable, LAUNCHER))


def test_benchmark_launcher_and_faults_env(driver_env):  # pylint: disable=unused-argument
    launcher = benchmark._launcher  # pylint: disable=protected-access
    assert launcher(benchmark.NETWORKS['1gbit'], '/h', 322.5) == [
        sys.executable, LAUNCHER, '-n', '2', '-s', '1', '--timeout', '322', '--launcher',
        'netns', '-H', '/h', '--']
    assert launcher(benchmark.NETWORKS['jitter'], '/h', 60) == [
        sys.executable, LAUNCHER, '-n', '2', '-s', '1', '--timeout', '60', '--']
    env = harness.Job([], 60, env={'PYTHONPATH': REPO}).env
    _assert_clean(env)
    assert env['PYTHONPATH'] == REPO
    assert faults.JOB_TIMEOUT == 60


def test_networks():
    assert tta.NETWORKS == {'loopback': ('loopback', None, 100, 304, 1.0),
                            '1gbit': ('1 Gbit/s links', '1gbit', 40, 80, 2.0),
                            '100mbit': ('100 Mbit/s links', '100mbit', 12, 32, 10.0)}
    assert benchmark.NETWORKS['100mbit'] == dict(
        label='100 Mbit/s links', group='100mbit', rate='100mbit', jitter=False, warmup=3,
        steps=8, step_bound=10.0)
    assert benchmark.NETWORKS['jitter-1gbit'] == dict(
        label='1 Gbit/s links + jitter', group='1gbit', rate='1gbit', jitter=True, warmup=20,
        steps=80, step_bound=2.0)


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
