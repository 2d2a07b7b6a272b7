"""Periodic checkpoints of a ``DelayedTrainer`` without code in the training loop, and
resuming from the newest one.

``DelayedTrainer(..., checkpoint_dir=DIR, checkpoint_every=N, keep_checkpoints=K)`` (or
``MXDELAY_CHECKPOINT_DIR``, ``MXDELAY_CHECKPOINT_EVERY``, ``MXDELAY_KEEP_CHECKPOINTS``, which
``mxdelay-launch --checkpoint-dir DIR --checkpoint-every N`` sets for every worker):

- **Resume**, when the script first reads ``trainer.resumed_step`` (or, failing that, at its
  first step): every worker loads the newest complete checkpoint of DIR
  (:mod:`mxdelay.checkpoint_dir`) with ``load_states``. Worker 0 lists them and the others
  follow its list through the vote, so that all load the same one; a checkpoint whose load
  is refused (a damaged part: nothing changes then) is skipped for the next older. With
  none, the job starts at step 0 and says so. ``resumed_step`` is the step counter then: the
  script skips that many batches, and training continues bit for bit as if it had never
  stopped after that checkpoint.
- **Save**, on every worker, at the first step counter at or after each multiple of N
  where the worker waits for the servers anyway: before a step that follows a warm-up
  step, or before a delayed step that applies the pull issued by the step before it (which
  waits for every round pushed so far); a worker in ``join`` saves at such a counter too,
  before its vote there, whether it fills the others' rounds or not. The files are those of
  ``save_states``, named ``DIR/step-<counter>``: the state before that step. No collective,
  and no wait for the servers: each worker has MXNet's engine copy its arrays to host
  memory after its queued work (:class:`~kvstore_ext.checkpoint.host_copies.HostCopies`); worker 0 also
  has the servers copy theirs (:meth:`StoreCheckpoint.save_in_background
  <kvstore_ext.worker.store_checkpoint.StoreCheckpoint.save_in_background>`: each server
  copies each chunk once the rounds before the counter are applied, and none after it can
  complete before worker 0 pushes again). Threads (at a lower CPU priority) then write the
  files while training goes on, each part followed by its sha256
  (:mod:`kvstore_ext.checkpoint.background`); worker 0's thread waits for the servers' and
  the other workers' and writes the kvstore index, then the index, last, with every
  part's sha256, which makes the checkpoint complete, and deletes all but the newest K up
  to it. A save first waits for the previous save's thread (a warning says how long): one
  copy of the state at a time. Its id is ``<token>-<counter>``, the token worker 0's, shared
  at the resume: no vote per save. A worker whose script ends without ``join`` (the store
  fills the others' rounds at exit) leaves, in place of its part of each save due
  meanwhile, why it cannot write one: worker 0 gives those checkpoints up at once.

Every worker must use the same settings (the launcher and the environment give them all
the same). A non-distributed kvstore has no servers' part and is refused.
"""
import concurrent.futures
import logging
import os
import time

from kvstore_ext import env
from kvstore_ext.checkpoint import background, files
from kvstore_ext.checks import check_int, check_path
from . import checkpoint_dir, worker_state

__all__ = ['create', 'AutoSave', 'NoAutoSave']

_LOG = logging.getLogger(__name__)

#: How long worker 0's thread waits for another worker's or a server's file of a save before
#: it gives the checkpoint up (it stays incomplete): that process has died or sees another
#: folder.
PART_TIMEOUT = 600.0
_RESUME = 'resume: '
_CANDIDATES = 16   # the newest complete checkpoints tried, at most
_NOTICED = 0.1     # seconds: a save's wait for the previous one that is worth a warning
_LEFT = ('worker %d ended its training script at step %d without trainer.join() and fills the '
         "other workers' rounds until they end: no checkpoint after that step can hold its "
         'state. With uneven data and periodic checkpoints, call trainer.join() on every '
         'worker at the end of every epoch')


