"""AMP's all-finite flag of a round, as the pushes and the finish counter carry it.

Under AMP (docs/design.md §11) a trainer gives the store each round's all-finite flag
(``Rounds.set_finite_flag``, :mod:`kvstore_ext.worker.rounds`): a one-element NDArray, 1 if
every gradient of the round is finite, else 0, still being computed in MXNet's engine. The
flag is chosen per round, once: a round without one gets :data:`ALL_FINITE`, which changes
nothing, and a round with one a :class:`FiniteFlag`. The data paths call it and never ask
which they hold.
"""
from mxnet import nd

__all__ = ['AllFinite', 'FiniteFlag', 'ALL_FINITE']


class AllFinite(object):
    """No flag for the round: its pushes go as they are, its finish flag unmarked."""

    def divide(self, buf):
        """Leave the send buffer `buf` as it is."""

    @staticmethod
    def mark(flag, overflow_mark):  # pylint: disable=unused-argument
        """The finish counter's `flag` of the round, unchanged."""
        return flag


class FiniteFlag(AllFinite):
    """The round's flag `flag` (a one-element NDArray, 1 or 0)."""

    def __init__(self, flag):
        self._flag = flag

    def divide(self, buf):
        """Divide the send buffer `buf` by the flag, in place, after the encode: x / 1 is x bit
        for bit; x / 0 is inf or nan for every x (docs/design.md §11). The push waits in
        MXNet's engine for the flag, i.e. for the end of backward."""
        nd.broadcast_div(buf, self._flag.as_in_context(buf.context), out=buf)

    def mark(self, flag, overflow_mark):
        """`flag` plus `overflow_mark` where the flag is 0 (1 + overflowed at the round's
        mark), in MXNet's engine: no wait for the gradients here."""
        return flag + nd.broadcast_mul(overflow_mark, 1 - self._flag.as_in_context(flag.context))


#: A round without a flag.
ALL_FINITE = AllFinite()
