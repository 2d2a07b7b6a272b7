"""One server's rounds: authoritative weights, optimizer, rounds applied in order.

The native server (sync mode) calls the updater once a slot key holds one push from every
worker: one round of one chunk (docs/design.md §3). :class:`RoundKeeper` turns slot
completions back into one global update per chunk per round:

- it keeps the authoritative weights ``W`` and the optimizer state of every chunk; ``W`` is
  the stored value of the slot of the chunk's last applied round (no array of its own);
- when round t of chunk c completes (in slot ``t mod R``) it applies the optimizer once to
  ``W_t`` with the round's summed gradient, writing ``W_{t+1}`` straight into that slot's
  stored value, which the native server returns to every pull of the slot (with float16
  pushes: into the slot's pull key);
- rounds are applied in order: a round that completes before an earlier one (a worker's
  engine may send two pushes of different slots out of order) is held until the earlier
  rounds are applied.

Memory per chunk of n floats: the native server's R stored values (the newest is ``W``) and R
merge buffers, the optimizer state (n per momentum buffer), plus a copy of a round's
gradient while it waits for an earlier round: (2R + state) * n floats.
"""
import logging
import math
import types

import mxnet as mx

from . import sparse
from .optimizers import flatten_state

__all__ = ['RoundKeeper', 'is_plain_sgd', 'store_counter']

_LOG = logging.getLogger(__name__)


def is_plain_sgd(optimizer):
    """Whether `optimizer` is exactly ``mx.optimizer.SGD`` without multi-precision (the
    server then applies it with the single-tensor kernels)."""
    return type(optimizer) is mx.optimizer.SGD and not optimizer.multi_precision  # noqa: E721


