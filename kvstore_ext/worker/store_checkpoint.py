"""The store's checkpoints: the store's ``checkpoint`` part (``DistDelay.delayed.checkpoint``).

A save writes the servers' files (``Command.SAVE``, stamped with the save's id; each server
answers its file's sha256) and worker 0's index (:data:`kvstore_ext.checkpoint.files.KVSTORE_INDEX`:
the job's layout, every key's rounds, the finish counter's rounds, the job's
``rescale_grad``, the save id and the servers' sha256); a periodic checkpoint's has the
servers write in the background and worker 0 alone ask for it
(:meth:`StoreCheckpoint.save_in_background`). A load is two collective halves:
:meth:`StoreCheckpoint.check_states` validates everything on every worker and server and
agrees on the outcome (nothing changes), :meth:`StoreCheckpoint.apply_states` makes the
servers and the round counters take the state. Both send the servers the save id, their
files' sha256 and the index's rounds, which each server checks against its file, so that no
part of another save is validated or applied (docs/design.md §6.3).

The worker's own state that a trainer's checkpoint file holds (:mod:`mxdelay.worker_state`)
is here too: the compression residuals and the pulled models of compressed pulls.
"""
import functools
import math

import numpy as np
from mxnet import nd

from kvstore_ext.checkpoint import background, files
from kvstore_ext.checks import ArgumentTypeError, check_bool, check_optional_text, check_path
from kvstore_ext.optim.optimizers import describe_optimizer, optimizer_record
from kvstore_ext.protocol.commands import Command

__all__ = ['StoreCheckpoint', 'failure_message', 'is_count']

#: The job's settings that a checkpoint must have been saved with.
_LAYOUT = ('num_servers', 'slack', 'chunk_size')
_SAVE_ID = 'save id: '


