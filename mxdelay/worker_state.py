"""A worker's part of a ``DelayedTrainer`` checkpoint (docs/design.md §6).

What ``save_states`` writes for the worker (``fname.worker<i>``, and worker 0's index
``fname``), and what ``load_states`` reads, validates and applies. The files, their
``format`` and ``version`` are :mod:`kvstore_ext.checkpoint.files`'s; the servers' part is the
store's checkpoint part (:mod:`kvstore_ext.worker.store_checkpoint`: ``save``,
``check_states``, ``apply_states``), which also holds the worker's residuals and pulled
models. Each function takes the trainer's store `kv` (its rank and number of workers) and
the store's parts `parts` (``kv.delayed``). Every part of a checkpoint carries the save's id
(rank 0's, shared through the vote); worker 0 writes the index last, with the sha256 of
every worker file and of the kvstore index, which lists the servers' files' sha256 in turn.
"""
import math
import os

import numpy as np
from mxnet import nd, optimizer as mx_optimizer

from kvstore_ext.checkpoint import files
from kvstore_ext.worker.store_checkpoint import failure_message, is_count
from kvstore_ext.optim.optimizers import describe_optimizer, type_difference
from kvstore_ext.protocol.schedule import AUTO, PullSchedule

from .loss_scaling import _STATE as _SCALER_FIELDS

__all__ = ['save', 'load', 'collect', 'write', 'write_index', 'read', 'restore_arrays']


def save(fname, kv, parts, schedule, optimizer, base_lr, states, amp):
    """Write this worker's part of checkpoint `fname` (:func:`collect`, :func:`write`) once
    every queued update is done; collective: every worker calls it after the same round."""
    nd.waitall()
    write(fname, kv, parts, collect(kv, parts, schedule, optimizer, base_lr, states, amp),
          schedule)
    parts.job.barrier()


def load(fname, kv, parts, schedule, states, optimizer, amp, ctx, trusted=False):
    """Read and check this worker's files of checkpoint `fname` (:func:`read`), vote with
    every worker and server on whether all parts are good, then restore the parameters'
    arrays (on `ctx`), the residuals and the pulled models; collective.

    Returns
    -------
    dict
        The worker file's body, for what the trainer adopts (optimizer, AMP, the counter).

    Raises
    ------
    ValueError
        On every worker, if any worker's or server's part is bad; nothing has changed then.
    """
    state, error, part_of = None, None, None
    try:
        state, part_of = read(fname, kv, parts, schedule, [s.param for s in states], optimizer,
                              amp, trusted)
    except Exception as err:  # pylint: disable=broad-except
        # Any error, not only ValueError, goes to the vote: one that escaped here would
        # leave the other workers waiting in it (read turns them into ValueErrors).
        error = failure_message(fname, err)
    # Collective: if any worker's or server's file is bad, every worker raises here.
    checkpoint = parts.checkpoint
    checkpoint.apply_states(checkpoint.check_states(files.kvstore_file(fname), error, trusted,
                                                    part_of))
    restore_arrays(state, states, ctx)
    checkpoint.set_residuals(state.get('residuals', {}))
    checkpoint.set_pulled_models(state.get('pulled_models', {}))
    return state


def collect(kv, parts, schedule, optimizer, base_lr, states, amp, to_host=None):
    """The worker file's body: what this worker needs to continue bit for bit.

    Parameters
    ----------
    kv : DistDelay
        The trainer's store.
    parts : DelayedParts
        The store's parts (``kv.delayed``).
    schedule : DelaySchedule
        The trainer's schedule (its counter).
    optimizer : Optimizer
        The trainer's optimizer; base_lr: the learning rate ``local_lr`` is scaled against.
    states : list of ParamState
        The trainer's per-parameter state, in index order.
    amp : NoAmp or LossScaledAmp
        The trainer's AMP policy.
    to_host : callable, optional
        ``to_host(array)``: the parameters' arrays as numpy (default ``asnumpy``; a
        :class:`~kvstore_ext.checkpoint.host_copies.HostCopies`, which need not wait).
    """
    settings = parts.settings
    to_host = to_host or nd.NDArray.asnumpy
    return {
        'rank': kv.rank,
        'schedule': schedule.state_dict(), 'rescale_grad': optimizer.rescale_grad,
        'weights': {s.index: to_host(s.weights()[0]) for s in states},
        'pre_weight': {s.index: to_host(s.pre_weight) for s in states
                       if s.pre_weight is not None},
        'pulled': {s.index: to_host(s.pulled) for s in states if s.pulled is not None},
        'rule_state': {s.index: _to_numpy(s.rule_state, to_host) for s in states
                       if s.started},
        # As gluon.Trainer's states: the optimizer (its param_dict is not pickled) and
        # the learning rate local_lr is scaled against.
        'optimizer': optimizer, 'base_lr': base_lr,
        # Gradient compression: the setting and this worker's residuals (per key).
        'compression': settings.compression and settings.compression.describe(),
        'residuals': parts.checkpoint.residuals(),
        # Compressed pulls: the setting and this worker's pulled models x̂ (docs/design.md §2.12).
        'pull_compression': settings.pull_compression and settings.pull_compression.describe(),
        'pulled_models': parts.checkpoint.pulled_models(),
        # AMP: the loss scaler and the rounds it has seen (docs/design.md §11).
        'amp': amp.state_dict(),
    }


