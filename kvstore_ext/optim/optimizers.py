"""What decides an optimizer's update, and whether two optimizers are the same.

Workers and servers must apply one optimizer; they compare :func:`describe_optimizer`
dicts (which travel as JSON) with :func:`optimizer_differences`, the one place where
optimizer equality is decided.
"""
import json

import numpy as np

__all__ = ['describe_optimizer', 'optimizer_differences', 'type_difference',
           'format_differences', 'flatten_state', 'whole_tensor_refusal', 'PER_STEP_FIELDS',
           'optimizer_record', 'build_optimizer', 'register_lr_scheduler',
           'UnknownOptimizerError']


class UnknownOptimizerError(ValueError):
    """A record names an optimizer or a learning-rate scheduler that this process does not
    know (``kind``: ``'optimizer'`` or ``'learning-rate scheduler'``; ``name``: its name)."""

    def __init__(self, message, kind, name):
        super(UnknownOptimizerError, self).__init__(message)
        self.kind, self.name = kind, name


#: Fields of :func:`describe_optimizer` that a trainer sets at every step, not at creation:
#: ``rescale_grad`` is 1/batch_size from the first step on, so a worker that has not stepped
#: yet (``trainer.join()`` first, with uneven data) legitimately still has its initial value,
#: and workers may use different batch sizes. Workers' optimizers are compared without them:
#: the servers apply worker 0's, and each worker scales its gradients relative to it
#: (``Rounds.scale_gradients``, :mod:`kvstore_ext.worker.rounds`).
PER_STEP_FIELDS = ('rescale_grad',)

#: Attributes of an optimizer or learning-rate scheduler that are bookkeeping, not
#: hyper-parameters: update counters and caches (they differ between a fresh optimizer and
#: a used one) and MXNet's kernel aggregation size (read from the environment; the arithmetic
#: is the same).
_NOT_HYPER_PARAMETERS = frozenset([
    'num_update', 'aggregate_num', 'allow_np_array', 'param_dict', 'idx2name',
    'param_idx2name', 'sym_info', 'lr_mult', 'wd_mult',
    'count', 'cur_step_ind',                       # lr schedulers' progress
    'last_lr', 'cur_lr', 'm_schedule', 'init_updates', 'lbmult', 'admult', 'cumgrads',
    'weight_previous'])                            # LARS, Nadam, LBSGD, DCASGD state


def _hyper_parameters(obj):
    """The JSON-able public attributes of `obj` that set its arithmetic."""
    out = {}
    for name, value in sorted(vars(obj).items()):
        if name.startswith('_') or name in _NOT_HYPER_PARAMETERS:
            continue
        if isinstance(value, np.generic):
            value = value.item()
        if isinstance(value, (list, tuple)):
            if not all(isinstance(v, (bool, int, float, str, type(None), np.generic))
                       for v in value):
                continue
            value = [v.item() if isinstance(v, np.generic) else v for v in value]
        elif not isinstance(value, (bool, int, float, str, type(None))):
            continue
        out[name] = value
    return out


def describe_optimizer(optimizer):
    """Return what decides `optimizer`'s update, as a JSON-able dict (None for None).

    Workers and servers compare these dicts, so that a server never applies another
    optimizer than the workers set: ``'type'`` (the class name), ``'learning_rate'``
    (without scheduler), ``'rescale_grad'``, ``'wd'``, ``'clip_gradient'``,
    ``'multi_precision'``, ``'begin_num_update'``, the optimizer's own hyper-parameters
    (``'momentum'``, ``'beta1'``, ...: every public attribute that is a number, a string, a
    bool, None or a list of those) and ``'lr_scheduler'`` (None, or the scheduler's class
    name and parameters). Update counters, per-parameter state and MXNet's aggregation size
    are left out: they are not chosen by the user.

    Parameters
    ----------
    optimizer : mxnet.optimizer.Optimizer or None

    Returns
    -------
    dict or None
        The same dict before and after a JSON round trip (lists, not tuples).
    """
    if optimizer is None:
        return None
    described = _hyper_parameters(optimizer)
    described['learning_rate'] = described.pop('lr', None)
    scheduler = getattr(optimizer, 'lr_scheduler', None)
    if scheduler is not None:
        described['lr_scheduler'] = dict(_hyper_parameters(scheduler),
                                         type=type(scheduler).__name__)
    described['type'] = type(optimizer).__name__
    return json.loads(json.dumps(described))


