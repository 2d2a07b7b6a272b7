"""benchmarks/harness.py's guarantees, and what each maintained benchmark does with them.

The harness: a job's processes run in a clean environment and a stock job has no mxdelay in
any of them (a real job each way); every process records what it imported, and a stock one
that finds mxdelay exits; the launcher's argv; a run's provenance; a signal stops the job and
its roles; every method of the registry is a command line the worker accepts. Then the
scenarios' own behaviour, with the jobs faked (``launched``): which jobs ``tta.py``,
``accuracy_cnn.py``, ``scaling.py``, ``memory.py`` and ``kvstore_roundtrip.py`` start, in what
order and with which timeouts, their reports from results files, and ``results_page.py``.
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
import bench_worker  # noqa: E402
import harness  # noqa: E402
import kvstore_roundtrip  # noqa: E402
import memory  # noqa: E402
import monitor  # noqa: E402
import netns as bench_netns  # noqa: E402
import provenance  # noqa: E402
import results_page  # noqa: E402
import report  # noqa: E402
import scaling  # noqa: E402
import tta  # noqa: E402
import tta_real  # noqa: E402
import tta_report  # noqa: E402
import tta_setup  # noqa: E402
# pylint: enable=wrong-import-position

LAUNCHER = os.path.join(REPO, 'mxdelay', 'launcher.py')
WORKER = os.path.join(REPO, 'benchmarks', 'bench_worker.py')
KV_WORKER = os.path.join(REPO, 'benchmarks', 'kv_worker.py')
DELAYED = ['--mode', 'delayed', '--delay']


@pytest.fixture(name='driver_env')
def fixture_driver_env(monkeypatch):
    """The driver's environment holds variables that no job may inherit."""
    for name in ('DMLC_ROLE', 'MXNET_ENGINE_TYPE', 'MXDELAY_RANK'):
        monkeypatch.setenv(name, 'x')
    monkeypatch.setenv('OMP_NUM_THREADS', '8')


def _assert_clean(env):
    assert not [k for k in env if k.startswith(('DMLC_', 'MXNET_', 'MXDELAY_'))]
    assert env['OMP_NUM_THREADS'] == '1' and env['PYTHONUNBUFFERED'] == '1'


# -- the harness's guarantees -----------------------------------------------------------------
@pytest.mark.parametrize('hostfile', [None, '/tmp/hosts'])
def test_job_argv_and_clean_environment(hostfile, driver_env):  # pylint: disable=unused-argument
    job = harness.Job(['cmd', 'a'], 100.7, 4, 2, hostfile, env={'MXNET_X': '1'})
    netns = ['--launcher', 'netns', '-H', hostfile] if hostfile else []
    # The launcher as a plain file (never -m: importing mxdelay would set its defaults).
    assert job.argv == ([sys.executable, LAUNCHER, '-n', '4', '-s', '2', '--timeout', '100']
                        + netns + ['--', 'cmd', 'a'])
    env = job.env
    assert env.pop('MXNET_X') == '1'   # a method's own variable, on top of the clean one
    _assert_clean(env)
    assert harness.Job(['cmd'], None).argv == [sys.executable, LAUNCHER, '-n', '2', '-s', '1',
                                                '--', 'cmd']


@pytest.mark.jobs
def test_a_stock_job_has_no_mxdelay_in_any_process_and_a_delayed_job_has(tmp_path):
    # This driver imported mxdelay (tests/conftest.py), which set its MXNet defaults in
    # os.environ: the job's explicit environment keeps them, and mxdelay, out of every
    # process of the stock job. The same check flags the delayed job's processes.
    assert 'mxdelay' in sys.modules
    pids = PidFile(tmp_path / 'pids')
    roles = {}
    for kind in ('dist_sync', 'dist_delay'):
        folder = tmp_path / kind
        folder.mkdir()
        job = harness.Job(pids.wrap([sys.executable, KV_WORKER, kind, '3',
                                     str(folder / 'rank0.json')]), 120)
        assert job.run(str(folder / 'log.txt')) == 0, (folder / 'log.txt').read_text()[-3000:]
        assert len(json.loads((folder / 'rank0.json').read_text())['times']) == 3
        roles[kind] = harness.read_roles(str(folder))
    pids.assert_all_dead(timeout=5)
    stock, delayed = roles['dist_sync'], roles['dist_delay']
    names = ['scheduler-0', 'server-0', 'worker-0', 'worker-1']
    assert sorted(stock) == sorted(delayed) == names
    for name, records in stock.items():
        assert [r['stage'] for r in records] == ['start', 'exit'], name
        assert not any(r['mxdelay_imported'] or r['kvstore_ext_imported'] for r in records)
        assert not [k for r in records for k in r['env'] if k.startswith('MXNET_')], name
        assert records[0]['env']['OMP_NUM_THREADS'] == '1'
    assert harness.stock_check(True, stock) == 'ok' and harness.worker_env(stock) == '(none)'
    # The workers kept mxdelay imported; the scheduler and the server left its import only
    # to exit, with the MXNet defaults it set.
    assert harness.stock_check(True, delayed) == (
        'scheduler-0 saw MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN_BWD; server-0 saw '
        'MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN_BWD; worker-0 imported mxdelay; worker-1 imported '
        'mxdelay')
    assert harness.stock_check(False, delayed) == 'ok'
    assert harness.worker_env(delayed) == 'MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN_BWD=4'


