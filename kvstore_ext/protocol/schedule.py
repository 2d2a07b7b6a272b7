"""The phase schedule of the k-step delayed update, known to workers and servers alike.

docs/design.md §1.2, with W = ``warmup_steps``, k = ``delay`` and t0 = W + 1 (step t is
round t):

======================  ==========================================================
step t                  what the worker does
======================  ==========================================================
t < W   (warm-up, S1)   push g, pull ``W_{t+1}``, ``w' := W_{t+1}``
t == W  (switch, S2)    as warm-up, then back up ``pre_weight := w'``
t >= t0 (delayed, S3)   push g; local update; the last step of each period of k
                        (``(t - t0) % k == k - 1``) also issues a pull of ``W_{t+1}``,
                        applied at step t + 1's local update
======================  ==========================================================

With ``delay='auto'`` (:data:`AUTO`, docs/design.md §1.2) k is not known at construction:
the job decides it at the switch (:meth:`PullSchedule.amend`, ``delay``), and may fall back
to synchronous steps from a round F at a period's end (``synchronous_from``):

======================  ==========================================================
t0 <= t < F (delayed)   as above, with the decided k
t >= F  (synchronous)   as warm-up: push g, pull ``W_{t+1}``, ``w' := W_{t+1}``
======================  ==========================================================

F = t0 (staying synchronous: no delayed step) needs no k; F > t0 is ``t0 + j k``, so that
the last delayed step F - 1 ends a period and issues its pull as without a fallback.

The trainer asks it for the phase of every step (``mxdelay.schedule.DelaySchedule`` adds
the step counter); the store and the servers ask which rounds every worker pulls
(compressed pulls, §2.12): the same object's amendments reach all three
(``DistDelay.delayed.settings.set_schedule``, the servers' SCHEDULE command).
"""
from kvstore_ext.checks import check_int, check_rounds

__all__ = ['PullSchedule', 'AUTO', 'WARMUP', 'SWITCH', 'DELAYED', 'SYNCHRONOUS']

WARMUP, SWITCH, DELAYED, SYNCHRONOUS = 'warm-up', 'switch', 'delayed', 'synchronous'

#: ``delay='auto'``: k decided by the job at the switch (:meth:`PullSchedule.amend`).
AUTO = 'auto'


