"""A worker's part of a ``DelayedTrainer`` checkpoint (docs/design.md §6).

What ``save_states`` writes for the worker (``fname.worker<i>``, and worker 0's index
``fname``), and what ``load_states`` reads, validates and applies. The files, their
``format`` and ``version`` are :mod:`kvstore_ext.checkpoint`'s; the servers' part is the
store's (:mod:`kvstore_ext.store_checkpoint`: ``save``, ``check_states``, ``apply_states``).
Every part carries the save's id (rank 0's, shared through the vote); worker 0 writes the
index last, with the sha256 of every worker file and of the kvstore index, which lists the
servers' files' sha256 in turn.
"""
import os

from mxnet import nd

from kvstore_ext import checkpoint, store_checkpoint
from kvstore_ext.optimizers import describe_optimizer, type_difference

__all__ = ['collect', 'write', 'read', 'restore_arrays']


def collect(kv, schedule, optimizer, base_lr, states, amp):
    """The worker file's body: what this worker needs to continue bit for bit.

    Parameters
    ----------
    kv : DistDelay
        The trainer's store.
    schedule : DelaySchedule
        The trainer's schedule (its counter).
    optimizer : Optimizer
        The trainer's optimizer; base_lr: the learning rate ``local_lr`` is scaled against.
    states : list of ParamState
        The trainer's per-parameter state, in index order.
    amp : NoAmp or LossScaledAmp
        The trainer's AMP policy.
    """
    return {
        'rank': kv.rank,
        'schedule': schedule.state_dict(), 'rescale_grad': optimizer.rescale_grad,
        'weights': {s.index: s.weights()[0].asnumpy() for s in states},
        'pre_weight': {s.index: s.pre_weight.asnumpy() for s in states if s.started},
        'pulled': {s.index: s.pulled.asnumpy() for s in states if s.pulled is not None},
        'rule_state': {s.index: _to_numpy(s.rule_state) for s in states if s.started},
        # As gluon.Trainer's states: the optimizer (its param_dict is not pickled) and
        # the learning rate local_lr is scaled against.
        'optimizer': optimizer, 'base_lr': base_lr,
        # Gradient compression: the setting and this worker's residuals (per key).
        'compression': kv.compression and kv.compression.describe(),
        'residuals': kv.residuals(),
        # Compressed pulls: the setting and this worker's pulled models x̂ (docs/design.md §2.12).
        'pull_compression': kv.pull_compression and kv.pull_compression.describe(),
        'pulled_models': kv.pulled_models(),
        # AMP: the loss scaler and the rounds it has seen (docs/design.md §11).
        'amp': amp.state_dict(),
    }


def write(fname, kv, body, schedule):
    """Write this worker's file, have the servers write theirs, and (worker 0, last) the
    index `fname` with the save id and every other part's sha256 (docs/design.md §6.1-6.2).
    Collective."""
    save_id = store_checkpoint.shared_save_id(kv)
    checkpoint.write_archive(checkpoint.worker_file(fname, kv.rank), checkpoint.WORKER, body,
                             save_id)
    # Its first barrier: every worker's file is written when worker 0 goes on.
    kvstore_digest = store_checkpoint.save(kv, checkpoint.kvstore_file(fname), save_id)
    if kv.rank == 0:
        parts = {'worker%d' % rank: checkpoint.file_sha256(checkpoint.worker_file(fname, rank))
                 for rank in range(kv.num_workers)}
        parts['kvstore'] = kvstore_digest
        checkpoint.write_json(fname, checkpoint.TRAINER_INDEX, {
            'num_workers': kv.num_workers, 'schedule': schedule.state_dict(),
            'kvstore': os.path.basename(checkpoint.kvstore_file(fname)),
            'save_id': save_id, 'parts': parts})


