"""A server's part of a checkpoint: ``SAVE`` and ``LOAD``, validated before anything changes.

A server writes and reads only its own file of a checkpoint, ``<index>.server<j>``
(:func:`kvstore_ext.protocol.commands.check_paths`), in the formats of
:mod:`kvstore_ext.checkpoint.files`. ``LOAD`` comes twice (docs/design.md §6.3): with
``check_only`` the server reads and validates every field the apply uses and keeps what it
validated; the apply then takes those very objects (a body naming another save is read and
validated afresh). Any failure of the check is a ``ValueError`` naming the file, which the
workers turn into the collective refusal. ``SAVE`` with ``background`` (a periodic
checkpoint's, docs/design.md §6.4) answers at once; each chunk is copied to host memory at
the save's round (:mod:`kvstore_ext.server.save_copy`), then a thread writes the file and its
sha256 beside it, and the next ``SAVE`` or ``LOAD`` waits for it (and is refused while
chunks wait for their round).
"""
import json
import logging

import numpy as np

import mxnet as mx

from kvstore_ext import env
from kvstore_ext.checkpoint import background, files
from kvstore_ext.optim.optimizers import flatten_state, format_differences
from kvstore_ext.protocol import commands, counter
from kvstore_ext.protocol.commands import field
from kvstore_ext.server import agreement, save_copy
from kvstore_ext.server.job import ALLOW_PICKLE

__all__ = ['ServerCheckpoint']

_LOG = logging.getLogger(__name__)

#: What a LOAD body holds besides the files it names: the bodies of a check and of its
#: apply name the same files of the same save when they agree on everything else.
_NOT_THE_FILES = ('check_only', 'optimizer', 'seq', 'rank')


