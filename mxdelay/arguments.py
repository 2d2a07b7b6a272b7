"""Checks of :class:`mxdelay.DelayedTrainer`'s arguments: the kvstore, the batch size, what
compression refuses, and the order in which the user gave the parameters."""
from mxnet import gluon
from mxnet.kvstore import KVStoreBase

from kvstore_ext.checks import ArgumentTypeError, check_bool, check_int, check_real, check_rounds
from kvstore_ext.typenames import STORE_TYPE
from kvstore_ext.worker.dist_delay import DistDelay

__all__ = ['check_schedule', 'check_kvstore', 'check_auto_codec', 'check_batch_size',
           'refuse_compressed_sparse_grads', 'refuse_compressed_pulls', 'parameter_names']


def check_schedule(delay, warmup_steps, slack):
    """Check `delay`, `warmup_steps` and `slack`; return the schedule and the slack.

    With ``delay='auto'`` the slack is at least :data:`mxdelay.autodelay.SLACK` (4: room for
    every candidate k) and the warm-up measures at least 2 steps.

    Returns
    -------
    schedule : DelaySchedule
    slack : int
        `slack`, or its default: ``delay`` (``'auto'``: 4).

    Raises
    ------
    TypeError
        (:class:`mxdelay.ArgumentTypeError`) For an argument of the wrong type.
    ValueError
        For an argument out of range.
    """
    # pylint: disable=import-outside-toplevel
    from .autodelay import MIN_WARMUP_STEPS, SLACK
    from .schedule import DelaySchedule
    schedule = DelaySchedule(delay, warmup_steps)  # checks both
    least = schedule.delay
    if schedule.auto:
        least = SLACK
        if schedule.warmup_steps < MIN_WARMUP_STEPS:
            raise ValueError("warmup_steps=%d with delay='auto': the warm-up measures steps "
                             '%d to warmup_steps to choose k; use warmup_steps >= %d (or a '
                             'fixed delay)' % (schedule.warmup_steps, MIN_WARMUP_STEPS - 2,
                                               MIN_WARMUP_STEPS))
    if slack is None:
        return schedule, least
    fix = ("delay='auto' may choose k up to %d (slack >= %d)" % (least, least) if schedule.auto
           else 'the slack must cover a whole period (slack >= delay=%d)' % least)
    slack = check_int('slack', slack, least, fix)
    return schedule, check_rounds('slack', slack)


def check_kvstore(kvstore, update_on_kvstore):
    """Check `kvstore` and `update_on_kvstore` at construction; return whether `kvstore` is
    ``'dist_delay'`` (the type or an instance).

    Raises
    ------
    TypeError
        (:class:`mxdelay.ArgumentTypeError`) For a kvstore that is no str, KVStore or None,
        or an `update_on_kvstore` that is no bool or None.
    ValueError
        For another distributed type, or ``update_on_kvstore=False`` with ``'dist_delay'``.
    """
    if kvstore is not None and not isinstance(kvstore, (str, KVStoreBase)):
        # gluon.Trainer raises the same TypeError, but only at the first step.
        raise ArgumentTypeError("kvstore must be a str, a KVStore or None, got %r (%s); use "
                                "kvstore='dist_delay'" % (kvstore, type(kvstore).__name__))
    if update_on_kvstore is not None:
        check_bool('update_on_kvstore', update_on_kvstore, 'or None to let the trainer choose')
    dist_delay = (kvstore == STORE_TYPE if isinstance(kvstore, str)
                  else isinstance(kvstore, DistDelay))
    if isinstance(kvstore, str) and 'dist' in kvstore.lower() and not dist_delay:
        # MXNet's native distributed stores (and MXNet's fallback for a misspelt type,
        # kvstore_ext.typenames.check_kvstore_type) have no delayed update.
        raise ValueError("kvstore=%r: DelayedTrainer trains distributed only with "
                         "kvstore='dist_delay'; use kvstore='dist_delay' (or 'local', "
                         "'device', None on one machine)" % kvstore)
    if update_on_kvstore is False and dist_delay:
        raise ValueError("update_on_kvstore=False cannot be used with kvstore='dist_delay': "
                         'the servers apply the optimizer once per round; leave it None')
    return dist_delay


def check_auto_codec(compression_params, pull_compression):
    """Whether the codecs are ``'auto'`` (docs/design.md §2.16): ``compression_params='auto'``
    with `pull_compression` None or ``'auto'``.

    Raises
    ------
    ValueError
        For ``'auto'`` with a pull codec, or ``pull_compression='auto'`` without
        ``compression_params='auto'``, naming both and the fix.
    """
    auto = isinstance(compression_params, str) and compression_params == 'auto'
    pull_auto = isinstance(pull_compression, str) and pull_compression == 'auto'
    if auto and not (pull_compression is None or pull_auto):
        raise ValueError("compression_params='auto' chooses the pull codec too, but "
                         'pull_compression=%r; pass pull_compression=None (or \'auto\'), or '
                         'give both codecs yourself' % (pull_compression,))
    if pull_auto and not auto:
        raise ValueError("pull_compression='auto' is chosen together with the push codec, but "
                         "compression_params=%r; pass compression_params='auto' too, or a "
                         'pull codec such as {\'type\': \'int8\'}' % (compression_params,))
    return auto


def check_batch_size(batch_size):
    """Raise for a `batch_size` that is not a finite number > 0."""
    # gluon.Trainer divides by it unchecked: 0 raises ZeroDivisionError at the step, a
    # negative or NaN size silently corrupts the update.
    check_real('batch_size', batch_size, minimum=0, min_inclusive=False,
               fix='pass the number of samples of this step, e.g. trainer.step(data.shape[0])')


def refuse_compressed_sparse_grads(stypes, compressed):
    """Refuse row_sparse gradients with compression on 'dist_delay' (docs/design.md §2.10);
    `stypes`: ``(param, stype, grad_stype)`` of each parameter."""
    for param, _, grad_stype in stypes:
        if grad_stype != 'default':
            raise ValueError(
                'compression_params=%r cannot be combined with row_sparse gradients '
                '(Parameter %s has grad_stype=%r): row_sparse pushes are not compressed; '
                'use compression_params=None, or dense gradients'
                % (compressed.describe(), param.name, grad_stype))


def refuse_compressed_pulls(stypes, pull_codec):
    """Refuse what compressed pulls do not support (docs/design.md §2.12); `stypes`:
    ``(param, stype, grad_stype)`` of each parameter."""
    for param, stype, grad_stype in stypes:
        if (grad_stype, stype) != ('default', 'default'):
            raise ValueError(
                'pull_compression=%r cannot be used with row_sparse parameters (Parameter %s '
                'has stype=%r, grad_stype=%r): their pulls bring rows, not a model every '
                'worker holds; use pull_compression=None, or dense parameters'
                % (pull_codec.describe(), param.name, stype, grad_stype))


def parameter_names(params):
    """The names of `params` (a dict, ParameterDict, list or tuple) in the order given
    (Gluon sorts a dict's by key)."""
    if isinstance(params, (dict, gluon.ParameterDict)):
        return [params[key].name for key in params.keys()]
    if isinstance(params, (list, tuple)):
        return [getattr(p, 'name', None) for p in params]
    return []
