"""Aux states sent by command: the ``AUX`` command and the values it brings for a round.

With quantized pushes an aux chunk's (BatchNorm's running statistics) round carries zeros,
and each worker sends its float32 values by command before its push; the round then writes
the sum of all workers' values (docs/design.md §2.13). Every server hears every worker's
command and keeps its own chunks' values until their round takes them.
"""
import numpy as np

from kvstore_ext.protocol.commands import check_rank, field

__all__ = ['AuxValues']


class AuxValues(object):
    """The aux values that wait for their chunk's next round."""

    def __init__(self):
        # chunk id -> (workers expected, {rank: float32 array})
        self._values = {}

    def command(self, body, chunks, num_workers):
        """The ``aux`` command `body`: keep its values of this server's aux `chunks` (the
        :class:`kvstore_ext.server.registry.ChunkRegistry`) for their next round, which
        takes the values of all `num_workers` workers."""
        rank = check_rank(body, num_workers)
        taken = {}
        for text, values in field(body, 'chunks', dict).items():
            chunk = int(text) if isinstance(text, str) and text.isdigit() else None
            if chunk is None or not isinstance(values, list) or not all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
                raise ValueError('command aux: chunks must map chunk ids to lists of numbers, '
                                 'got %.60r: %.60r' % (text, values))
            if chunk not in chunks:
                continue   # another server's
            if not chunks.is_aux(chunk) or len(values) != chunks.size(chunk):
                raise ValueError('command aux: chunk %d is not an aux chunk of %d elements '
                                 '(got %d values)' % (chunk, chunks.size(chunk), len(values)))
            taken[chunk] = np.array(values, dtype=np.float32)
        for chunk, values in taken.items():
            self._values.setdefault(chunk, (num_workers, {}))[1][rank] = values
        return {'chunks': len(taken)}

    def take(self, chunk):
        """The workers' values for `chunk`'s round now applied, by rank (None if none were
        sent: its pushes carry the values).

        Raises
        ------
        RuntimeError
            If some worker's values are missing.
        """
        if chunk not in self._values:
            return None
        expected, known = self._values.pop(chunk)
        if len(known) != expected:
            raise RuntimeError('aux chunk %d: a round with the values of workers %s, not of all '
                               '%d: every worker sends them before its push'
                               % (chunk, sorted(known), expected))
        return [known[rank] for rank in sorted(known)]
