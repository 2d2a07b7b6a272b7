"""The store's checkpoints: save, then validate-agree-apply (docs/design.md §6.3).

A save writes the servers' files (``Command.SAVE``) and worker 0's index
(:data:`kvstore_ext.checkpoint.KVSTORE_INDEX`: the job's layout, every key's rounds, the
finish counter's rounds and the job's ``rescale_grad``). A load is two collective halves:
:func:`check` validates everything on every worker and server and agrees on the outcome
(nothing changes), :func:`apply` makes the servers and the round counters take the state.

The functions work on a :class:`DistDelay <kvstore_ext.dist_delay.DistDelay>` through its
collectives (``rank``, ``barrier``, ``agree``, ``_command``) and its job record
(``_job_index()``, ``_restore_job_index(state)``).
"""
from mxnet import nd

from . import checkpoint
from .checks import ArgumentTypeError
from .optimizers import describe_optimizer
from .protocol import Command

__all__ = ['save', 'check', 'apply']

#: The job's settings that a checkpoint must have been saved with.
_LAYOUT = ('num_servers', 'slack', 'chunk_size')


def save(store, fname):
    """Write the checkpoint `fname` of `store` (every worker calls it; no round in flight)."""
    nd.waitall()
    store.barrier()
    if store.rank == 0:
        index = store._job_index()  # pylint: disable=protected-access
        store._command(Command.SAVE, {  # pylint: disable=protected-access
            'paths': checkpoint.server_files(fname, index['num_servers'])})
        checkpoint.write_json(fname, checkpoint.KVSTORE_INDEX, index)
    store.barrier()


def check(store, fname, error):
    """Validate checkpoint `fname` for `store` and agree with every worker (with this
    worker's own `error`, if any); return the state for :func:`apply`.

    Raises
    ------
    ValueError
        On every worker, if any worker or server found a problem; nothing changed then.
    """
    nd.waitall()
    state = None
    try:
        state = checkpoint.read_json(fname, checkpoint.KVSTORE_INDEX)
        mine = store._job_index()  # pylint: disable=protected-access
        for name in _LAYOUT:
            if state[name] != mine[name]:
                raise ValueError('%s was saved with %s=%r but this job has %s=%r; start '
                                 'the job with the same setting'
                                 % (fname, name, state[name], name, mine[name]))
        if set(state['rounds']) != set(mine['rounds']):
            raise ValueError('%s holds keys %s, this kvstore has %s: the model differs'
                             % (fname, sorted(state['rounds']), sorted(mine['rounds'])))
        state['servers'] = checkpoint.server_files(fname, mine['num_servers'])
        if store.rank == 0:
            # Every server validates its file before any server changes.
            store._command(Command.LOAD, {  # pylint: disable=protected-access
                'paths': state['servers'], 'check_only': True,
                'optimizer': describe_optimizer(store._optimizer)})  # pylint: disable=protected-access
    except (ValueError, RuntimeError) as err:
        error = error or str(err)
    failures = store.agree(error)
    if failures:
        raise ValueError('cannot load %s, nothing was changed: %s' % (fname, '; '.join(
            'worker %d: %s' % failure for failure in failures)))
    return state


def apply(store, state):
    """Make the servers and `store`'s round counters take `state` (from :func:`check`)."""
    if not isinstance(state, dict) or 'servers' not in state or 'rounds' not in state:
        raise ArgumentTypeError('state must be the dict that check_states returned, got '
                                '%.80r (%s)' % (state, type(state).__name__))
    if store.rank == 0:
        store._command(Command.LOAD, {  # pylint: disable=protected-access
            'paths': state['servers'],
            'optimizer': describe_optimizer(store._optimizer)})  # pylint: disable=protected-access
    store.barrier()
    store._restore_job_index(state)  # pylint: disable=protected-access