class ServerCheckpoint(object):
    """One server's ``save`` and ``load`` commands.

    Parameters
    ----------
    job : kvstore_ext.server.job.Job
    chunks : kvstore_ext.server.registry.ChunkRegistry
    rounds : kvstore_ext.server.rounds.RoundKeeper
    num_servers : callable
        ``num_servers()``: the job's number of servers (one path each).
    """

    def __init__(self, job, chunks, rounds, num_servers):
        self._job = job
        self._chunks = chunks
        self._rounds = rounds
        self._num_servers = num_servers
        self._validated = None         # (LOAD body key, its validated file), until applied
        self._writer = None            # the thread of a save in the background
        self._copy = None              # a save in the background whose chunks wait for rounds

    def save(self, body):
        """The ``save`` command: write this server's file; reply with its sha256. With
        ``background``, reply at once: each chunk is copied to host memory at the save's
        round (:mod:`kvstore_ext.server.save_copy`: at once, or when its round before is
        applied, if the body names the rounds), then a thread writes the file, then its
        sha256 beside it (:mod:`kvstore_ext.checkpoint.background`)."""
        job, rounds = self._job, self._rounds
        path = commands.check_paths(body, job.server_rank, self._num_servers())
        save_id = field(body, 'save_id', str, optional=True)
        in_background = field(body, 'background', bool, optional=True, default=False)
        if in_background and save_id is None:
            raise ValueError('a save in the background needs a save_id (its sha256 file '
                             'names it)')
        targets = save_copy.save_rounds(body, self._chunks, rounds)
        if targets is not None and not in_background:
            raise ValueError('a save names its rounds only in the background (a save that '
                             'waits writes the state after every round pushed)')
        self._check_no_copy('save %s' % path)
        if self._writer is not None and self._writer.is_alive():
            _LOG.warning('server %d: the save of %s waits for the previous one, still being '
                         'written (saves never overlap: one copy of the state at a time)',
                         job.server_rank, path)
        self.wait()
        if targets is None and rounds.in_flight():
            raise ValueError('cannot save server %d while rounds are in flight; save after a '
                             'barrier' % job.server_rank)
        reply = {'path': path, 'chunks': len(self._chunks)}
        written = []

        def copied(chunks, updater):
            # Every array a copy: the state at the save's rounds, whatever rounds are
            # applied while a thread writes it.
            self._copy = rounds.after_round = None
            arrays = []
            tree = files.encode({'server': job.server_rank, 'num_workers': job.num_workers,
                                 'chunks': chunks, 'updater': updater}, arrays)
            if in_background:
                self._writer = background.start_writer(self._write, 'mxdelay-server-save',
                                                       path, tree, arrays, save_id)
            else:
                written.append(files.write_encoded(path, files.SERVER, tree, arrays, save_id))

        copy = save_copy.SaveCopy(self._chunks, rounds, targets, copied)
        if copy.waiting():
            self._copy = (copy, path, save_id)
            rounds.after_round = self._applied
        return dict(reply, sha256=written[0]) if written else reply

    def _applied(self, chunk):
        # The round keeper applied a round of `chunk` while a save waits for rounds. A
        # failure is the save's (left for worker 0, which then gives that checkpoint up),
        # not the round's, which would stop the server.
        copy, path, save_id = self._copy
        try:
            copy.applied(chunk)
        except Exception as err:  # pylint: disable=broad-except
            self._copy = self._rounds.after_round = None
            _LOG.exception('server %d: the copy of %s failed', self._job.server_rank, path)
            background.fail(path, save_id, '%s: %s' % (type(err).__name__, err))

    def set_hyper(self, body):
        """A ``set_hyper`` (`body`, checked and applied) while a save waits for rounds
        changes its copy of the optimizer too: its sender waited for its own pushes, so it
        has not pushed the round that a waiting chunk misses, which comes before the save's
        round; the learning rate is the one the save's state holds."""
        if self._copy is not None and body.get('lr') is not None:
            self._copy[0].set_learning_rate(float(body['lr']))

    def _check_no_copy(self, what):
        """Refuse `what` while a save in the background still waits for rounds: it would
        change (or copy) the state that save has not copied yet."""
        if self._copy is not None:
            raise ValueError('server %d cannot %s: the previous save in the background still '
                             'waits for rounds before it copies chunks %s (the save that '
                             'sent it must wait for its files first)'
                             % (self._job.server_rank, what, self._copy[0].waiting()))

    def wait(self):
        """Wait until the file of a ``save`` in the background is written."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None

    def _write(self, path, tree, arrays, save_id):
        # The thread of a save in the background: its failure is logged, and left for the
        # worker that writes the index, which then leaves the checkpoint incomplete.
        try:
            background.leave(path, save_id, lambda: files.write_encoded(
                path, files.SERVER, tree, arrays, save_id))
        except Exception:  # pylint: disable=broad-except
            _LOG.exception('server %d: %s could not be written', self._job.server_rank, path)

    def load(self, body):
        """The ``load`` command: with ``check_only``, validate this server's file and keep
        what was validated; else replace the weights, rounds and optimizer state by it."""
        path = self._request(body)
        self._check_no_copy('load %s' % path)
        self.wait()   # a save in the background may still be writing this very file
        # The apply takes the very objects its check validated (not the file read again),
        # when the bodies name the same files of the same save.
        key = json.dumps({k: v for k, v in body.items() if k not in _NOT_THE_FILES},
                         sort_keys=True)
        if body.get('check_only'):
            self._validated = (key, self._validate(path, body))
            return {'path': path, 'valid': True}
        validated, self._validated = self._validated, None
        if validated is not None and validated[0] == key:
            state, states, optimizer = validated[1]
            self._check_optimizer(path, optimizer, body.get('optimizer'), warn=True)
        else:
            state, states, optimizer = self._validate(path, body)
        self._apply(state, states, optimizer)
        return {'path': path, 'chunks': len(state['chunks'])}

    def _request(self, body):
        """LOAD's `body`, every field checked; return this server's path."""
        path = commands.check_paths(body, self._job.server_rank, self._num_servers())
        version = field(body, 'version', int, optional=True, default=files.VERSION)
        if version not in (files.VERSION, files.LEGACY_VERSION):
            raise ValueError('command field \'version\' must be %d or %d, got %r'
                             % (files.VERSION, files.LEGACY_VERSION, version))
        for name in ('trusted', 'check_only'):
            field(body, name, bool, optional=True)
        field(body, 'optimizer', dict, optional=True)
        field(body, 'save_id', str, optional=True)
        digests = field(body, 'sha256', list, optional=True, default=[])
        if not all(isinstance(d, str) for d in digests):
            raise ValueError('command field \'sha256\' must list strings, got %.120r'
                             % (digests,))
        rounds = field(body, 'rounds', dict, optional=True, default={})
        for key in rounds:
            field(rounds, key, int, minimum=0)
        field(body, 'finish_rounds', int, minimum=0, optional=True)
        return path

    def _validate(self, path, body):
        """LOAD's check phase: read `path` and validate every field, changing nothing."""
        try:
            state, states, optimizer = _read(path, body, self._job.server_rank)
            self._upgrade_counter(path, state['chunks'])
            self._chunks.check_saved(path, state['chunks'])
            _check_rounds(path, state['chunks'], body)
            _check_chunks(path, state['chunks'], self._rounds.weight)
            _check_updater(path, state['chunks'], states, optimizer)
            self._check_optimizer(path, optimizer, body.get('optimizer'),
                                  warn=not body.get('check_only'))
        except ValueError:
            raise
        except Exception as err:  # pylint: disable=broad-except
            # Any failure of the check phase is a refusal naming the file (the workers turn
            # it into the collective ValueError), never an error that skips the vote.
            raise ValueError('%s cannot be loaded (%s: %s)' % (path, type(err).__name__, err)) \
                from None
        return state, states, optimizer

    def _apply(self, state, states, optimizer):
        # Validated: now replace the state.
        rounds = self._rounds
        if states is not None:
            # As Updater.set_states: the saved optimizer (if saved) and its states.
            updates = rounds.updates
            updates.install(optimizer or updates.optimizer)
            updates.updater.states = states
            updates.updater.states_synced = dict.fromkeys(states, False)
            # The saved job's rescale_grad, which the workers also restore (apply_states).
            self._job.rescale_grad = updates.optimizer.rescale_grad
        for chunk, saved in state['chunks'].items():
            rounds.restore_chunk(chunk, saved['weight'], saved['next_round'],
                                 saved.get('skipped', 0), saved.get('stype', 'default'),
                                 saved.get('model'))

    def _check_optimizer(self, path, saved, expected, warn):
        """Refuse a checkpoint whose optimizer `saved` is of another type than the workers'
        `expected`; with `warn`, log the hyper-parameters that the load will change."""
        differences = agreement.saved_optimizer_differences(path, saved, expected)
        if warn and differences:
            _LOG.warning('server %d: loading %s sets the optimizer\'s %s', self._job.server_rank,
                         path, format_differences(differences, 'the trainer', 'the checkpoint'))

    def _upgrade_counter(self, path, chunks):
        # A file of mxdelay before the counter's exchanged element (kvstore_ext.worker.finish).
        for chunk, saved in chunks.items():
            if chunk in self._chunks and self._chunks.is_counter(chunk) \
                    and isinstance(saved, dict):
                chunks[chunk] = counter.upgrade_saved(saved, self._chunks.size(chunk))
                if chunks[chunk] is not saved:
                    _LOG.info('%s: the finish counter of %d elements (saved before its '
                              'exchanged element) converted to %d', path, saved['size'],
                              chunks[chunk]['size'])


