"""A worker's timeline: record MXNet's profiler trace around a few steps.

Built on MXNet's own profiler, which timestamps every engine operation and every C API
call (Chrome trace JSON, viewable in chrome://tracing or Perfetto): :func:`recording` turns
it on around a few steps (off by default; nothing is recorded outside the block, and the
steps inside pay only MXNet's per-operation timestamps). Given the trainer, it also marks
per parameter when its gradient, push and pull were done: it is the trainer's
:class:`mxdelay.observer.StepObserver` for the block. :mod:`mxdelay.trace` reads the trace
back (and needs no MXNet); its functions are re-exported here.

Without code changes: with ``MXDELAY_TIMELINE=PREFIX`` set, every
:class:`mxdelay.DelayedTrainer` records its first ``MXDELAY_TIMELINE_STEPS`` steps (with the
per-parameter marks) into ``PREFIX.rank<i>.json``, from its second step (:func:`record_from_env`), with what
``python -m mxdelay.trace`` needs to summarize it (keys per step, schedule) in the trace's
``otherData``.
"""
import atexit
import concurrent.futures
import contextlib
import json
import logging
import os

import mxnet as mx
from mxnet.base import _LIB, check_call

from kvstore_ext import env

from .observer import StepObserver
from .trace import MARKER_DOMAIN, format_table, parameter_rows, summarize, totals

__all__ = ['recording', 'record_from_env', 'summarize', 'parameter_rows', 'totals', 'format_table']

_LOG = logging.getLogger(__name__)


@contextlib.contextmanager
def recording(path, trainer=None):
    """Record MXNet's profiler trace of the enclosed steps into `path` (Chrome trace JSON).

    MXNet's profiler writes a complete trace only once per process (it cannot be restarted
    after that), so record one window: e.g. the last warm-up steps and the first delayed
    ones. Operators and C API calls are recorded (the pull calls tell which step issued a
    pull); memory is not.

    Parameters
    ----------
    path : str
        Output file; written when the block ends (after all queued work has finished).
    trainer : mxdelay.DelayedTrainer, optional
        Also record, per step and per parameter, when backward wrote the gradient, when the
        push's round was acknowledged, and when a pull arrived and was applied (instant
        markers named after the parameter; read them with :func:`parameter_rows`). MXNet's
        profiler does not say which parameter a push or pull operation belongs to; these
        markers do. Each is taken by a waiting thread when its array becomes ready (within
        about 0.3 ms on an idle core, a few ms on a busy machine), and never before the mark
        of its cause (gradient, push acknowledged, pull received, pull applied).
    """
    mx.profiler.set_config(profile_symbolic=True, profile_imperative=True, profile_api=True,
                           profile_memory=False, aggregate_stats=False, filename=path)
    # A thread per wait that a step may have outstanding: a gradient, a push and a pull
    # per parameter (and the previous step's).
    watcher = (_ParameterWatcher(8 + 6 * len(trainer.priority_order())) if trainer is not None
               else None)
    mx.profiler.set_state('run')
    if watcher is not None:
        trainer.set_observer(watcher)
    try:
        yield path
    finally:
        mx.nd.waitall()
        if watcher is not None:
            trainer.set_observer(None)
            watcher.close()
        mx.profiler.set_state('stop')
        mx.profiler.dump()
        _LOG.info('timeline: profiler trace written to %s', path)


class _ParameterWatcher(StepObserver):
    """Marks in the profiler trace when arrays become ready, from waiting threads.

    A wait for reading returns once every write issued before it has finished (backward
    wrote a gradient, a pull filled its output, a copy applied it); a wait for writing also
    waits for the reads (a push holds its send buffer until its round is acknowledged).
    The threads block in MXNet's engine (the GIL is released); a pool large enough for a
    step's waits keeps every mark on time.
    """

    def __init__(self, threads):
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, 'mxdelay-timeline')
        self._last = {}    # (event, parameter) -> the future of its last mark
        self._domain = mx.profiler.Domain(MARKER_DOMAIN)

    # The trainer's events, each marked once its array is ready, after its cause's mark.
    def gradient_written(self, parameter, step, grad):
        self.watch('gradient', parameter, step, grad)

    def push_acknowledged(self, parameter, step, send_buffer):
        self.watch('pushed', parameter, step, send_buffer, for_writing=True, after='gradient')

    def pull_received(self, parameter, step, target):
        self.watch('pull_received', parameter, step, target, after='pushed')

    def pull_applied(self, parameter, step, weight):
        self.watch('pull_applied', parameter, step, weight, after='pull_received')

    def watch(self, events, parameter, step, array, for_writing=False, after=None):
        """Mark ``'<event> <parameter> <step>'`` for each of `events` (a name or a tuple of
        names) when `array` is ready, and not before `parameter`'s last mark of the event
        `after` (its cause: two threads' wake-ups must not invert the order of the marks)."""
        events = (events,) if isinstance(events, str) else events
        cause = self._last.get((after, parameter))
        future = self._pool.submit(self._wait, ['%s %s %d' % (event, parameter, step)
                                                for event in events], array, for_writing, cause)
        for event in events:
            self._last[(event, parameter)] = future

    def _wait(self, names, array, for_writing, cause):
        if for_writing:
            check_call(_LIB.MXNDArrayWaitToWrite(array.handle))
        else:
            array.wait_to_read()
        if cause is not None:
            cause.result()   # submitted earlier, so it has a thread: no deadlock
        for name in names:
            mx.profiler.Marker(self._domain, name).mark('process')

    def close(self):
        self._pool.shutdown(wait=True)


