"""What a server does with one chunk's completed round: one applier object per chunk.

An applier writes ``W_{t+1}`` into the round's stored value from ``W_t`` and the round's
summed gradient (docs/design.md §3.2). :func:`choose` picks a chunk's applier once, when
what decides it arrives: the chunk's kind (the finish counter at ``REGISTER``; dense or
row_sparse with its first round or at ``LOAD``), the optimizer (installed, replaced or
loaded), AMP (the hand-shake) and the chunk's codec settings (``REGISTER``; ``{'aux':
True}``: the chunk holds aux states, docs/design.md §2.13). The round keeper calls
``applier.apply(chunk, grad, weight, stored)`` and never asks again.

============================  ===========================================================
applier                       used for
============================  ===========================================================
:class:`StoreCounter`         the finish counter (docs/design.md §5)
:class:`CopySum`              a dense chunk without optimizer: the round's sum
:class:`AuxSum`               an aux chunk (§2.13): the round's sum, or the sum of the
                              values the workers sent by command for it
:class:`CopyAllRows`          a row_sparse chunk without optimizer (§2.10)
:class:`PlainSGD`             a dense chunk under plain SGD: the single-tensor kernels (§3.4)
:class:`OptimizerStep`        every other chunk: MXNet's updater (lazy for row_sparse, §2.10)
:class:`ScaleSum`             decorator: the sum times the codec's ``sum_scale``
:class:`DecodeRows`           decorator: the round's rows (one payload per worker, §2.14)
                              decoded and summed in rank order
:class:`SkipNonFinite`        decorator under AMP: an overflowed round is skipped (§11)
============================  ===========================================================

What a server does when the optimizer's update raises is a policy chosen once per server
(``MXDELAY_UPDATER_ERRORS``, :data:`UPDATER_ERRORS`): :class:`StopOnError` (the default)
raises :class:`UpdaterError`, which ends the job; :class:`LogAndGoOn` logs and goes on, as
MXNet's own server does. :class:`OptimizerStep` hands it the error.
"""
import logging
import math

import mxnet as mx
import numpy as np
from mxnet import nd

from kvstore_ext import codecs
from kvstore_ext.codecs import heap, host, kernels
from kvstore_ext.protocol.commands import AUX_SETTINGS as AUX
from kvstore_ext.protocol.counter import HEAD

__all__ = ['Applier', 'StoreCounter', 'CopySum', 'AuxSum', 'CopyAllRows', 'PlainSGD',
           'OptimizerStep', 'ScaleSum', 'DecodeRows', 'SkipNonFinite', 'COUNTER', 'AUX',
           'CODEC_SETTINGS', 'UPDATER_ERRORS', 'UpdaterError', 'StopOnError', 'LogAndGoOn',
           'check_codec', 'choose', 'is_plain_sgd', 'sgd_step', 'store_counter']

_LOG = logging.getLogger(__name__)

#: The kind of the finish counter's chunks; the others are their storage type.
COUNTER = 'counter'


class Applier(object):
    """Writes one chunk's next weights from its round.

    ``weight`` (``W_t``) is the stored value of the previous round's slot, which the workers
    may still pull: an applier only reads it. ``W_{t+1}`` goes into ``stored``, which then
    becomes ``W`` (no copy of ``W`` per round where the kernels take ``out=``, §3.5).
    """

    def apply(self, chunk, grad, weight, stored):
        """Write the weights after the round with summed gradient `grad` into `stored`."""
        raise NotImplementedError


class StoreCounter(Applier):
    """The finish counter: keeps the round's sums and its ring of overflow marks."""

    def apply(self, chunk, grad, weight, stored):
        store_counter(grad, weight, stored)


class CopySum(Applier):
    """No optimizer, dense: the round's sum, as MXNet's server without optimizer."""

    def apply(self, chunk, grad, weight, stored):
        grad.copyto(stored)


class AuxSum(Applier):
    """An aux chunk (docs/design.md §2.13): the round's sum, or, where the workers sent
    their values by command (quantized pushes: the round is one of zeros), their float32 sum
    in rank order. ``take(chunk)`` returns those values (None if none were sent)."""

    def __init__(self, take):
        self._take = take

    def apply(self, chunk, grad, weight, stored):
        values = self._take(chunk)
        if values is None:
            grad.copyto(stored)
            return
        total = values[0]
        for value in values[1:]:
            total = total + value
        mx.nd.array(total.reshape(stored.shape), dtype=stored.dtype).copyto(stored)


