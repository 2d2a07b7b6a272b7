"""What reaches the whole job: the store's ``job`` part (``DistDelay.delayed.job``).

A barrier of every worker, a vote in which every worker learns which workers failed
(docs/design.md §4.4), and the servers' count of applied rounds.
"""
from kvstore_ext.checks import check_optional_text
from kvstore_ext.protocol.commands import Command

__all__ = ['Job']


class Job(object):
    """The job's collectives on `session` (:class:`kvstore_ext.worker.session.Session`)."""

    def __init__(self, session):
        self._session = session

    def barrier(self):
        """Wait for every worker (MXNet's worker barrier)."""
        finish = self._session.finish
        if finish is not None:
            finish.check_no_worker_left()  # a worker that left never arrives
        self._session.native._barrier()  # pylint: disable=protected-access

    def agree(self, error=None):
        """Collective: tell every worker whether any worker failed a step.

        Every worker calls it with its own `error` (None or a message); each one gets the
        same list of ``(rank, message)`` of the workers that failed, so that all raise (or
        all go on) together instead of one raising while the others wait in a barrier.
        """
        check_optional_text('error', error, 'pass None, or a message saying what failed')
        self._session.ensure_started()
        return self._session.link.agree(error, self.barrier)

    def decide(self, value=None):
        """Collective: every worker gets worker 0's `value` (a small JSON value: a decision
        only worker 0 takes; the other workers' `value` is ignored). A vote of
        :meth:`agree` whose ballot carries the value and no error (docs/design.md §4.4).
        """
        self._session.ensure_started()
        mine = value if self._session.rank == 0 else None
        _, values = self._session.link.vote(None, self.barrier, mine)
        return values.get(0)

    def amend_schedule(self, amendments):
        """Tell the servers ``delay='auto'``'s decisions (`amendments`: ``delay``,
        ``synchronous_from``; :meth:`PullSchedule.amend
        <kvstore_ext.protocol.schedule.PullSchedule.amend>`), after this worker's issued
        work and so before its next push; one worker sends it (worker 0)."""
        self._session.command(Command.SCHEDULE, dict(amendments))

    def server_stats(self):
        """Per-server, per-chunk count of applied rounds (and rounds held out of order)."""
        return self._session.command(Command.STATS, {})
