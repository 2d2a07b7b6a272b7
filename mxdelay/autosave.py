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
  where the job waits for the servers anyway: before a step that follows a warm-up step,
  or before a delayed step that applies the pull issued by the step before it (which
  waits for every round pushed so far: the save's ``join`` waits for nothing more); or
  after a ``join`` that ends at such a counter. The files are those of ``save_states``,
  named ``DIR/step-<counter>``: the state before that step. The part that needs the job to stand
  still is synchronous: a ``join`` (after a step), a copy of the worker's state to host
  memory, and the servers' files (they write them at once: no round may be in flight). The
  worker's own file is written by a thread (at a lower CPU priority) while training goes
  on, then its sha256 beside it (``.sha256``); worker 0's thread waits for every worker's
  sha256 and writes the index, last, with every part's sha256, which makes the checkpoint
  complete, and deletes all but the newest K. A save first
  waits for the previous save's thread. Its id is ``<token>-<counter>``, the token worker
  0's, shared at the resume: no vote per save.

A save after a ``join`` skips its own ``join``: a worker whose ``join`` was filling rounds
returns from it at the round where the others, having reached the counter by their steps,
joined to save; a second ``join`` would wait for a round nobody else pushes.
Every worker must use the same settings (the launcher and the environment give them all
the same). A non-distributed kvstore has no servers' part and is refused.
"""
import concurrent.futures
import logging
import os
import threading
import time

from kvstore_ext import env
from kvstore_ext.checkpoint import files
from kvstore_ext.checks import check_int, check_path
from . import checkpoint_dir

__all__ = ['create', 'AutoSave', 'NoAutoSave']

_LOG = logging.getLogger(__name__)

#: How long worker 0's thread waits for another worker's file of a save before it gives the
#: checkpoint up (it stays incomplete): that worker has died or sees another folder.
PART_TIMEOUT = 600.0
_POLL_SECONDS = 0.02
#: The writing thread's nice value (:func:`_lower_priority`).
WRITER_NICENESS = 10
_RESUME = 'resume: '
_CANDIDATES = 16   # the newest complete checkpoints tried, at most


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

    def after_join(self):
        """Save if a save is due after this ``join`` (never here)."""


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
        self._busy = False     # resuming or saving: the trainer's join must not save
        self._writer = None    # the thread writing the last save's files

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
            self._save_if_due(join=True)
            return False
        if not self._resume():
            return False
        _LOG.warning('DelayedTrainer: resumed at step %d in the first step(); that step\'s '
                     'gradient, computed with the weights from before the resume, is dropped. '
                     'Read trainer.resumed_step before the first forward pass to resume there '
                     '(and skip that many batches)', self._resumed)
        return True

    def after_join(self):
        """Save if a save is due after this ``join`` (:meth:`_due`)."""
        self._save_if_due(join=False)

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
        """Whether a save falls at counter `step` (before step `step`, or after a join that
        ends there): the first counter at or after each multiple of the interval where the
        servers are waited for anyway: after a synchronous step, or before a delayed step
        that applies the pull issued by the step before, which waits for every round
        pushed so far. The save's join then waits for nothing more."""
        if self._busy or self._resumed is None:
            return False
        if step < (self._saved // self.every + 1) * self.every:
            return False
        schedule = self._trainer.schedule
        return schedule.is_synchronous(step - 1) or schedule.applies_pull(step)

    def _save_if_due(self, join):
        step = self._trainer.schedule.step
        if not self._due(step):
            return
        self._busy = True
        try:
            self._save(step, join)
        finally:
            self._busy = False
        self._saved = step

    def _save(self, step, join):
        trainer = self._trainer
        self.wait()
        if join:
            trainer.join()   # every worker at the same round (see the module docstring)
        mode = self._mode()
        fname = checkpoint_dir.path_of(self.directory, step)
        # An earlier run that reached this step but not its index left these; each goes
        # before the collectives below, so that worker 0 never takes one for this save's.
        stale = [files.worker_file(fname, mode.rank),
                 _digest_file(files.worker_file(fname, mode.rank))]
        if mode.rank == 0:
            stale += [fname, files.kvstore_file(fname)]
        for path in stale:
            if os.path.exists(path):
                os.unlink(path)
        save_id = '%s-%d' % (self._token, step)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            # The copy to host memory overlaps the servers' write: both only read.
            body = pool.submit(self._snapshot)
            kvstore_digest = mode.parts.checkpoint.save(files.kvstore_file(fname), save_id)
            body = body.result()
        schedule = trainer.schedule.state_dict()
        self._writer = threading.Thread(
            target=self._write, name='mxdelay-autosave',
            args=(fname, mode.rank, mode.num_workers, body, save_id, kvstore_digest, schedule))
        self._writer.start()

    def _snapshot(self):
        """The worker file's body, every field a copy (the optimizer's counters and
        scheduler included): training goes on while the thread writes it."""
        arrays = []
        tree = files.encode(self._mode().snapshot(), arrays)   # arrays: copies
        return files.decode(tree, arrays.__getitem__)

    def _write(self, fname, rank, num_workers, body, save_id, kvstore_digest, schedule):
        """The thread: this worker's file; on worker 0 then the index and the pruning."""
        _lower_priority()
        try:
            path = files.worker_file(fname, rank)
            digest = files.write_archive(path, files.WORKER, body, save_id)
            if rank != 0:
                # For worker 0, which would otherwise read the whole file to hash it again
                # (the load checks every part's sha256 against the index anyway).
                files.atomic_write(_digest_file(path), digest.encode('ascii'))
                return
            parts = {'worker0': digest, 'kvstore': kvstore_digest}
            for other in range(1, num_workers):
                parts['worker%d' % other] = _read_digest(
                    files.worker_file(fname, other))
            # The index of DelayedTrainer.save_states (mxdelay.worker_state.write).
            files.write_json(fname, files.TRAINER_INDEX, {
                'num_workers': num_workers, 'schedule': schedule,
                'kvstore': os.path.basename(files.kvstore_file(fname)),
                'save_id': save_id, 'parts': parts})
            _LOG.info('DelayedTrainer: checkpoint of step %d written (%s)', schedule['step'],
                      fname)
            checkpoint_dir.prune(self.directory, self.keep)
        except Exception:  # pylint: disable=broad-except
            # Training goes on; this checkpoint stays incomplete, so no resume will use it.
            _LOG.exception('DelayedTrainer: the checkpoint %s could not be written', fname)


def _digest_file(path):
    """Where the writer of the part `path` leaves its sha256 for worker 0."""
    return path + '.sha256'


def _read_digest(path):
    """The sha256 of another worker's part `path`, once it has written both (atomically)."""
    digest_file = _digest_file(path)
    deadline = time.monotonic() + PART_TIMEOUT
    while not os.path.exists(digest_file):
        if time.monotonic() > deadline:
            raise TimeoutError('%s did not appear within %g s: that worker stopped, or writes '
                               'to another folder (the checkpoint folder must be shared by '
                               'every worker and server)' % (digest_file, PART_TIMEOUT))
        time.sleep(_POLL_SECONDS)
    with open(digest_file, encoding='ascii') as src:
        return src.read()


def _lower_priority():
    """Give the calling thread (Linux: its own nice value) a lower CPU priority than
    training's threads: on a busy machine the save's hashing and compression take the
    cycles training leaves."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICENESS)
    except (AttributeError, OSError):   # not Linux, or not allowed: the default priority
        pass