def create(trainer, mode, params, is_dist_delay, directory=None, every=None, keep=None):
    """The trainer's periodic checkpoints: an :class:`AutoSave`, or :class:`NoAutoSave`
    when neither `directory` nor ``MXDELAY_CHECKPOINT_DIR`` names a folder. `trainer` is
    asked through its public methods; `mode()` returns its mode (creating the kvstore, the
    delayed update of ``'dist_delay'``) and `params` are its Parameters.

    Arguments win over the environment.

    Raises
    ------
    TypeError, ValueError
        For a bad setting (naming the argument or variable, its value and the fix), or a
        folder given for a kvstore other than ``'dist_delay'``.
    """
    source = 'checkpoint_dir'
    if directory is None and env.get('MXDELAY_CHECKPOINT_DIR'):
        directory, source = env.get('MXDELAY_CHECKPOINT_DIR'), 'MXDELAY_CHECKPOINT_DIR'
    if directory is None:
        for name, value in (('checkpoint_every', every), ('keep_checkpoints', keep)):
            if value is not None:
                raise ValueError('%s=%r needs checkpoint_dir, the folder of the checkpoints; '
                                 'pass checkpoint_dir=... or drop %s' % (name, value, name))
        return NoAutoSave()
    directory = os.path.abspath(check_path(source, directory))  # the servers write there too
    if not is_dist_delay:
        raise ValueError("%s=%r needs kvstore='dist_delay': a non-distributed kvstore has no "
                         'servers to checkpoint. Save with net.save_parameters and '
                         'trainer.save_states yourself, or train distributed' % (source, directory))
    if every is None:
        every = env.get_int('MXDELAY_CHECKPOINT_EVERY')
        if every is None:
            raise ValueError('%s=%r needs checkpoint_every=N, the steps between two '
                             'checkpoints (or MXDELAY_CHECKPOINT_EVERY=N)' % (source, directory))
    every = check_int('checkpoint_every', every, 1, 'e.g. checkpoint_every=500')
    keep = check_int('keep_checkpoints', env.get_int('MXDELAY_KEEP_CHECKPOINTS')
                     if keep is None else keep, 1, 'e.g. keep_checkpoints=2')
    return AutoSave(trainer, mode, params, directory, every, keep)


class NoAutoSave:
    """No periodic checkpoints: every hook does nothing, and the trainer never resumes."""

    resumed_step = 0

    def before_step(self):
        """Resume or save if due; return True to skip this step (never here)."""
        return False

    def before_round(self):
        """Save if a save is due at a counter where ``join`` votes (never here)."""

    @staticmethod
    def resumed_codecs():
        """The codecs a resume will keep (never here: None)."""
        return None