class CopyAllRows(Applier):
    """No optimizer, row_sparse: the sum in every row, since a pull may ask for any row."""

    def apply(self, chunk, grad, weight, stored):
        copy_all_rows(grad, stored)


class PlainSGD(Applier):
    """Plain SGD on a dense chunk through the kernels ``optimizer.SGD`` ends in
    (:func:`sgd_step`), writing straight into `stored`."""

    def __init__(self, updater):
        self._updater = updater

    def apply(self, chunk, grad, weight, stored):
        sgd_step(self._updater.optimizer, self._updater, chunk, grad, weight, out=stored)


class OptimizerStep(Applier):
    """MXNet's updater, which updates in place: ``W_t`` is copied into `stored` first.

    It gets the arrays MXNet's own server gives it: the round's sum and the stored value of
    the key's type, so a row_sparse chunk gets a full-row ``RowSparseNDArray`` weight (and
    MXNet's lazy update) with a row_sparse sum. If the update raises, ``on_error(chunk,
    error)`` decides (the server's policy, :data:`UPDATER_ERRORS`); `stored` then holds what
    the update wrote before it raised, as MXNet's server's stored value does.
    """

    def __init__(self, updater, on_error):
        self._updater, self._on_error = updater, on_error

    def apply(self, chunk, grad, weight, stored):
        _copy(weight, stored)
        try:
            self._updater(chunk, grad, stored)
        except Exception as error:  # pylint: disable=broad-except
            # A user's optimizer may fail on some keys (MXNet's own Test optimizer does on
            # row_sparse ones): the policy, chosen once, stops the job or logs.
            self._on_error(chunk, error)


class ScaleSum(Applier):
    """Decorator: `inner` gets the round's sum times `scale` (in the sum's dtype)."""

    def __init__(self, inner, scale):
        self._inner, self._scale = inner, scale

    def apply(self, chunk, grad, weight, stored):
        self._inner.apply(chunk, mx.nd._internal._mul_scalar(grad, scalar=self._scale),  # pylint: disable=protected-access
                          weight, stored)


class DecodeRows(Applier):
    """Decorator for one-row-per-worker pushes (docs/design.md §2.14): the round's merged
    row_sparse (N, P) array holds worker r's payload in row r; `inner` gets the float32 sum,
    in rank order, of the values each payload stands for (the chunk's codec's
    :meth:`~kvstore_ext.codecs.Codec.decode_sum`: the very values the workers computed, in
    one fused kernel where the codec has one), shaped as the weights.

    The kernel runs on every core of this process (:func:`kvstore_ext.codecs.kernels.cores`;
    a call splits only in parts of at least 2**20 values).

    Parameters
    ----------
    inner : Applier
    settings : dict
        The codec's description, e.g. ``{'type': 'int8', 'block_size': B}``: the codec is
        found in the registry (:func:`kvstore_ext.codecs.decoder`; checked by
        :func:`check_codec`).
    """

    def __init__(self, inner, settings):
        self._inner = inner
        self._codec = codecs.decoder(settings)
        self._threads = kernels.cores()
        heap.keep_large_blocks()   # the sums' fresh arrays: no page faults per round

    def apply(self, chunk, grad, weight, stored):
        # The sum's memory as an NDArray (no copy): the round keeper waits for `stored`,
        # i.e. for every operation that reads it, before the round ends.
        total = self.decode(chunk, grad, weight.size).reshape(weight.shape)
        self._inner.apply(chunk, mx.nd.from_numpy(total, zero_copy=True), weight, stored)

    def decode(self, chunk, grad, size):
        """The float32 numpy sum over the workers of the values `grad`'s rows stand for
        (`grad`: the merge of row_sparse pushes, which the slot keys of this wire are)."""
        workers = grad.shape[0]
        rows = host.view(grad.indices)    # the merged array's memory: read, not copied
        if sorted(rows.tolist()) != list(range(workers)):
            raise RuntimeError('chunk %s: a round with the rows of workers %s, not of all %d: '
                               'every worker pushes its own row' % (chunk, rows.tolist(),
                                                                     workers))
        data = host.view(grad.data).reshape(workers, -1)
        # Rank order: the sum does not depend on the order the pushes arrived in.
        return self._codec.decode_sum(data, np.argsort(rows), size, threads=self._threads)


