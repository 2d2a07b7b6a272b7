"""Checkpoint parts written by a thread while training goes on, and their sha256 left beside
them for the worker that writes the index (docs/design.md §6.4).

A periodic checkpoint (:mod:`mxdelay.autosave`) copies every part's content to host memory
while the job stands still, and a thread of each process writes its part afterwards
(:func:`kvstore_ext.checkpoint.files.write_encoded`). Such a part ``P`` is followed by
``P.sha256``, written atomically: the save's id, then the sha256 of ``P`` or ``failed:
<why>`` when ``P`` could not be written. Worker 0's thread waits for each (:func:`wait`)
before it writes the index that lists them, last: a part that was never written (its
process died, its write failed) leaves the checkpoint without an index, incomplete, and
never looks complete.
"""
import logging
import os
import threading
import time

from kvstore_ext.checkpoint import files

__all__ = ['WRITER_NICENESS', 'digest_file', 'remove', 'leave', 'fail', 'wait', 'start_writer']

_LOG = logging.getLogger(__name__)

#: The writing threads' nice value (:func:`start_writer`).
WRITER_NICENESS = 10
_FAILED = 'failed: '
_POLL_SECONDS = 0.02


def digest_file(part):
    """Where the writer of `part` leaves its sha256."""
    return part + '.sha256'


def remove(part):
    """Remove `part`'s sha256 file, if any (one that an index now lists, or one of an
    earlier save of the same name)."""
    try:
        os.unlink(digest_file(part))
    except FileNotFoundError:
        pass


def leave(part, save_id, write):
    """Run ``write()``, which writes `part` of save `save_id` and returns its sha256, and
    leave that sha256 beside `part`; if it raises, leave the failure instead (for
    :func:`wait`) and raise."""
    try:
        digest = write()
    except Exception as err:
        fail(part, save_id, '%s: %s' % (type(err).__name__, err))
        raise
    _leave(part, save_id, digest)
    return digest


def fail(part, save_id, why):
    """Leave, instead of a sha256, that `part` of save `save_id` will not be written, and
    `why` (:func:`wait` raises it)."""
    _leave(part, save_id, _FAILED + why)


def _leave(part, save_id, text):
    files.atomic_write(digest_file(part), ('%s\n%s' % (save_id, text)).encode('utf-8',
                                                                             'replace'))


def wait(part, save_id, timeout):
    """The sha256 of `part` of save `save_id`, once its writer has left it (:func:`leave`);
    one of another save (an earlier run's, not yet replaced) is waited past.

    Raises
    ------
    ValueError
        If the writer left a failure.
    TimeoutError
        If nothing of this save appears within `timeout` seconds: the writer stopped, or
        writes to another folder.
    """
    path = digest_file(part)
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(path, encoding='utf-8') as src:
                saved, text = src.read().split('\n', 1)
            if saved == save_id:
                break
        except (FileNotFoundError, ValueError):   # not yet; or not of this format
            pass
        if time.monotonic() > deadline:
            raise TimeoutError('%s of save %s did not appear within %g s: its writer stopped, '
                               'or writes to another folder (the checkpoint folder must be '
                               'shared by every worker and server)' % (path, save_id, timeout))
        time.sleep(_POLL_SECONDS)
    if text.startswith(_FAILED):
        raise ValueError('%s could not be written: %s' % (part, text[len(_FAILED):]))
    return text


def start_writer(target, name, *args):
    """Start a thread `name` that runs ``target(*args)`` at a lower CPU priority than the
    process's other threads (Linux: its own nice value), so that on a busy machine the
    write takes the cycles that training leaves. Not a daemon: the process exits once the
    thread is done. Return the thread."""
    def run():
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICENESS)
        except (AttributeError, OSError):   # not Linux, or not allowed: the default priority
            pass
        target(*args)
    thread = threading.Thread(target=run, name=name)
    thread.start()
    return thread
