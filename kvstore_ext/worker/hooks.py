"""Process-wide effects of the ``'dist_delay'`` store, each installed by one explicit call.

- :func:`register_store_type` (once, when :mod:`kvstore_ext.worker.dist_delay` is imported): the
  registry entry ``'dist_delay'``, and a check in ``mx.kv.create`` that refuses misspelt
  distributed types (:func:`kvstore_ext.typenames.check_kvstore_type`).
- :func:`install_worker_exit` (when a store is created): an uncaught exception ends the
  worker at once, and a normal exit leaves the job cleanly (docs/design.md §7).
"""
import atexit
import gc
import logging
import os
import sys
import threading
import weakref

import mxnet as mx
from mxnet import nd

from kvstore_ext import typenames

__all__ = ['register_store_type', 'install_worker_exit']

_LOG = logging.getLogger(__name__)

#: Seconds the other atexit handlers get after an uncaught exception, before the worker exits.
_EXIT_HANDLERS_GRACE = 5.0


def register_store_type(store_class):
    """Register `store_class` as ``'dist_delay'`` (replacing the stand-in that
    :mod:`kvstore_ext.bootstrap` registered when MXNet was imported) and make
    ``mx.kv.create`` check type names. Idempotent.
    """
    typenames.register_store_type(mx, store_class)


def install_worker_exit(store):
    """Make this worker leave the job cleanly at exit, and at once on an uncaught exception.

    Parameters
    ----------
    store : DistDelay
        Closed at a normal exit (its :meth:`close`), before MXNet's engine shuts down.
    """
    # atexit runs last-registered first: this runs before MXNet's engine shutdown.
    atexit.register(_close_at_exit, weakref.ref(store))
    previous = sys.excepthook
    if getattr(previous, 'mxdelay_exits', False):
        return

    def excepthook(kind, value, traceback):
        # Left to the interpreter, the exit would destroy the native store, whose destructor
        # waits in ps-lite's barrier for the other workers, which wait for this one: the job
        # would hang and no launcher would see a failure. So: print the traceback, run the
        # other libraries' atexit handlers (log flushes), then os._exit(1), which skips the
        # destructor's barrier. The handlers get a few seconds: one of them may wait on
        # communication that will never complete.
        previous(kind, value, traceback)
        _STORES_FAILED.set()
        watchdog = threading.Timer(_EXIT_HANDLERS_GRACE, _exit_now)
        watchdog.daemon = True
        watchdog.start()
        try:
            atexit._run_exitfuncs()  # pylint: disable=protected-access
        finally:
            _exit_now()
    excepthook.mxdelay_exits = True
    sys.excepthook = excepthook


_STORES_FAILED = threading.Event()


def _exit_now():
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)  # pylint: disable=protected-access


def _close_at_exit(store_ref):
    """Finish this worker's queued work, then leave the job (barrier, stop the servers).

    Left to the interpreter, the native store's destructor (a barrier across workers) and
    MXNet's engine shutdown can run in either order, and a worker whose engine is shutting
    down while another waits in the barrier hangs the job at exit. After an uncaught
    exception nothing is closed: the worker leaves with os._exit.
    """
    store = store_ref()
    if store is None or _STORES_FAILED.is_set():
        return
    nd.waitall()
    try:
        store.close()
    finally:
        gc.collect()