class StoreCheckpoint(object):
    """The checkpoints of `session` (:class:`kvstore_ext.worker.session.Session`), through
    the job's collectives `job` (:class:`kvstore_ext.worker.job.Job`: ``barrier``,
    ``agree``)."""

    def __init__(self, session, job):
        self._session = session
        self._job = job

    def shared_save_id(self):
        """Collective: a fresh save id, the same on every worker (rank 0's, sent to the others
        through the vote, §4.4: the one collective that carries text from a worker to all)."""
        mine = files.new_save_id() if self._session.rank == 0 else None
        votes = self._job.agree(None if mine is None else _SAVE_ID + mine)
        if len(votes) != 1 or votes[0][0] != 0 or not votes[0][1].startswith(_SAVE_ID):
            raise RuntimeError('the workers could not agree on a save id (votes %r)' % (votes,))
        return votes[0][1][len(_SAVE_ID):]

    def save(self, fname, save_id=None):
        """Write the store's checkpoint `fname` (every worker calls it; no round in flight),
        stamped with `save_id` (rank 0's; a fresh one if None). Return the sha256 of the
        index on rank 0, None on the others."""
        session = self._session
        if session.optimizer is not None:
            # Refused alike on every worker, before any collective: a checkpoint must name it.
            optimizer_record(session.optimizer)
        nd.waitall()
        self._job.barrier()
        digest = None
        if session.rank == 0:
            save_id = save_id or files.new_save_id()
            index = self._job_index()
            replies = session.command(Command.SAVE, {
                'paths': files.server_files(fname, index['num_servers']), 'save_id': save_id})
            index.update(save_id=save_id, servers_sha256=[reply['sha256'] for reply in replies])
            digest = files.write_json(fname, files.KVSTORE_INDEX, index)
        self._job.barrier()
        return digest

    def save_in_background(self, fname, save_id):
        """Rank 0 alone, not collective: have every server copy its state for the store's
        checkpoint `fname` (stamped with `save_id`) and write its file in the background
        (docs/design.md §6.4).

        The command names the index's rounds (every key's and the finish counter's) and
        does not wait for this worker's issued pushes: each server copies each chunk at its
        round, at once or when its round before is applied (:mod:`kvstore_ext.server.save_copy`),
        and none can apply that round before this worker pushes it, after the reply
        (the command travels on the connection its pushes take, ahead of them).

        Returns
        -------
        callable
            ``finish(timeout)``, for any thread (no MXNet): wait for the servers' files, write
            the index `fname` with their sha256, return its sha256.
        """
        session = self._session
        if session.optimizer is not None:
            optimizer_record(session.optimizer)   # refused before anything is written
        index = dict(self._job_index(), save_id=save_id)
        servers = files.server_files(fname, index['num_servers'])
        session.command(Command.SAVE, {'paths': servers, 'save_id': save_id, 'background': True,
                                       'rounds': index['rounds'],
                                       'finish_rounds': index['finish_rounds']})
        return functools.partial(_write_index, fname, index, servers)

    def check_states(self, fname, error=None, trusted=False, part_of=None):
        """Collective first half of a load: validate everything, agree, change nothing.

        Parameters
        ----------
        fname : str
            The index file written by ``save_optimizer_states``.
        error : str, optional
            A failure the caller found in its own files, to be agreed on as well.
        trusted : bool
            Also accept a version-1 checkpoint, whose server files are pickles (as in
            ``load_optimizer_states``).
        part_of : dict, optional
            ``{'save_id', 'sha256'}`` that a trainer checkpoint's index lists for `fname`.

        Returns
        -------
        dict
            The validated state, for :meth:`apply_states`.

        Raises
        ------
        ValueError
            On every worker, if any worker or server found a problem; nothing changed then.
        """
        fname = check_path('fname', fname)
        check_optional_text('error', error, 'pass None, or a message saying what failed')
        check_bool('trusted', trusted)
        session = self._session
        nd.waitall()
        state = None
        try:
            state = files.read_json(fname, files.KVSTORE_INDEX,
                                    part_of and part_of['sha256'], trusted)
            if part_of and state.get('save_id') != part_of['save_id']:
                raise ValueError('%s belongs to save %s, but its trainer index to save %s: a '
                                 'later save to the same name did not finish (it was killed '
                                 'midway). This checkpoint cannot be resumed; resume from an '
                                 'earlier one' % (fname, state.get('save_id'),
                                                  part_of['save_id']))
            mine = self._job_index()
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
            if session.rank == 0:
                # Every server validates its file before any server changes.
                session.command(Command.LOAD, dict(
                    state['load'], check_only=True,
                    optimizer=describe_optimizer(session.optimizer)))
        except Exception as err:  # pylint: disable=broad-except
            # Any failure (a KeyError for a missing field, an OSError, ...) is voted, so that
            # every worker raises the same ValueError; one that escaped would leave the
            # others waiting in the vote.
            error = error or failure_message(fname, err)
        failures = self._job.agree(error)
        if failures:
            raise ValueError('cannot load %s, nothing was changed: %s' % (fname, '; '.join(
                'worker %d: %s' % failure for failure in failures)))
        return state

    def apply_states(self, state):
        """Collective second half of a load: the servers and this worker's round counters
        take `state` (from :meth:`check_states`)."""
        if not isinstance(state, dict) or 'load' not in state or 'rounds' not in state:
            raise ArgumentTypeError('state must be the dict that check_states returned, got '
                                    '%.80r (%s)' % (state, type(state).__name__))
        session = self._session
        error = None
        if session.rank == 0:
            # Each server applies the state it validated in check (the same save's files).
            try:
                optimizer = describe_optimizer(session.optimizer)
                session.command(Command.LOAD, dict(state['load'], optimizer=optimizer))
            except Exception as err:  # pylint: disable=broad-except
                error = str(err)
        # Collective: a server that failed to apply makes every worker raise, not only rank
        # 0 (the others would train on; the vote's barrier is the one the apply needs anyway).
        failures = self._job.agree(error)
        if failures:
            raise ValueError('the servers could not apply %s after validating it: %s. Servers '
                             'that did apply hold the checkpoint\'s state and the others their '
                             'own: restart the job' % (state['servers'][0].rsplit('.server', 1)[0],
                                                       '; '.join('worker %d: %s' % failure
                                                                 for failure in failures)))
        self._restore_job_index(state)

    def _job_index(self):
        """What a checkpoint's index records of this worker's job."""
        session = self._session
        return {'num_servers': session.num_servers, 'slack': session.settings.slack,
                'chunk_size': session.settings.chunk_size,
                'rounds': {str(k): t.next_round for k, t in session.tensors.items()},
                'finish_rounds': session.finish.tensor.next_round if session.finish else 0,
                'rescale_grad': session.job_rescale_grad}

    def _restore_job_index(self, state):
        """Take the round counters and the job's rescale_grad of a checkpoint's index."""
        session = self._session
        for key, tensor in session.tensors.items():
            tensor.next_round = state['rounds'][str(key)]
        if session.finish is not None:
            session.finish.restore(state['finish_rounds'],
                                   max([t.next_round for t in session.tensors.values()
                                        if t.kind.trained] + [0]))
        # The servers apply the saved job's rescale_grad from now on (its optimizer).
        session.job_rescale_grad = state['rescale_grad']

    # -- the worker's own state, for a trainer's checkpoint ----------------------------------
    def residuals(self):
        """This worker's compression residuals: {key: numpy array} (empty without)."""
        return {k: codec.state() for k, codec in self._session.stateful.items()}

    def set_residuals(self, residuals):
        """Restore what :meth:`residuals` returned (a checkpoint's), before pushing again.

        Raises
        ------
        ValueError
            If the keys or sizes differ from this store's residuals.
        """
        mine = self._session.stateful
        if set(residuals) != set(mine):
            raise ValueError('compression residuals for keys %s, this store has %s: saved with '
                             'another compression setting or model'
                             % (sorted(residuals, key=str), sorted(mine, key=str)))
        for key, value in residuals.items():
            if np.size(value) != mine[key].state_size():
                raise ValueError('compression residual of key %r has %d elements, the key %d'
                                 % (key, np.size(value), mine[key].state_size()))
        for key, value in residuals.items():
            mine[key].load_state(value)

    def pulled_models(self):
        """This worker's pulled models of compressed pulls: {key: (numpy x̂, the round it
        was last pulled at)} (empty without)."""
        if self._session.settings.pull_compression is None:
            return {}
        return {k: t.pull_state.state() for k, t in self._session.tensors.items()
                if t.pull_state is not None}

    def set_pulled_models(self, models):
        """Restore what :meth:`pulled_models` returned (a checkpoint's).

        Raises
        ------
        ValueError
            If the keys differ from this store's.
        """
        mine = self.pulled_models()
        if set(models) != set(mine):
            raise ValueError('pulled models of keys %s, this store has %s: saved with another '
                             'pull_compression or model' % (sorted(models, key=str),
                                                            sorted(mine, key=str)))
        for key, state in models.items():
            self._session.tensors[key].pull_state.load(key, state)


