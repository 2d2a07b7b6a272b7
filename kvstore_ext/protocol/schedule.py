"""Which rounds every worker pulls: known to workers and servers alike (docs/design.md §2.12).
"""
from kvstore_ext.checks import check_int

__all__ = ['PullSchedule']


class PullSchedule(object):
    """The rounds every worker pulls: ``t <= W`` (warm-up and switch) and, from t0 = W + 1,
    ``(t - t0) % k == k - 1`` (the last step of each period; mxdelay.schedule's
    ``is_synchronous(t) or issues_pull(t)``).

    Parameters
    ----------
    delay : int
        k (at least 1).
    warmup_steps : int
        W (at least 0).
    """

    def __init__(self, delay, warmup_steps):
        self.delay = check_int('delay', delay, 1, 'the pull period of the delayed phase')
        self.warmup_steps = check_int('warmup_steps', warmup_steps, 0,
                                      'the number of synchronous steps')

    def pulled(self, t):
        """Whether round `t` is pulled by every worker."""
        first = self.warmup_steps + 1
        return t >= 0 and (t < first or (t - first) % self.delay == self.delay - 1)

    def previous(self, t):
        """The last pulled round before round `t` (-1: none)."""
        first = self.warmup_steps + 1
        if t <= first:
            return min(t, first) - 1
        # Pulled rounds from t0 on: t0 + k - 1 + j*k.
        j = (t - first - self.delay) // self.delay
        return first + self.delay - 1 + j * self.delay if j >= 0 else first - 1

    def describe(self):
        return {'delay': self.delay, 'warmup_steps': self.warmup_steps}