class AutoSave:
    """Periodic checkpoints of `trainer` in `directory` every `every` steps, the newest
    `keep` kept (see the module docstring). Made by :func:`create`, which checks them."""

    def __init__(self, trainer, mode, params, directory, every, keep):
        self._trainer = trainer
        self._mode, self._params = mode, params
        self.directory, self.every, self.keep = directory, every, keep
        self._resumed = None   # the step resumed at, once resumed (0: started over)
        self._saved = None     # the step counter of the last save (or of the resume)
        self._token = None     # worker 0's, shared at the resume: save ids are token-step
        self._busy = False     # resuming or saving: a join inside must not save
        self._writer = None    # the thread writing the last save's files
        self._left = None      # the step at which the script ended without join (_leaving)

    def resumed_codecs(self):
        """The codecs of the newest complete checkpoint (``worker_state.codecs_of``), which
        ``compression_params='auto'`` keeps so that its resume finds the state of the codecs
        it saved (a new choice would make every checkpoint's load refuse it); None: no
        checkpoint, or one from before its index named them (measure and choose)."""
        newest = checkpoint_dir.newest_complete(self.directory)
        return worker_state.index_codecs(newest[1]) if newest else None

    @property
    def resumed_step(self):
        """The step resumed at (0: the job started over); resumes first if needed."""
        if self._resumed is None:
            self._resume()
        return self._resumed

    def before_step(self):
        """Save if a save is due before this step (:meth:`_due`). Or resume, if the script
        has not read ``resumed_step``, and return True if it did now from a checkpoint:
        this step's gradient was computed with the weights from before the resume, and
        must not be pushed."""
        if self._resumed is not None:
            self.before_round()
            return False
        if not self._resume():
            return False
        _LOG.warning('DelayedTrainer: resumed at step %d in the first step(); that step\'s '
                     'gradient, computed with the weights from before the resume, is dropped. '
                     'Read trainer.resumed_step before the first forward pass to resume there '
                     '(and skip that many batches)', self._resumed)
        return True

    def before_round(self):
        """Save if a save is due at this counter (:meth:`_due`): before a step, or where
        this worker votes in ``join`` (filling the others' rounds or not)."""
        step = self._trainer.schedule.step
        if not self._due(step):
            return
        self._busy = True
        try:
            self._save(step)
        finally:
            self._busy = False
        self._saved = step

    def wait(self):
        """Wait until the last save's files are written."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None

    # -- resuming ---------------------------------------------------------------------------
    def _resume(self):
        """Load the newest complete checkpoint that loads; return its step (0: none)."""
        trainer = self._trainer
        missing = [p.name for p in self._params if any(d <= 0 for d in p.shape or (0,))]
        if missing:
            raise ValueError('DelayedTrainer cannot resume from %s before the shapes of %s are '
                             'known: run one forward pass (e.g. net(x)) before reading '
                             'trainer.resumed_step or the first step' % (self.directory,
                                                                         ', '.join(missing)))
        os.makedirs(self.directory, exist_ok=True)
        mode = self._mode()   # creates the kvstore
        mode.parts.uneven.before_leaving_round = self._leaving
        self._busy = True
        try:
            self._resumed = 0
            refused = []
            for step in self._candidates(mode):
                path = checkpoint_dir.path_of(self.directory, step)
                try:
                    trainer.load_states(path)
                except ValueError as err:   # on every worker alike (the load's vote)
                    _LOG.warning('DelayedTrainer: cannot resume from %s (%s); trying the '
                                 'next older checkpoint', path, err)
                    refused.append(str(err))
                    continue
                self._resumed = step
                _LOG.info('DelayedTrainer: resumed from %s at step %d', path, step)
                break
            else:
                if refused:
                    # Starting over would soon prune them, or be pruned by them (newer steps).
                    raise ValueError('%s holds checkpoints, none of which this job can resume '
                                     'from: %s. Use another checkpoint_dir, or delete them'
                                     % (self.directory, '; '.join(refused)))
                _LOG.info('DelayedTrainer: no complete checkpoint in %s: starting at step %d',
                          self.directory, trainer.schedule.step)
        finally:
            self._busy = False
        self._saved = trainer.schedule.step
        return self._resumed

    def _candidates(self, mode):
        """Worker 0's complete checkpoints, newest first, on every worker, and a fresh token
        of worker 0's (the vote carries rank 0's text to all, as it carries a save's id):
        the saves of this run are ``<token>-<step>``, no further vote needed."""
        mine = None
        if mode.rank == 0:
            mine = '%s%s %s' % (_RESUME, files.new_save_id(), ','.join(
                str(step) for step, _ in checkpoint_dir.complete(self.directory)[:_CANDIDATES]))
        votes = mode.parts.job.agree(mine)
        if len(votes) != 1 or votes[0][0] != 0 or not votes[0][1].startswith(_RESUME):
            raise RuntimeError('the workers could not agree on a checkpoint to resume from '
                               '(votes %r)' % (votes,))
        self._token, listed = votes[0][1][len(_RESUME):].split(' ')
        return [int(step) for step in listed.split(',')] if listed else []

    # -- saving -----------------------------------------------------------------------------
    def _due(self, step):
        """Whether a save falls at counter `step` (before step `step`, or at a vote of
        ``join``): the first counter at or after each multiple of the interval where the
        worker waits for the servers anyway: after a synchronous step, or before a delayed
        step that applies the pull issued by the step before, which waits for every round
        pushed so far. The save's wait for this worker's rounds waits for nothing more."""
        if self._busy or self._resumed is None:
            return False
        if step < (self._saved // self.every + 1) * self.every:
            return False
        schedule = self._trainer.schedule
        return schedule.is_synchronous(step - 1) or schedule.applies_pull(step)

    def _save(self, step):
        trainer = self._trainer
        self._wait_for_previous(step)
        mode = self._mode()
        fname = checkpoint_dir.path_of(self.directory, step)
        # An earlier run that reached this step but not its index left these; each goes
        # before this save writes anything, so that no index of it looks complete meanwhile.
        part = files.worker_file(fname, mode.rank)
        stale = [part]
        if mode.rank == 0:
            stale += [fname, files.kvstore_file(fname)]
        for path in stale:
            if os.path.exists(path):
                os.unlink(path)
        background.remove(part)
        save_id = '%s-%d' % (self._token, step)
        write_kvstore = None
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            # The copy to host memory overlaps the servers' copy.
            body = pool.submit(self._snapshot)
            if mode.rank == 0:
                write_kvstore = mode.parts.checkpoint.save_in_background(
                    files.kvstore_file(fname), save_id)
            body = body.result()
        schedule = trainer.schedule.state_dict()
        self._writer = background.start_writer(
            self._write, 'mxdelay-autosave', fname, mode.rank, mode.num_workers, body, save_id,
            write_kvstore, schedule, mode.codecs())

    def _wait_for_previous(self, step):
        """Wait until the previous save's thread is done (saves never overlap: one copy of
        the state at a time), and say so if that took a noticeable time: training stood
        still meanwhile."""
        start = time.monotonic()
        self.wait()
        waited = time.monotonic() - start
        if waited >= _NOTICED:
            _LOG.warning('DelayedTrainer: the checkpoint of step %d waited %.1f s for the '
                         'previous one, still being written (saves never overlap: one copy of '
                         'the state at a time); raise checkpoint_every (now %d) if this recurs',
                         step, waited, self.every)

    def _leaving(self, step):
        """Before each round this worker fills at exit (its script ended without ``join``,
        :meth:`UnevenData.leave <kvstore_ext.worker.uneven.UnevenData.leave>`): a save due
        there cannot hold its state, which stays at its last step. Leave that as its part's
        failure (:func:`background.fail`): worker 0 gives that checkpoint up at once, naming
        the cause, instead of waiting :data:`PART_TIMEOUT` for the part."""
        if not self._due(step):
            return
        rank = self._mode().rank
        if self._left is None:
            self._left = self._trainer.schedule.step
            _LOG.warning('DelayedTrainer: worker %d ended its training script at step %d '
                         'without trainer.join() while the others go on: no checkpoint after '
                         'it will be complete', rank, self._left)
        background.fail(files.worker_file(checkpoint_dir.path_of(self.directory, step), rank),
                        '%s-%d' % (self._token, step), _LEFT % (rank, self._left))
        self._saved = step

    def _snapshot(self):
        """The worker file's body, encoded (:func:`files.encode`: every field a copy, the
        optimizer's counters and scheduler included; the arrays filled by MXNet's engine),
        and the copies to wait for before writing it: training goes on while the thread
        writes it."""
        arrays = []
        body, copies = self._mode().snapshot()
        return files.encode(body, arrays), arrays, copies

    def _write(self, fname, rank, num_workers, body, save_id, write_kvstore, schedule, codecs):
        """The thread: this worker's file; on worker 0 then the kvstore index, once the
        servers' files are written, and the index, once every worker's is, and the pruning."""
        path = files.worker_file(fname, rank)
        try:
            def write():
                body[2].wait()   # the engine's copies of the arrays
                return files.write_encoded(path, files.WORKER, body[0], body[1], save_id)
            if rank != 0:
                # For worker 0, which would otherwise read the whole file to hash it again
                # (the load checks every part's sha256 against the index anyway).
                background.leave(path, save_id, write)
                return
            parts = {'worker0': write(), 'kvstore': write_kvstore(PART_TIMEOUT)}
            for other in range(1, num_workers):
                parts['worker%d' % other] = background.wait(files.worker_file(fname, other),
                                                            save_id, PART_TIMEOUT)
            worker_state.write_index(fname, num_workers, schedule, save_id, parts, codecs)
            _LOG.info('DelayedTrainer: checkpoint of step %d written (%s)', schedule['step'],
                      fname)
            checkpoint_dir.prune(self.directory, self.keep, schedule['step'])
        except Exception:  # pylint: disable=broad-except
            # Training goes on; this checkpoint stays incomplete, so no resume will use it.
            _LOG.exception('DelayedTrainer: the checkpoint %s could not be written', fname)
