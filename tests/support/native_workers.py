"""An in-process stand-in for ps-lite with N workers: N real ``DistDelay`` stores, one per
thread, over S of mxdelay's real servers, as :mod:`support.native` is for one worker.

What it does is what MXNet's native store does in sync mode (``kvstore_dist.h``,
``kvstore_dist_server.h``), with the waits made explicit in Python:

- ``init`` stores rank 0's value (the others' are ignored) and is a barrier of all workers;
- a push of a key waits until this worker's previous push of that key is complete (MXNet's
  engine orders the copy into a slot buffer after the slot's last acknowledgement); the
  round of a key completes when every worker has pushed it: the pushes are summed in rank
  order (MXNet sums in arrival order: the same for two workers, and a fixed order keeps
  three reproducible) and the server's updater runs, as in :mod:`support.native`; after
  command id 1 (``kSetMultiPrecision``) a float16 key's pushes are cast to float32 and
  summed in float32, its updater gets a float32 copy of the stored value, which is then
  cast into the float16 value that pulls return (as :mod:`support.native`);
- a pull waits until every push this worker has issued is complete (MXNet orders a pull of
  a slot after that slot's push, and mxdelay's stores order it after every earlier round,
  docs/design.md §2.4; waiting for all of them is the same for pulls issued after a round's
  pushes, as the trainers issue them), then returns the stored value;
- a pushpull is a push and then a pull;
- a row_sparse push is merged with the other workers' as MXNet's server does (a row_sparse
  sum: the one-row-per-worker pushes of docs/design.md §2.14 keep every row);
  ``row_sparse_pull`` waits as a pull does and returns the rows asked for (none for empty
  row ids);
- ``_barrier`` is a barrier of all workers; commands run the servers' controllers.

Every call holds one lock (the servers' code is not thread-safe); a waiting call releases
it. :func:`run_workers` runs ``fn(rank, store)`` in N threads and re-raises a failure.
"""
import os
import threading
import types

import numpy as np

import mxdelay  # noqa: F401  before mxnet
import mxnet as mx
from mxnet import nd

from kvstore_ext.worker.dist_delay import DistDelay
from kvstore_ext.server.controller import DelayServer

from .native import native_round

__all__ = ['Job', 'run_workers']

_SET_MULTI_PRECISION = 1
_TIMEOUT = 60.0   # seconds a call may wait for the other workers before the test fails


class Job(object):
    """The native side of a job of `num_workers` workers and `num_servers` servers."""

    def __init__(self, num_workers, num_servers=1):
        self.num_workers = num_workers
        self._faces = [types.SimpleNamespace(handle=None, rank=s, num_workers=num_workers,
                                             _updater=None) for s in range(num_servers)]
        for face in self._faces:
            face._set_updater = lambda fn, face=face: setattr(face, '_updater', fn)
        self.servers = [DelayServer(face) for face in self._faces]
        self._controllers = [server._controller() for server in self.servers]
        self._stored = {}
        self._stored32 = {}       # key -> its float32 copy (multi-precision, float16 keys)
        self._multi_precision = False
        self._pending = {}        # key -> {rank: value copy} of the round being pushed
        self._completed = {}      # key -> rounds completed
        self._pushed = [dict() for _ in range(num_workers)]   # rank -> key -> pushes
        self._cond = threading.Condition()
        self._barrier = threading.Barrier(num_workers, timeout=_TIMEOUT)
        self.workers = [_Worker(self, rank) for rank in range(num_workers)]

    def server_of(self, key):
        return (key * 9973) % len(self.servers)

    def _wait(self, predicate):
        if not self._cond.wait_for(predicate, timeout=_TIMEOUT):
            raise RuntimeError('the in-process job waited %.0f s for the other workers'
                               % _TIMEOUT)

    def init(self, rank, keys, values):
        with self._cond:
            if rank == 0:
                for key, value in zip(keys, values):
                    value = value[0] if isinstance(value, (list, tuple)) else value
                    self._stored[key] = value.copyto(mx.cpu())
                    if self._multi_precision and np.dtype(value.dtype) == np.float16:
                        self._stored32[key] = value.astype('float32')
                    self._completed[key] = 0
            self._cond.notify_all()
        self._barrier.wait()

    def push(self, rank, keys, values):
        with self._cond:
            for key, value in zip(keys, values):
                mine = self._pushed[rank]
                self._wait(lambda key=key: self._completed.get(key, 0) >= mine.get(key, 0))
                value = value if isinstance(value, (list, tuple)) else [value]
                merged = value[0].copyto(mx.cpu())
                for other in value[1:]:
                    merged = nd.elemwise_add(merged, other.as_in_context(mx.cpu()))
                mine[key] = mine.get(key, 0) + 1
                pending = self._pending.setdefault(key, {})
                pending[rank] = merged
                if len(pending) == self.num_workers:
                    del self._pending[key]
                    self._complete(key, [pending[r] for r in range(self.num_workers)])
                    self._completed[key] += 1
                    self._cond.notify_all()

    def pull(self, rank, keys, outs):
        with self._cond:
            mine = self._pushed[rank]
            self._wait(lambda: all(self._completed.get(k, 0) >= n for k, n in mine.items()))
            for key, targets in zip(keys, outs):
                for target in targets if isinstance(targets, (list, tuple)) else [targets]:
                    self._stored[key].copyto(target)

    def row_sparse_pull(self, rank, keys, outs, ids):
        with self._cond:
            mine = self._pushed[rank]
            self._wait(lambda: all(self._completed.get(k, 0) >= n for k, n in mine.items()))
            for key, target, rows in zip(keys, outs, ids):
                if rows.shape[0] == 0:   # no rows (MXNet's operators refuse empty ids)
                    nd.sparse.zeros('row_sparse', target.shape, dtype=target.dtype).copyto(target)
                else:
                    nd.sparse.retain(self._stored[key], rows.astype('int64')).copyto(target)

    def set_multi_precision(self):
        with self._cond:
            self._multi_precision = True   # the native server's, never the controller's

    def command(self, body):
        with self._cond:
            saved = os.environ.get('DMLC_NUM_SERVER')
            os.environ['DMLC_NUM_SERVER'] = str(len(self.servers))
            try:
                for controller in self._controllers:
                    controller(0, body, None)
            finally:
                if saved is None:
                    os.environ.pop('DMLC_NUM_SERVER', None)
                else:
                    os.environ['DMLC_NUM_SERVER'] = saved

    def barrier(self):
        self._barrier.wait()

    def _complete(self, key, values):
        if key in self._stored32:   # float16 pushes summed in float32
            values = [value.astype('float32') for value in values]
        merged = values[0]
        for value in values[1:]:
            merged = nd.elemwise_add(merged, value)
        native_round(self._faces[self.server_of(key)], self.servers[self.server_of(key)], key,
                     merged, self._stored[key], self._stored32.get(key))