class PullSchedule(object):
    """When every worker pulls, and when it updates locally: pure predicates of the step.

    Parameters
    ----------
    delay : int or 'auto'
        k: pull the global weights every k steps in the delayed phase
        (1 <= k <= ``kvstore_ext.checks.MAX_ROUNDS``, 256); ``'auto'``: decided by
        :meth:`amend` before the first delayed step.
    warmup_steps : int
        W: synchronous steps before the switch (W >= 0).

    Attributes
    ----------
    delay : int or None
        k (None: ``'auto'``, not decided yet, or decided to stay synchronous).
    auto : bool
        Whether k is the job's decision (``delay='auto'``).
    synchronous_from : int or None
        F: the round from which every step is synchronous again (None: no fallback).

    Raises
    ------
    TypeError
        (``kvstore_ext.checks.ArgumentTypeError``) If an argument is not an integer.
    ValueError
        If an argument is out of range.

    The predicates of the phases take a step index ``t``, an integer >= 0, and raise the
    same way; :meth:`pulled` and :meth:`previous` (the servers' data path) do not check.
    A predicate of a delayed step of an ``'auto'`` schedule not decided yet raises
    RuntimeError (a step cannot run before the job decides).
    """

    def __init__(self, delay, warmup_steps):
        self.auto = isinstance(delay, str) and delay == AUTO
        self.delay = None if self.auto else check_rounds(
            'delay', delay, "use delay=1 to pull every step, or delay='auto'")
        self.warmup_steps = check_int('warmup_steps', warmup_steps, 0,
                                      'use warmup_steps=0 to start delayed updates at once')
        self.synchronous_from = None

    @property
    def decided(self):
        """Whether every step's phase is known: a fixed k, or an ``'auto'`` schedule amended
        with k or with ``synchronous_from = t0``."""
        return self.delay is not None or self.synchronous_from == self.first_delayed_step

    def amend(self, delay=None, synchronous_from=None):
        """Set the job's decisions of an ``'auto'`` schedule (replacing earlier ones).

        Parameters
        ----------
        delay : int or None
            The decided k (2 <= k <= 256); None: not decided, or staying synchronous.
        synchronous_from : int or None
            F: synchronous from round F on; t0 (without `delay`: no delayed step) or
            ``t0 + j k`` with j >= 1 (the end of a period); None: no fallback.

        Raises
        ------
        ValueError
            If the schedule is not ``'auto'``, or a value is out of range.
        """
        if not self.auto:
            raise ValueError('amend: this schedule has delay=%d fixed; only a '
                             "delay='auto' schedule is decided by the job" % self.delay)
        if delay is not None:
            delay = check_rounds('delay', delay)
            if delay < 2:
                raise ValueError("amend: delay=%d; delay='auto' decides k >= 2 or stays "
                                 'synchronous (synchronous_from=t0)' % delay)
        t0 = self.first_delayed_step
        if synchronous_from is not None:
            synchronous_from = check_int('synchronous_from', synchronous_from, t0,
                                         'the fallback round is a delayed one (>= t0 = W + 1)')
            if synchronous_from > t0 and (delay is None or (synchronous_from - t0) % delay):
                raise ValueError(
                    'amend: synchronous_from=%d does not start a period of delay=%s from '
                    't0=%d: use t0 + j*delay (the last delayed step ends a period), or t0 '
                    'to stay synchronous' % (synchronous_from, delay, t0))
        self.delay, self.synchronous_from = delay, synchronous_from

    def amendments(self):
        """The job's decisions, for :meth:`amend`, the servers and checkpoints: ``{'delay':
        k or None, 'synchronous_from': F or None}``."""
        return {'delay': self.delay, 'synchronous_from': self.synchronous_from}

    @property
    def first_delayed_step(self):
        """t0 = W + 1: the first step with a local update."""
        return self.warmup_steps + 1

    def phase(self, t):
        """The phase of step `t`: WARMUP, SWITCH, DELAYED or SYNCHRONOUS (from the fallback
        round on)."""
        t = _check_step(t)
        if t < self.warmup_steps:
            return WARMUP
        if t == self.warmup_steps:
            return SWITCH
        return SYNCHRONOUS if self._fallen_back(t) else DELAYED

    def is_synchronous(self, t):
        """Step `t` pulls ``W_{t+1}`` and waits for it (warm-up, the switch, and from the
        fallback round on)."""
        t = _check_step(t)
        if t > self.warmup_steps and not self._fallen_back(t):
            self._need_delay(t)
            return False
        return True

    def issues_pull(self, t):
        """Step `t` of the delayed phase ends a period: it issues a pull without waiting."""
        return self._ends_period(_check_step(t))

    def applies_pull(self, t):
        """Step `t` starts its local update with the weights pulled at step t - 1."""
        t = _check_step(t)
        return not self._fallen_back(t) and self._ends_period(t - 1)

    def pulled(self, t):
        """Whether round `t` is pulled by every worker: ``is_synchronous(t) or
        issues_pull(t)`` (False for t < 0)."""
        return 0 <= t <= self.warmup_steps or self._fallen_back(t) or self._ends_period(t)

    def previous(self, t):
        """The last pulled round before round `t` (-1: none)."""
        first = self.first_delayed_step
        if t <= first or self._fallen_back(t - 1):
            return t - 1
        self._need_delay(t)
        # Pulled rounds from t0 on: t0 + k - 1 + j*k.
        j = (t - first - self.delay) // self.delay
        return first + self.delay - 1 + j * self.delay if j >= 0 else first - 1

    def describe(self):
        """The configuration: ``{'delay': k or 'auto', 'warmup_steps': W}``."""
        return {'delay': AUTO if self.auto else self.delay, 'warmup_steps': self.warmup_steps}

    def _fallen_back(self, t):
        return self.synchronous_from is not None and t >= self.synchronous_from

    def _need_delay(self, t):
        if self.delay is None:
            raise RuntimeError("step %d of a delay='auto' schedule before the job decided k "
                               '(at the switch, step %d)' % (t, self.warmup_steps))

    def _ends_period(self, t):
        # The one statement of the pull period: t0 + k - 1, t0 + 2k - 1, ... up to the
        # fallback round.
        t0 = self.first_delayed_step
        if t < t0 or self._fallen_back(t):
            return False
        self._need_delay(t)
        return (t - t0) % self.delay == self.delay - 1


def _check_step(t):
    return check_int('t', t, 0, 't is a step index (the trainer counts from 0)')
