"""Keep large freed blocks in the process's heap (glibc), for the numpy codecs' temporaries.

The push codecs ``'int8'``, ``'int4'`` and ``'ternary'`` (docs/design.md §2.14) encode on the
workers and decode on the servers in numpy, with temporaries of a chunk's size (megabytes)
every round. glibc serves blocks from 128 KiB up by ``mmap`` and gives them back on
``free``: each round's temporaries are then fresh pages, and their page faults cost
system time (on a loopback job of two workers, a large part of the extra CPU time of these
codecs over float16 pushes; not a committed measurement). :func:`keep_large_blocks` raises
glibc's mmap threshold to 32 MiB and its trim threshold to 64 MiB, so such blocks come from
the heap and stay mapped: at most 64 MiB of freed memory is kept. A process-wide setting,
applied once per process where such a codec is used; nothing is done without glibc.
"""
import ctypes
import ctypes.util
import logging

__all__ = ['keep_large_blocks']

_LOG = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 32 * 2 ** 20   # glibc's largest on 64-bit systems
_TRIM_THRESHOLD = 64 * 2 ** 20
_DONE = []


def keep_large_blocks():
    """Set glibc's mmap threshold to 32 MiB and its trim threshold to 64 MiB (once per
    process; a no-op without glibc). Returns True if the settings are in place."""
    if not _DONE:
        _DONE.append(_set())
    return _DONE[0]


def _set():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library('c') or 'libc.so.6')
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        _LOG.debug('no mallopt (not glibc): the heap thresholds stay as they are')
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    done = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)) and \
        bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
    _LOG.debug('glibc mmap threshold %d, trim threshold %d: %s', _MMAP_THRESHOLD,
               _TRIM_THRESHOLD, 'set' if done else 'refused')
    return done
