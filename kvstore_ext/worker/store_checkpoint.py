"""The store's checkpoints: save, then validate-agree-apply (docs/design.md §6.3).

A save writes the servers' files (``Command.SAVE``, stamped with the save's id; each server
answers its file's sha256) and worker 0's index (:data:`kvstore_ext.checkpoint.files.KVSTORE_INDEX`:
the job's layout, every key's rounds, the finish counter's rounds, the job's
``rescale_grad``, the save id and the servers' sha256). A load is two collective halves:
:func:`check` validates everything on every worker and server and agrees on the outcome
(nothing changes), :func:`apply` makes the servers and the round counters take the state.
Both send the servers the save id, their files' sha256 and the index's rounds, which each
server checks against its file, so that no part of another save is validated or applied.

The functions work on a :class:`DistDelay <kvstore_ext.worker.dist_delay.DistDelay>` through its
collectives (``rank``, ``barrier``, ``agree``, ``_command``) and its job record
(``_job_index()``, ``_restore_job_index(state)``).
"""
import math

from mxnet import nd

from kvstore_ext.checkpoint import files
from kvstore_ext.checks import ArgumentTypeError
from kvstore_ext.optim.optimizers import describe_optimizer, optimizer_record
from kvstore_ext.protocol.commands import Command

__all__ = ['shared_save_id', 'save', 'check', 'apply', 'failure_message']

#: The job's settings that a checkpoint must have been saved with.
_LAYOUT = ('num_servers', 'slack', 'chunk_size')
_SAVE_ID = 'save id: '


def shared_save_id(store):
    """Collective: a fresh save id, the same on every worker (rank 0's, sent to the others
    through the vote, §4.4: the one collective that carries text from a worker to all)."""
    mine = files.new_save_id() if store.rank == 0 else None
    votes = store.agree(None if mine is None else _SAVE_ID + mine)
    if len(votes) != 1 or votes[0][0] != 0 or not votes[0][1].startswith(_SAVE_ID):
        raise RuntimeError('the workers could not agree on a save id (votes %r)' % (votes,))
    return votes[0][1][len(_SAVE_ID):]


def save(store, fname, save_id=None):
    """Write the checkpoint `fname` of `store` (every worker calls it; no round in flight),
    stamped with `save_id` (rank 0's; a fresh one if None). Return the sha256 of the index
    on rank 0, None on the others."""
    if store._optimizer is not None:  # pylint: disable=protected-access
        # Refused alike on every worker, before any collective: a checkpoint must name it.
        optimizer_record(store._optimizer)  # pylint: disable=protected-access
    nd.waitall()
    store.barrier()
    digest = None
    if store.rank == 0:
        save_id = save_id or files.new_save_id()
        index = store._job_index()  # pylint: disable=protected-access
        replies = store._command(Command.SAVE, {  # pylint: disable=protected-access
            'paths': files.server_files(fname, index['num_servers']), 'save_id': save_id})
        index.update(save_id=save_id, servers_sha256=[reply['sha256'] for reply in replies])
        digest = files.write_json(fname, files.KVSTORE_INDEX, index)
    store.barrier()
    return digest


def check(store, fname, error, trusted=False, part_of=None):
    """Validate checkpoint `fname` for `store` and agree with every worker (with this
    worker's own `error`, if any); return the state for :func:`apply`.

    Parameters
    ----------
    trusted : bool
        Also accept a version-1 checkpoint, whose server files are pickles.
    part_of : dict, optional
        ``{'save_id', 'sha256'}`` that a trainer checkpoint's index lists for `fname`.

    Raises
    ------
    ValueError
        On every worker, if any worker or server found a problem; nothing changed then.
    """
    nd.waitall()
    state = None
    try:
        state = files.read_json(fname, files.KVSTORE_INDEX,
                                     part_of and part_of['sha256'], trusted)
        if part_of and state.get('save_id') != part_of['save_id']:
            raise ValueError('%s belongs to save %s, but its trainer index to save %s: a later '
                             'save to the same name did not finish (it was killed midway). '
                             'This checkpoint cannot be resumed; resume from an earlier one'
                             % (fname, state.get('save_id'), part_of['save_id']))
        mine = store._job_index()  # pylint: disable=protected-access
        for name in _LAYOUT:
            if state[name] != mine[name]:
                raise ValueError('%s was saved with %s=%r but this job has %s=%r; start '
                                 'the job with the same setting'
                                 % (fname, name, state[name], name, mine[name]))
        if set(state['rounds']) != set(mine['rounds']):
            raise ValueError('%s holds keys %s, this kvstore has %s: the model differs'
                             % (fname, sorted(state['rounds']), sorted(mine['rounds'])))
        _check_counters(fname, state)
        state['servers'] = files.server_files(fname, mine['num_servers'])
        state['load'] = _load_body(fname, state, trusted)
        if store.rank == 0:
            # Every server validates its file before any server changes.
            store._command(Command.LOAD, dict(  # pylint: disable=protected-access
                state['load'], check_only=True,
                optimizer=describe_optimizer(store._optimizer)))  # pylint: disable=W0212
    except Exception as err:  # pylint: disable=broad-except
        # Any failure (a KeyError for a missing field, an OSError, ...) is voted, so that
        # every worker raises the same ValueError; one that escaped would leave the others
        # waiting in the vote.
        error = error or failure_message(fname, err)
    failures = store.agree(error)
    if failures:
        raise ValueError('cannot load %s, nothing was changed: %s' % (fname, '; '.join(
            'worker %d: %s' % failure for failure in failures)))
    return state


