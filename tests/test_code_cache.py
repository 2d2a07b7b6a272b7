"""The test jobs' memo of ``import mxnet``'s generated functions
(support/site/mxnet_code_cache.py).

What is tested, each in fresh Python processes (the memo acts on MXNet's import): a first
import generates every function and writes the file, a second generates none; in both,
every function equals the one MXNet's own maker returns for the same operator in the same
process (code object: bytecode, constants with the handle, names, line table; docstring,
name, module, defaults); they work; a corrupt file, or one of another library, is
generated over; job_env puts the memo on the roles' ``PYTHONPATH``. And lazy_modules.py:
in a job role's Python, ``import mxnet`` leaves ``requests`` unrun, and its first use runs it
into the module object MXNet holds.

Tolerance: none.
"""
import json
import marshal
import os
import subprocess
import sys

from support.jobs import REPO, SITE, job_env

#: Imports MXNet with the memo at argv[1]; compares every function it makes with MXNet's
#: own maker's, and prints the counts as JSON.
CHECK = '''
import json, sys
sys.path.insert(0, %r)
import mxnet_code_cache as memo

class Checked(memo.CodeCache):
    def make(self, maker, handle, op_name, func_name):
        got = super().make(maker, handle, op_name, func_name)
        want = maker(handle, op_name, func_name)
        got_, want_ = ((f.__code__, f.__doc__, f.__name__, f.__module__, f.__defaults__,
                        f.__kwdefaults__) for f in (got, want))
        if got_ != want_:
            self.differ.append(op_name)
        return got

cache = Checked(sys.argv[1])
cache.differ = []
memo.install(cache)
import mxnet as mx
assert (mx.nd.ones((2,)) + 1).asnumpy().tolist() == [2.0, 2.0]
assert mx.sym.FullyConnected(mx.sym.var('x'), num_hidden=3).list_arguments() == [
    'x', 'fullyconnected0_weight', 'fullyconnected0_bias']
print(json.dumps({'hits': cache.hits, 'misses': cache.misses, 'differ': cache.differ}))
''' % SITE


def _import(path):
    # Without SITE on the path: its sitecustomize would install the memo of the repository.
    result = subprocess.run([sys.executable, '-c', CHECK, str(path)],
                            env=job_env({'PYTHONPATH': REPO}),
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def test_second_import_generates_nothing_and_gets_the_same_functions(tmp_path):
    path = tmp_path / 'ops.marshal'
    first = _import(path)
    assert first['hits'] == 0 and first['misses'] > 2000 and first['differ'] == []
    assert path.exists()
    second = _import(path)
    assert second == {'hits': first['misses'], 'misses': 0, 'differ': []}


def test_corrupt_file_or_one_of_another_library_is_generated_over(tmp_path):
    path = tmp_path / 'ops.marshal'
    path.write_bytes(b'not marshal data')
    first = _import(path)
    assert first['hits'] == 0 and first['misses'] > 2000 and first['differ'] == []
    fingerprint, entries = marshal.loads(path.read_bytes())   # rewritten, and valid
    changed = ((fingerprint[0][0], fingerprint[0][1] + 1, fingerprint[0][2]),) + fingerprint[1:]
    path.write_bytes(marshal.dumps((changed, entries)))
    assert _import(path) == first


def test_job_roles_get_the_memo():
    paths = job_env()['PYTHONPATH'].split(os.pathsep)
    assert paths[:2] == [REPO, SITE] and paths.count(SITE) == 1
    assert os.path.exists(os.path.join(SITE, 'sitecustomize.py'))


LAZY_CHECK = '''
import json, sys
import mxnet as mx
before = {'deferred': type(sys.modules['requests']).__name__, 'urllib3': 'urllib3' in sys.modules}
import requests
get = requests.get                      # the first use
from importlib.metadata import version
print(json.dumps({'before': before, 'urllib3': 'urllib3' in sys.modules,
                  'same': requests is mx.gluon.utils.requests is sys.modules['requests'],
                  'type': type(requests).__name__, 'get': get.__module__,
                  'version': requests.__version__ == version('requests')}))
'''


def test_requests_runs_at_its_first_use_in_the_same_module():
    result = subprocess.run([sys.executable, '-c', LAZY_CHECK], env=job_env(),
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == {
        'before': {'deferred': '_Deferred', 'urllib3': False}, 'urllib3': True, 'same': True,
        'type': 'module', 'get': 'requests.api', 'version': True}
