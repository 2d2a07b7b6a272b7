"""What the kernels run on: the compiled library or the numpy fallback (decided once per
process, ``MXDELAY_CODEC_KERNELS``), the argument checks, and the split of a call over threads.
"""
import collections
import logging
import numbers
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvstore_ext import env
from kvstore_ext.codecs import quantize

__all__ = ['LEVELS', 'MAX_BLOCK', 'MODES', 'library', 'backend', 'require_compiled', 'cores',
           'compiled_calls', 'address', 'flat', 'in_place', 'check_codec', 'check_block',
           'payload_size', 'check_threads', 'ranges', 'run']

_LOG = logging.getLogger('kvstore_ext.codecs.kernels')
F32 = np.float32

#: h of each push codec -> (its name, D: digits per packed word), from
#: :mod:`kvstore_ext.codecs.quantize`, which defines the format.
LEVELS = {h: (name, quantize.digits_per_word(h)) for name, h in quantize.LEVELS.items()}
#: The largest block size.
MAX_BLOCK = quantize.MAX_BLOCK
#: The values of MXDELAY_CODEC_KERNELS.
MODES = env.CHOICES['MXDELAY_CODEC_KERNELS']
#: Fewest elements a thread gets: on 2 cores, below about 2**20 elements a call a second
#: thread cost more than it saved (docs/benchmarks/codec-speed/results.md, "Threads").
_MIN_PART = 1 << 20

_STATE = {}
_LOCK = threading.Lock()
#: Compiled calls in this process, by the C function's name (:func:`compiled_calls`).
_CALLS = collections.Counter()


def _mode():
    return env.get_choice('MXDELAY_CODEC_KERNELS')


def library():
    """The compiled library, or None for the fallback (decided once per process)."""
    if 'library' not in _STATE:
        with _LOCK:
            if 'library' not in _STATE:
                _STATE['library'] = _load(_mode())
    return _STATE['library']


def _load(mode):
    if mode == 'numpy':
        return None
    from . import _library   # pylint: disable=import-outside-toplevel
    try:
        return _library.load()
    except _library.KernelBuildError as error:
        if mode == 'compiled':
            raise _library.KernelBuildError(
                '%s; or unset MXDELAY_CODEC_KERNELS=compiled to run the codecs in numpy (the '
                'same values, slower)' % error) from error
        _LOG.warning('codec kernels unavailable, the codecs run in numpy (the same values, '
                     'slower): %s', error)
        return None


def backend():
    """``'compiled'`` or ``'numpy'``: what the functions of this module run."""
    return 'numpy' if library() is None else 'compiled'


def require_compiled():
    """Raise unless the compiled kernels run (builds them if needed)."""
    if backend() != 'compiled':
        raise RuntimeError('the codec kernels run in numpy (MXDELAY_CODEC_KERNELS=%s, or no C '
                           'compiler): see the warning logged by %s' % (_mode(), _LOG.name))


def cores():
    """The cores this process may run on (``os.sched_getaffinity``: a ``taskset`` or a
    container's cpuset limits it): the ``threads`` a server gives its kernel calls."""
    return len(os.sched_getaffinity(0))


def compiled_calls():
    """``{C function name: calls}`` of the compiled kernels in this process so far (a
    function split over threads counts once): what shows that a job ran them."""
    return dict(_CALLS)


# -- helpers -----------------------------------------------------------------------------------
def address(array):
    """The address of `array`'s first element (for the kernels' pointer arguments)."""
    return array.__array_interface__['data'][0]


def flat(array):
    """`array` as flat contiguous float32 (a copy only if needed)."""
    return np.ascontiguousarray(array, dtype=F32).reshape(-1)


def in_place(array, name, size):
    """`array` (flat) if it can be written in place: a writeable contiguous float32 numpy
    array of `size` elements; else a ValueError naming argument `name`."""
    if not (isinstance(array, np.ndarray) and array.dtype == F32 and array.flags.c_contiguous
            and array.size == size and array.flags.writeable):
        raise ValueError('%s must be a writeable contiguous float32 numpy array of %d elements '
                         '(it is updated in place), got %s' % (name, size, _describe(array)))
    return array if array.ndim == 1 else array.reshape(-1)


def _describe(array):
    if isinstance(array, np.ndarray):
        return '%s array of shape %s%s' % (array.dtype, array.shape, '' if
                                           array.flags.c_contiguous else ', not contiguous')
    return type(array).__name__


def check_codec(h, block):
    """``(name, digits per word)`` of the push codec of largest level `h`; checks `block`."""
    if h not in LEVELS:
        raise ValueError('h=%r is not a push codec\'s largest level: use 127 (int8), 7 (int4) or '
                         '1 (ternary)' % (h,))
    check_block(block)
    return LEVELS[h]


def check_block(block):
    """`block` as an int, if it is a block size (1 .. 2**20)."""
    if (isinstance(block, (bool, np.bool_)) or not isinstance(block, numbers.Integral)
            or not 1 <= block <= MAX_BLOCK):
        raise ValueError('block=%r must be an integer in 1..%d (the values sharing one float32 '
                         'scale, e.g. 256)' % (block, MAX_BLOCK))
    return int(block)


def payload_size(n, h, block):
    """Float32 elements of a push payload of `n` values (kvstore_ext.codecs.quantize.payload_size,
    after the checks of `h` and `block`)."""
    check_codec(h, block)
    return quantize.payload_size(n, h, block)


def check_threads(threads):
    """`threads` as an int, if it is at least 1."""
    if isinstance(threads, (bool, np.bool_)) or not isinstance(threads, numbers.Integral) \
            or threads < 1:
        raise ValueError('threads=%r must be an integer >= 1 (e.g. the cores of this process: '
                         'len(os.sched_getaffinity(0)))' % (threads,))
    return int(threads)


def ranges(n, align, threads):
    """[lo, hi) parts of [0, n) for `threads` threads, each lo a multiple of `align`."""
    parts = max(1, min(check_threads(threads), n // _MIN_PART))
    if parts == 1:
        return [(0, n)]
    per_part = -(-n // parts)
    step = -(-per_part // align) * align   # rounded up to a multiple of align
    return [(lo, min(lo + step, n)) for lo in range(0, n, step)]


def run(function, calls, threads):
    """function(*call) for each call (argument tuples), on up to `threads` threads; the
    results in order."""
    _CALLS[function.__name__] += 1
    threads = min(check_threads(threads), len(calls))
    if threads == 1:
        return [function(*call) for call in calls]
    with _LOCK:
        pools = _STATE.setdefault('pools', {})
        if threads not in pools:   # one pool per thread count: a server uses one or two
            pools[threads] = ThreadPoolExecutor(threads, 'mxdelay-kernels')
    futures = [pools[threads].submit(function, *call) for call in calls]
    return [future.result() for future in futures]
