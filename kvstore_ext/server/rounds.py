"""One server's rounds: authoritative weights, optimizer, rounds applied in order.

The native server (sync mode) calls the updater once a slot key holds one push from every
worker: one round of one chunk (docs/design.md §3). :class:`RoundKeeper` turns slot
completions back into one global update per chunk per round:

- it keeps the authoritative weights ``W`` and the optimizer state of every chunk; ``W`` is
  the stored value of the slot of the chunk's last applied round (no array of its own);
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
import types

import mxnet as mx
import numpy as np

from kvstore_ext.server import appliers
# The kernels are importable from here too (the test seam runs the servers' plain SGD).
from kvstore_ext.server.appliers import is_plain_sgd, sgd_step, store_counter  # noqa: F401
from kvstore_ext.optim.optimizers import flatten_state

__all__ = ['RoundKeeper', 'ServerModel', 'is_plain_sgd', 'sgd_step', 'store_counter']

_LOG = logging.getLogger(__name__)


class RoundKeeper(object):
    """The rounds of one server's chunks.

    Every choice that changes how a chunk's round is applied is made when its information
    arrives (:meth:`register`, :meth:`install`, :meth:`set_skip_nonfinite`, a chunk's first
    round or :meth:`restore_chunk`), and picks the chunk's applier; :meth:`on_round` only
    calls it.

    Parameters
    ----------
    slots : int, optional
        Slot keys per chunk (R); set before the first round (:meth:`set_slots`: the server
        learns it from the workers' hand-shake).
    updater_errors : callable, optional
        What to do when the optimizer's update raises (:data:`appliers.UPDATER_ERRORS`):
        called as ``updater_errors(optimizer, where, error)``; default
        :class:`appliers.StopOnError`.
    """

    def __init__(self, slots=None, updater_errors=None):
        self._slots = slots
        self._updater_errors = updater_errors or appliers.StopOnError()
        self._names = {}               # chunk id -> its parameter's name (for messages)
        self._updater = None           # mx.optimizer.Updater over chunk ids
        self._skip_nonfinite = False   # AMP: a round whose sum is not finite is skipped
        self._kinds = {}               # chunk id -> appliers.COUNTER or its storage type
        self._codecs = {}              # chunk id -> codec settings (appliers.check_codec)
        self._appliers = {}            # chunk id -> its applier, once its kind is known
        self._skipped = {}             # chunk id -> rounds skipped for a non-finite sum
        self._weights = {}             # chunk id -> W: the stored value of its last round
        self._next_round = {}          # chunk id -> round whose completion is applied next
        self._slot_round = {}          # (chunk, slot) -> round of the slot's next completion
        self._held = {}                # chunk id -> {round: (gradient copy, stored)}
        # (chunk, slot) -> the stored array of the slot's pull key (float16 pushes,
        # docs/design.md §2.11): W is written there instead of into the slot's own.
        self._pull_stores = {}
        self._multipliers = {}         # chunk id -> (lr_mult, wd_mult)
        # The optimizer's idx2name by chunk id, for the names in the workers' idx2name
        # (install): those names, and the dict the optimizer holds.
        self._indexed_names = frozenset()
        self._chunk_names = {}
        # Compressed pulls (docs/design.md §2.12): the codec and the pulled rounds, and per
        # chunk its pulled model x̂ (ServerModel) with the model key's array.
        self._pull_codec = self._pull_schedule = None
        self._models = {}              # chunk id -> ServerModel
        self._model_stores = {}        # chunk id -> the model key's stored array
        # Aux chunks' values sent by command for their next round (quantized pushes,
        # docs/design.md §2.13): chunk id -> (workers expected, {rank: float32 array}).
        self._aux_values = {}

    # -- what arrives before the rounds -----------------------------------------------------
    def set_slots(self, slots):
        """The number of slot keys per chunk (R)."""
        self._slots = slots

    def set_skip_nonfinite(self, skip):
        """AMP (the hand-shake's ``amp``): skip rounds whose sum is not finite (§11)."""
        self._skip_nonfinite = bool(skip)
        self._choose_all()

    def register(self, chunk, lr_mult=1.0, wd_mult=1.0, counter=False, codec=None, name=None):
        """`chunk` belongs to a Parameter with `lr_mult` and `wd_mult` (and `name`, for
        messages); it is the finish counter (`counter`), or a tensor's chunk with codec
        settings `codec` (a dict, :func:`kvstore_ext.server.appliers.check_codec`)."""
        self._multipliers[chunk] = types.SimpleNamespace(lr_mult=lr_mult, wd_mult=wd_mult)
        self._names[chunk] = name
        if name in self._indexed_names:
            self._chunk_names[chunk] = name
        self._codecs[chunk] = dict(codec or {})
        if counter:
            self._kinds[chunk] = appliers.COUNTER
        self._choose(chunk)

    def set_pull_store(self, chunk, slot, stored):
        """`stored` is the stored array of `chunk`'s pull key `slot` (float16 pushes): W is
        written there from now on (its value, W_0, is kept)."""
        self._pull_stores[(chunk, slot)] = stored

    def set_pull_model(self, codec, schedule):
        """Compressed pulls: at every round `schedule` pulls, write `codec`'s payload into
        each chunk's model key (the hand-shake's ``pull_compression``)."""
        self._pull_codec, self._pull_schedule = codec, schedule

    def set_model_store(self, chunk, stored):
        """`stored` is the stored array of `chunk`'s model key: the payloads go there."""
        self._model_stores[chunk] = stored
        if chunk in self._models:
            self._models[chunk].store = stored

    def has_pull_store(self, chunk, slot):
        """Whether :meth:`set_pull_store` was called for `chunk`'s `slot`."""
        return (chunk, slot) in self._pull_stores

    def install(self, optimizer, states=None):
        """Apply `optimizer` from now on, with fresh state or the saved updater `states`
        (which also restore the saved optimizer)."""
        updater = mx.optimizer.get_updater(optimizer or mx.optimizer.SGD())
        if states is not None:
            updater.set_states(states)
        self._updater = updater
        # The optimizer keys its state by chunk id; lr_mult and wd_mult come from the
        # worker's Parameters (MXNet's stock server loses them: param_dict is not pickled).
        # The same dict: chunks registered later are seen too.
        updater.optimizer.param_dict = self._multipliers
        # idx2name names the workers' keys (the Module API's Parameter indexes; Gluon leaves
        # it empty), and LARS reads it: no ratio for names ending in bias, gamma or beta.
        # The servers key the optimizer by chunk id: each chunk gets its Parameter's name if
        # the workers' idx2name holds it, as MXNet's server, keyed by Parameter, finds it.
        self._indexed_names = frozenset(updater.optimizer.idx2name.values())
        self._chunk_names = {chunk: name for chunk, name in self._names.items()
                             if name in self._indexed_names}
        updater.optimizer.idx2name = self._chunk_names
        self._choose_all()

    def _choose(self, chunk):
        kind = self._kinds.get(chunk)
        if kind is not None:
            self._appliers[chunk] = appliers.choose(
                kind, self._updater, self._codecs.get(chunk, {}), self._skip_nonfinite,
                self._count_skip, self._take_aux, self._updater_failed)

    def _choose_all(self):
        for chunk in self._kinds:
            self._choose(chunk)

    def set_aux_values(self, chunk, rank, values, num_workers):
        """Worker `rank`'s aux states `values` (float32 numpy) for aux `chunk`'s next round,
        whose pushes are zeros; that round writes the sum of the `num_workers` workers'."""
        expected, known = self._aux_values.setdefault(chunk, (num_workers, {}))
        known[rank] = values

    def _take_aux(self, chunk):
        if chunk not in self._aux_values:
            return None
        expected, known = self._aux_values.pop(chunk)
        if len(known) != expected:
            raise RuntimeError('aux chunk %d: a round with the values of workers %s, not of all '
                               '%d: every worker sends them before its push'
                               % (chunk, sorted(known), expected))
        return [known[rank] for rank in sorted(known)]

    def _updater_failed(self, chunk, error):
        where = 'chunk %d (parameter %r) in round %d' % (chunk, self._names.get(chunk),
                                                         self._next_round[chunk])
        self._updater_errors(self._updater.optimizer, where, error)

    def _count_skip(self, chunk):
        self._skipped[chunk] = self._skipped.get(chunk, 0) + 1

    # -- the rounds -------------------------------------------------------------------------
    def on_round(self, chunk, slot, merged, stored):
        """Slot `slot` of `chunk` completed a round: the sum is `merged`; `stored` is what
        pulls of the slot return (unless the slot has a pull key: then that key's stored
        array). Apply it now if it is the next round, else hold it."""
        stored = self._pull_stores.get((chunk, slot), stored)
        next_round = self._next_round.setdefault(chunk, 0)
        if chunk not in self._weights:
            # Every slot (pull key) was initialised with the same initial value, W_0; its
            # storage type is the chunk's kind, unless it is the finish counter.
            self._weights[chunk] = stored
            self._kinds.setdefault(chunk, stored.stype)
            self._choose(chunk)
            if chunk in self._model_stores and chunk not in self._models:
                self._start_model(chunk, stored.asnumpy())
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
        self._appliers[chunk].apply(chunk, grad, self._weights[chunk], stored)
        self._weights[chunk] = stored
        model = self._models.get(chunk)
        if model is not None and self._pull_schedule.pulled(self._next_round[chunk]):
            # Every worker pulls this round: its payload must be in the model key before
            # the round is acknowledged (the native server answers pulls from it in C++).
            model.broadcast(stored)
        self._next_round[chunk] += 1

    def _start_model(self, chunk, initial):
        model = ServerModel(self._pull_codec, initial)
        model.store = self._model_stores[chunk]
        self._models[chunk] = model

    def copy_state(self, chunk, j, stored):
        """A round of `chunk`'s state key `j` completed: write array j of the chunk's
        optimizer state (:func:`kvstore_ext.optim.optimizers.flatten_state`) into `stored`, which
        the workers' pulls of that key return (docs/design.md §2.9). The workers push it
        once every round up to the switch is applied, and no later round before its pull."""
        state = self._updater.states.get(chunk) if self._updater is not None else None
        arrays = flatten_state(state)
        if j >= len(arrays):
            raise ValueError('state key %d of chunk %d: the chunk\'s optimizer state has %d '
                             'arrays (after %d rounds)' % (j, chunk, len(arrays),
                                                           self._next_round.get(chunk, 0)))
        # A row_sparse chunk's state (lazy updates, §2.10) is row_sparse: sent dense.
        array = arrays[j] if arrays[j].stype == 'default' else arrays[j].tostype('default')
        if array.size != stored.size:
            raise ValueError('state array %d of chunk %d has %d elements, the chunk %d: the '
                             'optimizer state is not elementwise' % (j, chunk, array.size,
                                                                     stored.size))
        array.reshape(stored.shape).copyto(stored)

    # -- what the server reads --------------------------------------------------------------
    @property
    def optimizer(self):
        """The installed optimizer (None before :meth:`install`)."""
        return None if self._updater is None else self._updater.optimizer

    @property
    def updater(self):
        """The ``mx.optimizer.Updater`` that holds the optimizer state, keyed by chunk id."""
        return self._updater

    @property
    def started(self):
        """Whether any round has been applied (or restored)."""
        return bool(self._weights)

    @property
    def skips_nonfinite(self):
        """Whether rounds whose sum is not finite are skipped (AMP)."""
        return self._skip_nonfinite

    def in_flight(self):
        """Whether a round is held (completed before an earlier one)."""
        return any(self._held.values())

    def applied_rounds(self, chunk):
        """The number of `chunk`'s rounds applied (skipped ones included): its next round."""
        return self._next_round.get(chunk, 0)

    def held_rounds(self, chunk):
        """The number of `chunk`'s rounds that wait for an earlier one."""
        return len(self._held.get(chunk, {}))

    def skipped_rounds(self, chunk):
        """The number of `chunk`'s rounds skipped for a non-finite sum."""
        return self._skipped.get(chunk, 0)

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
                 'skipped': self._skipped.get(chunk, 0)}
        if chunk in self._models:
            state['model'] = self._models[chunk].model.copy()   # x̂ (compressed pulls)
        return state

    def model(self, chunk):
        """`chunk`'s pulled model x̂ (numpy, to read; None without compressed pulls or
        before its first round)."""
        model = self._models.get(chunk)
        return None if model is None else model.model

    def restore_chunk(self, chunk, weight, next_round, skipped=0, stype='default', model=None):
        """Take `chunk`'s saved weights (numpy or None) of storage type `stype`, next round,
        skipped rounds and pulled model x̂ (compressed pulls); drop held rounds."""
        self._skipped[chunk] = skipped
        if model is not None and chunk in self._model_stores:
            self._start_model(chunk, model)
        if weight is not None:
            restored = mx.nd.array(weight, dtype=weight.dtype)
            if stype == 'row_sparse':
                # Full-row, as at init (§2.10): MXNet's lazy update of a row_sparse weight
                # with row_sparse state; a dense W would fall back to the standard update.
                restored = mx.nd.sparse.row_sparse_array(
                    (restored, mx.nd.arange(weight.shape[0], dtype='int64')),
                    shape=weight.shape, dtype=weight.dtype)
            self._weights[chunk] = restored
            if self._kinds.get(chunk) != appliers.COUNTER:
                self._kinds[chunk] = stype
            self._choose(chunk)
        self._next_round[chunk] = next_round
        self._held.pop(chunk, None)
        for slot in range(self._slots):
            self._slot_round.pop((chunk, slot), None)


# -- the server ------------------------------------------------------------------------------
class ServerModel(object):
    """A server's ``x̂`` of one chunk and the stored array of its model key.

    Parameters
    ----------
    codec : PullCodec
    initial : numpy.ndarray
        W_0 (flat float32): the workers start from it too.
    """

    def __init__(self, codec, initial):
        self.codec = codec
        self.model = np.array(initial, dtype=np.float32).reshape(-1)
        self.store = None   # the model key's stored NDArray, from the workers' zero round

    def broadcast(self, weight):
        """Round applied, pulled by every worker: write ``C(W - x̂)`` into the model key and
        advance ``x̂`` by what it carries. `weight` is W (an NDArray)."""
        d = weight.asnumpy().reshape(-1) - self.model
        payload, dec = self.codec.encode(d)
        self.model = self.model + dec
        self.store[:] = payload   # a synchronous copy: pulls read the bytes at once