def optimizer_differences(first, second, ignore=()):
    """Return ``[(field, first's value, second's value)]`` where two descriptions differ.

    Parameters
    ----------
    first, second : dict or None
        Results of :func:`describe_optimizer`. A differing type is the only difference
        reported (the other fields of two types are not comparable); scheduler fields are
        named ``'lr_scheduler.<name>'``.
    ignore : sequence of str
        Top-level fields not to compare (e.g. :data:`PER_STEP_FIELDS`).
    """
    if first is None or second is None:
        return [] if first == second else [('optimizer', first, second)]
    if first.get('type') != second.get('type'):
        return [('type', first.get('type'), second.get('type'))]
    differences = []
    for name in sorted((set(first) | set(second)) - set(ignore)):
        mine, theirs = first.get(name), second.get(name)
        if name == 'lr_scheduler' and isinstance(mine, dict) and isinstance(theirs, dict):
            differences.extend(('lr_scheduler.' + field, a, b)
                               for field, a, b in optimizer_differences(mine, theirs))
        elif mine != theirs:
            differences.append((name, mine, theirs))
    return [('lr_scheduler' if field == 'lr_scheduler.type' else field, a, b)
            for field, a, b in differences]


def format_differences(differences, first_name, second_name):
    """Text naming each difference with both values, e.g.
    ``'momentum: worker 0 has 0.9, worker 1 has 0.5'``."""
    return '; '.join('%s: %s has %r, %s has %r' % (field, first_name, a, second_name, b)
                     for field, a, b in differences)


def type_difference(first, second):
    """Return ``(first's type, second's type)`` if two descriptions differ in type, else None
    (from :func:`optimizer_differences`)."""
    differences = optimizer_differences(first, second)
    if differences and differences[0][0] in ('type', 'optimizer'):
        return differences[0][1:]
    return None


# -- optimizers in checkpoints, without pickle ------------------------------------------------
#: Learning-rate schedulers that are not MXNet's own (MXNet keeps no registry of them), by
#: class name: :func:`register_lr_scheduler`.
_LR_SCHEDULERS = {}


def register_lr_scheduler(cls):
    """Let checkpoints name the learning-rate scheduler class `cls` (a subclass of
    ``mx.lr_scheduler.LRScheduler`` that is not MXNet's own); usable as a class decorator.

    MXNet registers optimizers (``@mx.optimizer.register``) but not schedulers: a checkpoint
    stores a scheduler by class name and rebuilds it from MXNet's ``mx.lr_scheduler`` or from
    the classes registered here. Register it in a module that every process imports, the
    servers included, as MXNet's optimizers must be.

    Raises
    ------
    TypeError
        If `cls` is not such a class; ValueError if another class has its name.
    """
    import mxnet as mx  # pylint: disable=import-outside-toplevel
    if not isinstance(cls, type) or not issubclass(cls, mx.lr_scheduler.LRScheduler):
        raise TypeError('register_lr_scheduler takes a subclass of mx.lr_scheduler.LRScheduler, '
                        'got %.80r' % (cls,))
    known = _scheduler_class(cls.__name__)
    if known is not None and known is not cls:
        raise ValueError('a learning-rate scheduler named %s is already known (%s.%s); give '
                         'the class another name' % (cls.__name__, known.__module__,
                                                     known.__name__))
    _LR_SCHEDULERS[cls.__name__] = cls
    return cls


def _scheduler_class(name):
    import mxnet as mx  # pylint: disable=import-outside-toplevel
    cls = getattr(mx.lr_scheduler, name, None) if isinstance(name, str) else None
    if isinstance(cls, type) and issubclass(cls, mx.lr_scheduler.LRScheduler):
        return cls
    return _LR_SCHEDULERS.get(name)


def _registry():
    import mxnet as mx  # pylint: disable=import-outside-toplevel
    return mx.optimizer.Optimizer.opt_registry


