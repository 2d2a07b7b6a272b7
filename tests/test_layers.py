"""The two layers and the processes: who imports what, and what each process runs.

- ``kvstore_ext`` (the MXNet side) imports nothing from ``mxdelay``, and no file imports
  itself back through a cycle (read from the sources);
- importing every ``kvstore_ext`` module in a fresh interpreter loads no ``mxdelay``, and
  importing the packages loads no MXNet until MXNet itself is imported;
- the launcher and ``mxdelay-run`` never load MXNet nor change their own environment;
- a worker script that never imports mxdelay, run under ``mxdelay-run``, gets mxdelay's store
  for ``'dist_delay'``, with ``sys.argv``, ``__main__``, its PID and exit code untouched;
- a server process becomes mxdelay's server whichever public module it imports first, and
  the scheduler runs MXNet's library without MXNet's Python package;
- an uncaught exception in a worker still runs the other atexit handlers and ends the job.
"""
import ast
import json
import os
import subprocess
import sys
import textwrap

import pytest

from support.jobs import (REPO, PidFile, assert_ok, python_command, role_lines, run_job,
                          worker_lines)

PACKAGES = ('kvstore_ext', 'mxdelay')
BIN = os.path.dirname(sys.executable)


def _modules():
    """{module name: path} of every module of both packages, subpackages included."""
    found = {}
    for package in PACKAGES:
        for folder, _, names in sorted(os.walk(os.path.join(REPO, package))):
            if '__init__.py' not in names:
                continue   # not a package (e.g. kvstore_ext/autoload, a sys.path entry)
            dotted = os.path.relpath(folder, REPO).replace(os.sep, '.')
            for name in sorted(names):
                if name.endswith('.py'):
                    module = dotted if name == '__init__.py' else '%s.%s' % (dotted, name[:-3])
                    found[module] = os.path.join(folder, name)
    return found


def _imports(module, path):
    """The project modules that `module` imports anywhere in its file (lazy imports too)."""
    package = module if path.endswith('__init__.py') else module.rsplit('.', 1)[0]
    targets = set()
    for node in ast.walk(ast.parse(open(path, encoding='utf-8').read())):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ''
            if node.level:   # relative: `from .` is the package, each more dot one up
                anchor = '.'.join(package.split('.')[:len(package.split('.')) - node.level + 1])
                base = anchor + ('.' + base if base else '')
            # `from pkg import name` imports pkg.name if that is a module, else a name of pkg.
            names = ['%s.%s' % (base, alias.name) for alias in node.names]
            submodules = [name for name in names if name in _modules()]
            targets.update(submodules or [base])
    modules = _modules()
    return {t for t in targets if t in modules and t != module}


def test_kvstore_ext_never_imports_mxdelay_and_no_file_imports_itself_back():
    graph = {module: _imports(module, path) for module, path in _modules().items()}
    upward = {m: sorted(t for t in targets if t.startswith('mxdelay'))
              for m, targets in graph.items() if m.startswith('kvstore_ext')}
    assert not any(upward.values()), upward
    # Depth-first search for a cycle; a package's __init__ counts as importing what it
    # imports (its lazy __getattr__ imports included).
    state = {}

    def visit(module, trail):
        state[module] = 'open'
        for target in sorted(graph[module]):
            if state.get(target) == 'open':
                raise AssertionError('import cycle: %s' % ' -> '.join(trail + [target]))
            if target not in state:
                visit(target, trail + [target])
        state[module] = 'done'
    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def _fresh(source, env=None):
    """Run `source` in a fresh interpreter (no DMLC role); return its stdout, parsed as JSON."""
    environ = dict(os.environ, PYTHONPATH=REPO)
    environ.pop('DMLC_ROLE', None)
    environ.pop('MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN_BWD', None)
    environ.update(env or {})
    done = subprocess.run([sys.executable, '-c', textwrap.dedent(source)], env=environ,
                          capture_output=True, text=True, timeout=120, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


#: kvstore_ext's rooms by the process that runs them: a room may import only the rooms listed.
#: The top level (bootstrap, env, checks, typenames) runs before MXNet in every process.
ROOMS = {
    'worker': {'worker', 'codecs', 'protocol', 'checkpoint', 'optim', 'top'},
    'server': {'server', 'codecs', 'protocol', 'checkpoint', 'optim', 'top'},
    'codecs': {'codecs', 'protocol', 'top'},
    'protocol': {'protocol', 'checkpoint', 'optim', 'top'},
    'checkpoint': {'checkpoint', 'optim', 'top'},
    'optim': {'optim', 'top'},
}


def _room(module):
    parts = module.split('.')
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in ROOMS) else 'top'


