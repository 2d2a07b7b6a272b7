"""Uneven data and leaving: the store's ``uneven`` part (``DistDelay.delayed.uneven``).

A worker without data for its next round votes on the finish counter
(:mod:`kvstore_ext.worker.finish`, docs/design.md §5) until every worker has finished; the
trainer's ``join`` pushes zero gradients in the rounds the others still send. A worker whose
script ends does the same at exit (:meth:`UnevenData.leave`, from ``DistDelay.close``), so
the others' remaining rounds complete without it.
"""
import logging

from kvstore_ext.checks import check_bool

__all__ = ['UnevenData']

_LOG = logging.getLogger(__name__)


class UnevenData(object):
    """The finish votes of `session` (:class:`kvstore_ext.worker.session.Session`); a padded
    round goes through `rounds` (:class:`kvstore_ext.worker.rounds.Rounds`)."""

    def __init__(self, session, rounds):
        self._session = session
        self._rounds = rounds

    def finish_round(self, leaving=False):
        """Vote that this worker has no data for its next round; wait for every worker's vote.

        Every worker pushes a flag on the finish counter in every round: ``(0, 0)`` with its
        first push of a round (automatically), ``(1, leaving)`` here. The round's sum reaches
        every worker identically (rounds are exact), so all workers that call this see the
        same first round in which every worker has finished, and stop there together.

        Parameters
        ----------
        leaving : bool, default False
            True when this worker's script is ending (called at exit).

        Returns
        -------
        bool
            True if every worker has finished in this round: no round is pushed; False if some
            worker still has data: the caller must push this round (zero gradients) and vote
            again.
        """
        finish = self._session.finish
        if finish is None:
            return True  # nothing was ever initialised: there are no rounds to fill
        return finish.vote(check_bool('leaving', leaving))

    def leave(self):
        """Fill the other workers' remaining rounds with zero gradients, as if this worker
        called :meth:`finish_round` until every worker finished (``DistDelay.close``)."""
        finish = self._session.finish
        if finish is None or finish.all_finished:
            return
        padded = 0
        while not self.finish_round(leaving=True):
            for tensor in self._session.tensors.values():
                # a tensor pushed in every round so far gets this round too
                if tensor.kind.trained and tensor.next_round == finish.flagged_rounds - 1:
                    # as the workers with data send the round (Rounds.send)
                    self._rounds.send(tensor, [tensor.zeros()], None, 0)
            padded += 1
        if padded:
            _LOG.info('dist_delay: worker %d had no data for the last %d rounds of the other '
                      'workers and pushed zero gradients in them', self._session.rank, padded)
