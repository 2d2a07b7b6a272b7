"""A log line every N steps: samples/s, the share of the time spent waiting for
communication, bytes sent and received per step.

Opt-in: ``MXDELAY_LOG_EVERY=N`` (N >= 1; unset or 0: off). The trainer's delayed update
(:mod:`mxdelay.delayed`) chooses its step log once, at construction (:func:`from_env`): off,
it is :data:`OFF`, whose one method does nothing; on, a :class:`StepLog`, which logs
(``logging.info``, logger ``mxdelay.trainer``) on every worker after every N steps::

    DelayedTrainer: worker 0 step 400: 1843.2 samples/s over the last 20 steps, 41% of the
    time waiting for communication, 11,048 bytes sent and 2,762 received per step

How it is measured. *Samples/s*: the batch sizes given to ``step`` over the wall time
between the ``step`` calls that open and close the window (on the Python thread). *Wait*:
the trainer's calls return before any communication is done (MXNet's engine runs it), so
the log times it from two helper threads that wait (``wait_to_read``, which blocks only the
helper) for each step's gradients, g(t), and for the communication the next computation
needs, c(t): a synchronous step's pulled weights, a delayed step's pull; each waits for a
one-value copy of each array issued with the step (MXNet's engine orders it after that
step's writes and before the next step's, which rewrite the same arrays). A synchronous
step waits ``max(0, c(t) - g(t))`` (from the end of backward to the weights' arrival: the
next forward needs them); a delayed step that applies the pull of step t - 1 waits
``max(0, c(t - 1) - g(t))`` (the pull arrived after this step's backward); other delayed
steps wait for nothing (a push waits only for its slot's round ``slack`` rounds back,
which is not counted). The share is the waits' sum over the window's wall time. A
helper's wake-up takes about 0.3 ms on an idle core, a few ms on a busy one: the wait is
an estimate, the timeline (``MXDELAY_TIMELINE``) measures it from MXNet's profiler.
*Bytes*: :meth:`mxdelay.DelayedTrainer.round_bytes` (the values of the parameters, no
headers): every step sends one push, and receives one pull if it pulled.

The line of the steps that close a window is written by the helper once their times are
known, a few milliseconds after ``step`` returned; ``join`` rounds (no data) are not
counted.
"""
import concurrent.futures
import logging
import time

from kvstore_ext import env

__all__ = ['OFF', 'StepLog', 'StepTimes', 'from_env']

_LOG = logging.getLogger('mxdelay.trainer')


class _Off(object):
    """The step log when it is off: nothing is measured, nothing is logged."""

    def stepped(self, t, batch_size):
        """Called by the trainer after issuing step `t` (see :meth:`StepLog.stepped`)."""


#: The step log when ``MXDELAY_LOG_EVERY`` is unset or 0.
OFF = _Off()


def from_env(update):
    """The step log of `update` (:class:`mxdelay.delayed.DelayedUpdate`): :class:`StepLog`
    every ``MXDELAY_LOG_EVERY`` steps, or :data:`OFF`.

    Raises
    ------
    ValueError
        If ``MXDELAY_LOG_EVERY`` is not an integer >= 0.
    """
    every = env.get_int('MXDELAY_LOG_EVERY')
    return StepLog(update, every) if every else OFF


def _ready(arrays):
    """Wait until every array of `arrays` is readable; return the time (perf_counter)."""
    for array in arrays:
        array.wait_to_read()
    return time.perf_counter()


def _marker(array):
    """A one-value copy of `array`, issued now: readable once every write to `array` issued
    before it is done, and never later. Waiting for `array` itself could also wait for
    writes issued after it (the next step's backward rewrites the gradients, its pull the
    weights) if the helper thread ran late, which it does under the GIL while the training
    loop issues the next step."""
    if array.stype != 'default':
        return array.copy()
    return array.reshape((-1,))[0:1].copy()


