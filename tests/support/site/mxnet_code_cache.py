"""Memoise the operator functions that ``import mxnet`` generates.

sitecustomize.py, next to this file, installs it in every role of a test job (scheduler,
servers, workers, stock MXNet's included): :func:`support.jobs.job_env` puts this folder
on their ``PYTHONPATH``.

``import mxnet`` makes about 2,500 functions, one per operator and namespace: for each,
``mxnet.ndarray.register`` or ``mxnet.symbol.register`` writes its source and docstring
from the operator's description in the library, then compiles and ``exec``\\ s it. That is
0.55 s of the 0.95 s of CPU the import takes, in each of the ~1,000 processes of the suite's
jobs. Here the compiled code object and the docstring of each are kept in a file
(:data:`CACHE`) and reused: the function is then made from them as MXNet makes it from its
source. The one process-dependent part of a source, the operator's handle (an address), is
compiled as as many 5s as it has digits (so that the line table's columns stay), and the
cached code object gets the process's handle back in place of that constant.
tests/test_code_cache.py checks, for every function, that it equals MXNet's own (code
object: bytecode, constants, names, line table; docstring, name, module, defaults).

The file is valid for one library and MXNet Python code (:func:`_fingerprint`: sizes and
modification times); any other file is ignored, and at exit a process that generated a
function rewrites the file, in full and atomically, with its set. Only the registrations
that run while ``import mxnet`` executes the modules of :data:`MODULES` are memoised
(``mx.library.load`` registers a library's operators afresh). Nothing here is imported by
mxdelay.
"""
import atexit
import importlib.abc
import importlib.machinery
import marshal
import os
import re
import sys

#: The modules that register MXNet's operators during ``import mxnet``.
MODULES = frozenset('mxnet.%s._register' % name for name in (
    'ndarray.numpy', 'ndarray.numpy_extension', 'numpy', 'numpy_extension', 'symbol.numpy',
    'symbol.numpy_extension')) | {'mxnet.ndarray.register', 'mxnet.symbol.register'}
#: Where the functions are kept: the repository's .cache/ (git ignores it), one file per
#: Python bytecode version.
CACHE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))), '.cache', 'mxnet-ops.%s.marshal' % sys.implementation.cache_tag)
#: MXNet's function makers: {name: (its generator of source and docstring, the function's
#: __module__)}, in mxnet/ndarray/register.py and mxnet/symbol/register.py.
_MAKERS = {'_make_ndarray_function': ('_generate_ndarray_function_code', 'mxnet.ndarray'),
           '_make_symbol_function': ('_generate_symbol_function_code', 'mxnet.symbol')}
#: The files whose sizes and times make the fingerprint, in the mxnet package.
_SOURCES = ('base.py', 'ndarray/register.py', 'symbol/register.py', 'ndarray_doc.py',
            'symbol_doc.py', '_numpy_op_doc.py')
#: The handle in a generated source: the first argument of the call into the library.
_HANDLE = re.compile(r'((?:_imperative_invoke|_symbol_creator)\()(\d+)(,)')


def _fingerprint(base):
    paths = [base._LIB._name] + [os.path.join(os.path.dirname(base.__file__), name)
                                 for name in _SOURCES]
    stats = [os.stat(path) for path in paths]
    return tuple((path, stat.st_size, stat.st_mtime_ns) for path, stat in zip(paths, stats))


