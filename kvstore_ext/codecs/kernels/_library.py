"""Build and load ``codec_kernels.c``: compiled once per machine with the system's C compiler
into a per-user cache, loaded with :mod:`ctypes` (whose calls release the GIL, so that several
threads can run kernels at once).

The library's file name holds a hash of the source, the compiler, its flags and the machine
type, so an edited source or another compiler builds a new one. Processes starting together
(a job's workers and servers on one host) may build it at the same time: each writes its own
temporary file and renames it into place, which is atomic.
"""
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile

__all__ = ['SOURCE', 'FLAGS', 'SIGNATURES', 'KernelBuildError', 'compiler', 'build', 'bind',
           'load']

_LOG = logging.getLogger(__name__)

#: The kernels' C source, beside this module.
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'codec_kernels.c')

#: No -ffast-math and no contraction into fused multiply-adds: the kernels must round as
#: numpy does (see the source's head). No -march=native: x86-64 clones are picked at load.
FLAGS = ['-O3', '-shared', '-fPIC', '-std=gnu11', '-ffp-contract=off', '-fno-math-errno',
         '-fno-trapping-math']

#: The compilers tried, in order.
_COMPILERS = ('cc', 'gcc', 'clang')

_P = ctypes.c_void_p
_I = ctypes.c_int64
#: Each exported function's argument types (all return int64).
SIGNATURES = {
    'mxd_init': [],
    'mxd_f16_encode': [_P, _P, _P, _P, _I, _I],
    'mxd_f16_decode': [_P, _P, _I, _I, _I],
    'mxd_i8pull_encode': [_P, _P, _P, _P, _P, _I, _I, _I, _I],
    'mxd_i8pull_decode_add': [_P, _P, _P, _I, _I, _I],
}
for _name in ('int8', 'int4', 'ternary'):
    SIGNATURES['mxd_%s_encode' % _name] = [_P, _P, _P, _P, _I, _I, _I, _I]
    SIGNATURES['mxd_%s_decode_sum' % _name] = [_P, _I, _P, _I, _P, _I, _I, _I, _I]


class KernelBuildError(RuntimeError):
    """The kernels could not be compiled or loaded (the message says why and what to do)."""


def compiler():
    """The path of the first C compiler found on PATH."""
    for name in _COMPILERS:
        path = shutil.which(name)
        if path:
            return path
    raise KernelBuildError('no C compiler found (tried %s on PATH); install one, e.g. '
                           '`apt-get install gcc`' % ', '.join(_COMPILERS))


def _cache_dir():
    """~/.cache/mxdelay, or None if it cannot be made (then the build stays private)."""
    path = os.path.join(os.path.expanduser('~'), '.cache', 'mxdelay')
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError:
        return None
    return path if os.access(path, os.W_OK) else None


def build(path, target, tries=((), ('-DMXD_NO_CLONES',))):
    """Compile SOURCE with compiler `path` into `target` (a temporary name first, then
    renamed), with the first of `tries` (extra flags) that the compiler accepts: by default
    with the x86-64 clones, else without."""
    temporary = '%s.%d.tmp' % (target, os.getpid())
    failures = []
    for extra in tries:
        command = [path] + FLAGS + list(extra) + ['-o', temporary, SOURCE]
        try:
            result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    universal_newlines=True, timeout=300, check=False)
        except (OSError, subprocess.SubprocessError) as error:
            raise KernelBuildError('compiling the codec kernels failed: %s: %s'
                                   % (' '.join(command), error)) from error
        if result.returncode == 0:
            os.replace(temporary, target)
            return
        failures.append('%s (exit %d):\n%s' % (' '.join(command), result.returncode,
                                                result.stdout))
    raise KernelBuildError('compiling the codec kernels failed: %s' % '\n'.join(failures))


def bind(path):
    """The library at `path` (:class:`ctypes.CDLL`) with its functions' signatures set and
    its tables made."""
    try:
        library = ctypes.CDLL(path)
    except OSError as error:
        raise KernelBuildError('loading the codec kernels %s failed: %s; delete the file to '
                               'build it again' % (path, error)) from error
    for name, arguments in SIGNATURES.items():
        function = getattr(library, name)
        function.argtypes = arguments
        function.restype = _I
    library.mxd_init()
    return library


def load(flags=None):
    """The library, built first if the cache has none (:func:`bind`); with `flags` (extra
    compiler flags, e.g. ``('-DMXD_NO_CLONES',)``) a build with exactly those (the tests').

    Raises
    ------
    KernelBuildError
        If no compiler is found, compiling fails or the library does not load.
    """
    path = compiler()
    with open(SOURCE, 'rb') as source:
        text = source.read()
    options = FLAGS + list(flags or ())
    key = hashlib.sha256(b'\0'.join([text, path.encode(), ' '.join(options).encode(),
                                     platform.machine().encode()])).hexdigest()[:16]
    directory = _cache_dir()
    private = None
    if directory is None:
        private = directory = tempfile.mkdtemp(prefix='mxdelay-kernels-')
    target = os.path.join(directory, 'codec_kernels-%s.so' % key)
    try:
        if not os.path.exists(target):
            _LOG.info('compiling the codec kernels into %s', target)
            build(path, target, *([] if flags is None else [(tuple(flags),)]))
        return bind(target)
    finally:
        if private is not None:
            shutil.rmtree(private, ignore_errors=True)   # the loaded library stays mapped
