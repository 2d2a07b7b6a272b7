"""Placing keys at ``init``: each key's kind, chosen once, its chunks on the servers, and
what the servers are told of them.

A key's kind is the only choice made from its value's stype (and, for aux states, from its
Gluon Parameter): dense keys travel by the codec's wire, row_sparse keys by
:mod:`kvstore_ext.worker.sparse` (docs/design.md §2.10), aux states by
:mod:`kvstore_ext.worker.aux_states` (§2.13). The servers learn every chunk by the REGISTER
command, with the Parameter's name and multipliers (§3.4) and the kind's server settings;
the finish counter (§5) is placed with the first keys.
"""
import numpy as np
import mxnet as mx
from mxnet import nd

from kvstore_ext.protocol import commands
from kvstore_ext.protocol.commands import Command
from kvstore_ext.protocol.counter import counter_size
from kvstore_ext.worker import sparse
from kvstore_ext.worker.aux_states import is_aux
from kvstore_ext.worker.finish import FinishCounter
from kvstore_ext.worker.store_errors import StoreValueError

__all__ = ['place']


def place(session, keys, values):
    """Place `keys` (checked by ``as_lists``) on the servers with initial `values`: the work
    of ``DistDelay.init`` on `session` (:class:`kvstore_ext.worker.session.Session`).

    Raises
    ------
    ValueError
        If a key is already initialised or given twice (nothing is placed then;
        :class:`~kvstore_ext.worker.store_errors.StoreValueError`, also an ``MXNetError``),
        or a row_sparse key meets compressed pulls.
    """
    for k in keys:
        if k in session.tensors or keys.count(k) > 1:
            raise StoreValueError('key %r is already initialised or given twice; '
                                  'initialise each key once' % (k,))
    codec = session.settings.codec
    for k, v in zip(keys, values):
        codec.check_dtype('key %r' % (k,), _first(v).dtype)
    session.ensure_started()
    native_keys, native_values, entries, placed = [], [], [], {}
    for k, v in zip(keys, values):
        v = _first(v)
        kind = _kind_of(session, k, v)
        tensor = session.tensors[k] = kind.place(session.placement, k, v)
        if tensor.codec.state_size():
            session.stateful[k] = tensor.codec
        placed.setdefault(kind, []).append(tensor)
        entries.extend(_entries(session.optimizer, tensor, v, native_keys, native_values))
    if session.finish is None:
        # The counter is placed with the first keys, in the same collective init, so that
        # its chunk id and server are the same on every worker.
        slots = session.settings.slack + 1
        value = nd.zeros(counter_size(slots))
        counter = session.counter_keys.place(session.placement, commands.FINISH_KEY, value)
        entries.extend(_entries(session.optimizer, counter, value, native_keys, native_values))
        counter.make_buffers(slots, mx.cpu())
        session.finish = FinishCounter(counter, session.counter_keys, session.num_workers,
                                       codec.flag_unit)
    session.command(Command.REGISTER, {'chunks': entries})
    session.native.init(native_keys, native_values)
    for kind, tensors in placed.items():
        kind.after_init(tensors)


def _first(value):
    """The first device's array of `value` (an NDArray, or a list of them)."""
    return value[0] if isinstance(value, (list, tuple)) else value


def _kind_of(session, key, value):
    """The kind of `key` (docs/design.md §2.10 for row_sparse keys, §2.13 for aux states)."""
    param = _param_of(session.optimizer, key)
    if sparse.is_row_sparse(value, param):
        kind = session.rows
    else:
        kind = session.aux if is_aux(param) else session.dense
    pull_codec = session.settings.pull_compression
    if kind is session.rows and pull_codec is not None:
        raise ValueError('key %r is row_sparse, which pull_compression=%r does not '
                         'support (its pulls bring the rows asked for, not a model '
                         'every worker holds); use dense keys or no pull_compression'
                         % (key, pull_codec.describe()))
    return kind


def _entries(optimizer, tensor, value, native_keys, native_values):
    """Add `tensor`'s native keys and initial values to the lists; return its REGISTER
    entries: ``[chunk id, server, index, name, lr_mult, wd_mult, size]``, and its kind's
    server settings (the codec's) as an eighth element where there are any."""
    keys, values, sizes = tensor.kind.init_entries(tensor, value)
    native_keys.extend(keys)
    native_values.extend(values)
    lr_mult, wd_mult, name = _mults(optimizer, tensor.key)
    index = int(tensor.key) if isinstance(tensor.key, (int, np.integer)) else str(tensor.key)
    settings = tensor.kind.server_settings()
    return [[chunk.chunk_id, chunk.server, index, name, lr_mult, wd_mult, size]
            + ([settings] if settings else []) for chunk, size in zip(tensor.chunks, sizes)]


def _param_of(optimizer, key):
    # Gluon's Parameter of `key` (Gluon sets the optimizer before init), or None.
    return optimizer.param_dict.get(key) if optimizer is not None else None


def _mults(optimizer, key):
    param = _param_of(optimizer, key)
    if param is not None:  # Gluon: Parameters by key
        return float(param.lr_mult), float(param.wd_mult), param.name
    if optimizer is not None and isinstance(key, str) and key in optimizer.idx2name.values():
        # Module: the keys are the parameters' names, the optimizer's multipliers are by
        # name (Variables' lr_mult/wd_mult attributes; wd_mult 0 for names not ending in
        # _weight or _gamma) and MXNet's server finds them through idx2name.
        return (float(optimizer.lr_mult.get(key, 1.0)),
                float(optimizer.wd_mult.get(key, 1.0)), key)
    return 1.0, 1.0, str(key)
