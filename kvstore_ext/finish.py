"""The finish counter: how workers with uneven data agree on the round where all stop.

A two-element key that every worker pushes once per round: ``(0, 0)`` with its first push
of a round while it has data, ``(1, leaving)`` once it has none (``leaving`` when its script
is ending). The server stores each round's sum instead of applying an optimizer. Rounds are
exact, so every worker reads the same sums, and all workers that vote stop at the first
round in which every worker has finished; that round is never pushed (docs/design.md §5).
With gradient compression a flag of 1 travels as the compression's ``flag_unit`` (the 2bit
threshold t, which the wire carries exactly), and the sums are read back in that unit.
"""
from mxnet import nd

__all__ = ['FinishCounter', 'FLAG_PRIORITY']

#: The flag needs no gradient: let it go first.
FLAG_PRIORITY = 1 << 20


class FinishCounter(object):
    """One worker's side of the finish counter.

    Parameters
    ----------
    tensor : kvstore_ext.layout.Tensor
        The counter's key, placed and initialised (two elements).
    data_path : object
        The store: its ``push_tensor(tensor, arrays, priority)`` and
        ``pull_tensor(tensor, outs, priority)`` send the flags and read the sums.
    num_workers : int
        Workers of the job.
    unit : float, default 1.0
        The value that a flag of 1 is sent as (the compression's ``flag_unit``).
    """

    def __init__(self, tensor, data_path, num_workers, unit=1.0):
        self.tensor = tensor
        self._data_path = data_path
        self._num_workers = num_workers
        self._unit = unit
        self._flags = {flag: nd.array([f * unit for f in flag])
                       for flag in ((0, 0), (1, 0), (1, 1))}
        self._counts = nd.zeros(2)     # receives a round's sums of the flags
        self.flagged_rounds = 0        # rounds before this carry this worker's flag
        self.all_finished = False      # the last vote found every worker finished; no push since
        self.workers_left = 0          # workers that ended their script at that vote

    def flag_round(self, round_index):
        """Before the first push of round `round_index`: flag it "this worker has data" (once
        per round)."""
        if round_index < self.flagged_rounds:
            return
        self.check_no_worker_left()
        self._data_path.push_tensor(self.tensor, [self._flags[(0, 0)]], FLAG_PRIORITY)
        self.flagged_rounds = round_index + 1
        self.all_finished = False

    def vote(self, leaving=False):
        """Vote that this worker has no data for its next round; wait for every worker's vote.

        Returns
        -------
        bool
            True if every worker has finished in this round (no round is pushed); False if
            some worker still has data: the caller must push this round (zero gradients)
            and vote again.
        """
        self.check_no_worker_left()
        self._data_path.push_tensor(self.tensor, [self._flags[(1, int(bool(leaving)))]],
                                    FLAG_PRIORITY)
        self._data_path.pull_tensor(self.tensor, [self._counts], FLAG_PRIORITY)
        # A sum of at most N units: its float32 rounding is far below half a unit.
        finished, left = (int(round(c / self._unit)) for c in self._counts.asnumpy())
        if finished < self._num_workers:
            self.flagged_rounds += 1
            return False
        self.all_finished = True
        if not leaving:
            self.workers_left = left
        return True

    def check_no_worker_left(self):
        """Raise if a worker ended its script while this one goes on (it never arrives)."""
        if self.workers_left:
            raise RuntimeError(
                '%d of %d workers ended their training script while this worker goes on '
                '(training, or a collective call such as save_states): the job cannot '
                'continue. With uneven data every worker must call trainer.join() (or '
                'kvstore.finish_round()) at the same points, e.g. at the end of every epoch'
                % (self.workers_left, self._num_workers))

    def restore(self, rounds, flagged_rounds):
        """Take the counter's round count and this worker's flagged rounds from a checkpoint."""
        self.tensor.next_round = rounds
        self.flagged_rounds = flagged_rounds