def test_the_server_imports_nothing_of_the_worker_and_shared_rooms_import_neither():
    graph = {m: _imports(m, p) for m, p in _modules().items() if m.startswith('kvstore_ext')}
    assert {_room(m) for m in graph} >= set(ROOMS) | {'top'}, sorted(graph)
    wrong = {m: sorted(t for t in targets if _room(t) not in ROOMS[_room(m)])
             for m, targets in graph.items() if _room(m) in ROOMS}
    assert not any(wrong.values()), {m: t for m, t in wrong.items() if t}
    # And the server's processes never load a worker module (nor mxdelay), read from a real
    # import of the server's entry point.
    loaded = subprocess.run(
        [sys.executable, '-c', 'import sys; import kvstore_ext.server.controller; '
         'print(" ".join(sorted(sys.modules)))'],
        cwd=REPO, check=True, capture_output=True, text=True, timeout=120).stdout.split()
    assert 'kvstore_ext.server.controller' in loaded
    assert not [m for m in loaded if m.startswith(('kvstore_ext.worker', 'mxdelay'))], loaded


def test_every_kvstore_ext_module_imports_without_mxdelay():
    modules = sorted(m for m in _modules() if m.startswith('kvstore_ext'))
    loaded = _fresh('''
        import importlib, json, sys
        for name in %r:
            importlib.import_module(name)
        print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'mxdelay')))
    ''' % modules)
    assert loaded == []
    assert len(modules) >= 12   # every part of the store and the server was imported


@pytest.mark.parametrize('first', ['mxdelay', 'kvstore_ext', 'mxdelay.launcher', 'mxdelay.run',
                                   'mxdelay.trace'])
def test_importing_the_packages_loads_no_mxnet_and_changes_no_environment(first):
    result = _fresh('''
        import json, os, sys
        before = dict(os.environ)
        import %s
        print(json.dumps({'mxnet': 'mxnet' in sys.modules,
                          'changed': sorted(k for k in set(os.environ) | set(before)
                                            if os.environ.get(k) != before.get(k))}))
    ''' % first)
    assert result == {'mxnet': False, 'changed': []}


@pytest.mark.parametrize('order', ['mxdelay-then-mxnet', 'mxnet-then-mxdelay',
                                   'kvstore_ext-then-mxnet'])
def test_dist_delay_is_registered_whatever_the_import_order(order):
    first, second = order.split('-then-')
    result = _fresh('''
        import json, os
        import %s
        import %s
        import mxnet as mx
        entry = mx.kvstore.KVStoreBase.kv_registry['dist_delay']   # the class, or its factory
        print(json.dumps({'registered': entry.__module__,
                          'bulk': os.environ.get('MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN_BWD')}))
    ''' % (first, second))
    # mxdelay's default for MXNet's backward bulk size is only possible before MXNet loads.
    assert result['registered'].startswith('kvstore_ext.'), result
    assert result['bulk'] == (None if first == 'mxnet' else '4')