def failure_message(fname, err):
    """The vote's message for `err`, raised while checking the file `fname`: a ValueError's
    own message (which names the file and the field), or the error's type and message after
    the file's name."""
    if isinstance(err, ValueError):
        return str(err)
    detail = ('field %s is missing' % err) if isinstance(err, KeyError) else str(err)
    return '%s cannot be loaded (%s: %s)' % (fname, type(err).__name__, detail)


def _is_count(value):
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_counters(fname, state):
    """The fields that apply gives the round counters, checked before anything changes."""
    bad = sorted(k for k, v in state['rounds'].items() if not _is_count(v))
    if bad:
        raise ValueError('%s: field rounds of key %s is %r, not an integer >= 0'
                         % (fname, bad[0], state['rounds'][bad[0]]))
    if state.get('finish_rounds') is not None and not _is_count(state['finish_rounds']):
        raise ValueError('%s: field finish_rounds is %.60r, not an integer >= 0'
                         % (fname, state['finish_rounds']))
    scale = state.get('rescale_grad')
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale) or scale <= 0):
        raise ValueError('%s: field rescale_grad is %.60r, not a finite number > 0'
                         % (fname, scale))


def _load_body(fname, state, trusted):
    """The LOAD command's body for the validated kvstore index `state`."""
    body = {'paths': state['servers'], 'version': state['version'],
            'rounds': state['rounds'], 'finish_rounds': state['finish_rounds']}
    if state['version'] == files.LEGACY_VERSION:
        body['trusted'] = bool(trusted)   # read_json accepted version 1 only if trusted
        return body
    digests = state.get('servers_sha256')
    if (not isinstance(state.get('save_id'), str) or not isinstance(digests, list)
            or len(digests) != len(state['servers'])):
        raise ValueError('%s lacks the save id or the servers\' sha256 (one per server) that '
                         'every version-%d kvstore index holds' % (fname, files.VERSION))
    body.update(save_id=state['save_id'], sha256=digests)
    return body


def apply(store, state):
    """Make the servers and `store`'s round counters take `state` (from :func:`check`)."""
    if not isinstance(state, dict) or 'load' not in state or 'rounds' not in state:
        raise ArgumentTypeError('state must be the dict that check_states returned, got '
                                '%.80r (%s)' % (state, type(state).__name__))
    error = None
    if store.rank == 0:
        # Each server applies the state it validated in check (the same save's files).
        try:
            optimizer = describe_optimizer(store._optimizer)  # pylint: disable=W0212
            store._command(Command.LOAD, dict(  # pylint: disable=protected-access
                state['load'], optimizer=optimizer))
        except Exception as err:  # pylint: disable=broad-except
            error = str(err)
    # Collective: a server that failed to apply makes every worker raise, not only rank 0
    # (the others would train on; the vote's barrier is the one the apply needs anyway).
    failures = store.agree(error)
    if failures:
        raise ValueError('the servers could not apply %s after validating it: %s. Servers '
                         'that did apply hold the checkpoint\'s state and the others their '
                         'own: restart the job' % (state['servers'][0].rsplit('.server', 1)[0],
                                                   '; '.join('worker %d: %s' % failure
                                                             for failure in failures)))
    store._restore_job_index(state)  # pylint: disable=protected-access