class RoundKeeper(object):
    """The rounds of one server's chunks.

    Parameters
    ----------
    slots : int, optional
        Slot keys per chunk (R); set before the first round (the server learns it from the
        workers' hand-shake).
    """

    def __init__(self, slots=None):
        self.slots = slots
        self.optimizer = None
        self.updater = None            # mx.optimizer.Updater over chunk ids
        self.counters = set()          # chunk ids that store a round's sum (finish counter)
        self.skip_nonfinite = False    # AMP: a round whose sum is not finite is skipped
        self.skipped = {}              # chunk id -> rounds skipped for a non-finite sum
        self.weights = {}              # chunk id -> W: the stored value of its last round
        self.next_round = {}           # chunk id -> round whose completion is applied next
        self._slot_round = {}          # (chunk, slot) -> round of the slot's next completion
        self.held = {}                 # chunk id -> {round: (gradient copy, stored)}
        # (chunk, slot) -> the stored array of the slot's pull key (float16 pushes,
        # docs/design.md §2.11): W is written there instead of into the slot's own.
        self.pull_stores = {}
        self._multipliers = {}         # chunk id -> (lr_mult, wd_mult)

    @property
    def started(self):
        """Whether any round has been applied (or restored)."""
        return bool(self.weights)

    def set_multipliers(self, chunk, lr_mult, wd_mult):
        """The lr_mult and wd_mult of the Parameter that `chunk` belongs to."""
        self._multipliers[chunk] = types.SimpleNamespace(lr_mult=lr_mult, wd_mult=wd_mult)

    def install(self, optimizer, states=None):
        """Apply `optimizer` from now on, with fresh state or the saved updater `states`
        (which also restore the saved optimizer)."""
        updater = mx.optimizer.get_updater(optimizer or mx.optimizer.SGD())
        if states is not None:
            updater.set_states(states)
        self.updater, self.optimizer = updater, updater.optimizer
        # The optimizer keys its state by chunk id; lr_mult and wd_mult come from the
        # worker's Parameters (MXNet's stock server loses them: param_dict is not pickled).
        # The same dict: chunks registered later are seen too.
        self.optimizer.param_dict = self._multipliers

    def on_round(self, chunk, slot, merged, stored):
        """Slot `slot` of `chunk` completed a round: the sum is `merged`; `stored` is what
        pulls of the slot return (unless the slot has a pull key: then that key's stored
        array). Apply it now if it is the next round, else hold it."""
        stored = self.pull_stores.get((chunk, slot), stored)
        next_round = self.next_round.setdefault(chunk, 0)
        if chunk not in self.weights:
            # Every slot (pull key) was initialised with the same initial value, W_0.
            self.weights[chunk] = stored
        rnd = self._slot_round.get((chunk, slot))
        if rnd is None:
            rnd = next_round + (slot - next_round) % self.slots
        self._slot_round[(chunk, slot)] = rnd + self.slots
        if rnd != next_round:
            self.held.setdefault(chunk, {})[rnd] = (merged.copy(), stored)
            _LOG.debug('chunk %d round %d completed before round %d; held', chunk, rnd,
                       next_round)
            return
        self._apply(chunk, merged, stored)
        # The native server waits only for the stored array of the key it called us for;
        # a pull key is another key, and a pull of it reads its bytes without waiting.
        stored.wait_to_read()
        held = self.held.get(chunk, {})
        while self.next_round[chunk] in held:
            grad, later_stored = held.pop(self.next_round[chunk])
            self._apply(chunk, grad, later_stored)
            later_stored.wait_to_read()

    def _apply(self, chunk, grad, stored):
        # W_t is the stored value of the previous round's slot, which the workers may still
        # pull: it is only read. W_{t+1} goes into this round's `stored`, which becomes W:
        # no copy of W per round with plain SGD or without an optimizer (one before), and n
        # floats less per chunk (docs/design.md §3.5). copyto, not `a[:] = b`: the same copy
        # without Python's indexing machinery (a third of the updater time, py-spy).
        weight = self.weights[chunk]
        dense = stored.stype == 'default'
        if chunk in self.counters:
            store_counter(grad, weight, stored)
        elif self.skip_nonfinite and not _first_is_finite(grad):
            # An overflowed round (docs/design.md §11): a worker whose gradients were not all
            # finite pushed them divided by 0, so every element of every chunk's sum is
            # inf or nan; one element decides. Weights, optimizer state and update count
            # stay, as gluon.Trainer skips the step; the round still counts as a round.
            self.skipped[chunk] = self.skipped.get(chunk, 0) + 1
            _copy(weight, stored)
        elif self.updater is None:
            if dense:
                grad.copyto(stored)  # the round's sum: MXNet's server without optimizer
            else:
                sparse.copy_all_rows(grad, stored)  # a pull may ask for any row (§2.10)
        elif is_plain_sgd(self.optimizer) and dense:  # else: lazy (§2.10)
            sgd_step(self.optimizer, self.updater, chunk, grad, weight, out=stored)
        else:
            _copy(weight, stored)
            self.updater(chunk, grad, stored)
        self.weights[chunk] = stored
        self.next_round[chunk] += 1

    def copy_state(self, chunk, j, stored):
        """A round of `chunk`'s state key `j` completed: write array j of the chunk's
        optimizer state (:func:`kvstore_ext.optimizers.flatten_state`) into `stored`, which
        the workers' pulls of that key return (docs/design.md §2.9). The workers push it
        once every round up to the switch is applied, and no later round before its pull."""
        state = self.updater.states.get(chunk) if self.updater is not None else None
        arrays = flatten_state(state)
        if j >= len(arrays):
            raise ValueError('state key %d of chunk %d: the chunk\'s optimizer state has %d '
                             'arrays (after %d rounds)' % (j, chunk, len(arrays),
                                                           self.next_round.get(chunk, 0)))
        # A row_sparse chunk's state (lazy updates, §2.10) is row_sparse: sent dense.
        array = arrays[j] if arrays[j].stype == 'default' else arrays[j].tostype('default')
        if array.size != stored.size:
            raise ValueError('state array %d of chunk %d has %d elements, the chunk %d: the '
                             'optimizer state is not elementwise' % (j, chunk, array.size,
                                                                     stored.size))
        array.reshape(stored.shape).copyto(stored)

    def in_flight(self):
        """Whether a round is held (completed before an earlier one)."""
        return any(self.held.values())

    def chunk_state(self, chunk):
        """What a checkpoint saves of `chunk`: its weights (numpy, None before its first
        round) and their storage type, and its next round."""
        weight = self.weights.get(chunk)
        return {'weight': None if weight is None else weight.asnumpy(),
                'stype': 'default' if weight is None else weight.stype,
                'next_round': self.next_round.get(chunk, 0),
                'skipped': self.skipped.get(chunk, 0)}

    def restore_chunk(self, chunk, weight, next_round, skipped=0, stype='default'):
        """Take `chunk`'s saved weights (numpy or None) of storage type `stype`, next round
        and skipped rounds; drop held rounds."""
        self.skipped[chunk] = skipped
        if weight is not None:
            restored = mx.nd.array(weight, dtype=weight.dtype)
            if stype == 'row_sparse':
                # Full-row, as at init (§2.10): MXNet's lazy update of a row_sparse weight
                # with row_sparse state; a dense W would fall back to the standard update.
                restored = mx.nd.sparse.row_sparse_array(
                    (restored, mx.nd.arange(weight.shape[0], dtype='int64')),
                    shape=weight.shape, dtype=weight.dtype)
            self.weights[chunk] = restored
        self.next_round[chunk] = next_round
        self.held.pop(chunk, None)
        for slot in range(self.slots):
            self._slot_round.pop((chunk, slot), None)


