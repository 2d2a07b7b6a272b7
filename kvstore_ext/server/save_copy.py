"""A save in the background's copy of a server's state: each chunk copied at the save's round.

Worker 0 sends ``SAVE`` with ``background`` and the kvstore index's rounds (every key's and
the finish counter's: the round R the checkpoint is at, per key) without waiting for its own
pushes (docs/design.md §6.4). So a chunk may still miss rounds before R when the command
arrives; none can have applied round R, which needs worker 0's push of it, issued after the
reply. :class:`SaveCopy` copies each chunk whose applied rounds are R at once, and every
other one at the moment its round R - 1 is applied (:meth:`SaveCopy.applied`, which the
round keeper calls after every round it applies, before any other round of the chunk), so
that the file holds every chunk exactly at its round R, whatever arrives meanwhile.

A chunk's copy is everything the server file holds of it: its weights, round counter,
skipped rounds and pulled model x̂ (:meth:`RoundKeeper.chunk_state
<kvstore_ext.server.rounds.RoundKeeper.chunk_state>`), its optimizer state, and its update
count in the optimizer. The optimizer itself (hyper-parameters, learning-rate scheduler) is
copied when the command arrives, before any round R; each chunk's copy then sets its update
count there, and ``num_update`` (their maximum) follows, as does a learning rate set while
chunks wait (:meth:`SaveCopy.set_learning_rate`: it is for a round before R). A field that
an optimizer changes at every update besides the update counts (MXNet's ``Nadam``'s
``m_schedule``: one product over every chunk's updates, which no chunk's copy can hold)
is as of the command's arrival: exact only if no chunk waited.
"""
import copy

import mxnet as mx

from kvstore_ext.protocol.commands import field

__all__ = ['SaveCopy', 'save_rounds']


def save_rounds(body, chunks, rounds):
    """Each chunk's round in ``SAVE``'s `body` (``rounds`` by key, ``finish_rounds``), for
    this server's `chunks` (the registry), checked against what `rounds` (the round keeper)
    has applied; None if the body names no rounds (the state is copied as it is).

    Raises
    ------
    ValueError
        If the body lacks a chunk's key, or a chunk has applied a round at or past its save's
        (impossible for a save that worker 0 sent before pushing that round: the index and
        this server would disagree).
    """
    if 'rounds' not in body:
        return None
    by_key = field(body, 'rounds', dict)
    for key in by_key:
        field(by_key, key, int, minimum=0)
    finish = field(body, 'finish_rounds', int, minimum=0, optional=True, default=0)
    targets = {}
    for chunk in chunks.ids():
        key = chunks.key(chunk)
        target = finish if chunks.is_counter(chunk) else by_key.get(str(key))
        if target is None:
            raise ValueError('save: the rounds name no round for key %r (chunk %d)'
                             % (key, chunk))
        applied = rounds.applied_rounds(chunk)
        if applied > target:
            raise ValueError(
                'save: chunk %d (key %r) has applied %d rounds, past the save\'s round %d, '
                'which cannot complete before the worker that sent the save pushes it, after '
                'the reply: the save\'s rounds are not this job\'s' % (chunk, key, applied,
                                                                      target))
        targets[chunk] = target
    return targets


class SaveCopy(object):
    """One save's copy of a server's chunks, each at its round (see the module docstring).

    Parameters
    ----------
    chunks : kvstore_ext.server.registry.ChunkRegistry
    rounds : kvstore_ext.server.rounds.RoundKeeper
    targets : dict
        Chunk id -> the round the save holds it at (:func:`save_rounds`); None: every chunk
        as it is now.
    done : callable
        ``done(chunks, updater)`` once every chunk is copied: the file's ``chunks`` (chunk id
        -> info and state) and ``updater`` (None without optimizer, else ``{'states',
        'optimizer'}``), copies that later rounds leave alone.
    """

    def __init__(self, chunks, rounds, targets, done):
        self._chunks, self._rounds, self._done = chunks, rounds, done
        updater = rounds.updates.updater
        self._updater = updater
        # Copied now, before any round of the save's can be applied (see the docstring).
        self._optimizer = None if updater is None else copy.deepcopy(updater.optimizer)
        self._copied, self._states = {}, {}
        self._pending = {} if targets is None else {
            c: r for c, r in targets.items() if rounds.applied_rounds(c) < r}
        for chunk in chunks.ids():
            if chunk not in self._pending:
                self._copy(chunk)
        self._finish_if_done()

    def waiting(self):
        """The chunks that still wait for a round before their copy, sorted."""
        return sorted(self._pending)

    def set_learning_rate(self, lr):
        """The workers set the learning rate `lr` for a round before the save's."""
        if self._optimizer is not None:
            self._optimizer.set_learning_rate(lr)

    def applied(self, chunk):
        """The round keeper has just applied a round of `chunk`: copy it if that was the
        save's round - 1 (its applied rounds are the save's round now)."""
        if self._pending.get(chunk) == self._rounds.applied_rounds(chunk):
            del self._pending[chunk]
            self._copy(chunk)
            self._finish_if_done()

    def _copy(self, chunk):
        self._copied[chunk] = self._chunks.saved(chunk, self._rounds.chunk_state(chunk))
        updater = self._updater
        if updater is None:
            return
        if chunk in updater.states:
            self._states[chunk] = _copy_state(updater.states[chunk])
        # The chunk's update count at its round; the optimizer's num_update is their maximum.
        count = updater.optimizer._index_update_count.get(chunk)  # pylint: disable=W0212
        if count is not None:
            self._optimizer._index_update_count[chunk] = count  # pylint: disable=W0212
            self._optimizer.num_update = max(self._optimizer.num_update, count)

    def _finish_if_done(self):
        if not self._pending:
            updater = None if self._updater is None else {'states': self._states,
                                                          'optimizer': self._optimizer}
            self._done({c: self._copied[c] for c in sorted(self._copied)}, updater)


def _copy_state(state):
    """A copy of one chunk's optimizer state (None, an NDArray, or nested tuples and lists of
    those): an NDArray's in MXNet's engine, after the update that wrote it and before any
    later one."""
    if isinstance(state, (tuple, list)):
        return type(state)(_copy_state(s) for s in state)
    if isinstance(state, mx.nd.NDArray):
        return state.copy()
    return copy.deepcopy(state)
