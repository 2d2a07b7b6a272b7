"""``delay='auto'``: k chosen at the switch from the warm-up's measurements, and a measured
fallback after it (docs/design.md §1.2).

Worker 0 measures; every worker adopts its decisions at two collective points, before the
push of the round they change:

1. **The decision, before step t0 = W + 1.** Worker 0's steady warm-up steps (from step
   :data:`SKIPPED`; the first ones initialise the keys and MXNet's engine) give the step
   time S, by wall clock alone (a ``perf_counter`` as each step is issued, nothing on
   MXNet's engine), and its last :data:`WAIT_STEPS` steps the wait W for communication
   (:class:`mxdelay.steplog.StepTimes`: one-value copies of every gradient and weight,
   waited for by helper threads; on ResNet-50's 299 tensors this costs about a tenth of a
   step, so S leaves out the steps it slows); the trainer gives the bytes P pushed and Q
   pulled per round. :func:`choose` estimates each
   candidate k of :data:`CANDIDATES` with :func:`mxdelay.estimate.estimate`'s model,
   ``S'(k) = max(C, T (P + Q/k) / (P + Q))`` with C = S - W. T, the communication time, is
   not measured without the profiler: the wait W stands for it, a lower bound (pushes that
   overlap backward are not counted), so the estimate favours k >= 2 and the fallback
   below corrects it. It picks the smallest k of :data:`CANDIDATES` whose estimate is
   within :data:`MARGIN` of the best one's, or stays synchronous when no k is estimated
   faster than S.
2. **The fallback check, before step D = t0 + k + m k.** Worker 0's delayed steps after one
   settling period (t0 + k to D - 1: m periods, two and at least :data:`MEASURED_STEPS`
   steps: k=2 four periods, k=4 two) give their mean step, by wall clock as S; slower
   than S by more than :data:`FALLBACK_MARGIN`, the job is synchronous from round F = D
   on (the end of a period,
   :meth:`PullSchedule.amend <kvstore_ext.protocol.schedule.PullSchedule.amend>`), for the
   rest of the job, and drops the local rule's state.

Each decision travels in worker 0's ballot (``job.decide``: every worker gets the same
value) and, from worker 0, in a SCHEDULE command to the servers, which need it for the
rounds of compressed pulls; worker 0 sends it before its push of the round, which cannot be
applied before. Everything measured, each estimate and the decision are logged (INFO),
with the arguments that repeat it. ``MXDELAY_AUTO_DELAY_FORCE`` (tests only) forces the
decisions. A checkpoint keeps the decisions (``DelaySchedule.state_dict``); a job resumed
before the switch measures again from where it resumed.
"""
import logging
import time

from kvstore_ext import env

from . import estimate
from .steplog import StepTimes

__all__ = ['AutoDelay', 'choose', 'CANDIDATES', 'MARGIN', 'SKIPPED', 'SLACK',
           'MIN_WARMUP_STEPS', 'MEASURED_STEPS', 'WAIT_STEPS', 'FALLBACK_MARGIN']

_LOG = logging.getLogger('mxdelay.trainer')

#: The k that ``delay='auto'`` chooses from: k=4, the accuracy tables' best time to accuracy
#: for SGD-momentum on both shaped links (1.41x and 1.40x stock against k=2's 1.27x, k=8's
#: 1.31x and 1.33x: docs/tuning.md, the ``delay`` row). k=2 is not a candidate: this
#: estimate never finds it faster than k=4 (it counts no per-pull cost), and where the two
#: tie, taking it pulled twice as often and cost 22% of the samples/s (MLP, 1 Gbit/s, ternary
#: + int8 pulls: docs/benchmarks/scaling/auto/k2-rule).
CANDIDATES = (4,)
#: The slack of ``delay='auto'`` (R = 5 slot keys, as k = 4): the largest candidate.
SLACK = max(CANDIDATES)
#: The smallest k whose estimate is within this share of the best one's is chosen.
MARGIN = 0.05
#: The first warm-up steps, not measured: the first initialises the keys, the next ones
#: warm MXNet's engine.
SKIPPED = 3
#: The warm-up measures at least 2 steps: steps SKIPPED .. W.
MIN_WARMUP_STEPS = SKIPPED + 2
#: The fallback check measures whole periods, at least two and at least this many steps.
MEASURED_STEPS = 8
#: The warm-up's last steps whose wait for communication is measured (the mean of their
#: waits is W); S leaves out the steps this measurement slows (each one's next).
WAIT_STEPS = 3
#: The fallback check falls back only if the delayed steps' mean is above (1 + this) S:
#: the noise of comparing a mean of 8 steps with the warm-up's on a busy 2-core machine
#: (docs/benchmarks/scaling/auto/timing/notes.md).
FALLBACK_MARGIN = 0.15