def optimizer_record(optimizer):
    """What a checkpoint stores of `optimizer`: its MXNet registry name and its fields.

    The fields are the optimizer's attributes, as its pickle would hold them (without
    ``param_dict``, which the trainer sets; with the update counters), so that the rebuilt
    optimizer (:func:`build_optimizer`) continues bit for bit; the learning-rate scheduler
    likewise, by class name, with its progress (``count``, ``base_lr``, ...).

    Raises
    ------
    ValueError
        If the optimizer's class is not registered with MXNet under its name, or its
        scheduler's class is neither MXNet's nor registered (:func:`register_lr_scheduler`):
        a checkpoint could not name it. The message names the class and the fix.
    """
    cls = type(optimizer)
    name = cls.__name__.lower()
    if _registry().get(name) is not cls:
        raise ValueError(
            'optimizer %s.%s is not registered with MXNet under the name %r, so a checkpoint '
            'cannot name it (checkpoints hold no pickles): decorate the class with '
            '@mx.optimizer.register, in a module that every worker and server imports'
            % (cls.__module__, cls.__name__, name))
    fields = dict(vars(optimizer))
    fields.pop('param_dict', None)
    scheduler = fields.pop('lr_scheduler', None)
    # _index_update_count is one of _all_index_update_counts' dicts (the current device's):
    # kept as that device's number, so that the rebuilt optimizer shares it as well.
    current = fields.pop('_index_update_count', None)
    device = None
    for key, counts in (fields.get('_all_index_update_counts') or {}).items():
        if counts is current:
            device = key
    record = {'name': name, 'fields': fields, 'current_device': device,
              'index_update_count': current if device is None else None,
              'lr_scheduler': None}
    if scheduler is not None:
        kind = type(scheduler)
        if _scheduler_class(kind.__name__) is not kind:
            raise ValueError(
                'learning-rate scheduler %s.%s is neither one of mx.lr_scheduler\'s nor '
                'registered, so a checkpoint cannot name it (checkpoints hold no pickles): '
                'decorate the class with @kvstore_ext.optim.optimizers.register_lr_scheduler, in a '
                'module that every worker and server imports' % (kind.__module__, kind.__name__))
        record['lr_scheduler'] = {'name': kind.__name__, 'fields': dict(vars(scheduler))}
    return record


def build_optimizer(record):
    """The optimizer that :func:`optimizer_record` recorded (``param_dict`` empty, as after
    unpickling: the trainer sets it).

    The class is MXNet's registered one of that name (the registry that
    ``mx.optimizer.create`` reads); it is made without running its ``__init__`` and given the
    saved fields, exactly as unpickling would, so that no default of the constructor
    overrides a saved value (and classes whose constructor needs arguments work too).

    Raises
    ------
    ValueError
        If the record is malformed, or names an optimizer (:class:`UnknownOptimizerError`) or
        scheduler that this process does not know (naming it and the fix).
    """
    if not isinstance(record, dict) or not isinstance(record.get('fields'), dict):
        raise ValueError('the optimizer record %.80r is not one that a checkpoint holds'
                         % (record,))
    name = record.get('name')
    cls = _registry().get(name) if isinstance(name, str) else None
    if cls is None:
        raise UnknownOptimizerError(
            'the checkpoint\'s optimizer %r is not registered with MXNet in this process: '
            'import the module that defines it (decorated with @mx.optimizer.register) '
            'before loading' % (name,), 'optimizer', name)
    optimizer = cls.__new__(cls)
    fields = dict(record['fields'])
    device = record.get('current_device')
    counts = fields.get('_all_index_update_counts')
    if device is not None:
        if not isinstance(counts, dict) or device not in counts:
            raise ValueError('the optimizer record names device %r, whose update counts it '
                             'does not hold' % (device,))
        fields['_index_update_count'] = counts[device]
    else:
        fields['_index_update_count'] = record.get('index_update_count')
    saved = record.get('lr_scheduler')
    fields['lr_scheduler'] = None if saved is None else _build_scheduler(saved)
    optimizer.__setstate__(fields)   # Optimizer's own: the fields, and an empty param_dict
    return optimizer


def _build_scheduler(saved):
    if not isinstance(saved, dict) or not isinstance(saved.get('fields'), dict):
        raise ValueError('the learning-rate scheduler record %.80r is not one that a '
                         'checkpoint holds' % (saved,))
    cls = _scheduler_class(saved.get('name'))
    if cls is None:
        raise UnknownOptimizerError(
            'the checkpoint\'s learning-rate scheduler %r is neither one of mx.lr_scheduler\'s '
            'nor registered in this process: import the module that defines it, decorated '
            'with @kvstore_ext.optim.optimizers.register_lr_scheduler, before loading'
            % (saved.get('name'),), 'learning-rate scheduler', saved.get('name'))
    scheduler = cls.__new__(cls)
    scheduler.__dict__.update(saved['fields'])   # as unpickling does (no __setstate__)
    return scheduler


