"""The phase schedule of the k-step delayed update: pure predicates of the step counter.

SPEC section 1, with W = ``warmup_steps``, k = ``delay`` and t0 = W + 1:

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
__all__ = ['DelaySchedule', 'WARMUP', 'SWITCH', 'DELAYED']

WARMUP, SWITCH, DELAYED = 'warm-up', 'switch', 'delayed'


class DelaySchedule(object):
    """When to pull and when to update locally; the trainer asks, nothing else decides.

    Parameters
    ----------
    delay : int
        k: pull the global weights every k steps in the delayed phase (k >= 1).
    warmup_steps : int
        W: synchronous steps before the switch (W >= 0).
    step : int, default 0
        The counter: the index of the next ``trainer.step`` call.
    """

    def __init__(self, delay, warmup_steps, step=0):
        if delay < 1 or warmup_steps < 0 or step < 0:
            raise ValueError('DelaySchedule needs delay >= 1, warmup_steps >= 0, step >= 0; got '
                             'delay=%r warmup_steps=%r step=%r' % (delay, warmup_steps, step))
        self.delay = delay
        self.warmup_steps = warmup_steps
        self.step = step

    @property
    def first_delayed_step(self):
        """t0 = W + 1: the first step with a local update."""
        return self.warmup_steps + 1

    def phase(self, t):
        """The phase of step `t`: WARMUP, SWITCH or DELAYED."""
        if t < self.warmup_steps:
            return WARMUP
        return SWITCH if t == self.warmup_steps else DELAYED

    def is_synchronous(self, t):
        """Step `t` pulls ``W_{t+1}`` and waits for it (warm-up and the switch)."""
        return t <= self.warmup_steps

    def issues_pull(self, t):
        """Step `t` of the delayed phase ends a period: it issues a pull without waiting."""
        t0 = self.first_delayed_step
        return t >= t0 and (t - t0) % self.delay == self.delay - 1

    def applies_pull(self, t):
        """Step `t` starts its local update with the weights pulled at step t - 1."""
        return self.issues_pull(t - 1)

    def state_dict(self):
        """The counter and the configuration, for checkpoints."""
        return {'step': self.step, 'delay': self.delay, 'warmup_steps': self.warmup_steps}
