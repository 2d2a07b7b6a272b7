"""The package as a user gets it: a wheel built from the sources, installed into a fresh
virtual environment with MXNet's CPU build, runs a real job from there, not from the checkout.

What is tested: the wheel builds from a copy of the sources (so the checkout gains no build
files); its metadata has ``mxdelay.__version__`` (setup.py's one version source) and the
LICENSE and NOTICE files; ``pip install mxdelay-*.whl[cpu]`` into a new venv gives its
console scripts; a 2-worker, 1-server job launched by the venv's ``mxdelay-launch``, in a
folder outside the checkout and without PYTHONPATH, imports mxdelay and kvstore_ext from the
venv (the workers say so; the hand-shake needs mxdelay's servers), trains a linear regression with ``DelayedTrainer`` (k=2, ternary pushes,
int8 pulls) and ends with the same global weights on both workers after ``sync_weights()``.

Bounds: the job's loss falls below a tenth of its first step's (it falls about 100-fold in
these 40 steps); the workers' weights are compared exactly. Time: about 30 s (the wheel and
the venv are most of it).
"""
import os
import re
import shutil
import signal
import subprocess
import sys
import zipfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ('setup.py', 'README.md', 'LICENSE', 'NOTICE', 'mxdelay', 'kvstore_ext')
TIMEOUT = 120

JOB = '''
import mxdelay                      # before mxnet: the servers become mxdelay's
import kvstore_ext
import mxnet as mx
import numpy as np
from mxnet import autograd, gluon, nd

kv = mx.kv.create('dist_delay')
net = gluon.nn.Dense(1, in_units=4)
net.initialize(mx.init.Zero())
trainer = mxdelay.DelayedTrainer(net.collect_params(), 'sgd', {'learning_rate': 0.1},
                                 kvstore=kv, delay=2, warmup_steps=4,
                                 compression_params={'type': 'ternary'},
                                 pull_compression={'type': 'int8'})
rng = np.random.RandomState(kv.rank)
losses = []
for step in range(40):
    x = rng.randn(32, 4).astype(np.float32)
    y = x.dot(np.array([1.0, -2.0, 3.0, 0.5], dtype=np.float32))[:, None]
    with autograd.record():
        loss = ((net(nd.array(x)) - nd.array(y)) ** 2).mean()
    loss.backward()
    trainer.step(1)
    losses.append(float(loss.asscalar()))
trainer.sync_weights()
print('RESULT rank=%d version=%s mxdelay=%s kvstore_ext=%s first=%r last=%r weight=%s' % (
    kv.rank, mxdelay.__version__, mxdelay.__file__, kvstore_ext.__file__, losses[0],
    losses[-1], net.weight.data().asnumpy().tobytes().hex()))
'''


def _run(argv, **kwargs):
    result = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT, check=False,
                            **kwargs)
    assert result.returncode == 0, '%s\n%s\n%s' % (argv, result.stdout, result.stderr)
    return result


def _source_version():
    with open(os.path.join(REPO, 'mxdelay', '__init__.py'), encoding='utf-8') as src:
        [version] = re.findall(r"^__version__ = '([^']+)'$", src.read(), re.MULTILINE)
    return version


def _clean_env(**extra):
    env = {name: value for name, value in os.environ.items()
           if not name.startswith(('DMLC_', 'MXNET_', 'MXDELAY_', 'PYTHON', 'VIRTUAL_ENV'))}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK='1', OMP_NUM_THREADS='1', **extra)
    return env


@pytest.fixture(scope='module')
def wheel(tmp_path_factory):
    base = tmp_path_factory.mktemp('wheel')
    for name in SOURCES:
        source = os.path.join(REPO, name)
        if os.path.isdir(source):
            shutil.copytree(source, base / 'src' / name,
                            ignore=shutil.ignore_patterns('__pycache__', '*.pyc'))
        else:
            os.makedirs(base / 'src', exist_ok=True)
            shutil.copy(source, base / 'src' / name)
    _run([sys.executable, '-m', 'pip', 'wheel', '-q', '--no-deps', '-w', str(base / 'dist'),
          str(base / 'src')], env=_clean_env())
    [name] = os.listdir(base / 'dist')
    return base, base / 'dist' / name


@pytest.mark.jobs
@pytest.mark.timeout(4 * TIMEOUT)
def test_the_wheel_installs_and_runs_a_job_from_a_fresh_venv(wheel):
    base, path = wheel
    version = _source_version()
    assert path.name == 'mxdelay-%s-py3-none-any.whl' % version
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
        metadata = archive.read('mxdelay-%s.dist-info/METADATA' % version).decode()
    assert 'Version: %s\n' % version in metadata and 'License: Apache-2.0' in metadata
    for name in ('LICENSE', 'NOTICE'):
        assert any(n.startswith('mxdelay-%s.dist-info/' % version) and n.endswith(name)
                   for n in names), (name, names)

    venv = base / 'venv'
    # A new venv without pip of its own (ensurepip takes seconds): this pip installs into it.
    _run([sys.executable, '-m', 'venv', '--without-pip', str(venv)], env=_clean_env())
    _run([sys.executable, '-m', 'pip', '--python', str(venv / 'bin' / 'python'), 'install', '-q',
          '%s[cpu]' % path], env=_clean_env())

    run = base / 'run'
    run.mkdir()
    (run / 'job.py').write_text(JOB, encoding='utf-8')
    launcher = subprocess.Popen(  # pylint: disable=consider-using-with
        [str(venv / 'bin' / 'mxdelay-launch'), '-n', '2', '-s', '1', '--timeout', str(TIMEOUT),
         str(venv / 'bin' / 'python'), 'job.py'], cwd=str(run), env=_clean_env(),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = launcher.communicate(timeout=TIMEOUT + 30)
    finally:
        if launcher.poll() is None:        # only the job this test started
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    assert launcher.returncode == 0, stdout + stderr
    results = dict(re.findall(r'RESULT rank=(\d) (.*)', stdout))
    assert sorted(results) == ['0', '1'], stdout + stderr
    fields = {rank: dict(item.split('=', 1) for item in line.split()) for rank, line in
              results.items()}
    site = str(venv / 'lib')
    for rank, field in fields.items():
        assert field['version'] == version
        assert field['mxdelay'].startswith(site) and field['kvstore_ext'].startswith(site), field
        assert float(field['last']) < float(field['first']) / 10, (rank, field)
    assert fields['0']['weight'] == fields['1']['weight']