def flatten_state(state):
    """The arrays of an optimizer state, in a fixed order: an ``mx.optimizer.Updater``'s
    ``states[index]`` is an NDArray, None, or a (nested) tuple or list of those
    (``multi_precision`` adds a float32 master copy). Workers and servers flatten alike, so
    array j of one is array j of the other (docs/design.md §2.9).

    Raises
    ------
    TypeError
        For a state that holds anything else (a number, say).
    """
    if state is None:
        return []
    if isinstance(state, (tuple, list)):
        return [array for part in state for array in flatten_state(part)]
    if hasattr(state, 'copyto') and hasattr(state, 'shape'):  # an NDArray, loaded lazily
        return [state]
    raise TypeError('optimizer state part %.60r (%s) is not an NDArray, a tuple or None'
                    % (state, type(state).__name__))


#: MXNet's optimizers (and their subclasses) whose step reads norms of the whole tensor
#: (docs/design.md §3.4): name -> what the norms decide. LBSGD only with
#: ``warmup_strategy='lars'``; its other strategies are elementwise.
WHOLE_TENSOR = {
    'LAMB': 'its trust ratio is computed from the norms of the whole weight and update',
    'LARS': 'its layer-wise learning rate is computed from the norms of the whole weight and '
            'gradient',
    'LBSGD': "with warmup_strategy='lars' its learning rate is computed from the norms of the "
             'whole weight and gradient',
}


def whole_tensor_name(optimizer):
    """The :data:`WHOLE_TENSOR` class that `optimizer` is or derives from, if its step reads
    whole-tensor norms (LBSGD: only with ``warmup_strategy='lars'``); else None. Classes are
    recognised by name among the optimizer's MXNet base classes, so that this module loads
    no MXNet."""
    for cls in type(optimizer).__mro__:
        if cls.__module__.startswith('mxnet.') and cls.__name__ in WHOLE_TENSOR:
            if cls.__name__ == 'LBSGD' and getattr(optimizer, 'warmup_strategy', None) != 'lars':
                return None
            return cls.__name__
    return None


def whole_tensor_refusal(optimizer, tensors, chunk_size, bound):
    """Why the servers must refuse to apply `optimizer` per chunk, or None.

    Parameters
    ----------
    optimizer : mxnet.optimizer.Optimizer or None
    tensors : dict
        Parameter index -> ``{'name', 'size', 'chunks'}`` (its number of elements and of
        chunks).
    chunk_size : int or None
        The job's ``MXDELAY_CHUNK_SIZE``.
    bound : int
        ``MXNET_KVSTORE_BIGARRAY_BOUND``: chunks must stay below it.

    Returns
    -------
    str or None
        None unless `optimizer` reads whole-tensor norms (:func:`whole_tensor_name`) and some
        tensor spans more than one chunk; then the message names the optimizer, the largest
        such parameter, its size, the chunk size and the fixes.
    """
    base = whole_tensor_name(optimizer) if optimizer is not None else None
    split = [t for t in tensors.values() if t['chunks'] > 1]
    if base is None or not split:
        return None
    worst = max(split, key=lambda t: t['size'])
    largest = max(t['size'] for t in tensors.values())
    name = type(optimizer).__name__
    fix = ('set MXDELAY_CHUNK_SIZE to at least %d (the largest tensor) on every worker, below '
           'MXNET_KVSTORE_BIGARRAY_BOUND=%d' % (largest, bound))
    if largest >= bound:
        fix = ('set MXNET_KVSTORE_BIGARRAY_BOUND above %d and MXDELAY_CHUNK_SIZE to at least '
               '%d, alike on every worker and server' % (largest, largest))
    return ('%s%s: %s, but the mxdelay servers apply the optimizer per chunk of '
            'MXDELAY_CHUNK_SIZE=%s elements, and parameter %r (%d elements) spans %d chunks: '
            'each chunk would get its own ratio, unlike dist_sync. Fix: %s; or use another '
            'optimizer (e.g. Adam or SGD)'
            % (name, '' if name == base else ' (a %s)' % base, WHOLE_TENSOR[base], chunk_size,
               worst['name'], worst['size'], worst['chunks'], fix))
