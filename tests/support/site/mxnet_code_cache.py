"""Memoise the compilation of the operator functions that ``import mxnet`` generates.

sitecustomize.py, next to this file, installs it in every role of a test job (scheduler,
servers, workers, stock MXNet's included): :func:`support.jobs.job_env` puts this folder
on their ``PYTHONPATH``.

``import mxnet`` writes the source of about 2,500 functions, one per operator and
namespace (``mxnet.ndarray.register`` and ``mxnet.symbol.register``), and ``exec``\\ s each:
compiling them is 0.45 s of the 0.95 s of CPU that the import takes, in each of the ~1,000
processes of the suite's jobs. Here the compiled code objects are kept in a file
(:data:`CACHE`) and reused. Each source is looked up by its SHA-1 after its one
process-dependent part, the operator's handle (an address), is replaced by as many 5s as
it has digits (so that the line table's columns stay); the cached code object gets the
handle back in place of that constant. So a function's code object is the one ``compile`` makes of its source
(tests/test_code_cache.py compares them: bytecode, constants, names, line table); a source that is not in the file
is compiled as MXNet does, and at exit the file is rewritten, in full and atomically,
with the process's set.

Only those two modules' ``exec`` is replaced (a name in their globals, before they run);
the rest of MXNet, and of the process, is untouched. Nothing here is imported by mxdelay.
"""
import atexit
import hashlib
import importlib.abc
import importlib.machinery
import marshal
import os
import re
import sys

#: The modules whose generated functions are memoised.
MODULES = ('mxnet.ndarray.register', 'mxnet.symbol.register')
#: Where the code objects are kept: the repository's .cache/ (git ignores it), one file per
#: Python bytecode version.
CACHE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))), '.cache', 'mxnet-ops.%s.marshal' % sys.implementation.cache_tag)
#: The handle in a generated source: the first argument of the call into the library.
_HANDLE = re.compile(r'((?:_imperative_invoke|_symbol_creator)\()(\d+)(,)')


class CodeCache:
    """The memoised code objects, loaded from :data:`CACHE` on first use."""

    def __init__(self, path=CACHE):
        self.path = path
        self.entries = None   # {sha1 of normalised source: marshalled code}
        self.used = {}
        self.hits = self.misses = 0

    def _load(self):
        self.entries = {}
        try:
            with open(self.path, 'rb') as src:
                entries = marshal.load(src)
        except (OSError, EOFError, ValueError, TypeError):
            return
        if isinstance(entries, dict):
            self.entries = entries

    def compile(self, source):
        """Return the code object of `source` (as ``compile(source, '<string>', 'exec')``)."""
        found = _HANDLE.findall(source)
        if len(found) != 1:   # not the expected shape: compile it as MXNet would
            return compile(source, '<string>', 'exec')
        digits = found[0][1]
        sentinel = int('5' * len(digits))
        normalised = _HANDLE.sub(r'\g<1>%d\g<3>' % sentinel, source)
        key = hashlib.sha1(normalised.encode('utf-8')).digest()
        if self.entries is None:
            self._load()
        data = self.entries.get(key)
        if data is None:
            self.misses += 1
            data = marshal.dumps(compile(normalised, '<string>', 'exec'))
        else:
            self.hits += 1
        self.used[key] = data
        return _replace_constant(marshal.loads(data), sentinel, int(digits))

    def save(self):
        """Rewrite :data:`CACHE` with the code objects used, if any of them was compiled."""
        if not self.misses:
            return
        temporary = '%s.%d.tmp' % (self.path, os.getpid())
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            with open(temporary, 'wb') as dst:
                marshal.dump(self.used, dst)
            os.replace(temporary, self.path)
        except OSError:   # a read-only checkout: the next process compiles again
            pass


def _replace_constant(code, old, new):
    consts = tuple(new if type(c) is int and c == old  # noqa: E721  not True == 1
                   else _replace_constant(c, old, new) if isinstance(c, type(code)) else c
                   for c in code.co_consts)
    return code.replace(co_consts=consts)


class _Finder(importlib.abc.MetaPathFinder):
    """Gives the modules of MODULES an ``exec`` of their own that compiles through the cache."""

    def __init__(self, cache):
        self.cache = cache

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MODULES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or not hasattr(spec.loader, 'exec_module'):
            return None
        load, cache = spec.loader.exec_module, self.cache

        def exec_module(module):
            def cached_exec(source, globals_=None, locals_=None):
                if isinstance(source, str):
                    source = cache.compile(source)
                # MXNet's call is exec(code, None, local): None means the module's globals.
                return exec(source, module.__dict__ if globals_ is None else globals_, locals_)
            # It stays: mxnet.ndarray.numpy._register and the like call this module's
            # _make_ndarray_function later.
            module.exec = cached_exec
            load(module)
        spec.loader.exec_module = exec_module
        return spec


def install(cache=None):
    """Memoise the generated functions of the next ``import mxnet`` (idempotent)."""
    if 'mxnet' not in sys.modules and not any(isinstance(f, _Finder) for f in sys.meta_path):
        cache = cache or CodeCache()
        sys.meta_path.insert(0, _Finder(cache))
        atexit.register(cache.save)   # MXNet's scheduler and stock servers exit inside import