def _read(path, body, rank):
    """Server `rank`'s file `path` of a LOAD (`body`), validated as far as this file alone
    can be: ``(state, states, optimizer)`` with the updater's saved states and optimizer
    (None when saved without)."""
    if body.get('version', files.VERSION) == files.LEGACY_VERSION:
        # A pickle: only when the user asked for it (load_states(..., trusted=True)) and
        # this server's own environment allows it (a command alone may not make a
        # server unpickle a file: any peer can send one).
        if body.get('trusted') is not True:
            raise ValueError('%s would be a version-1 (pickled) server state, which is read '
                             'only with trusted=True' % path)
        if not env.get_bool(ALLOW_PICKLE):
            raise ValueError('%s would be a version-1 (pickled) server state: server %d '
                             'reads one only with %s=1 in its environment, besides '
                             'trusted=True (unpickling runs code). Start the job with '
                             '%s=1 (mxdelay-launch passes the environment on) to convert '
                             'a checkpoint you trust' % (path, rank, ALLOW_PICKLE,
                                                        ALLOW_PICKLE))
        state = files.read_pickle(path, files.SERVER)
        states, optimizer = files.legacy_updater(path, state.get('updater'))
    else:
        digests = body.get('sha256')
        state = files.read_archive(
            path, files.SERVER, body.get('save_id'),
            digests[rank] if isinstance(digests, list) and len(digests) > rank else None)
        saved = state.get('updater')
        if saved is not None and (not isinstance(saved, dict)
                                  or set(saved) != {'states', 'optimizer'}):
            raise ValueError('%s: field \'updater\' is not {states, optimizer}' % path)
        states, optimizer = (None, None) if saved is None else (saved['states'],
                                                               saved['optimizer'])
    if state.get('server') != rank:
        raise ValueError('%s holds the state of server %r, not of server %d'
                         % (path, state.get('server'), rank))
    if not isinstance(state.get('chunks'), dict):
        raise ValueError('%s: field \'chunks\' is missing or not a dict' % path)
    return state, states, optimizer