def read(fname, kv, schedule, params, optimizer, amp, trusted=False):
    """Read and validate this worker's files of checkpoint `fname`; change nothing.

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
    index = checkpoint.read_json(fname, checkpoint.TRAINER_INDEX, trusted=trusted)
    if index['num_workers'] != kv.num_workers:
        raise ValueError('%s was saved by %d workers, this job has %d'
                         % (fname, index['num_workers'], kv.num_workers))
    path = checkpoint.worker_file(fname, kv.rank)
    if index['version'] == checkpoint.LEGACY_VERSION:
        state, part_of = checkpoint.read_pickle(path, checkpoint.WORKER), None
    else:
        parts, save_id = index.get('parts'), index.get('save_id')
        mine = 'worker%d' % kv.rank
        if not isinstance(parts, dict) or mine not in parts or 'kvstore' not in parts \
                or not isinstance(save_id, str):
            raise ValueError('%s lacks the save id or the sha256 of %s or of the kvstore '
                             'index, which every version-%d index holds'
                             % (fname, mine, checkpoint.VERSION))
        state = checkpoint.read_archive(path, checkpoint.WORKER, save_id, parts[mine])
        part_of = {'save_id': save_id, 'sha256': parts['kvstore']}
        if state.get('rank') != kv.rank:
            raise ValueError('%s holds the state of worker %r, not of worker %d'
                             % (path, state.get('rank'), kv.rank))
        if state['schedule']['step'] != index['schedule']['step']:
            raise ValueError('%s was saved at step %s, but its index %s at step %s: the files '
                             'are of different saves' % (path, state['schedule']['step'],
                                                         fname, index['schedule']['step']))
    saved = state['schedule']
    if (saved['delay'], saved['warmup_steps']) != (schedule.delay, schedule.warmup_steps):
        raise ValueError('%s was saved with delay=%d warmup_steps=%d; this trainer has '
                         'delay=%d warmup_steps=%d' % (fname, saved['delay'],
                                                       saved['warmup_steps'],
                                                       schedule.delay, schedule.warmup_steps))
    for i, param in enumerate(params):
        if state['weights'][i].shape != param.shape:
            raise ValueError('%s: parameter %s has shape %s, saved %s' % (
                fname, param.name, param.shape, state['weights'][i].shape))
    current = kv.compression and kv.compression.describe()
    if state.get('compression') != current:
        raise ValueError('%s was saved with compression_params %r, this trainer has %r: '
                         'resume with the same compression'
                         % (fname, state.get('compression'), current))
    if set(state.get('residuals', {})) != set(kv.residuals()):
        raise ValueError('%s holds compression residuals of keys %s, this trainer has %s'
                         % (fname, sorted(state.get('residuals', {})), sorted(kv.residuals())))
    current = kv.pull_compression and kv.pull_compression.describe()
    if state.get('pull_compression') != current:
        raise ValueError('%s was saved with pull_compression %r, this trainer has %r: resume '
                         'with the same pull_compression'
                         % (fname, state.get('pull_compression'), current))
    amp.check_saved(state.get('amp'), fname)
    saved = state.get('optimizer')
    types = saved is not None and type_difference(describe_optimizer(saved),
                                                  describe_optimizer(optimizer))
    if types:
        raise ValueError('%s was saved with optimizer %s, this trainer uses %s: create the '
                         'trainer with the checkpoint\'s optimizer to resume from it'
                         % ((fname,) + tuple(types)))
    return state, part_of


def restore_arrays(state, states, ctx):
    """Give every parameter its saved weights (on every device), and `states` their saved
    ``pre_weight``, pending pull and rule state (on `ctx`)."""
    for s in states:
        # Not Parameter.set_data: it resets the trainer's kvstore (impossible when dist).
        for data in s.weights():
            data[:] = state['weights'][s.index]
        s.pre_weight = _from_numpy(state['pre_weight'].get(s.index), ctx)
        s.pulled = _from_numpy(state['pulled'].get(s.index), ctx)
        s.rule_state = _from_numpy(state['rule_state'].get(s.index), ctx)


def _to_numpy(state):
    # A rule state: None, an NDArray, or a (nested) tuple or list of those.
    if isinstance(state, (tuple, list)):
        return type(state)(_to_numpy(s) for s in state)
    return None if state is None else state.asnumpy()


def _from_numpy(state, ctx):
    if isinstance(state, (tuple, list)):
        return type(state)(_from_numpy(s, ctx) for s in state)
    return None if state is None else nd.array(state, ctx=ctx, dtype=state.dtype)
