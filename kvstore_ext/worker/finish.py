"""The finish counter: how workers with uneven data agree on the round where all stop, how
a worker without data sends the same requests as the others, and how they learn which rounds
overflowed (AMP).

A key of ``3 + R`` elements (R slots) that every worker pushes once per round: ``(0, 0,
exchanged)`` with its first push of a round while it has data, ``(1, leaving, 0)`` once it has
none (``leaving`` when its script is ending). The server stores each round's sum of these
three instead of applying an optimizer. Rounds are exact, so every worker reads the same
sums, and all workers that vote stop at the first round in which every worker has finished;
that round is never pushed (docs/design.md §5).

``exchanged`` is 1 if the worker sends its round's dense keys as pushpulls (one request with
the push and the pull, kvstore_ext.worker.wires.slots.ExchangeWire). MXNet's server answers
only the pushpulls of a round that has one, and never acknowledges a plain push in it: a
worker that fills a round without data sends pushpulls exactly if the workers with data did
(its vote reads their sum, :attr:`FinishCounter.exchanged`), and a worker with data sends all
of its round's dense keys the way its flag said.

The other R elements are a ring of overflow marks (docs/design.md §11): in round t a worker
pushes ``1 + overflowed`` at element ``3 + t mod R`` (``overflowed`` is 1 if its gradients
were not all finite, 0 otherwise and in a vote), and the server keeps, per element, the last
round that marked it (:func:`kvstore_ext.server.rounds.store_counter`). One pull after round t
then tells how many workers overflowed in each of the rounds t - R + 1 .. t.
With gradient compression a value of 1 travels as the codec's ``flag_unit`` (the 2bit
threshold t, which the wire carries exactly), and the sums are read back in that unit.
"""
import numpy as np
from mxnet import nd

from kvstore_ext.protocol.counter import FLAG_PRIORITY, HEAD
from kvstore_ext.worker.finite import ALL_FINITE

__all__ = ['FinishCounter']


class FinishCounter(object):
    """One worker's side of the finish counter.

    Parameters
    ----------
    tensor : kvstore_ext.worker.layout.Tensor
        The counter's key, placed and initialised (:func:`counter_size` elements).
    data_path : kvstore_ext.worker.wires.slots.SlotWire
        The counter's data path: its ``push(tensor, arrays, priority)`` and
        ``pull(tensor, outs, priority)`` send the flags and read the sums.
    num_workers : int
        Workers of the job.
    unit : float, default 1.0
        The value that a flag of 1 is sent as (the codec's ``flag_unit``).
    """

    def __init__(self, tensor, data_path, num_workers, unit=1.0):
        self.tensor = tensor
        self._data_path = data_path
        self._num_workers = num_workers
        self._unit = unit
        self._slots = tensor.size - HEAD
        # (head, ring position) -> the array pushed: the head (finished, leaving,
        # exchanged), and 1 at the round's mark, in units of `unit`; the mark alone, for
        # the overflow of AMP.
        self._flags, self._marks_alone = {}, []
        for position in range(self._slots):
            mark = np.zeros(tensor.size, dtype=np.float32)
            mark[HEAD + position] = 1
            self._marks_alone.append(nd.array(mark * np.float32(unit)))
            for head in ((0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 1, 0)):
                flag = mark.copy()
                flag[:HEAD] = head
                self._flags[(head, position)] = nd.array(flag * np.float32(unit))
        self._counts = nd.zeros(tensor.size)   # receives a round's sums of the flags
        self._marks = nd.zeros(tensor.size)    # receives the ring of overflow marks
        self.flagged_rounds = 0        # rounds before this carry this worker's flag
        self.all_finished = False      # the last vote found every worker finished; no push since
        self.workers_left = 0          # workers that ended their script at that vote
        # Whether this worker's current round (flagged_rounds - 1) sends its dense keys as
        # pushpulls: as its flag said, or after a vote as the workers with data do.
        self.exchanged = False

    def flag_round(self, round_index, finite=ALL_FINITE, exchanged=False):
        """Before the first push of round `round_index`: flag it "this worker has data" (once
        per round). `finite`: this worker's all-finite flag of the round
        (:mod:`kvstore_ext.worker.finite`), which marks an overflow at the round's mark.
        `exchanged`: whether this worker sends the round's dense keys as pushpulls (then
        :attr:`exchanged` for the whole round)."""
        if round_index < self.flagged_rounds:
            return
        self.check_no_worker_left()
        position = round_index % self._slots
        flag = finite.mark(self._flags[((0, 0, int(exchanged)), position)],
                           self._marks_alone[position])
        self._data_path.push(self.tensor, [flag], FLAG_PRIORITY)
        self.flagged_rounds = round_index + 1
        self.all_finished = False
        self.exchanged = bool(exchanged)

    def vote(self, leaving=False):
        """Vote that this worker has no data for its next round; wait for every worker's vote.

        Returns
        -------
        bool
            True if every worker has finished in this round (no round is pushed); False if
            some worker still has data: the caller must push this round (zero gradients),
            as pushpulls if :attr:`exchanged` (the workers with data send pushpulls), and
            vote again.
        """
        self.check_no_worker_left()
        head = (1, int(bool(leaving)), 0)
        self._data_path.push(self.tensor, [self._flags[(head, self.flagged_rounds %
                                                               self._slots)]], FLAG_PRIORITY)
        self._data_path.pull(self.tensor, [self._counts], FLAG_PRIORITY)
        # A sum of at most N units: its float32 rounding is far below half a unit.
        finished, left, exchanged = (int(round(c / self._unit))
                                     for c in self._counts.asnumpy()[:HEAD])
        if finished < self._num_workers:
            self.flagged_rounds += 1
            if 0 < exchanged < self._num_workers - finished:
                # Their own requests already mix pushpulls and pushes: MXNet's server leaves
                # the pushes of the round unanswered, whatever this worker sends.
                raise RuntimeError(
                    'in round %d, %d of the %d workers with data sent pushpulls and the others '
                    'pushes: the round cannot complete. Every worker must call the same '
                    'kvstore methods in a round (pushpull, or push and pull)'
                    % (self.flagged_rounds - 1, exchanged, self._num_workers - finished))
            self.exchanged = exchanged > 0
            return False
        self.all_finished = True
        if not leaving:
            self.workers_left = left
        return True

    def pull_marks(self):
        """Issue a pull of the overflow marks after this worker's last flagged round; returns
        at once (:meth:`overflows` waits for it)."""
        self._data_path.pull(self.tensor, [self._marks], FLAG_PRIORITY)

    def overflows(self, rounds):
        """The number of workers whose gradients overflowed in each of `rounds` (at most R
        back from the round of the last :meth:`pull_marks`); waits for that pull."""
        marks = self._marks.asnumpy()
        return [int(round(marks[HEAD + r % self._slots] / self._unit)) - self._num_workers
                for r in rounds]

    def check_no_worker_left(self):
        """Raise if a worker ended its script while this one goes on (it never arrives)."""
        if self.workers_left:
            raise RuntimeError(
                '%d of %d workers ended their training script while this worker goes on '
                '(training, or a collective call such as save_states): the job cannot '
                'continue. With uneven data every worker must call trainer.join() (or '
                'kvstore.delayed.uneven.finish_round()) at the same points, e.g. at the end '
                'of every epoch'
                % (self.workers_left, self._num_workers))

    def restore(self, rounds, flagged_rounds):
        """Take the counter's round count and this worker's flagged rounds from a checkpoint."""
        self.tensor.next_round = rounds
        self.flagged_rounds = flagged_rounds
