"""The trainer's schedule: the phase schedule of docs/design.md §1.2 and the step counter.

The phases and the pull period are :class:`kvstore_ext.protocol.schedule.PullSchedule`'s,
the one statement that workers and servers share; this module adds the counter that the
trainer advances and checkpoints.
"""
from kvstore_ext.checks import check_int
from kvstore_ext.protocol.schedule import (AUTO, DELAYED, SWITCH, SYNCHRONOUS, WARMUP,
                                           PullSchedule)

__all__ = ['DelaySchedule', 'AUTO', 'WARMUP', 'SWITCH', 'DELAYED', 'SYNCHRONOUS']


class DelaySchedule(PullSchedule):
    """When to pull and when to update locally, and the step counter; the trainer asks,
    nothing else decides.

    Parameters
    ----------
    delay : int or 'auto'
        k: pull the global weights every k steps in the delayed phase
        (1 <= k <= ``kvstore_ext.checks.MAX_ROUNDS``, 256); ``'auto'``: the job decides it
        at the switch (:mod:`mxdelay.autodelay`).
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

    The predicates (``phase``, ``is_synchronous``, ``issues_pull``, ``applies_pull``) take a
    step index ``t``, an integer >= 0, and raise the same way.
    """

    def __init__(self, delay, warmup_steps, step=0):
        super(DelaySchedule, self).__init__(delay, warmup_steps)
        self.step = check_int('step', step, 0, 'steps are counted from 0')

    def state_dict(self):
        """The counter and the configuration, for checkpoints; with ``delay='auto'`` also
        the job's decisions (``amendments``: a resume keeps them; before the switch there
        are none, and the resumed job measures again)."""
        if not self.auto:
            return {'step': self.step, 'delay': self.delay, 'warmup_steps': self.warmup_steps}
        return {'step': self.step, 'delay': AUTO, 'warmup_steps': self.warmup_steps,
                'amendments': self.amendments()}
