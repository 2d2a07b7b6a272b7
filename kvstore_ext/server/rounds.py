"""One server's rounds: the authoritative weights, rounds applied in order, held rounds.

The native server (sync mode) calls the updater once a slot key holds one push from every
worker: one round of one chunk (docs/design.md §3). :class:`RoundKeeper` turns slot
completions back into one global update per chunk per round:

- it keeps the authoritative weights ``W`` of every chunk (the optimizer state is in
  :mod:`kvstore_ext.server.updates`); ``W`` is the stored value of the slot of the chunk's
  last applied round (no array of its own);
- when round t of chunk c completes (in slot ``t mod R``) the chunk's applier
  (:mod:`kvstore_ext.server.appliers`, chosen once per chunk) writes ``W_{t+1}`` from ``W_t`` and
  the round's summed gradient straight into that slot's stored value, which the native
  server returns to every pull of the slot (with float16 pushes: into the slot's pull key);
- rounds are applied in order: a round that completes before an earlier one (a worker's
  engine may send two pushes of different slots out of order) is held until the earlier
  rounds are applied.

Memory per chunk of n floats: the native server's R stored values (the newest is ``W``) and R
merge buffers, the optimizer state (n per momentum buffer), plus a copy of a round's
gradient while it waits for an earlier one: (2R + state) * n floats.
"""
import logging

import mxnet as mx

from kvstore_ext.server.aux import AuxValues
from kvstore_ext.server.pulled import PulledModels, PullStores, ServerModel
from kvstore_ext.server.updates import ChunkUpdates
# The kernels are importable from here too (the test seam runs the servers' plain SGD).
from kvstore_ext.server.appliers import is_plain_sgd, sgd_step, store_counter  # noqa: F401

__all__ = ['RoundKeeper', 'ServerModel', 'stats', 'is_plain_sgd', 'sgd_step', 'store_counter']

_LOG = logging.getLogger(__name__)