class _Worker(object):
    """Worker `rank`'s native store (what ``DistDelay`` calls)."""

    type = 'dist_sync'

    def __init__(self, job, rank):
        self._job, self.rank, self.num_workers = job, rank, job.num_workers
        self.servers = job.servers   # as support.native's: server_weights reads them
        self.compression = None

    def init(self, keys, values):
        keys, values = _pairs(keys, values)
        self._job.init(self.rank, keys, values)

    def push(self, keys, values, priority=0):
        keys, values = _pairs(keys, values)
        self._job.push(self.rank, keys, values)

    def pull(self, keys, out=None, priority=0, ignore_sparse=True):
        keys, outs = _pairs(keys, out)
        self._job.pull(self.rank, keys, outs)

    def row_sparse_pull(self, key, out=None, priority=0, row_ids=None):
        keys, outs = _pairs(key, out)
        _, ids = _pairs(key, row_ids)
        self._job.row_sparse_pull(self.rank, keys, outs, ids)

    def pushpull(self, keys, values, out=None, priority=0):
        # MXNet's answers the push with the key's value once its round is applied: here the
        # push, then a pull (which waits for this worker's rounds, as DistDelay's exchange
        # orders its pushpull after them).
        keys, values = _pairs(keys, values)
        _, outs = _pairs(keys, out)
        self._job.push(self.rank, keys, values)
        self._job.pull(self.rank, keys, outs)

    def _barrier(self):
        self._job.barrier()

    def _send_command_to_servers(self, cmd_id, body):
        if cmd_id == _SET_MULTI_PRECISION:
            self._job.set_multi_precision()
            return
        self._job.command(body.encode('utf-8') if isinstance(body, str) else body)

    def set_gradient_compression(self, compression_params):
        self.compression = dict(compression_params)


def _pairs(keys, values):
    if isinstance(keys, (list, tuple)):
        return list(keys), list(values)
    return [keys], [values]


def run_workers(num_workers, fn, num_servers=1):
    """Run ``fn(rank, store)`` for each worker in its own thread (``store``: a real
    ``DistDelay`` over this job); return ``(job, [fn's results by rank])``."""
    job = Job(num_workers, num_servers)
    saved = os.environ.get('DMLC_NUM_SERVER')
    os.environ['DMLC_NUM_SERVER'] = str(num_servers)
    try:
        stores = [DistDelay(native=worker) for worker in job.workers]
    finally:
        if saved is None:
            os.environ.pop('DMLC_NUM_SERVER', None)
        else:
            os.environ['DMLC_NUM_SERVER'] = saved
    results, errors = [None] * num_workers, []

    def run(rank):
        try:
            results[rank] = fn(rank, stores[rank])
        except BaseException as err:  # pylint: disable=broad-except
            errors.append((rank, err))
            job._barrier.abort()   # pylint: disable=protected-access
            with job._cond:        # pylint: disable=protected-access
                job._cond.notify_all()   # pylint: disable=protected-access
    threads = [threading.Thread(target=run, args=(rank,), daemon=True)
               for rank in range(num_workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(4 * _TIMEOUT)
    if errors:
        rank, err = sorted(errors, key=lambda e: e[0])[0]
        raise AssertionError('worker %d failed: %r' % (rank, err)) from err
    assert not any(t.is_alive() for t in threads), 'a worker thread did not finish'
    nd.waitall()
    return job, results