def record_from_env(trainer):
    """Start recording `trainer`'s first steps if ``MXDELAY_TIMELINE`` is set.

    Called by :class:`mxdelay.DelayedTrainer` at construction. The profiler runs from the
    end of the trainer's first step (which also sends the initial weights) until
    ``MXDELAY_TIMELINE_STEPS`` more steps have queued their pushes; then the recording
    waits for the queued work, stops and writes ``PREFIX.rank<i>.json`` (i =
    ``trainer.rank``), adding ``otherData.mxdelay`` (``keys_per_step``, ``warmup_steps``,
    ``delay``, with ``delay='auto'`` its ``amendments`` (the decided k and fallback round),
    ``first_step``, ``rank``, and ``bytes``: :meth:`DelayedTrainer.round_bytes`)
    for ``python -m mxdelay.trace``. A process that exits
    before then writes what it recorded at exit. MXNet's profiler writes one trace per
    process: do not also use :func:`recording` in such a process.

    Parameters
    ----------
    trainer : mxdelay.DelayedTrainer

    Returns
    -------
    object or None
        The recording (None when ``MXDELAY_TIMELINE`` is unset or empty).

    Raises
    ------
    ValueError
        If ``MXDELAY_TIMELINE_STEPS`` is not an integer >= 1, or the prefix's folder does not
        exist.
    """
    prefix = env.get('MXDELAY_TIMELINE')
    if not prefix:
        return None
    steps = env.get_int('MXDELAY_TIMELINE_STEPS')
    folder = os.path.dirname(os.path.abspath(prefix))
    if not os.path.isdir(folder):
        raise ValueError('environment variable MXDELAY_TIMELINE=%r: folder %r does not exist; '
                         'create it or give a prefix in an existing folder' % (prefix, folder))
    return _EnvRecording(trainer, '%s.rank%d.json' % (prefix, trainer.rank), steps)


class _EnvRecording(_ParameterWatcher):
    """The trainer's observer while ``MXDELAY_TIMELINE`` records.

    The profiler starts once the trainer's first step has queued its pushes and all of its
    work has finished (``waitall``), and stops once `steps` more steps have queued theirs.
    The first step is left out: it also sends the initial weights (docs/design.md §10),
    extra pushes that :func:`summarize` would count as gradient pushes. Both ends fall
    between steps, so the trace holds whole steps.
    """

    def __init__(self, trainer, path, steps):
        self._names = set(trainer.priority_order())
        super().__init__(8 + 6 * len(self._names))
        self._trainer, self._path, self._steps = trainer, path, steps
        self._first = None      # the first recorded step, once recording
        self._written = set()   # parameters whose gradient the current step has pushed
        self._done = False
        mx.profiler.set_config(profile_symbolic=True, profile_imperative=True,
                               profile_api=True, profile_memory=False, aggregate_stats=False,
                               filename=path)
        trainer.set_observer(self)
        atexit.register(self.finish)
        _LOG.info('timeline: recording %d steps, from the second, into %s (MXDELAY_TIMELINE)',
                  steps, path)

    def gradient_written(self, parameter, step, grad):
        if self._first is not None:
            super().gradient_written(parameter, step, grad)
        self._written.add(parameter)
        if not self._written >= self._names:
            return
        self._written = set()   # every push of `step` is queued
        if self._first is None:
            mx.nd.waitall()
            mx.profiler.set_state('run')
            self._first = step + 1
        elif step >= self._first + self._steps - 1:
            self.finish()

    def push_acknowledged(self, parameter, step, send_buffer):
        if self._first is not None:
            super().push_acknowledged(parameter, step, send_buffer)

    def pull_received(self, parameter, step, target):
        if self._first is not None:
            super().pull_received(parameter, step, target)

    def pull_applied(self, parameter, step, weight):
        if self._first is not None:
            super().pull_applied(parameter, step, weight)

    def finish(self):
        """Wait for the queued work, stop the profiler and write the trace (once)."""
        if self._done or self._first is None:  # done, or not one step was taken
            return
        self._done = True
        mx.nd.waitall()
        self._trainer.set_observer(None)
        self.close()
        mx.profiler.set_state('stop')
        mx.profiler.dump()
        with open(self._path, encoding='utf-8') as file:
            trace = json.load(file)
        # The schedule as a checkpoint states it: with delay='auto' 'auto' and the job's
        # decisions (k and the fallback round), so that the summary places every phase.
        schedule = {name: value for name, value in self._trainer.schedule.state_dict().items()
                    if name != 'step'}
        trace.setdefault('otherData', {})['mxdelay'] = dict(
            schedule, keys_per_step=self._trainer.keys_per_step, first_step=self._first,
            rank=self._trainer.rank, bytes=self._trainer.round_bytes())
        with open(self._path, 'w', encoding='utf-8') as file:
            json.dump(trace, file)
        _LOG.info('timeline: trace written to %s; summarize it with python -m mxdelay.trace %s',
                  self._path, self._path)