class CodeCache:
    """The memoised functions, loaded from `path` when the first one is made."""

    def __init__(self, path=CACHE):
        self.path = path
        self.fingerprint = None
        self.entries = None   # {(maker, op, func_name, digits): (marshalled code, docstring)}
        self.made = {}
        self.hits = self.misses = 0

    def _load(self, base):
        self.fingerprint, self.entries = _fingerprint(base), {}
        try:
            with open(self.path, 'rb') as src:
                fingerprint, entries = marshal.load(src)
        except (OSError, EOFError, ValueError, TypeError):
            return
        if fingerprint == self.fingerprint and isinstance(entries, dict):
            self.entries = entries

    def make(self, maker, handle, op_name, func_name):
        """Return the function that MXNet's `maker` (``_make_ndarray_function`` or
        ``_make_symbol_function``) returns for these arguments."""
        if self.entries is None:
            self._load(sys.modules['mxnet.base'])
        generator, module = _MAKERS[maker.__name__]
        digits = len(str(handle.value))
        sentinel = int('5' * digits)
        key = (maker.__name__, op_name, func_name, digits)
        entry = self.entries.get(key)
        if entry is None:
            source, doc = maker.__globals__[generator](handle, op_name, func_name)
            found = _HANDLE.findall(source)
            if len(found) != 1 or found[0][1] != str(handle.value):
                return maker(handle, op_name, func_name)   # not the expected shape: MXNet's
            code = compile(_HANDLE.sub(r'\g<1>%d\g<3>' % sentinel, source), '<string>', 'exec')
            entry = (marshal.dumps(code), doc)
            self.misses += 1
        else:
            self.hits += 1
        self.made[key] = entry
        # From here on, as MXNet's maker does with its source.
        local = {}
        exec(_replace_constant(marshal.loads(entry[0]), sentinel, handle.value),  # noqa: S102
             maker.__globals__, local)
        function = local[func_name]
        function.__name__ = func_name
        function.__doc__ = entry[1]
        function.__module__ = module
        return function

    def save(self):
        """Rewrite the file with the functions made, if any of them was generated."""
        if not self.misses:
            return
        temporary = '%s.%d.tmp' % (self.path, os.getpid())
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            with open(temporary, 'wb') as dst:
                marshal.dump((self.fingerprint, self.made), dst)
            os.replace(temporary, self.path)
        except OSError:   # a read-only checkout: the next process generates them again
            pass


def _replace_constant(code, old, new):
    consts = tuple(new if type(c) is int and c == old  # noqa: E721  not True == 1
                   else _replace_constant(c, old, new) if isinstance(c, type(code)) else c
                   for c in code.co_consts)
    return code.replace(co_consts=consts)


class _Finder(importlib.abc.MetaPathFinder):
    """While a module of MODULES runs, MXNet's op registrations make functions through the
    cache: ``mxnet.base``'s two registration functions get a maker that asks it first."""

    def __init__(self, cache):
        self.cache = cache
        self.running = 0
        self.patched = False

    def _patch(self, base):
        self.patched = True
        for name in ('_init_op_module', '_init_np_op_module'):
            setattr(base, name, self._registration(getattr(base, name)))

    def _registration(self, register):
        def memoised(*args, **kwargs):
            maker = kwargs.get('make_op_func', args[-1] if args else None)
            if self.running and getattr(maker, '__name__', None) in _MAKERS:
                def make(handle, op_name, func_name):
                    return self.cache.make(maker, handle, op_name, func_name)
                if 'make_op_func' in kwargs:
                    kwargs['make_op_func'] = make
                else:
                    args = args[:-1] + (make,)
            return register(*args, **kwargs)
        return memoised

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MODULES or 'mxnet.base' not in sys.modules:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or not hasattr(spec.loader, 'exec_module'):
            return None
        if not self.patched:
            self._patch(sys.modules['mxnet.base'])
        load = spec.loader.exec_module

        def exec_module(module):
            self.running += 1
            try:
                load(module)
            finally:
                self.running -= 1
        spec.loader.exec_module = exec_module
        return spec


def install(cache=None):
    """Memoise the generated functions of the next ``import mxnet`` (idempotent)."""
    if 'mxnet' not in sys.modules and not any(isinstance(f, _Finder) for f in sys.meta_path):
        cache = cache or CodeCache()
        sys.meta_path.insert(0, _Finder(cache))
        atexit.register(cache.save)   # MXNet's scheduler and stock servers exit inside import
