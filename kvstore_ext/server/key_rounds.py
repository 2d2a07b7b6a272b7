"""A key's completed round, handled by the kind of the key: one handler per kind.

The native server calls the updater with an integer key. The job's
:class:`~kvstore_ext.protocol.keys.KeyLayout` (from the hand-shake) decodes it into its kind
and its chunk's local index (docs/design.md §2.6), and each kind has its handler, chosen
once when the layout is known:

- ``status``: the hand-shake round, which also gives the server its status key;
- ``slot``: a round of a chunk, applied in order (:class:`~kvstore_ext.server.rounds.RoundKeeper`);
- ``pull`` and ``model``: the workers' round of zeros at init, which gives the server the
  stored arrays that W and the compressed pulls' payloads go to
  (:mod:`kvstore_ext.server.pulled`);
- ``state``: a copy of the chunk's optimizer state for the workers (docs/design.md §2.9).
"""
__all__ = ['KeyRounds']


class KeyRounds(object):
    """The updater's rounds of a job whose key layout is known.

    Parameters
    ----------
    layout : kvstore_ext.protocol.keys.KeyLayout
    chunks : kvstore_ext.server.registry.ChunkRegistry
    rounds : kvstore_ext.server.rounds.RoundKeeper
    job : kvstore_ext.server.job.Job
    status_round : callable
        ``status_round(stored)``: the hand-shake round of the status key `stored`.
    """

    def __init__(self, layout, chunks, rounds, job, status_round):
        self._layout = layout
        self._chunks = chunks
        self._rounds = rounds
        self._job = job
        self._status_round = status_round
        self._by_kind = {
            'status': self._status,
            # With pull keys (float16 or blockwise pushes), a chunk that pulls them must
            # have them before its first round.
            'slot': self._checked_slot if layout.pull_keys else self._slot,
            'pull': self._pull,
            'model': self._model,
            'state': self._state,
        }

    def complete_round(self, key, merged, stored):
        """`key`'s round completed with sum `merged` into `stored`."""
        kind, local, index = self._layout.decode(key)
        self._by_kind[kind](key, local, index, merged, stored)

    def _chunk(self, key, local):
        if local >= self._chunks.local_count():
            raise RuntimeError('key %d is chunk %d of server %d, which registered %d chunks'
                               % (key, local, self._job.server_rank,
                                  self._chunks.local_count()))
        return self._chunks.chunk_at(local)

    def _status(self, key, local, index, merged, stored):
        self._status_round(stored)

    def _slot(self, key, local, slot, merged, stored):
        self._rounds.on_round(self._chunk(key, local), slot, merged, stored)

    def _checked_slot(self, key, local, slot, merged, stored):
        chunk = self._chunk(key, local)
        if not self._chunks.reads_slot_keys(chunk) and not self._rounds.pulls.has_store(chunk,
                                                                                     slot):
            raise RuntimeError('chunk %d slot %d completed a round before its pull key '
                               'was set up' % (chunk, slot))
        self._rounds.on_round(chunk, slot, merged, stored)

    def _pull(self, key, local, index, merged, stored):
        # The workers' round of zeros at init (worker/wires/pull_keys.py, push_handle_round):
        # keep the stored array, leave its value (W_0), write W into it from now on.
        self._rounds.pulls.set_store(self._chunk(key, local), index, stored)

    def _model(self, key, local, index, merged, stored):
        # The workers' round of zeros at init (worker/wires/pulls.py, CompressedPulls):
        # the compressed pulls' payloads go into this stored array.
        self._rounds.models.set_store(self._chunk(key, local), stored)

    def _state(self, key, local, j, merged, stored):
        self._rounds.updates.copy_state(self._chunk(key, local), j, stored)