RECORDING_PROCESS = '''
import sys
sys.path.insert(0, sys.argv[1])
if sys.argv[3] == 'imported':
    sys.modules['mxdelay'] = sys   # as if mxdelay had been imported before the check
import provenance
provenance.record(sys.argv[2], 'sync', stock=True)
'''


@pytest.mark.parametrize('before', ['clean', 'imported'])
def test_a_stock_process_records_what_it_imported_and_exits_if_mxdelay_was(tmp_path, before):
    done = subprocess.run([sys.executable, '-c', RECORDING_PROCESS,
                           os.path.join(REPO, 'benchmarks'), str(tmp_path), before],
                          env=dict(os.environ, DMLC_ROLE='server', MXDELAY_RANK='1',
                                   MXNET_X='2'),
                          capture_output=True, text=True, timeout=60, check=False)
    roles, imported = provenance.read_records(str(tmp_path))
    records = roles['server-1']
    if before == 'clean':
        assert done.returncode == 0, done.stderr
        assert [r['stage'] for r in records] == ['start', 'exit'] and imported == []
    else:
        assert done.returncode == provenance.STOCK_VIOLATION == 3
        assert 'a stock process found mxdelay imported' in done.stderr
        assert [r['stage'] for r in records] == ['start'] and imported == ['server-1']
    assert records[0]['env']['MXNET_X'] == '2' and records[0]['role'] == 'server'


def test_run_worker(tmp_path, monkeypatch, driver_env):  # pylint: disable=unused-argument
    seen = {}

    def fake_popen(argv, **kwargs):
        seen.update(argv=argv, **kwargs)
        return mock.Mock(pid=2 ** 22 - 7, poll=lambda: 1,
                         wait=lambda timeout=None: seen.update(timeout=timeout) or 1)
    monkeypatch.setattr(subprocess, 'Popen', fake_popen)
    folder = str(tmp_path / 'run')
    os.makedirs(folder)
    (tmp_path / 'run' / 'stale.json').write_text('{}')   # a previous run's file goes
    code, results, _, roles = harness.run_worker(folder, harness.METHODS['k4'].args, 2640, '/h')
    assert (code, results, roles) == (1, [], {})
    assert seen['argv'] == [
        sys.executable, LAUNCHER, '-n', '2', '-s', '1', '--timeout', '2640', '--launcher',
        'netns', '-H', '/h', '--', sys.executable, WORKER, '--mode', 'delayed', '--delay', '4',
        '--out', os.path.join(folder, 'worker-{rank}.json')]
    assert seen['cwd'] == REPO and seen['timeout'] == 2700 and seen['start_new_session']
    _assert_clean(seen['env'])
    assert os.listdir(folder) == ['log.txt']
    with open(os.path.join(folder, 'log.txt'), encoding='utf-8') as src:
        assert src.readline().startswith('$ %s %s -n 2' % (sys.executable, LAUNCHER))


def test_window_of_a_run():
    # 2 workers x 4 steps x 128 over the first start to the last end (1.0 to 3.0 s); the
    # CPU monitor's cores per role summed by role; worker 0's step times.
    results = [dict(steps=4, start=1.0, end=2.5, step_ends=[1.5, 2.0, 2.25, 2.5]),
               dict(steps=4, start=1.25, end=3.0, step_ends=[1.5, 2.0, 2.5, 3.0])]
    cpu = mock.Mock(usage=lambda start, end: {
        'worker 0': 0.5, 'worker 1': 0.25, 'server 0': 0.125, 'scheduler': 0.0625,
        'launcher': 0.03125, 'driver': 0.03125, 'other': 1.0} if (start, end) == (1.0, 3.0)
        else None)
    assert harness.window(results, cpu) == dict(
        samples_per_s=2 * 4 * 128 / 2.0, ms_per_step=500.0, window_s=2.0, cpu_workers=0.75,
        cpu_server=0.125, cpu_scheduler=0.0625, cpu_launcher=0.0625, cpu_other=1.0,
        step_ms='500.0 500.0 250.0 250.0')


