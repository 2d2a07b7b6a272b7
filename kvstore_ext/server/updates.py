"""How each chunk's round is applied: the optimizer, and every chunk's applier chosen once.

A chunk's applier (:mod:`kvstore_ext.server.appliers`) depends on its kind (the finish
counter, or its storage type), its codec settings, the optimizer and AMP's skipping of
overflowed rounds. :class:`ChunkUpdates` chooses it again whenever one of these arrives
(``REGISTER``, ``OPTIMIZER`` or a load, the hand-shake, a chunk's first round), never per
round (docs/design.md §3.2). It also holds the optimizer state, which the workers' state
keys read (:meth:`ChunkUpdates.copy_state`, docs/design.md §2.9).
"""
import types

import mxnet as mx

from kvstore_ext.optim.optimizers import flatten_state
from kvstore_ext.server import appliers

__all__ = ['ChunkUpdates']


class ChunkUpdates(object):
    """The optimizer of one server's chunks and each chunk's applier.

    Parameters
    ----------
    take_aux : callable
        ``take_aux(chunk)``: the workers' values of an aux chunk's round, or None
        (:meth:`kvstore_ext.server.aux.AuxValues.take`).
    round_of : callable
        ``round_of(chunk)``: the number of the chunk's next round (for messages).
    updater_errors : callable, optional
        What to do when the optimizer's update raises (:data:`appliers.UPDATER_ERRORS`):
        called as ``updater_errors(optimizer, where, error)``; default
        :class:`appliers.StopOnError`.
    """

    def __init__(self, take_aux, round_of, updater_errors=None):
        self._take_aux = take_aux
        self._round_of = round_of
        self._updater_errors = updater_errors or appliers.StopOnError()
        self._names = {}               # chunk id -> its parameter's name (for messages)
        self._updater = None           # mx.optimizer.Updater over chunk ids
        self._skip_nonfinite = False   # AMP: a round whose sum is not finite is skipped
        self._kinds = {}               # chunk id -> appliers.COUNTER or its storage type
        self._codecs = {}              # chunk id -> codec settings (appliers.check_codec)
        self._appliers = {}            # chunk id -> its applier, once its kind is known
        self._skipped = {}             # chunk id -> rounds skipped for a non-finite sum
        self._multipliers = {}         # chunk id -> (lr_mult, wd_mult)
        # The optimizer's idx2name by chunk id, for the names in the workers' idx2name
        # (install): those names, and the dict the optimizer holds.
        self._indexed_names = frozenset()
        self._chunk_names = {}

    # -- what arrives before the rounds -----------------------------------------------------
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

    def set_skip_nonfinite(self, skip):
        """AMP (the hand-shake's ``amp``): skip rounds whose sum is not finite (§11)."""
        self._skip_nonfinite = bool(skip)
        self._choose_all()

    def set_storage(self, chunk, stype):
        """`chunk`'s weights are of storage type `stype` (its first round, or a load): its
        kind, unless it is the finish counter."""
        if self._kinds.get(chunk) != appliers.COUNTER:
            self._kinds[chunk] = stype
        self._choose(chunk)

    def restore_skipped(self, chunk, skipped):
        """A checkpoint's count of `chunk`'s skipped rounds."""
        self._skipped[chunk] = skipped

    def _choose(self, chunk):
        kind = self._kinds.get(chunk)
        if kind is not None:
            self._appliers[chunk] = appliers.choose(
                kind, self._updater, self._codecs.get(chunk, {}), self._skip_nonfinite,
                self._count_skip, self._take_aux, self._updater_failed)

    def _choose_all(self):
        for chunk in self._kinds:
            self._choose(chunk)

    def _updater_failed(self, chunk, error):
        where = 'chunk %d (parameter %r) in round %d' % (chunk, self._names.get(chunk),
                                                         self._round_of(chunk))
        self._updater_errors(self._updater.optimizer, where, error)

    def _count_skip(self, chunk):
        self._skipped[chunk] = self._skipped.get(chunk, 0) + 1

    # -- the rounds -------------------------------------------------------------------------
    def apply(self, chunk, grad, weight, out):
        """Apply `chunk`'s round: its applier writes the update of `weight` by the round's
        sum `grad` into `out`."""
        self._appliers[chunk].apply(chunk, grad, weight, out)

    def copy_state(self, chunk, j, stored):
        """A round of `chunk`'s state key `j` completed: write array j of the chunk's
        optimizer state (:func:`kvstore_ext.optim.optimizers.flatten_state`) into `stored`,
        which the workers' pulls of that key return (docs/design.md §2.9). The workers push
        it once every round up to the switch is applied, and no later round before its
        pull."""
        state = self._updater.states.get(chunk) if self._updater is not None else None
        arrays = flatten_state(state)
        if j >= len(arrays):
            raise ValueError('state key %d of chunk %d: the chunk\'s optimizer state has %d '
                             'arrays (after %d rounds)' % (j, chunk, len(arrays),
                                                           self._round_of(chunk)))
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
    def skips_nonfinite(self):
        """Whether rounds whose sum is not finite are skipped (AMP)."""
        return self._skip_nonfinite

    def skipped_rounds(self, chunk):
        """The number of `chunk`'s rounds skipped for a non-finite sum."""
        return self._skipped.get(chunk, 0)
