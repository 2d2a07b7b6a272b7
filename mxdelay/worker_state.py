"""A worker's part of a ``DelayedTrainer`` checkpoint (docs/design.md §6).

What ``save_states`` writes for the worker (``fname.worker<i>``, and worker 0's index
``fname``), and what ``load_states`` reads, validates and applies. The files, their
``format`` and ``version`` are :mod:`kvstore_ext.checkpoint`'s; the servers' part is the
store's (``save_optimizer_states``, ``check_states``, ``apply_states``).
"""
import os

from mxnet import nd

from kvstore_ext import checkpoint
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
    index `fname` (docs/design.md §6.1-6.2)."""
    checkpoint.write_pickle(checkpoint.worker_file(fname, kv.rank), checkpoint.WORKER, body)
    kv.save_optimizer_states(checkpoint.kvstore_file(fname))
    if kv.rank == 0:
        checkpoint.write_json(fname, checkpoint.TRAINER_INDEX, {
            'num_workers': kv.num_workers, 'schedule': schedule.state_dict(),
            'kvstore': os.path.basename(checkpoint.kvstore_file(fname))})


def read(fname, kv, schedule, params, optimizer, amp):
    """Read and validate this worker's files of checkpoint `fname`; change nothing.

    Returns
    -------
    dict
        The worker file's body (:func:`collect`).

    Raises
    ------
    ValueError
        For a missing, truncated or foreign file, or one saved by another configuration.
    """
    index = checkpoint.read_json(fname, checkpoint.TRAINER_INDEX)
    if index['num_workers'] != kv.num_workers:
        raise ValueError('%s was saved by %d workers, this job has %d'
                         % (fname, index['num_workers'], kv.num_workers))
    state = checkpoint.read_pickle(checkpoint.worker_file(fname, kv.rank), checkpoint.WORKER)
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
    return state


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