def write(fname, kv, parts, body, schedule):
    """Write this worker's file, have the servers write theirs, and (worker 0, last) the
    index `fname` with the save id and every other part's sha256 (docs/design.md §6.1-6.2).
    Collective."""
    save_id = parts.checkpoint.shared_save_id()
    files.write_archive(files.worker_file(fname, kv.rank), files.WORKER, body,
                             save_id)
    # Its first barrier: every worker's file is written when worker 0 goes on.
    kvstore_digest = parts.checkpoint.save(files.kvstore_file(fname), save_id)
    if kv.rank == 0:
        digests = {'worker%d' % rank: files.file_sha256(files.worker_file(fname, rank))
                   for rank in range(kv.num_workers)}
        digests['kvstore'] = kvstore_digest
        write_index(fname, kv.num_workers, schedule.state_dict(), save_id, digests,
                    codecs_of(parts.settings))


def write_index(fname, num_workers, schedule, save_id, parts, codecs):
    """Write the index `fname` (worker 0, last: it makes the checkpoint complete) naming the
    schedule's `schedule` state, the save id, each part's sha256 (`parts`: ``workerN`` and
    ``kvstore`` -> digest), which :func:`read` checks, and the job's `codecs`
    (:func:`codecs_of`: what a resumed ``compression_params='auto'`` job keeps). Return its
    sha256."""
    return files.write_json(fname, files.TRAINER_INDEX, {
        'num_workers': num_workers, 'schedule': schedule,
        'kvstore': os.path.basename(files.kvstore_file(fname)),
        'save_id': save_id, 'parts': parts, 'codecs': codecs})


def codecs_of(settings):
    """The store's codecs as the trainer's arguments that pin them: ``{'compression_params':
    dict or None, 'pull_compression': dict or None}`` (`settings`: ``kv.delayed.settings``)."""
    pull = settings.pull_compression
    return {'compression_params': settings.codec.describe(),
            'pull_compression': pull.describe() if pull is not None else None}


def index_codecs(fname):
    """The codecs the index `fname` names (:func:`write_index`), or None: an index from
    before they were written, or one that cannot be read (its resume will say why)."""
    try:
        codecs = files.read_json(fname, files.TRAINER_INDEX).get('codecs')
    except ValueError:
        return None
    return codecs if isinstance(codecs, dict) else None


def read(fname, kv, parts, schedule, params, optimizer, amp, trusted=False):
    """Read and validate this worker's files of checkpoint `fname`; change nothing.

    Every field that :func:`restore_arrays` and the trainer's load apply is checked here
    (types, shapes, dtypes, keys), so that the apply cannot fail halfway; any error of
    another type met while checking (a missing field, a directory, a permission) becomes a
    ValueError naming the file, so that the load's vote sees it (docs/design.md §6.3).

    Parameters
    ----------
    trusted : bool
        Also read a version-1 checkpoint (pickles).

    Returns
    -------
    (dict, dict or None)
        The worker file's body (:func:`collect`), and what the index says of the kvstore
        index (``{'save_id', 'sha256'}``, for ``check_states``; None for version 1).

    Raises
    ------
    ValueError
        For a missing, truncated or foreign file, one saved by another configuration, or
        one of another save than the index.
    """
    try:
        return _read(fname, kv, parts, schedule, params, optimizer, amp, trusted)
    except ValueError:
        raise
    except Exception as err:  # pylint: disable=broad-except
        raise ValueError(failure_message(
            files.worker_file(fname, kv.rank), err)) from None