def test_job_tree_labels_each_process_by_its_role(tmp_path):
    # A process reads as its parent until it execs; then as the role its environment names.
    child = subprocess.Popen(  # pylint: disable=consider-using-with
        ['sleep', '30'], env=dict(os.environ, DMLC_ROLE='server', MXDELAY_RANK='3'))
    try:
        labels = {}
        found = monitor.job_tree({os.getpid(): 'driver'}, labels)
        assert found[0] == os.getpid() and child.pid in found
        assert labels[os.getpid()] == 'driver' and labels[child.pid] == 'server 3'
    finally:
        child.kill()
        child.wait()


def test_stock_check():
    clean = [{'mxdelay_imported': False, 'kvstore_ext_imported': False, 'env': {'OMP_X': '1'}}]
    dirty = [dict(clean[0], kvstore_ext_imported=True)]
    defaults = [clean[0], dict(clean[0], env={'MXNET_A': '1', 'MXNET_B': '2'})]
    roles = {'scheduler-0': clean, 'server-0': defaults, 'worker-0': clean, 'worker-1': dirty}
    assert harness.stock_check(False, roles) == 'ok'
    assert harness.stock_check(True, roles) == ('server-0 saw MXNET_A, MXNET_B; worker-1 '
                                                'imported mxdelay')
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