class SkipNonFinite(Applier):
    """Decorator under AMP: a round whose sum is not finite is skipped (docs/design.md §11).

    A worker whose gradients were not all finite pushed them divided by 0, so every element of
    every chunk's sum is inf or nan, and one element decides. Weights, optimizer state and
    update count stay, as ``gluon.Trainer`` skips the step; the round still counts as a
    round, and `count(chunk)` is called.
    """

    def __init__(self, inner, count):
        self._inner, self._count = inner, count

    def apply(self, chunk, grad, weight, stored):
        if math.isfinite(grad.reshape((-1,))[0:1].asnumpy()[0]):
            self._inner.apply(chunk, grad, weight, stored)
        else:
            self._count(chunk)
            _copy(weight, stored)


def _is_true(value):
    return value is True


class UpdaterError(RuntimeError):
    """The optimizer's update raised, under :class:`StopOnError`: the server ends the job."""


class StopOnError(object):
    """``MXDELAY_UPDATER_ERRORS=stop`` (the default): an update that raises stops the job, as
    any failure of a server's round does (exit code 3), rather than train on with weights the
    optimizer left half-updated."""

    def __call__(self, optimizer, where, error):
        raise UpdaterError('optimizer %s raised on %s: %s: %s. MXNet\'s own server would log '
                           'this and go on with the weights as far as the update got; set '
                           'MXDELAY_UPDATER_ERRORS=log on the servers for that, or fix the '
                           'optimizer' % (type(optimizer).__name__, where,
                                          type(error).__name__, error)) from error


class LogAndGoOn(object):
    """``MXDELAY_UPDATER_ERRORS=log``: as MXNet's own server, log the error (with its
    traceback) and go on; the round stands as far as the update got."""

    def __call__(self, optimizer, where, error):
        _LOG.error('optimizer %s raised on %s; going on (MXDELAY_UPDATER_ERRORS=log), with '
                   'the weights as far as the update got', type(optimizer).__name__, where,
                   exc_info=error)


#: ``MXDELAY_UPDATER_ERRORS`` -> the policy's class (read by the server at its start).
UPDATER_ERRORS = {'stop': StopOnError, 'log': LogAndGoOn}


def _raise(chunk, error):  # pylint: disable=unused-argument
    raise error


def _decoded(value):
    return codecs.decoder(value) is not None


def _positive_finite(value):
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0)


#: The codec settings a chunk's ``REGISTER`` entry may carry: name -> (whether a value is
#: valid, what a valid value is, the decorator that applies it). These are what a server
#: does, not codecs: ``payload`` names the chunk's codec, which the registry gives
#: (:func:`kvstore_ext.codecs.decoder`). ``aux`` is no decorator: it makes the chunk an aux
#: chunk (:data:`AUX`), which :func:`choose` gives the sum alone.
CODEC_SETTINGS = {
    'sum_scale': (_positive_finite, 'a finite number above 0', ScaleSum),
    'aux': (_is_true, 'True', None),
    'payload': (_decoded, "the description of a codec whose rows the servers decode, with "
                          "every setting (e.g. {'type': 'int8', 'block_size': 256})",
                DecodeRows),
}


def check_codec(chunk, codec):
    """Return `chunk`'s codec settings `codec` (a dict, see :data:`CODEC_SETTINGS`).

    Raises
    ------
    ValueError
        For anything but a dict of known settings with valid values; the message names the
        chunk, the setting and its value.
    """
    if not isinstance(codec, dict):
        raise ValueError('chunk %s: codec settings must be a dict, got %r' % (chunk, codec))
    for name, value in sorted(codec.items()):
        if name not in CODEC_SETTINGS:
            raise ValueError('chunk %s: unknown codec setting %r=%r; known: %s: install the '
                             'same mxdelay version on workers and servers'
                             % (chunk, name, value, ', '.join(sorted(CODEC_SETTINGS))))
        valid, what, _ = CODEC_SETTINGS[name]
        if not valid(value):
            raise ValueError('chunk %s: codec setting %s=%r is not %s' % (chunk, name, value,
                                                                          what))
    if 'aux' in codec and codec != AUX:
        raise ValueError('chunk %s: an aux chunk takes no other codec setting, got %r (its '
                         'pushes are never compressed)' % (chunk, codec))
    return codec