def _read(fname, kv, parts, schedule, params, optimizer, amp, trusted):
    index = files.read_json(fname, files.TRAINER_INDEX, trusted=trusted)
    if index['num_workers'] != kv.num_workers:
        raise ValueError('%s was saved by %d workers, this job has %d'
                         % (fname, index['num_workers'], kv.num_workers))
    path = files.worker_file(fname, kv.rank)
    if index['version'] == files.LEGACY_VERSION:
        state, part_of = files.read_pickle(path, files.WORKER), None
    else:
        digests, save_id = index.get('parts'), index.get('save_id')
        mine = 'worker%d' % kv.rank
        if not isinstance(digests, dict) or mine not in digests or 'kvstore' not in digests \
                or not isinstance(save_id, str):
            raise ValueError('%s lacks the save id or the sha256 of %s or of the kvstore '
                             'index, which every version-%d index holds'
                             % (fname, mine, files.VERSION))
        state = files.read_archive(path, files.WORKER, save_id, digests[mine])
        part_of = {'save_id': save_id, 'sha256': digests['kvstore']}
        if state.get('rank') != kv.rank:
            raise ValueError('%s holds the state of worker %r, not of worker %d'
                             % (path, state.get('rank'), kv.rank))
        if state['schedule']['step'] != index['schedule']['step']:
            raise ValueError('%s was saved at step %s, but its index %s at step %s: the files '
                             'are of different saves' % (path, state['schedule']['step'],
                                                         fname, index['schedule']['step']))
    saved = _field(path, state, 'schedule', dict)
    auto = saved.get('delay') == AUTO
    for name in ('step', 'warmup_steps') + (() if auto else ('delay',)):
        if not is_count(saved.get(name)):
            raise ValueError('%s: field schedule.%s is %.60r, not an integer >= 0'
                             % (path, name, saved.get(name)))
    mine = schedule.describe()
    if (saved['delay'], saved['warmup_steps']) != (mine['delay'], mine['warmup_steps']):
        raise ValueError('%s was saved with delay=%r warmup_steps=%d; this trainer has '
                         'delay=%r warmup_steps=%d' % (fname, saved['delay'],
                                                       saved['warmup_steps'],
                                                       mine['delay'], mine['warmup_steps']))
    if auto:
        try:   # delay='auto''s decisions, as the trainer will adopt them
            PullSchedule(AUTO, saved['warmup_steps']).amend(**saved['amendments'])
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError("%s: field schedule.amendments is %.80r, not delay='auto''s "
                             'decisions: %s' % (path, saved.get('amendments'), err)) from None
    _check_arrays(path, state, params)
    settings, checkpoint = parts.settings, parts.checkpoint
    _check_setting(fname, state, 'compression', 'compression_params', settings.compression)
    residuals = _field(path, state, 'residuals', dict, default={})
    if set(residuals) != set(checkpoint.residuals()):
        raise ValueError('%s holds compression residuals of keys %s, this trainer has %s'
                         % (fname, sorted(residuals), sorted(checkpoint.residuals())))
    for key, mine in checkpoint.residuals().items():
        theirs = residuals[key]
        if not isinstance(theirs, np.ndarray) or np.shape(theirs) != np.shape(mine) \
                or theirs.dtype != np.asarray(mine).dtype:
            raise ValueError('%s: field residuals[%r] is %s, this trainer\'s residual is %s %s'
                             % (path, key, _describe(theirs), np.asarray(mine).dtype,
                                np.shape(mine)))
    _check_setting(fname, state, 'pull_compression', 'pull_compression',
                   settings.pull_compression)
    models = _field(path, state, 'pulled_models', dict, default={})
    mine = checkpoint.pulled_models()
    if set(models) != set(mine):
        raise ValueError('%s holds pulled models of keys %s, this trainer has %s'
                         % (path, sorted(models, key=str), sorted(mine, key=str)))
    for key, (model, _) in mine.items():
        theirs = models[key]
        if not (isinstance(theirs, (tuple, list)) and len(theirs) == 2
                and isinstance(theirs[0], np.ndarray) and theirs[0].shape == model.shape
                and theirs[0].dtype == model.dtype and isinstance(theirs[1], int)):
            raise ValueError('%s: field pulled_models[%r] is %.60r, not (%s %s, round)'
                             % (path, key, theirs, model.dtype, model.shape))
    amp.check_saved(state.get('amp'), fname)
    if amp.enabled:
        _check_amp(path, state.get('amp'))
    saved = _field(path, state, 'optimizer', mx_optimizer.Optimizer, default=None)
    _field(path, state, 'base_lr', (int, float), default=0.0, finite=True)
    _field(path, state, 'rescale_grad', (int, float), finite=True)
    types = saved is not None and type_difference(describe_optimizer(saved),
                                                  describe_optimizer(optimizer))
    if types:
        raise ValueError('%s was saved with optimizer %s, this trainer uses %s: create the '
                         'trainer with the checkpoint\'s optimizer to resume from it'
                         % ((fname,) + tuple(types)))
    return state, part_of


def _check_setting(fname, state, name, argument, codec):
    """Refuse a file saved with another `codec` setting (field `name`, the trainer's
    `argument`) than this trainer's."""
    current = codec and codec.describe()
    if state.get(name) != current:
        raise ValueError('%s was saved with %s %r, this trainer has %r: resume with the same '
                         '%s (compression_params=\'auto\' keeps the checkpoint\'s codecs when '
                         'load_states comes before the first step)'
                         % (fname, argument, state.get(name), current, argument))