def test_wrong_mxnet_release_is_refused_with_what_to_install(tmp_path):
    fake = tmp_path / 'mxnet'
    fake.mkdir()
    (fake / '__init__.py').write_text("__version__ = '1.8.0'\n")
    (fake / 'libinfo.py').write_text("__version__ = '1.8.0'\n")
    environ = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), REPO]))
    environ.pop('DMLC_ROLE', None)
    done = subprocess.run([sys.executable, '-c', 'import mxdelay, mxnet'], env=environ,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert ("ImportError: mxdelay needs MXNet 1.9.1 (it overrides private seams of "
            "gluon.Trainer and of the kvstore server, which change between releases); found "
            "MXNet 1.8.0. Install one build of it: pip install 'mxnet==1.9.1'") in done.stderr
    assert "or the CUDA build that matches your CUDA, e.g. pip install 'mxnet-cu112==1.9.1'" \
        in done.stderr


# -- processes ----------------------------------------------------------------------------------

# Every role runs this: it reports whether its parent (the launcher) has MXNet's library
# mapped, and which MXNet variables the parent's environment had at its start.
PARENT_PROBE = '''
import os
maps = open('/proc/%d/maps' % os.getppid()).read()
print('parent libmxnet:', 'libmxnet' in maps)
'''


@pytest.mark.jobs
@pytest.mark.parametrize('how', ['console-script', 'module'])
def test_the_launcher_process_never_loads_mxnet(tmp_path, how):
    launcher = ([os.path.join(BIN, 'mxdelay-launch')] if how == 'console-script'
                else [sys.executable, '-m', 'mxdelay.launcher'])
    environ = dict(os.environ, PYTHONPATH=REPO, DMLC_NODE_HOST='127.0.0.1')
    environ.pop('DMLC_ROLE', None)
    done = subprocess.run(launcher + ['-n', '1', '-s', '1', '--'] +
                          python_command(PARENT_PROBE), env=environ, capture_output=True,
                          text=True, timeout=120, cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr
    for role in ('[scheduler]', '[server 0]', '[worker 0]'):
        assert '%s parent libmxnet: False' % role in done.stdout.splitlines(), done.stdout


# A worker script with no mxdelay import: what a user's stock script looks like.
STOCK_SCRIPT = '''
import json, os, sys
import mxnet as mx
from mxnet import gluon, nd

net = gluon.nn.Dense(2, in_units=3)
net.initialize()
trainer = gluon.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1},
                        kvstore='dist_delay')   # Gluon calls mx.kv.create('dist_delay')
trainer._init_kvstore()
kv = trainer._kvstore                          # one store per process
rank = kv.rank
kv.init('x', nd.zeros(3))
kv.push('x', nd.ones(3) * (rank + 1))
out = nd.zeros(3)
kv.pull('x', out=out)
print(json.dumps({'store': '%s.%s' % (type(kv).__module__, type(kv).__name__),
                  'sum': out.asnumpy().tolist(), 'argv': sys.argv, 'name': __name__,
                  'file': os.path.basename(__file__), 'pid': os.getpid(),
                  'mxdelay_imported': 'mxdelay' in sys.modules}))
sys.stdout.flush()
os._exit(int(sys.argv[1]) if rank == 0 else 0)
'''


@pytest.mark.jobs
def test_dist_delay_under_mxdelay_run_is_mxdelays_store_in_a_script_without_mxdelay(tmp_path):
    script = tmp_path / 'train.py'
    script.write_text(STOCK_SCRIPT)
    pids = PidFile(tmp_path / 'pids')
    result = run_job(pids.wrap([os.path.join(BIN, 'mxdelay-run'), sys.executable, str(script),
                                '7', '--flag=x y']), num_workers=2, cwd=str(tmp_path))
    # The exit code of rank 0's script is the job's, as if it ran directly.
    assert result.returncode == 7, result.stderr
    recorded = pids.read()
    for launcher_rank in (0, 1):
        report = json.loads(worker_lines(result.stdout, launcher_rank)[-1])
        assert report['store'] == 'kvstore_ext.worker.dist_delay.DistDelay'
        # one round of SGD (lr 0.1, the trainer's optimizer on the servers): 0 - 0.1 * (1 + 2)
        assert [round(v, 6) for v in report['sum']] == [-0.3] * 3
        assert report['argv'] == [str(script), '7', '--flag=x y']
        assert (report['name'], report['file']) == ('__main__', 'train.py')
        assert report['mxdelay_imported'] is False          # only kvstore_ext was loaded
        # mxdelay-run exec'd the script: it kept the PID the launcher started.
        assert report['pid'] == recorded[('worker', launcher_rank)]
    pids.assert_all_dead()


# A worker of the import-order jobs: the role dispatch happens at the first import of any
# public module; the hand-shake proves the servers are mxdelay's. The scheduler reports at
# exit that it ran MXNet's library without MXNet's Python package.
ORDER_SCRIPT = '''
import atexit, os, sys
if os.environ['DMLC_ROLE'] == 'scheduler':
    atexit.register(lambda: print('scheduler: package %%s, library %%s' %% (
        any(m.split('.')[0] == 'mxnet' for m in sys.modules),
        'libmxnet' in open('/proc/self/maps').read())))
import %s
import mxnet as mx
from mxnet import nd
kv = mx.kv.create('dist_delay')
kv.init(0, nd.zeros(2))
kv.push(0, nd.ones(2) * (kv.rank + 1))
out = nd.zeros(2)
kv.pull(0, out=out)
stats = kv.delayed.job.server_stats()  # a command: only mxdelay's servers answer it
print('sum', out.asnumpy().tolist(), 'servers', sorted(s['server'] for s in stats))
'''


@pytest.mark.jobs
@pytest.mark.parametrize('first', ['mxdelay', 'kvstore_ext', 'kvstore_ext.server.controller'])
def test_a_server_becomes_mxdelays_whatever_module_it_imports_first(tmp_path, first):
    pids = PidFile(tmp_path / 'pids')
    result = run_job(pids.wrap(python_command(ORDER_SCRIPT % first)), num_workers=2,
                     num_servers=2)
    assert_ok(result)
    for rank in (0, 1):
        assert worker_lines(result.stdout, rank) == ['sum [3.0, 3.0] servers [0, 1]']
    assert role_lines(result.stdout, 'scheduler') == ['scheduler: package False, library True']
    for server in (0, 1):
        assert any("mxdelay server starting" in line
                   for line in result.stderr.splitlines() if line.startswith('[server %d]' % server))
    pids.assert_all_dead()


RAISING_WORKER = '''
import atexit, os, sys, time
import mxdelay
import mxnet as mx
from mxnet import nd
marker = sys.argv[1]
atexit.register(lambda: open(marker + os.environ['MXDELAY_RANK'], 'w').write('flushed'))
kv = mx.kv.create('dist_delay')
kv.init(0, nd.zeros(2))
if kv.rank == 1:
    raise RuntimeError('worker fails on purpose')
time.sleep(60)   # rank 0 would wait for rank 1 forever
'''


@pytest.mark.jobs
def test_uncaught_exception_runs_other_atexit_handlers_and_ends_the_job(tmp_path):
    marker = str(tmp_path / 'flushed')
    result = run_job(python_command(RAISING_WORKER, marker), num_workers=2, timeout=60)
    assert result.returncode == 1, result.stderr
    assert 'RuntimeError: worker fails on purpose' in result.stderr
    assert result.duration < 30, result.duration
    flushed = [name for name in os.listdir(str(tmp_path)) if name.startswith('flushed')]
    assert len(flushed) == 1        # the raising worker's handler ran; rank 0 was killed
    assert open(os.path.join(str(tmp_path), flushed[0])).read() == 'flushed'