def _copy(source, target):
    if source is not target:
        source.copyto(target)


def _first_is_finite(array):
    return math.isfinite(array.reshape((-1,))[0:1].asnumpy()[0])


def store_counter(total, counter, out=None):
    """Store round sum `total` of the finish counter, whose value was `counter` (numpy-sized),
    into `out` (default: `counter`).

    Elements 0 and 1 take the round's sums (the finish votes, docs/design.md §5). The rest
    is a ring of the last R rounds' overflow marks (docs/design.md §11): in round t every
    worker pushes 1, plus 1 if its gradients overflowed, at element ``2 + t mod R`` and 0
    elsewhere, so the element that is not 0 is round t's and the others keep older rounds.
    """
    values = total.asnumpy()
    ring = counter.asnumpy()
    marked = values != 0
    marked[:2] = True
    ring[marked] = values[marked]
    mx.nd.array(ring, dtype=ring.dtype).copyto(counter if out is None else out)


def sgd_step(optimizer, updater, index, grad, weight, out=None):
    """Apply plain SGD (with or without momentum) to one tensor, as ``optimizer.SGD`` does,
    writing the new weights into `out` (default: `weight`, in place).

    ``optimizer.SGD`` goes through Python code made for lists of tensors; this calls the
    kernels it ends in directly, with the same arithmetic, so that a round gives the same
    bits as MXNet's server (tested against a stock job): ``sgd_mom_update`` with momentum
    (identical to ``multi_sgd_mom_update`` for one tensor), and ``multi_sgd_update`` without
    (``sgd_update`` rounds ``(1 - lr*wd)*w - lr*g`` differently from its ``w - (lr*wd*w +
    lr*g)``). The state lives in `updater`, so that saving and loading it is unchanged.
    """
    if index not in updater.states:
        updater.states[index] = optimizer.create_state(index, weight)
        updater.states_synced[index] = True
    optimizer._update_count(index)  # pylint: disable=protected-access
    kwargs = {'lr': optimizer._get_lr(index), 'wd': optimizer._get_wd(index),  # pylint: disable=protected-access
              'rescale_grad': optimizer.rescale_grad}
    if optimizer.clip_gradient:
        kwargs['clip_gradient'] = optimizer.clip_gradient
    momentum = updater.states[index]
    out = weight if out is None else out
    if momentum is not None:
        mx.nd.sgd_mom_update(weight, grad, momentum, out=out, momentum=optimizer.momentum,
                             **kwargs)
    else:
        mx.nd.multi_sgd_update(weight, grad, out=out, num_weights=1,
                               lrs=(kwargs.pop('lr'),), wds=(kwargs.pop('wd'),), **kwargs)
