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

The trainer asks it for the phase of every step (``mxdelay.schedule.DelaySchedule`` adds
the step counter); the store and the servers ask which rounds every worker pulls
(compressed pulls, §2.12).
"""
from kvstore_ext.checks import check_int, check_rounds

__all__ = ['PullSchedule', 'WARMUP', 'SWITCH', 'DELAYED']

WARMUP, SWITCH, DELAYED = 'warm-up', 'switch', 'delayed'


class PullSchedule(object):
    """When every worker pulls, and when it updates locally: pure predicates of the step.

    Parameters
    ----------
    delay : int
        k: pull the global weights every k steps in the delayed phase
        (1 <= k <= ``kvstore_ext.checks.MAX_ROUNDS``, 256).
    warmup_steps : int
        W: synchronous steps before the switch (W >= 0).

    Raises
    ------
    TypeError
        (``kvstore_ext.checks.ArgumentTypeError``) If an argument is not an integer.
    ValueError
        If an argument is out of range.

    The predicates of the phases take a step index ``t``, an integer >= 0, and raise the
    same way; :meth:`pulled` and :meth:`previous` (the servers' data path) do not check.
    """

    def __init__(self, delay, warmup_steps):
        self.delay = check_rounds('delay', delay, 'use delay=1 to pull every step')
        self.warmup_steps = check_int('warmup_steps', warmup_steps, 0,
                                      'use warmup_steps=0 to start delayed updates at once')

    @property
    def first_delayed_step(self):
        """t0 = W + 1: the first step with a local update."""
        return self.warmup_steps + 1

    def phase(self, t):
        """The phase of step `t`: WARMUP, SWITCH or DELAYED."""
        t = _check_step(t)
        if t < self.warmup_steps:
            return WARMUP
        return SWITCH if t == self.warmup_steps else DELAYED

    def is_synchronous(self, t):
        """Step `t` pulls ``W_{t+1}`` and waits for it (warm-up and the switch)."""
        return _check_step(t) <= self.warmup_steps

    def issues_pull(self, t):
        """Step `t` of the delayed phase ends a period: it issues a pull without waiting."""
        return self._ends_period(_check_step(t))

    def applies_pull(self, t):
        """Step `t` starts its local update with the weights pulled at step t - 1."""
        return self._ends_period(_check_step(t) - 1)

    def pulled(self, t):
        """Whether round `t` is pulled by every worker: ``is_synchronous(t) or
        issues_pull(t)`` (False for t < 0)."""
        return 0 <= t <= self.warmup_steps or self._ends_period(t)

    def previous(self, t):
        """The last pulled round before round `t` (-1: none)."""
        first = self.first_delayed_step
        if t <= first:
            return min(t, first) - 1
        # Pulled rounds from t0 on: t0 + k - 1 + j*k.
        j = (t - first - self.delay) // self.delay
        return first + self.delay - 1 + j * self.delay if j >= 0 else first - 1

    def describe(self):
        """The configuration: ``{'delay': k, 'warmup_steps': W}``."""
        return {'delay': self.delay, 'warmup_steps': self.warmup_steps}

    def _ends_period(self, t):
        # The one statement of the pull period: t0 + k - 1, t0 + 2k - 1, ...
        t0 = self.first_delayed_step
        return t >= t0 and (t - t0) % self.delay == self.delay - 1


def _check_step(t):
    return check_int('t', t, 0, 't is a step index (the trainer counts from 0)')