def choose(kind, updater, codec, skip_nonfinite, count_skip, take_aux=None,
           on_error=_raise):
    """Return the applier of a chunk.

    Parameters
    ----------
    kind : str
        :data:`COUNTER`, ``'default'`` or ``'row_sparse'``.
    updater : mx.optimizer.Updater or None
        The installed optimizer's updater; None: no optimizer.
    codec : dict
        The chunk's codec settings (:func:`check_codec`); the finish counter takes none.
        :data:`AUX`: the round's sum, whatever the optimizer and AMP.
    skip_nonfinite : bool
        AMP: skip overflowed rounds (not the finish counter's, which mark them).
    count_skip : callable
        ``count_skip(chunk)`` for each skipped round.
    take_aux : callable, optional
        An aux chunk's values sent by command (:class:`AuxSum`); default: none.
    on_error : callable, optional
        ``on_error(chunk, error)`` when MXNet's updater raises (:class:`OptimizerStep`);
        default: the error propagates.
    """
    if kind == COUNTER:
        return StoreCounter()
    if codec == AUX:
        # Aux states are averaged, not trained: an optimizer step (or a skipped round:
        # their pushes carry no overflow flag) would corrupt them (docs/design.md §2.13).
        return AuxSum(take_aux or (lambda chunk: None))
    if updater is None:
        applier = CopySum() if kind == 'default' else CopyAllRows()
    elif kind == 'default' and is_plain_sgd(updater.optimizer):
        applier = PlainSGD(updater)
    else:
        applier = OptimizerStep(updater, on_error)
    for name, value in sorted(codec.items()):
        applier = CODEC_SETTINGS[name][2](applier, value)   # not AUX: returned above
    return SkipNonFinite(applier, count_skip) if skip_nonfinite else applier


def _copy(source, target):
    # copyto, not `a[:] = b`: the same copy without Python's indexing machinery (a third of
    # the updater time, py-spy).
    if source is not target:
        source.copyto(target)


def is_plain_sgd(optimizer):
    """Whether `optimizer` is exactly ``mx.optimizer.SGD`` without multi-precision (the
    server then applies it with the single-tensor kernels)."""
    return type(optimizer) is mx.optimizer.SGD and not optimizer.multi_precision  # noqa: E721


def store_counter(total, counter, out=None):
    """Store round sum `total` of the finish counter, whose value was `counter` (numpy-sized),
    into `out` (default: `counter`).

    Elements 0 to 2 take the round's sums (the finish votes and the workers that sent
    pushpulls, docs/design.md §5). The rest is a ring of the last R rounds' overflow marks
    (docs/design.md §11): in round t every worker pushes 1, plus 1 if its gradients
    overflowed, at element ``3 + t mod R`` and 0 elsewhere, so the element that is not 0 is
    round t's and the others keep older rounds.

    A selection in MXNet's engine (no wait on the server's updater thread, which applies
    every key's rounds one after the other): each element is `total`'s or `counter`'s bits.
    """
    # pylint: disable=protected-access
    nonzero = mx.nd._internal._not_equal_scalar(total, scalar=0.0)   # `!=` without its checks
    taken = mx.nd.broadcast_maximum(nonzero, _head_mask(total))
    mx.nd.where(taken, total, counter, out=counter if out is None else out)


_HEAD_MASKS = {}


def _head_mask(like):
    """1 at the counter's head (elements 0 to 2, always taken), 0 on its ring; shaped,
    typed and placed like `like` (one per shape, dtype and device)."""
    key = (like.shape, np.dtype(like.dtype).str, like.context)
    if key not in _HEAD_MASKS:
        mask = np.zeros(like.size, dtype=like.dtype)
        mask[:HEAD] = 1
        _HEAD_MASKS[key] = mx.nd.array(mask.reshape(like.shape), ctx=like.context,
                                       dtype=like.dtype)
    return _HEAD_MASKS[key]


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


def copy_all_rows(source, target):
    """Server side: make the full-row row_sparse `target` equal to the row_sparse `source`
    (rows absent from `source` become zero), keeping every row present in `target`."""
    rows = target.shape[0]
    nd.sparse.row_sparse_array((nd.cast_storage(source, stype='default'),
                                nd.arange(rows, dtype='int64')),
                               shape=target.shape, dtype=target.dtype).copyto(target)
