"""What a trainer tells an observer: named events per parameter and step.

:class:`mxdelay.DelayedTrainer` calls its observer (``trainer.set_observer``) when it issues
the work behind each event; the event itself happens when the array passed along becomes
ready in MXNet's engine (the calls return at once; an observer that needs the time waits
for the array, as :func:`mxdelay.timeline.recording` does). The default observer does
nothing. For a pull applied in a delayed step, `step` is the step that issued the pull.
"""

__all__ = ['StepObserver']


class StepObserver(object):
    """Receives a trainer's events; every method does nothing unless overridden.

    Each method gets the parameter's name, the step (``trainer.schedule.step`` when the
    work was issued) and the array whose readiness marks the event.
    """

    def gradient_written(self, parameter, step, grad):
        """Backward has written `grad` (this worker's gradient, summed over devices) once
        `grad` is readable."""

    def push_acknowledged(self, parameter, step, send_buffer):
        """The push of this round is acknowledged (the round is complete on the server) once
        `send_buffer` is writable."""

    def pull_received(self, parameter, step, target):
        """The pulled weights have arrived once `target` is readable."""

    def pull_applied(self, parameter, step, weight):
        """The pulled weights replaced the worker's weights once `weight` is readable."""