class RoundKeeper(object):
    """The rounds of one server's chunks, applied in order.

    Its parts, each a concern of its own:

    - :attr:`updates` (:class:`~kvstore_ext.server.updates.ChunkUpdates`): the optimizer and
      each chunk's applier, chosen when what decides it arrives; :meth:`on_round` only
      calls it;
    - :attr:`pulls` (:class:`~kvstore_ext.server.pulled.PullStores`): the pull keys that W
      goes to with float16 or blockwise pushes;
    - :attr:`models` (:class:`~kvstore_ext.server.pulled.PulledModels`): the model keys of
      compressed pulls;
    - :attr:`aux` (:class:`~kvstore_ext.server.aux.AuxValues`): aux values sent by command.

    Parameters
    ----------
    slots : int, optional
        Slot keys per chunk (R); set before the first round (:meth:`set_slots`: the server
        learns it from the workers' hand-shake).
    updater_errors : callable, optional
        What to do when the optimizer's update raises (:class:`ChunkUpdates`).
    """

    def __init__(self, slots=None, updater_errors=None):
        self._slots = slots
        self.aux = AuxValues()
        self.updates = ChunkUpdates(self.aux.take, self.applied_rounds, updater_errors)
        self.pulls = PullStores()
        self.models = PulledModels()
        self._weights = {}             # chunk id -> W: the stored value of its last round
        self._next_round = {}          # chunk id -> round whose completion is applied next
        self._slot_round = {}          # (chunk, slot) -> round of the slot's next completion
        self._held = {}                # chunk id -> {round: (gradient copy, stored)}
        #: ``after_round(chunk)``, if set, after each round applied, before any other round
        #: of the chunk: a save in the background that copies chunks at their round (§6.4).
        self.after_round = None

    def set_slots(self, slots):
        """The number of slot keys per chunk (R)."""
        self._slots = slots

    # -- the rounds -------------------------------------------------------------------------
    def on_round(self, chunk, slot, merged, stored):
        """Slot `slot` of `chunk` completed a round: the sum is `merged`; `stored` is what
        pulls of the slot return (unless the slot has a pull key: then that key's stored
        array). Apply it now if it is the next round, else hold it."""
        stored = self.pulls.target(chunk, slot, stored)
        next_round = self._next_round.setdefault(chunk, 0)
        if chunk not in self._weights:
            # Every slot (pull key) was initialised with the same initial value, W_0; its
            # storage type is the chunk's kind, unless it is the finish counter.
            self._weights[chunk] = stored
            self.updates.set_storage(chunk, stored.stype)
            self.models.start(chunk, stored)
        rnd = self._slot_round.get((chunk, slot))
        if rnd is None:
            rnd = next_round + (slot - next_round) % self._slots
        self._slot_round[(chunk, slot)] = rnd + self._slots
        if rnd != next_round:
            self._held.setdefault(chunk, {})[rnd] = (merged.copy(), stored)
            _LOG.debug('chunk %d round %d completed before round %d; held', chunk, rnd,
                       next_round)
            return
        self._apply(chunk, merged, stored)
        # The native server waits only for the stored array of the key it called us for;
        # a pull key is another key, and a pull of it reads its bytes without waiting.
        stored.wait_to_read()
        held = self._held.get(chunk, {})
        while self._next_round[chunk] in held:
            grad, later_stored = held.pop(self._next_round[chunk])
            self._apply(chunk, grad, later_stored)
            later_stored.wait_to_read()

    def _apply(self, chunk, grad, stored):
        # W_{t+1} goes into this round's `stored`, which becomes W (docs/design.md §3.5).
        self.updates.apply(chunk, grad, self._weights[chunk], stored)
        self._weights[chunk] = stored
        self.models.broadcast(chunk, self._next_round[chunk], stored)
        self._next_round[chunk] += 1
        if self.after_round is not None:
            self.after_round(chunk)

    # -- what the server reads --------------------------------------------------------------
    @property
    def started(self):
        """Whether any round has been applied (or restored)."""
        return bool(self._weights)

    def in_flight(self):
        """Whether a round is held (completed before an earlier one)."""
        return any(self._held.values())

    def applied_rounds(self, chunk):
        """The number of `chunk`'s rounds applied (skipped ones included): its next round."""
        return self._next_round.get(chunk, 0)

    def held_rounds(self, chunk):
        """The number of `chunk`'s rounds that wait for an earlier one."""
        return len(self._held.get(chunk, {}))

    def weight(self, chunk):
        """`chunk`'s W (the stored value of its last round; None before its first): to read."""
        return self._weights.get(chunk)

    # -- checkpoints ------------------------------------------------------------------------
    def chunk_state(self, chunk):
        """What a checkpoint saves of `chunk`: its weights (numpy, None before its first
        round) and their storage type, and its next round."""
        weight = self._weights.get(chunk)
        state = {'weight': None if weight is None else weight.asnumpy(),
                 'stype': 'default' if weight is None else weight.stype,
                 'next_round': self._next_round.get(chunk, 0),
                 'skipped': self.updates.skipped_rounds(chunk)}
        model = self.models.model(chunk)
        if model is not None:
            state['model'] = model.copy()   # x̂ (compressed pulls)
        return state

    def restore_chunk(self, chunk, weight, next_round, skipped=0, stype='default', model=None):
        """Take `chunk`'s saved weights (numpy or None) of storage type `stype`, next round,
        skipped rounds and pulled model x̂ (compressed pulls); drop held rounds."""
        self.updates.restore_skipped(chunk, skipped)
        self.models.restore(chunk, model)
        if weight is not None:
            restored = mx.nd.array(weight, dtype=weight.dtype)
            if stype == 'row_sparse':
                # Full-row, as at init (§2.10): MXNet's lazy update of a row_sparse weight
                # with row_sparse state; a dense W would fall back to the standard update.
                restored = mx.nd.sparse.row_sparse_array(
                    (restored, mx.nd.arange(weight.shape[0], dtype='int64')),
                    shape=weight.shape, dtype=weight.dtype)
            self._weights[chunk] = restored
            self.updates.set_storage(chunk, stype)
        self._next_round[chunk] = next_round
        self._held.pop(chunk, None)
        for slot in range(self._slots):
            self._slot_round.pop((chunk, slot), None)


def stats(rounds, chunks, server_rank):
    """The ``stats`` reply of server `server_rank`: per registered chunk (`chunks`, the
    :class:`~kvstore_ext.server.registry.ChunkRegistry`) its rounds applied and held (and
    skipped, under AMP); the finish counter's rounds apart."""
    updates = rounds.updates
    counters = [c for c in chunks.ids() if chunks.is_counter(c)]
    return {'server': server_rank,
            'chunks': {str(c): dict({'rounds': rounds.applied_rounds(c),
                                     'held': rounds.held_rounds(c)},
                                    **({'skipped': updates.skipped_rounds(c)}
                                       if updates.skips_nonfinite else {}))
                       for c in chunks.ids() if c not in counters},
            'finish_rounds': {str(c): rounds.applied_rounds(c) for c in counters}}
