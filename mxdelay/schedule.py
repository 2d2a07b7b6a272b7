"""The phase schedule of the k-step delayed update: pure predicates of the step counter.

docs/design.md §1, with W = ``warmup_steps``, k = ``delay`` and t0 = W + 1:

======================  ==========================================================
step t                  what the worker does
======================  ==========================================================
t < W   (warm-up, S1)   push g, pull ``W_{t+1}``, ``w' := W_{t+1}``
t == W  (switch, S2)    as warm-up, then back up ``pre_weight := w'``
t >= t0 (delayed, S3)   push g; local update; the last step of each period of k
                        (``(t - t0) % k == k - 1``) also issues a pull of ``W_{t+1}``,
                        applied at step t + 1's local update
======================  ==========================================================
"""
from kvstore_ext.checks import check_int, check_rounds

__all__ = ['DelaySchedule', 'WARMUP', 'SWITCH', 'DELAYED']

WARMUP, SWITCH, DELAYED = 'warm-up', 'switch', 'delayed'


class DelaySchedule(object):
    """When to pull and when to update locally; the trainer asks, nothing else decides.

    Parameters
    ----------
    delay : int
        k: pull the global weights every k steps in the delayed phase
        (1 <= k <= ``kvstore_ext.checks.MAX_ROUNDS``, 256).
    warmup_steps : int
        W: synchronous steps before the switch (W >= 0).
    step : int, default 0
        The counter: the index of the next ``trainer.step`` call.

    Raises
    ------
    TypeError
        (:class:`mxdelay.ArgumentTypeError`) If an argument is not an integer.
    ValueError
        If an argument is out of range.

    The predicates take a step index ``t``, an integer >= 0, and raise the same way.
    """

    def __init__(self, delay, warmup_steps, step=0):
        self.delay = check_rounds('delay', delay, 'use delay=1 to pull every step')
        self.warmup_steps = check_int('warmup_steps', warmup_steps, 0,
                                      'use warmup_steps=0 to start delayed updates at once')
        self.step = check_int('step', step, 0, 'steps are counted from 0')

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
        return self._issues_pull(_check_step(t))

    def applies_pull(self, t):
        """Step `t` starts its local update with the weights pulled at step t - 1."""
        return self._issues_pull(_check_step(t) - 1)

    def _issues_pull(self, t):
        t0 = self.first_delayed_step
        return t >= t0 and (t - t0) % self.delay == self.delay - 1

    def state_dict(self):
        """The counter and the configuration, for checkpoints."""
        return {'step': self.step, 'delay': self.delay, 'warmup_steps': self.warmup_steps}


def _check_step(t):
    return check_int('t', t, 0, 't is a step index (the trainer counts from 0)')