def _describe(value):
    if isinstance(value, np.ndarray):
        return '%s %s' % (value.dtype, value.shape)
    return 'a %s' % type(value).__name__


def _field(path, state, name, kind, default=KeyError, finite=False):
    """Field `name` of the worker file `path`'s `state`, of type `kind` (finite if asked)."""
    if name not in state or (default is not KeyError and state[name] is None):
        if default is KeyError:
            raise ValueError('%s: field %s is missing' % (path, name))
        return default
    value = state[name]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool \
            or (finite and not math.isfinite(value)):
        raise ValueError('%s: field %s is %.60r, not %s%s' % (
            path, name, value, 'a finite ' if finite else 'a ',
            kind.__name__ if isinstance(kind, type) else 'number'))
    return value


def _arrays_of(value):
    # A rule state: None, an array, or a (nested) tuple or list of those.
    if value is None:
        return []
    if isinstance(value, (tuple, list)):
        return [a for part in value for a in _arrays_of(part)]
    return [value]


def _check_arrays(path, state, params):
    """The weights (one per parameter, its shape and dtype: no silent cast), and each
    ``pre_weight``, ``pulled`` and rule state array (a parameter's, of its shape)."""
    weights = _field(path, state, 'weights', dict)
    indexes = set(range(len(params)))
    if set(weights) != indexes:
        raise ValueError('%s: field weights holds parameters %s, this trainer has %d '
                         '(0..%d): the model differs from the one that was saved'
                         % (path, sorted(weights, key=str), len(params), len(params) - 1))
    for i, param in enumerate(params):
        saved = weights[i]
        if not isinstance(saved, np.ndarray) or saved.shape != param.shape \
                or saved.dtype != np.dtype(param.dtype):
            raise ValueError('%s: field weights[%d]: parameter %s is %s %s, saved %s' % (
                path, i, param.name, np.dtype(param.dtype), param.shape, _describe(saved)))
    for name, same_dtype in (('pre_weight', True), ('pulled', True), ('rule_state', False)):
        entries = _field(path, state, name, dict)
        for i, value in entries.items():
            if i not in indexes:
                raise ValueError('%s: field %s holds parameter %r, this trainer has %d'
                                 % (path, name, i, len(params)))
            param = params[i]
            arrays = _arrays_of(value) if name == 'rule_state' else [value]
            for array in arrays:
                if not isinstance(array, np.ndarray) or array.shape != param.shape \
                        or (same_dtype and array.dtype != np.dtype(param.dtype)):
                    raise ValueError('%s: field %s[%d]: parameter %s is %s %s, saved %s' % (
                        path, name, i, param.name, np.dtype(param.dtype), param.shape,
                        _describe(array)))


def _check_amp(path, saved):
    """AMP's saved state (the loss scaler's fields and the rounds it has seen)."""
    scaler = saved.get('scaler') if isinstance(saved, dict) else None
    overflows = saved.get('overflows') if isinstance(saved, dict) else None
    names = [name.lstrip('_') for name in _SCALER_FIELDS]
    if not isinstance(scaler, dict) or set(scaler) != set(names) or any(
            isinstance(scaler[n], bool) or not isinstance(scaler[n], (int, float))
            for n in names):
        raise ValueError('%s: field amp.scaler is %.120r, not the loss scaler\'s %s'
                         % (path, scaler, ', '.join(names)))
    if not isinstance(overflows, dict) or set(overflows) != {'applied', 'skipped'} or any(
            not is_count(overflows[n]) for n in overflows):
        raise ValueError('%s: field amp.overflows is %.120r, not {applied, skipped} counts'
                         % (path, overflows))


def restore_arrays(state, states, ctx):
    """Give every parameter its saved weights (on every device), and `states` their saved
    ``pre_weight``, pending pull and rule state (on `ctx`)."""
    for s in states:
        # Not Parameter.set_data: it resets the trainer's kvstore (impossible when dist).
        for data in s.weights():
            data[:] = state['weights'][s.index]
        s.started = s.index in state['rule_state']   # saved for every started state
        s.pre_weight = _from_numpy(state['pre_weight'].get(s.index), ctx)
        s.pulled = _from_numpy(state['pulled'].get(s.index), ctx)
        s.rule_state = _from_numpy(state['rule_state'].get(s.index), ctx)


def _to_numpy(state, to_host):
    # A rule state: None, an NDArray, or a (nested) tuple or list of those.
    if isinstance(state, (tuple, list)):
        return type(state)(_to_numpy(s, to_host) for s in state)
    return None if state is None else to_host(state)


def _from_numpy(state, ctx):
    if isinstance(state, (tuple, list)):
        return type(state)(_from_numpy(s, ctx) for s in state)
    return None if state is None else nd.array(state, ctx=ctx, dtype=state.dtype)