# A driver that runs one launcher job under harness.interruptible(): argv 1 is benchmarks/,
# 2 the job's log, the rest the roles' command.
SIGNALLED_DRIVER = '''
import sys
sys.path.insert(0, sys.argv[1])
import harness
sys.exit(harness.run_stoppable(
    lambda: harness.Job(sys.argv[3:], 600, num_workers=2).run(sys.argv[2])))
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


# -- the methods (benchmarks/methods.py) ------------------------------------------------------
def test_every_method_is_a_command_line_the_worker_accepts():
    # Arguments in the order mode, delay, extra, compression; stock exactly for --mode sync;
    # and bench_worker parses each one (a sync method's compression is stock MXNet's 2bit).
    assert harness.Method('k', delay=4, extra=('--x',), compression='fp16').args == [
        '--mode', 'delayed', '--delay', '4', '--x', '--compression', 'fp16']
    for name, method in harness.METHODS.items():
        assert method.stock == (method.args[:2] == ['--mode', 'sync']), name
        adam = ['--optimizer', 'adam'] if '--freeze-second-moment' in method.args else []
        parsed = bench_worker.parse_args(method.args + adam + ['--out', 'x.json'])
        assert (parsed.mode == 'sync') == method.stock, name
        assert parsed.delay == (method.delay or 4), name
        # a stock method asks only for MXNet's own compression
        assert not method.stock or (parsed.compression or {'type': '2bit'})['type'] == '2bit'


def test_method_variants_differ_only_in_what_they_name():
    # A warm-up variant runs the same job per step as its base method (so it shares its
    # phase times); a global-model variant adds --global-model; the rest keep the default.
    for base in ('k4-fp16-pull-int8', 'k8-fp16-pull-int8', 'k4-ternary-pull-int8'):
        for w in (0, 50, 100):
            variant = harness.METHODS['%s-w%d' % (base, w)]
            assert (variant.warmup, variant.job) == (w, harness.METHODS[base].job)
            assert variant.label == '%s, warm-up %d' % (harness.METHODS[base].label, w)
    assert harness.METHODS['k4-fp16-pull-int8'].job != harness.METHODS['k8-fp16-pull-int8'].job
    assert sorted(n for n, m in harness.METHODS.items() if m.warmup is not None) == sorted(
        '%s-w%d' % (b, w) for b in ('k4-fp16-pull-int8', 'k8-fp16-pull-int8',
                                    'k4-ternary-pull-int8') for w in (0, 50, 100))
    for base in ('k4', 'k4-ternary-pull-int8'):
        variant = harness.METHODS[base + '-gm']
        assert variant.extra == harness.METHODS[base].extra + ('--global-model',)
        assert (variant.delay, variant.compression) == (4, harness.METHODS[base].compression)
    assert harness.methods('sync', 'k4=mirror-k4') == {
        'sync': harness.METHODS['sync'], 'k4': harness.METHODS['mirror-k4']}


def test_method_warmup_is_checked():
    with pytest.raises(ValueError, match='warmup=-1'):
        harness.Method('k=4', delay=4, warmup=-1)
    with pytest.raises(ValueError, match='delayed method'):
        harness.Method('stock', trainer='sync', warmup=0)


# -- the workers' command lines -----------------------------------------------------------------
def test_worker_compression_options():
    base = ['--mode', 'delayed', '--out', 'x.json']
    parsed = {text: bench_worker.parse_args(base + ['--compression', text]).compression
              for text in ('none', 'int8', 'int4', 'ternary', 'ternary:64', 'fp16', '2bit:0.5')}
    assert parsed == {'none': None, 'int8': {'type': 'int8'}, 'int4': {'type': 'int4'},
                      'ternary': {'type': 'ternary'},
                      'ternary:64': {'type': 'ternary', 'block_size': 64},
                      'fp16': {'type': 'fp16'}, '2bit:0.5': {'type': '2bit', 'threshold': 0.5}}
    for bad in ('int8:', 'int8:x', 'fp16:2', 'ternary:-1'):
        with pytest.raises(ValueError, match="'int8', 'int4' or 'ternary' with an optional "
                                             "':BLOCK'"):
            bench_worker.compression_params(bad)
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


def test_worker_zoo_models_their_batch_and_synthetic_data():
    # resnet50: batch 8 unless given; the others 128; synthetic data only (no --epochs)
    base = ['--mode', 'sync', '--out', 'x.json']
    batch = {tuple(extra): bench_worker.parse_args(base + extra).batch_size for extra in (
        [], ['--model', 'resnet18'], ['--model', 'resnet50'],
        ['--model', 'resnet50', '--batch-size', '4'])}
    assert batch == {(): 128, ('--model', 'resnet18'): 128, ('--model', 'resnet50'): 8,
                     ('--model', 'resnet50', '--batch-size', '4'): 4}
    with pytest.raises(SystemExit):
        bench_worker.parse_args(base + ['--model', 'resnet50', '--epochs', '1'])
    # the model zoo's resnet50_v1 with 10 classes: scaling.MODELS' 23.55M trained parameters
    # (94.2 MB of float32) in 193 tensors, 299 with the BatchNorm statistics
    net = bench_worker.build_model('resnet50')
    net.initialize()
    with bench_worker.autograd.train_mode():
        net(bench_worker.nd.zeros((1,) + bench_worker.INPUT_SHAPE['resnet50']))
    params = list(net.collect_params().values())
    trained = [p for p in params if p.grad_req != 'null']
    assert (sum(p.data().size for p in trained), len(trained), len(params)) == (
        23547402, 193, 299)
    assert scaling.MODELS['resnet50']['megabytes'] == round(23547402 * 4 / 1e6, 1)
    # the same fixed batches for a seed and rank, others for another rank
    first = bench_worker.SyntheticShard(8, 0, 1, num_batches=2)
    again = list(bench_worker.SyntheticShard(8, 0, 1, num_batches=2).batches(5))
    other = list(bench_worker.SyntheticShard(8, 1, 1, num_batches=2).batches(0))
    assert len(first) == 2 and [x.shape for x, _ in first.batches(0)] == [(8, 3, 32, 32)] * 2
    for (x, y), (x2, y2), (x3, _) in zip(first.batches(0), again, other):
        assert (x == x2).all() and (y == y2).all() and not (x == x3).any()
        assert set(y.tolist()) <= set(range(10))


@pytest.mark.parametrize('script, required', [
    ('kv_worker.py', 'kvstore, steps, out_json'),
    ('memory_worker.py', 'mode, k, model, steps, out_folder')])
def test_positional_workers_answer_help_and_missing_arguments(script, required):
    path = os.path.join(REPO, 'benchmarks', script)
    done = subprocess.run([sys.executable, path, '-h'], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0 and 'Usage (under a launcher)' in done.stdout, done.stderr
    done = subprocess.run([sys.executable, path], capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 2
    assert 'the following arguments are required: %s' % required in done.stderr


# -- the scenarios' jobs, faked ---------------------------------------------------------------
class _Launched:
    """Records what the scripts would start: subprocess.run and Popen do nothing, exit 1."""

    def __init__(self):
        self.calls = []

    def run(self, argv, **kwargs):
        if argv[0] in ('git', 'uname'):
            return subprocess.CompletedProcess(argv, 0, stdout='', stderr='')
        if argv[0] == 'ip':  # link counters: one idle port (or eth0) per node
            return subprocess.CompletedProcess(argv, 0, stdout=json.dumps([
                {'ifname': 'p%d' % i, 'stats64': {'rx': {'bytes': 0}, 'tx': {'bytes': 0}}}
                for i in range(16)]))
        self.calls.append((list(argv), kwargs))
        return subprocess.CompletedProcess(argv, 1, stdout='', stderr='')

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


def test_tta_networks():
    # network -> (label, rate, warm-up and delayed steps of a phase run, s/step bound)
    assert tta.NETWORKS == {'loopback': ('loopback', None, 100, 304, 1.0),
                            '1gbit': ('1 Gbit/s links', '1gbit', 40, 80, 2.0),
                            '100mbit': ('100 Mbit/s links', '100mbit', 12, 32, 10.0)}


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


def test_tta_runs_any_method_of_the_registry_with_its_arguments(tmp_path, launched):
    # --methods may name any method of benchmarks/methods.py; its warm-up, if it has its own,
    # replaces the default 200, and the meta file records each delayed method's.
    scratch = str(tmp_path / 's')
    chosen = ['sync', 'k4-2bit-pull-int8', 'k8-fp16-pull-int8-w50']
    assert tta.main(['--part', 'full', '--out', str(tmp_path / 'out'), '--scratch', scratch,
                     '--seeds', '1', '--epochs', '5', '--methods', ','.join(chosen)]) == 1
    for (argv, kwargs), name, warmup in zip(launched.calls, chosen, (200, 200, 50)):
        assert argv == _launch(2, '-s', 1, '--timeout', 1470) + [
            sys.executable, WORKER] + harness.METHODS[name].args + [
                '--epochs', '5', '--seed', '1', '--warmup-steps', str(warmup),
                '--eval-every', '78'] + DATA + [
            '--out', os.path.join(scratch, 'full', name + '-s1', 'worker-{rank}.json')]
        assert _changes(kwargs['env']) == CLEAN
    assert len(launched.calls) == len(chosen)
    meta = report.read_json(str(tmp_path / 'out' / 'meta-full.json'))
    assert meta['settings']['warmups'] == {'k4-2bit-pull-int8': 200, 'k8-fp16-pull-int8-w50': 50}
    with pytest.raises(SystemExit):
        tta.parse_args(['--part', 'full', '--methods', 'sync,k5'])


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
    settings = report.read_json(os.path.join(out, 'meta-full.json'))['settings']
    assert (settings['workers'], settings['servers'], settings['eval_every']) == (4, 2, 39)
    assert tta_setup.job_shape({'full': {'settings': settings}}) == [4, 2]
    assert tta_setup.job_shape({'full': {'settings': {}}}) == [2, 1]  # folders from before
    with pytest.raises(ValueError, match='ran different jobs'):
        tta_setup.job_shape({'full': {'settings': settings}, 'phases': {'settings': {}}})


def test_tta_method_epochs_reach_each_job(tmp_path, launched):
    # --method-epochs: the named method trains its own epochs (and its timeout grows with
    # them), the others --epochs; a bad entry or a method not run is refused by name.
    assert tta.main(['--part', 'full', '--out', str(tmp_path / 'out'), '--scratch',
                     str(tmp_path / 's'), '--seeds', '1', '--epochs', '5', '--methods',
                     'sync,k4', '--method-epochs', 'sync=3']) == 1
    (sync, sync_kw), (k4, k4_kw) = launched.calls
    assert sync[sync.index('--epochs') + 1] == '3' and sync_kw['timeout'] == 1062  # 1002 + 60
    assert k4[k4.index('--epochs') + 1] == '5' and k4_kw['timeout'] == 1530
    assert report.read_json(str(tmp_path / 'out' / 'meta-full.json'))['settings'][
        'method_epochs'] == {'sync': 3}
    assert tta.method_epochs('sync=3,k4-ternary-pull-int8=5') == {
        'sync': 3, 'k4-ternary-pull-int8': 5}
    for bad in ('sync=0', 'sync', 'sync=x'):
        with pytest.raises(ValueError, match="--method-epochs: '%s' is not METHOD=N" % bad):
            tta.method_epochs(bad)
    with pytest.raises(SystemExit):
        tta.parse_args(['--part', 'full', '--methods', 'sync', '--method-epochs', 'k4=3'])


def _headline_folder(folder):
    """A folder of real runs alone: stock and k=4 on two links, 2 s and 0.5 s a step on
    100 Mbit/s, 0.25 s and 0.1 s on 1 Gbit/s; k=4 never reaches the target on 1 Gbit/s."""
    stock = [0.70, 0.75, 0.80, 0.81, 0.82, 0.83, 0.84, 0.86, 0.85]   # steps 78 .. 702
    delayed = {'100mbit': [0.74, 0.79, 0.82, 0.84, 0.851, 0.86],      # steps 78 .. 468
               '1gbit': [0.74, 0.79, 0.82, 0.84, 0.849, 0.849]}
    evals, runs = [], []
    for network, (stock_s, delayed_s) in (('100mbit', (2.0, 0.5)), ('1gbit', (0.25, 0.1))):
        for method, accs, per_step in (('sync', stock, stock_s),
                                       ('k4-ternary-pull-int8', delayed[network], delayed_s)):
            runs.append(dict(network=network, method=method, seed=1, exit=0, load_before=1.0,
                             load_after=2.0, stock_check='ok', steps=78 * len(accs),
                             train_s=78 * len(accs) * per_step, first_step_s=0.5,
                             cpu_other=0.1))
            evals += [dict(network=network, method=method, seed=1, step=78 * i,
                           epoch=round(78 * i / 234, 4), test_acc=acc, wall_s=78 * i * per_step,
                           epoch_end=i % 3 == 0) for i, acc in enumerate(accs, 1)]
    report.write_csv(str(folder / 'real-runs.csv'), runs)
    report.write_csv(str(folder / 'real-evals.csv'), evals)
    report.write_json(str(folder / 'meta-real.json'), dict(
        command='python benchmarks/tta.py --part real', started='start', finished='end',
        code_start={'commit': 'abcdef0123', 'dirty': False}, load_before=[1.0, 1.0, 1.0],
        load_after=[2.0, 2.0, 2.0]))
    return evals, runs


def test_tta_real_report_times_to_target(tmp_path):
    # A folder of real runs alone: the target is stock's accuracy at the end of epoch 3 of
    # its run on each link (0.85 at step 702); stock reaches it first at step 624 (0.86),
    # k=4 at step 390 on 100 Mbit/s (195 s: 6.40x), never on 1 Gbit/s.
    evals, runs = _headline_folder(tmp_path)
    assert tta.main(['--part', 'report', '--real-target', 'epoch3', '--out',
                     str(tmp_path)]) == 0
    links = report.read_json(str(tmp_path / 'headline.json'))
    assert [(link['network'], link['target']) for link in links] == [
        ('100mbit', 0.85), ('1gbit', 0.85)]
    fast = {r['method']: r for r in links[0]['runs']}
    assert (fast['sync']['hit']['step'], fast['sync']['hit']['wall_s']) == (624, 1248.0)
    assert (fast['k4-ternary-pull-int8']['hit']['step'],
            fast['k4-ternary-pull-int8']['hit']['wall_s']) == (390, 195.0)
    assert fast['k4-ternary-pull-int8']['ratio'] == 1248.0 / 195.0
    slow = {r['method']: r for r in links[1]['runs']}
    assert slow['sync']['hit']['wall_s'] == 624 * 0.25
    assert slow['k4-ternary-pull-int8']['hit'] is None
    assert slow['k4-ternary-pull-int8']['ratio'] is None
    with open(tmp_path / 'accuracy-time.png', 'rb') as png:
        assert png.read(8) == b'\x89PNG\r\n\x1a\n'
    text = (tmp_path / 'results.md').read_text()
    assert '| 100 Mbit/s links | 0.8500 | k=4 + ternary + pull int8 | 1 | 195.0 s (step 390, ' \
        'epoch 1.67, 0.8510) | 6.40x |' in text
    assert '- 100 Mbit/s links, seed 1, to 0.8500: k=4 + ternary + pull int8 195.0 s (3.2 min), ' \
        'dist_sync (stock) 1248.0 s (20.8 min): **6.40x**.' in text
    assert 'not reached (0.8490 at step 468, 46.8 s)' in text
    assert 'dist_sync (stock) on the links, at the same 9 steps: the same test accuracy' in text
    assert 'k=4 + ternary + pull int8 on the links, at the same 6 steps: test accuracies up ' \
        'to 0.0110 apart' in text  # 0.86 against 0.849 at step 468
    # a target given as an accuracy; an epoch the stock runs lack is refused by name
    assert tta_real.link_target(evals, '1gbit', ('accuracy', 0.8)) == (
        0.8, 'test accuracy 0.8 (--real-target)')
    with pytest.raises(ValueError, match='epoch4: the real runs have no sync evaluation at '
                                         'the end of epoch 4 on 100mbit; give an epoch'):
        tta_real.time_to_target(evals, runs, ('epoch', 4))
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
    rows = report.read_csv(os.path.join(out, 'real-runs.csv'))
    assert [(r['network'], r['method'], r['seed'], r['exit']) for r in rows] == [
        (n.split('-')[0], n.split('-')[1], int(n[-1]), 1) for n in names]
    meta = report.read_json(os.path.join(out, 'meta-real.json'))
    assert meta['command'].startswith('python benchmarks/tta.py --part real ')
    assert not os.path.exists(os.path.join(out, 'real-evals.csv'))  # no run succeeded


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


def test_scaling_job(tmp_path, launched):
    args = scaling.parse_args(['--scratch', str(tmp_path)])
    row = scaling.run_one(args, _Net(7), '/tmp/h', ('resnet18', '1gbit', 4, 2), 'k4-fp16', 1)
    folder = tmp_path / 'resnet18-1gbit-n4-s2-k4-fp16-r1'
    assert row['error'] == 'exit 1; see %s' % (folder / 'log.txt')
    assert row['stock_check'] == '0 role records' and 'wall_s' in row
    argv, env = launched.only()
    assert argv == _launch(4, '-s', 2, '--timeout', 272, '--launcher', 'netns', '-H',
                           '/tmp/h') + [
        sys.executable, WORKER] + DELAYED + ['4', '--local-rule', 'mirror', '--compression',
                                             'fp16', '--model', 'resnet18', '--batch-size',
                                             '32', '--lr', '0.01', '--warmup-steps', '3',
                                             '--steps', '8', '--seed', '1'] + DATA + [
        '--out', str(folder / 'worker-{rank}.json')]
    assert env == CLEAN
    # ResNet-50 at 10 Gbit/s: its batch of 8, 20 timed steps (3 whole periods of 4 after the
    # first and the switch: a steady rate), the timeout's bytes at its link's rate
    row = scaling.run_one(args, _Net(3), '/tmp/h', ('resnet50', '10gbit', 2, 1), 'sync', 2)
    assert (row['rate'], row['batch'], row['steps']) == ('10gbit', 8, 20)
    argv, _ = launched.calls[-1]
    assert argv[:argv.index('--') + 1] == _launch(2, '-s', 1, '--timeout', 256, '--launcher',
                                                  'netns', '-H', '/tmp/h')
    assert argv[argv.index('--model'):argv.index('--data-dir')] == [
        '--model', 'resnet50', '--batch-size', '8', '--lr', '0.01', '--warmup-steps', '3',
        '--steps', '20', '--seed', '1']


def test_memory_and_roundtrip_jobs(tmp_path, launched):
    with pytest.raises(RuntimeError):
        memory.run('big', 'delay', 8, str(tmp_path))
    assert launched.only() == (_launch(2, '-s', 2, '--timeout', 1500) + [
        sys.executable, os.path.join(REPO, 'benchmarks', 'memory_worker.py'), 'delay', '8',
        'big', '21', str(tmp_path)], CLEAN)
    launched.calls.clear()
    with pytest.raises(RuntimeError):
        kvstore_roundtrip.run('dist_delay', 30, str(tmp_path), 'sgd', 'big')
    assert launched.only() == (_launch(2, '-s', 1, '--timeout', 600) + [
        sys.executable, KV_WORKER, 'dist_delay', '30', str(tmp_path / 'rank0.json'), 'sgd',
        'big'], CLEAN)


# -- the scenarios' reports, from results files -----------------------------------------------
def _cnn_folder(path, runs):
    """A results folder of accuracy_cnn with `runs`: (optimizer, method, seed, exit, acc)."""
    os.makedirs(path)
    report.write_csv(os.path.join(path, 'runs.csv'), [
        dict(optimizer=o, method=m, seed=s, exit=e, load_before=0.5, load_after=0.5,
             stock_check='ok') for o, m, s, e, _ in runs])
    report.write_csv(os.path.join(path, 'accuracy.csv'), [
        dict(optimizer=o, method=m, seed=s, epoch=i + 1, test_acc=a)
        for o, m, s, _, acc in runs for i, a in enumerate(acc)])


def test_accuracy_cnn_plots_every_method():
    assert set(accuracy_cnn.PLOT_STYLES) == set(accuracy_cnn.METHODS)


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
    report.write_csv(os.path.join(out, 'full-evals.csv'),
                     evals({}, (1, 2), 5, lambda step: 0.01 * step))
    report.write_csv(os.path.join(out, 'full-runs.csv'), [
        dict(method=m, seed=s, **run) for s in (1, 2) for m in ('sync', 'k4')])
    report.write_csv(os.path.join(out, 'phases-runs.csv'), [dict(
        network='1gbit', method=m, round=1, exit=0, warmup=40, steps=80, load_before=1.0,
        load_after=1.0, stock_check='ok', worker_env='(none)', first_step_s=1.0, sync_steps=40,
        sync_step_ms=100.0, delayed_steps=80, delayed_step_ms=50.0, drain_s=0.1,
        window_samples_per_s=1000.0, cpu_other=0.1, noisy=False, loss_digest='x')
        for m in ('sync', 'k4')])
    if real:
        report.write_csv(os.path.join(out, 'real-evals.csv'), evals(
            {'network': '1gbit'}, (1,), 1, lambda step: 2 + 0.1 * step))
        report.write_csv(os.path.join(out, 'real-runs.csv'), [
            dict(network='1gbit', method=m, seed=1, **run) for m in ('sync', 'k4')])


def test_tta_report_of_real_runs(tmp_path):
    out = str(tmp_path / 'out')
    _tta_folder(out)
    result = tta_report.build_report(out, real_target=('accuracy', 0.82))
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
    real = tta_report.build_report(out)['real']
    assert real['target'] == pytest.approx(0.8325, abs=1e-12)
    assert real['target_definition'] == ("mean over seeds 1, 2 of dist_sync's test accuracy "
                                         'after epoch 1 (full runs)')
    assert [(c['real_step'], c['full_step'], c['last_step']) for c in real['runs']] == [
        (None, 312, 234), (None, 390, 234)]
    with open(os.path.join(out, 'results.md'), encoding='utf-8') as src:
        assert 'not reached (0.8300 at step 234)' in src.read()
    with pytest.raises(ValueError, match='--real-target epoch6: the full runs'):
        tta_report.build_report(out, real_target=('epoch', 6))


def test_tta_report_without_real_runs_is_unchanged(tmp_path):
    out = str(tmp_path / 'out')
    _tta_folder(out, real=False)
    result = tta_report.build_report(out)
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


@pytest.fixture
def tta_methods():
    """tta's methods (one dict, shared by tta.py and its report), as they were after the test
    (the report adds the methods a folder's runs name)."""
    before = dict(tta_setup.METHODS)
    yield tta_setup.METHODS
    tta_setup.METHODS.clear()
    tta_setup.METHODS.update(before)


def test_tta_report_leaves_out_methods_of_fewer_seeds(tmp_path, tta_methods):
    # A method with full runs of seed 1 only (of seeds 1, 2) has no mean over the seeds: it is
    # named, and left out of the tables over seeds, instead of failing the report.
    out = str(tmp_path / 'out')
    _tta_folder(out, real=False)
    evals = report.read_csv(os.path.join(out, 'full-evals.csv'))
    extra = [dict(e, method='k8') for e in evals if e['method'] == 'k4' and e['seed'] == 1]
    report.write_csv(os.path.join(out, 'full-evals.csv'), evals + extra)
    result = tta_report.build_report(out)
    assert result['partial'] == {'k8': [1]}
    assert sorted(result['accuracy']) == ['k4', 'sync']
    with open(os.path.join(out, 'results.md'), encoding='utf-8') as src:
        assert 'Left out of every table over seeds (full runs of fewer seeds): k=8 (seed 1).' in (
            src.read())


#: methods of the warm-up tests: the same job per step, warm-ups 200 and 50 and 0 and 100
WARMUPS = ('k4-fp16-pull-int8', 'k4-fp16-pull-int8-w50', 'k8-fp16-pull-int8-w0',
           'k4-fp16-pull-int8-w100')


def test_warmup_in_derived_time(tta_methods):
    tta_methods.update(harness.methods(*WARMUPS))
    times = {'first_step_s': 10.0, 'sync_step_ms': 800.0, 'delayed_step_ms': 700.0}
    # step n: first step + (min(n, W + 1) - 1) synchronous steps + the rest delayed
    assert tta_report.derived_time(1170, 'k4-fp16-pull-int8', times) == pytest.approx(
        10 + 200 * 0.8 + 969 * 0.7)
    assert tta_report.derived_time(1170, 'k4-fp16-pull-int8-w50', times) == pytest.approx(
        10 + 50 * 0.8 + 1119 * 0.7)
    assert tta_report.derived_time(1170, 'k8-fp16-pull-int8-w0', times) == pytest.approx(
        10 + 1169 * 0.7)
    assert tta_report.derived_time(30, 'k4-fp16-pull-int8-w100', times) == pytest.approx(10 + 29 * 0.8)
    assert tta_report.derived_time(1170, 'sync', times) == pytest.approx(10 + 1169 * 0.8)


def test_report_takes_phases_of_the_same_job(tmp_path, tta_methods):
    # Accuracy runs of k=4 with W=200 and W=50, phase runs of W=200 only: W=50's derived time
    # uses W=200's step times, and the report says so.
    tta_methods.update(harness.methods(*WARMUPS))
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
    result = tta_report.build_report(out)
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


def test_the_results_page_is_generated_from_the_results_files():
    # docs/results.md is what results_page.py writes from the committed results files
    # (--check writes nothing); README.md's figures are checked by tests/test_docs.py.
    assert results_page.main(['--check']) == 0