class StepTimes(object):
    """Each step's issue time and, from two helper threads, when its gradients and the
    communication its next computation needs were ready (see the module docstring); for
    :class:`StepLog` and :mod:`mxdelay.autodelay`.

    Parameters
    ----------
    update : mxdelay.delayed.DelayedUpdate
        Its ``schedule`` and ``awaited(t)``.
    """

    def __init__(self, update):
        self._update = update
        # One thread per kind of wait, each in step order: the gradients of a later step
        # can be ready before the pull of an earlier one has arrived.
        self._gradients = concurrent.futures.ThreadPoolExecutor(1, 'mxdelay-steplog-g')
        self._communication = concurrent.futures.ThreadPoolExecutor(1, 'mxdelay-steplog-c')

    def record(self, t, batch_size):
        """Step `t` of `batch_size` samples is issued: its record ``(t, batch_size, pulled,
        wall time, g future, c future)``."""
        now = time.perf_counter()
        gradients, communication, pulled = self._update.awaited(t)
        gradients = [_marker(a) for a in gradients]
        communication = [_marker(a) for a in communication]
        return (t, batch_size, pulled, now, self._gradients.submit(_ready, gradients),
                self._communication.submit(_ready, communication))

    def after_recorded(self, fn, *args):
        """Run ``fn(*args)`` on the communication thread: after the waits of every step
        recorded so far, off the training loop's thread."""
        self._communication.submit(fn, *args)

    def wall_and_wait(self, window):
        """Seconds from `window`'s first record to its last, and the waits of its steps
        after the first (which gives c(t - 1) to the second); blocks until they are known."""
        wait = sum(self.wait(step, before) for before, step in zip(window, window[1:]))
        return window[-1][3] - window[0][3], wait

    def wait(self, step, before=None):
        """Seconds the step of record `step` waited for communication; `before`: the record
        of the step before it, which a delayed step that applies a pull needs (without it
        that step counts no wait). Blocks until they are known."""
        schedule = self._update.schedule
        t, g = step[0], step[4].result()
        if schedule.is_synchronous(t):
            return max(0.0, step[5].result() - g)
        if schedule.applies_pull(t) and before is not None and before[0] == t - 1:
            return max(0.0, before[5].result() - g)
        return 0.0


class StepLog(object):
    """Logs every `every` steps of `update` (see the module docstring).

    Parameters
    ----------
    update : mxdelay.delayed.DelayedUpdate
        The trainer's delayed update: its ``schedule``, ``rank``, ``round_bytes()`` and
        ``awaited(t)``.
    every : int
        Steps per line (>= 1).
    """

    def __init__(self, update, every):
        self._update, self._every = update, every
        self._times = StepTimes(update)
        self._steps = []     # StepTimes.record's
        self._bytes = None
        _LOG.info('DelayedTrainer: logging every %d steps (MXDELAY_LOG_EVERY)', every)

    def stepped(self, t, batch_size):
        """Step `t` of `batch_size` samples is issued; the update tells which arrays its
        gradients and its awaited communication are (``awaited(t)``)."""
        self._steps.append(self._times.record(t, batch_size))
        if len(self._steps) == self._every + 1:
            # The last step opens the next window (and gives its first step c(t - 1)).
            window, self._steps = self._steps, self._steps[-1:]
            if self._bytes is None:
                self._bytes = self._update.round_bytes()
            self._times.after_recorded(self._report, window, self._update.rank)

    def _report(self, window, rank):
        """Log the steps of `window` after its first (which opens it)."""
        try:
            record = self.measure(window)
        except Exception:  # pylint: disable=broad-except
            _LOG.exception('DelayedTrainer: the step log failed')  # never the training
            return
        _LOG.info('DelayedTrainer: worker %d step %d: %.1f samples/s over the last %d steps, '
                  '%.0f%% of the time waiting for communication, %s bytes sent and %s '
                  'received per step', rank, record['step'], record['samples_per_s'],
                  record['steps'], 100 * record['wait_share'],
                  '{:,}'.format(record['sent']), '{:,.0f}'.format(record['received']))

    def measure(self, window):
        """The line's numbers for `window`: its steps after the first (the first opens it and
        gives c(t - 1))."""
        wall, wait = self._times.wall_and_wait(window)
        steps = window[1:]
        pulls = sum(1 for step in steps if step[2])
        counted = self._bytes or {'push': 0, 'pull': 0}
        return {'step': steps[-1][0], 'steps': len(steps),
                'samples_per_s': sum(step[1] for step in steps) / wall if wall > 0 else 0.0,
                'wait_share': wait / wall if wall > 0 else 0.0,
                'sent': counted['push'], 'received': counted['pull'] * pulls / len(steps)}