def _measured_periods(k):
    return max(2, -(-MEASURED_STEPS // k))


def _mean_step_ms(issued):
    """The mean step, in ms, of `issued`: (t, perf_counter) of consecutive steps, in order."""
    return 1e3 * (issued[-1][1] - issued[0][1]) / (len(issued) - 1)


def choose(step_ms, wait_ms, push_bytes, pull_bytes, candidates=CANDIDATES, margin=MARGIN):
    """The k to use, from a synchronous step's measurements (see the module docstring).

    Parameters
    ----------
    step_ms, wait_ms : float
        The measured synchronous step S and its wait W for communication (0 <= W <= S).
    push_bytes, pull_bytes : int
        P and Q: bytes of one round's pushes and of one pull.
    candidates : tuple of int
    margin : float

    Returns
    -------
    k : int or None
        The chosen k; None: stay synchronous (no candidate is estimated faster than S).
    rows : list of dict
        Per candidate: ``delay`` and its estimated ``step_ms`` and ``speedup``.
    """
    budget = {'step_ms': step_ms, 'wait_ms': wait_ms, 'compute_ms': step_ms - wait_ms,
              'comm_ms': wait_ms}
    rows = estimate.estimate(budget, {'push': push_bytes, 'pull': pull_bytes,
                                      'settings': {'this job': [push_bytes, pull_bytes]}},
                             candidates)
    best = min(row['step_ms'] for row in rows)
    if not best < step_ms:
        return None, rows
    return min(row['delay'] for row in rows if row['step_ms'] <= best * (1 + margin)), rows


class AutoDelay(object):
    """The measurements and the decisions of one trainer's ``delay='auto'``.

    Parameters
    ----------
    update : mxdelay.delayed.DelayedUpdate
        Its ``schedule`` (amended here), ``states``, ``rank``, ``round_bytes()``,
        ``awaited(t)`` and ``parts`` (``job.decide``, ``job.amend_schedule``,
        ``settings.slack``).
    """

    def __init__(self, update):
        self._update = update
        self._force = env.get_choice('MXDELAY_AUTO_DELAY_FORCE')
        self._times = None          # StepTimes, on worker 0 from its first sampled step
        self._warmup = []           # (t, perf_counter) of the warm-up steps issued
        self._sampled = []          # StepTimes records of the warm-up steps whose wait counts
        self._delayed = []          # (t, perf_counter) of the delayed steps measured
        self._warmup_ms = None      # the warm-up's steady step S

    def stepped(self, t, batch_size):
        """Step `t` is issued: worker 0 records it if a decision will need it."""
        schedule = self._update.schedule
        if self._update.rank != 0:
            return
        if not schedule.decided:
            if SKIPPED - 1 <= t <= schedule.warmup_steps:
                self._warmup.append((t, time.perf_counter()))
            if max(SKIPPED, schedule.warmup_steps - WAIT_STEPS + 1) <= t \
                    <= schedule.warmup_steps:
                if self._times is None:
                    self._times = StepTimes(self._update)
                self._sampled.append(self._times.record(t, batch_size))
        elif self._check_step() is not None:
            # One settling period left out, then two: records t0 + k - 1 .. D - 1.
            if self._check_step() - _measured_periods(schedule.delay) * schedule.delay - 1 \
                    <= t < self._check_step():
                self._delayed.append((t, time.perf_counter()))

    def before_step(self, t):
        """Before step `t`'s pushes, on every worker: the collective decisions due there."""
        schedule = self._update.schedule
        if t == schedule.first_delayed_step and not schedule.decided:
            self._decide(t)
        elif t == self._check_step():
            self._check(t)

    def _check_step(self):
        """D = t0 + k + m k, the fallback check's step; None: no check due (no k decided, or
        fallen back already)."""
        schedule = self._update.schedule
        if schedule.delay is None or schedule.synchronous_from is not None:
            return None
        k = schedule.delay
        return schedule.first_delayed_step + k + _measured_periods(k) * k

    # -- the decision at the switch -----------------------------------------------------------
    def _decide(self, t0):
        mine = self._choice() if self._update.rank == 0 else None
        decided = self._update.parts.job.decide(mine)
        self._amend(decided)
        if decided['delay'] is None:
            self._drop_rule_state()
            _LOG.info("DelayedTrainer: delay='auto' stays synchronous from step %d on (pin it: "
                      "warmup_steps at least the job's steps, or kvstore='dist_sync')", t0)
        else:
            _LOG.info("DelayedTrainer: delay='auto' chose delay=%d from step %d on (pin it: "
                      'delay=%d, slack=%d)', decided['delay'], t0, decided['delay'],
                      self._update.parts.settings.slack)

    def _choice(self):
        """Worker 0's decision at the switch: ``{'delay': k or None, 'synchronous_from':
        None or t0}``."""
        t0 = self._update.schedule.first_delayed_step
        stay = {'delay': None, 'synchronous_from': t0}
        if self._force != 'measure':
            _LOG.info("DelayedTrainer: delay='auto' forced by MXDELAY_AUTO_DELAY_FORCE=%s",
                      self._force)
            return stay if self._force == 'stay' else {'delay': int(self._force[0]),
                                                       'synchronous_from': None}
        # A sampled step's copies and helper threads slow the step after it: S ends before.
        first = self._sampled[0][0] if self._sampled else None
        steady = [(t, at) for t, at in self._warmup if first is None or t <= first]
        if len(steady) < 2 or not self._sampled:
            _LOG.warning("DelayedTrainer: delay='auto' measured %d warm-up steps, too few to "
                         'estimate (a job resumed close to the switch?): it stays synchronous',
                         max(0, len(steady) - 1))
            return stay
        steps = len(steady) - 1
        step_ms = _mean_step_ms(steady)
        wait_ms = 1e3 * sum(self._times.wait(r) for r in self._sampled) / len(self._sampled)
        self._warmup_ms = step_ms
        sizes = self._update.round_bytes()
        k, rows = choose(step_ms, wait_ms, sizes['push'], sizes['pull'])
        _LOG.info("DelayedTrainer: delay='auto' measured %d warm-up steps (from step %d): step "
                  'S = %.1f ms, waiting for communication W = %.1f ms, measured on steps '
                  '%d-%d, compute C = S - W = %.1f ms; %s bytes pushed and %s pulled per round; '
                  'estimated step max(C, W (P + Q/k)/(P + Q)): %s', steps, steady[1][0],
                  step_ms, wait_ms, self._sampled[0][0], self._sampled[-1][0],
                  step_ms - wait_ms, '{:,}'.format(sizes['push']), '{:,}'.format(sizes['pull']),
                  ', '.join('k=%d %.1f ms (%.2fx)' % (row['delay'], row['step_ms'],
                                                      row['speedup']) for row in rows))
        return stay if k is None else {'delay': k, 'synchronous_from': None}

    # -- the fallback -------------------------------------------------------------------------
    def _check(self, d):
        mine = self._fallback(d) if self._update.rank == 0 else None
        decided = self._update.parts.job.decide(mine)
        if decided['synchronous_from'] is None:
            return
        self._amend(decided)
        self._drop_rule_state()
        _LOG.info("DelayedTrainer: delay='auto' fell back: the job runs synchronously from "
                  'step %d on (delay=%d before it)', d, decided['delay'])

    def _fallback(self, d):
        """Worker 0's decision at the fallback check before step `d`."""
        k = self._update.schedule.delay
        keep, back = {'delay': k, 'synchronous_from': None}, {'delay': k, 'synchronous_from': d}
        if self._force != 'measure':
            return back if self._force == '4-fallback' else keep
        if self._warmup_ms is None or len(self._delayed) < 2:
            _LOG.info("DelayedTrainer: delay='auto' keeps delay=%d: no measurement to compare "
                      '(a resumed job)', k)
            return keep
        step_ms = _mean_step_ms(self._delayed)
        bound = self._warmup_ms * (1 + FALLBACK_MARGIN)
        slower = step_ms > bound
        _LOG.info("DelayedTrainer: delay='auto' measured delayed steps %d-%d: %.1f ms a step "
                  'against the warm-up\'s %.1f ms (both by wall clock; falling back above %.1f '
                  'ms, the margin %.0f%%): %s', self._delayed[1][0], self._delayed[-1][0],
                  step_ms, self._warmup_ms, bound, 100 * FALLBACK_MARGIN,
                  'falling back to synchronous steps' if slower else 'keeping delay=%d' % k)
        return back if slower else keep

    def restore(self, amendments):
        """A checkpoint's decisions (``DelaySchedule.state_dict``), on every worker: adopted
        here and on the servers; what was measured before is dropped (a resume before the
        switch measures again)."""
        self._warmup, self._sampled, self._delayed, self._warmup_ms = [], [], [], None
        self._amend(amendments)

    def _drop_rule_state(self):
        for s in self._update.states:
            s.pre_weight = s.rule_state = None   # the local rule is done for this job

    def _amend(self, decided):
        """Adopt `decided` here and, from worker 0, on the servers (before its next push)."""
        self._update.schedule.amend(**decided)
        if self._update.rank == 0:
            self._update.parts.job.amend_schedule(decided)