def _write_index(fname, index, servers, timeout):
    """The kvstore index `fname` of a save in the background, once every server's file
    (`servers`) is written and its sha256 beside it; return the index's sha256."""
    digests = [background.wait(path, index['save_id'], timeout) for path in servers]
    digest = files.write_json(fname, files.KVSTORE_INDEX, dict(index, servers_sha256=digests))
    for path in servers:
        background.remove(path)   # the index lists them now
    return digest


def failure_message(fname, err):
    """The vote's message for `err`, raised while checking the file `fname`: a ValueError's
    own message (which names the file and the field), or the error's type and message after
    the file's name."""
    if isinstance(err, ValueError):
        return str(err)
    detail = ('field %s is missing' % err) if isinstance(err, KeyError) else str(err)
    return '%s cannot be loaded (%s: %s)' % (fname, type(err).__name__, detail)


def is_count(value):
    """Whether `value` is an int >= 0 (not a bool): a count in a checkpoint's fields."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_counters(fname, state):
    """The fields that apply gives the round counters, checked before anything changes."""
    bad = sorted(k for k, v in state['rounds'].items() if not is_count(v))
    if bad:
        raise ValueError('%s: field rounds of key %s is %r, not an integer >= 0'
                         % (fname, bad[0], state['rounds'][bad[0]]))
    if state.get('finish_rounds') is not None and not is_count(state['finish_rounds']):
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
