"""An in-process stand-in for MXNet's native distributed store (ps-lite): one worker and S
of mxdelay's real servers (``kvstore_ext.server.controller.DelayServer``) in this process.

A ``DistDelay`` built on it (:func:`delay_store`) runs its real push, pull, init,
hand-shake and command path, and the servers their real rounds, with no network. What the
stand-in does is what MXNet's native store does in sync mode with one worker
(``kvstore_dist.h``, ``kvstore_dist_server.h``):

- key k lives on server ``(k * 9973) % S`` (ps-lite's range of a key below the big-array
  bound);
- a push completes the key's round at once: merged = the push summed over its device list
  (row_sparse pushes summed as row_sparse; after command id 1, ``kSetMultiPrecision``,
  float16 pushes summed into a float32 merge buffer, and a float32 copy of the stored
  value kept for the updater); then the server's updater ``(key, merged, stored)`` with
  the key's stored array (its init value at first); without an updater, merged is copied
  into stored;
- a pull returns stored; ``row_sparse_pull`` the rows asked for;
- ``_send_command_to_servers(0, body)`` calls every server's controller synchronously;
  id 1 is consumed here, as the native server does, and never given to the controller;
- the barrier of one worker returns at once;
- ``set_gradient_compression``: for '2bit' mxdelay's worker quantizes itself, and the
  native quantization of values already quantized to ``+t, 0, -t`` is lossless, so the
  stand-in passes pushed values through unchanged.

The updater the server installs (``DelayServer._on_round``) ends the process when a round
fails (a wrong server must stop its job); the stand-in calls the same round code through
``DelayServer.complete_round``, which raises instead, so that a failure fails the test.
"""
import contextlib
import os
import types

import numpy as np

import mxdelay  # noqa: F401  before mxnet, as the job scripts do
import mxnet as mx
from mxnet import nd

from kvstore_ext.worker.dist_delay import DistDelay
from kvstore_ext.server.controller import DelayServer

__all__ = ['InProcessNative', 'delay_store', 'server_weights', 'events', 'pushes',
           'server_optimizer', 'native_round']

_SET_MULTI_PRECISION = 1   # MXNet's kSetMultiPrecision (kvstore_dist_server.h)


class InProcessNative(object):
    """The native store of the only worker of a job of `num_servers` mxdelay servers.

    Parameters
    ----------
    num_servers : int, default 1

    Attributes
    ----------
    servers : list of DelayServer
        Server s of the job, real and in process.
    calls : list of (str, list of int, int)
        ``(op, native keys, priority)`` of every init, push, pull and pushpull call (a
        ``row_sparse_pull`` is a pull), in issue order; :func:`events` names their tensors.
    compression : dict or None
        What ``set_gradient_compression`` was given.
    """

    type = 'dist_sync'
    rank = 0
    num_workers = 1

    def __init__(self, num_servers=1):
        self._faces = [types.SimpleNamespace(handle=None, rank=s, num_workers=1, _updater=None)
                       for s in range(num_servers)]
        for face in self._faces:
            face._set_updater = lambda fn, face=face: setattr(face, '_updater', fn)
        self.servers = [DelayServer(face) for face in self._faces]
        self._controllers = [server._controller() for server in self.servers]
        self._stored = {}        # key -> the array pulls return
        self._stored32 = {}      # key -> its float32 copy (multi-precision, float16 keys)
        self._multi_precision = False
        self.calls = []
        self.compression = None

    def server_of(self, key):
        """The index of the server that holds native `key`."""
        return (key * 9973) % len(self.servers)

    # -- the worker's face -----------------------------------------------------------------
    def init(self, keys, values):
        keys, values = _pairs(keys, values)
        self.calls.append(('init', list(keys), 0))
        for key, value in zip(keys, values):
            assert key not in self._stored, 'native key %d initialised twice' % key
            value = value[0] if isinstance(value, (list, tuple)) else value
            self._stored[key] = value.copyto(mx.cpu())
            if self._multi_precision and np.dtype(value.dtype) == np.float16:
                self._stored32[key] = value.astype('float32')

    def push(self, keys, values, priority=0):
        keys, values = _pairs(keys, values)
        self.calls.append(('push', list(keys), priority))
        for key, value in zip(keys, values):
            self._complete_round(key, value if isinstance(value, (list, tuple)) else [value])

    def pull(self, keys, out=None, priority=0, ignore_sparse=True):
        keys, outs = _pairs(keys, out)
        self.calls.append(('pull', list(keys), priority))
        for key, targets in zip(keys, outs):
            for target in targets if isinstance(targets, (list, tuple)) else [targets]:
                self._stored[key].copyto(target)

    def pushpull(self, keys, values, out=None, priority=0):
        # MXNet's: one request per key; the server answers the push with the stored value
        # once the round is applied, which lands in the pushed array and then in `out`.
        keys, values = _pairs(keys, values)
        _, outs = _pairs(keys, out)
        self.calls.append(('pushpull', list(keys), priority))
        for key, value, targets in zip(keys, values, outs):
            value = value if isinstance(value, (list, tuple)) else [value]
            self._complete_round(key, value)
            self._stored[key].copyto(value[0])
            for target in targets if isinstance(targets, (list, tuple)) else [targets]:
                value[0].copyto(target)

    def row_sparse_pull(self, key, out=None, priority=0, row_ids=None):
        keys, outs = _pairs(key, out)
        _, ids = _pairs(key, row_ids)
        self.calls.append(('pull', list(keys), priority))
        for k, targets, rows in zip(keys, outs, ids):
            targets = targets if isinstance(targets, (list, tuple)) else [targets]
            rows = rows if isinstance(rows, (list, tuple)) else [rows] * len(targets)
            for target, row in zip(targets, rows):
                if row.shape[0] == 0:   # no rows (MXNet's operators refuse empty ids)
                    rows_of = nd.sparse.zeros('row_sparse', target.shape, dtype=target.dtype)
                else:
                    rows_of = nd.sparse.retain(self._stored[k], row.astype('int64'))
                rows_of.copyto(target)

    def _barrier(self):
        pass   # one worker: it is every worker

    def _send_command_to_servers(self, cmd_id, body):
        if cmd_id == _SET_MULTI_PRECISION:
            self._multi_precision = True   # the native server's, never the controller's
            return
        body = body.encode('utf-8') if isinstance(body, str) else body
        # A server reads its job's number of servers at the hand-shake, from its environment.
        with _environ(DMLC_NUM_SERVER=str(len(self.servers))):
            for controller in self._controllers:
                controller(cmd_id, body, None)

    def set_gradient_compression(self, compression_params):
        self.compression = dict(compression_params)

    # -- the native server's round -----------------------------------------------------------
    def _complete_round(self, key, values):
        stored = self._stored[key]
        wide = key in self._stored32
        merged = values[0].astype('float32') if wide else values[0].copyto(mx.cpu())
        for value in values[1:]:   # elemwise_add: row_sparse + row_sparse stays row_sparse
            merged = nd.elemwise_add(merged, value.astype('float32') if wide
                                     else value.as_in_context(mx.cpu()))
        native_round(self._faces[self.server_of(key)], self.servers[self.server_of(key)], key,
                     merged, stored, self._stored32.get(key))