def _check_rounds(path, chunks, body):
    # The kvstore index (the workers' round counters) and this file must be of one save.
    if 'rounds' not in body:
        return
    for chunk, saved in sorted(chunks.items()):
        index = saved['param_index']
        expected = (body.get('finish_rounds') if index == commands.FINISH_KEY
                    else body['rounds'].get(str(index)))
        if expected != saved['next_round']:
            raise ValueError('%s: chunk %d (parameter %r) was saved at round %s, but the '
                             'kvstore index says round %s: the files are of different saves'
                             % (path, chunk, saved.get('name'), saved['next_round'],
                                expected))


def _check_chunks(path, chunks, held_weight):
    """Every chunk field the apply uses, checked: its weight (size as registered, a float
    dtype, the dtype and shape ``held_weight(chunk)`` has), rounds and storage type."""
    for chunk, saved in sorted(chunks.items()):
        where = '%s: chunk %d' % (path, chunk)
        weight = saved.get('weight')
        if weight is not None:
            if not isinstance(weight, np.ndarray) or weight.dtype.kind != 'f':
                raise ValueError('%s: field \'weight\' is %s, not a float array'
                                 % (where, type(weight).__name__ if not isinstance(
                                     weight, np.ndarray) else weight.dtype))
            # check_saved has compared the saved size with the registered one
            if weight.size != saved['size']:
                raise ValueError('%s: field \'weight\' has %d elements, the registered '
                                 'chunk %d' % (where, weight.size, saved['size']))
            held = held_weight(chunk)
            if held is not None and (np.dtype(held.dtype) != weight.dtype
                                     or tuple(held.shape) != weight.shape):
                raise ValueError('%s: field \'weight\' is %s %s, this server holds %s %s '
                                 '(no silent cast)' % (where, weight.dtype, weight.shape,
                                                       np.dtype(held.dtype), held.shape))
        for name in ('next_round', 'skipped'):
            value = saved.get(name, 0)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError('%s: field %r must be an integer >= 0, got %.60r'
                                 % (where, name, value))
        if saved.get('stype', 'default') not in ('default', 'row_sparse'):
            raise ValueError('%s: field \'stype\' is %.60r' % (where, saved.get('stype')))


def _check_updater(path, chunks, states, optimizer):
    """The saved optimizer, and the updater's `states` (known chunks, arrays of the
    weight's shape)."""
    if optimizer is not None and not isinstance(optimizer, mx.optimizer.Optimizer):
        raise ValueError('%s: the saved optimizer is a %s, not an mx.optimizer.Optimizer'
                         % (path, type(optimizer).__name__))
    if states is None:
        return
    if not isinstance(states, dict):
        raise ValueError('%s: the updater\'s states are a %s, not a dict by chunk'
                         % (path, type(states).__name__))
    for chunk, state in sorted(states.items(), key=lambda item: str(item[0])):
        if chunk not in chunks:
            raise ValueError('%s: the updater holds a state of chunk %r, which the file '
                             'does not hold' % (path, chunk))
        weight = chunks[chunk].get('weight')
        try:
            arrays = flatten_state(state)
        except TypeError as err:
            raise ValueError('%s: chunk %d\'s optimizer state: %s' % (path, chunk, err)) \
                from None
        for array in arrays:
            if weight is not None and tuple(array.shape) != weight.shape:
                raise ValueError('%s: chunk %d\'s optimizer state has an array of shape %s, '
                                 'its weight %s' % (path, chunk, tuple(array.shape),
                                                    weight.shape))