def native_round(face, server, key, merged, stored, stored32=None):
    """The native server's end of a round of `key` (sum `merged`): without an updater on
    `face` the sum is stored; else `server`'s round gets `stored` or, for a float16 key in
    multi-precision mode, its float32 copy `stored32`, which is then cast into `stored`
    (what pulls return)."""
    if face._updater is None:
        merged.copyto(stored)
    elif stored32 is None:
        server.complete_round(key, merged, stored)
    else:
        server.complete_round(key, merged, stored32)
        stored32.copyto(stored)   # the cast the native server makes


def _pairs(keys, values):
    if isinstance(keys, (list, tuple)):
        return list(keys), list(values)
    return [keys], [values]


def delay_store(num_servers=1):
    """A real ``DistDelay`` of one worker over an :class:`InProcessNative` of `num_servers`
    servers; the stand-in is its session's ``native``."""
    with _environ(DMLC_NUM_SERVER=str(num_servers)):   # DistDelay reads it when created
        return DistDelay(native=InProcessNative(num_servers))


def server_weights(store, key):
    """Tensor `key`'s weights W as its servers hold them: numpy, the tensor's shape, in the
    servers' dtype (a row_sparse tensor's rows made dense)."""
    tensor = store._session.tensors[key]
    parts = []
    for chunk in tensor.chunks:   # in order: elements of a dense tensor, rows of a sparse one
        weight = store._session.native.servers[chunk.server].weight(chunk.chunk_id)
        assert weight is not None, 'chunk %d has no weights yet' % chunk.chunk_id
        parts.append(weight.asnumpy().reshape(-1))
    return np.concatenate(parts).reshape(tensor.shape)


def events(store, kinds=('slot', 'pull')):
    """The stand-in's calls as ``(op, key)`` per tensor, in issue order: `key` is the
    ``DistDelay`` key of the tensor whose native keys of `kinds` ('slot': its rounds,
    'pull': its float32 pull keys, 'state': its optimizer state keys, 'status': the
    servers' status keys, key None) a call used; the finish counter's key is 'finish'."""
    return [(op, key) for op, kind, key, _ in _tensor_calls(store) if kind in kinds]


def pushes(store):
    """``(key, priority)`` of every push (or pushpull) of a tensor's round, in issue order (the finish
    counter's left out)."""
    return [(key, priority) for op, kind, key, priority in _tensor_calls(store)
            if op in ('push', 'pushpull') and kind == 'slot' and key != 'finish']


def server_optimizer(store, server=0):
    """The optimizer that server `server` of `store`'s stand-in applies (None before one)."""
    return store._session.native.servers[server].optimizer


def _tensor_calls(store):
    # (op, kind, DistDelay key, priority) per tensor of every call (a call may hold several).
    session = store._session
    if session.placement is None:
        return   # not started: no call yet
    layout = session.placement.layout
    tensors = dict(session.tensors)
    if session.finish is not None:
        tensors['finish'] = session.finish.tensor
    by_chunk = {(chunk.server, chunk.local): key
                for key, tensor in tensors.items() for chunk in tensor.chunks}

    def name_of(native_key):
        kind, local, _ = layout.decode(native_key)
        return kind, None if kind == 'status' else by_chunk[(layout.server_of(native_key), local)]
    for op, keys, priority in session.native.calls:
        for kind, key in dict.fromkeys(name_of(k) for k in keys):
            yield op, kind, key, priority


@contextlib.contextmanager
def _environ(**values):
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
