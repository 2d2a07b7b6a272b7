"""``DelayedModule``: MXNet's Module API with the k-step delayed update (docs/design.md §1.7).

The algorithm has one implementation, :class:`mxdelay.DelayedTrainer`. This adapter gives it
Gluon ``Parameter`` objects whose data and gradient arrays *are* the Module executors'
(``param_arrays`` / ``grad_arrays``, one per device): ``Module.forward_backward`` writes the
gradients the trainer pushes, and the trainer's pulls and local steps write the weights the
next forward reads. ``update()`` is ``trainer.step``; the optimizer states are the trainer's
checkpoints.
"""
import logging

import mxnet as mx
from mxnet import autograd, gluon
from mxnet.kvstore import KVStoreBase
from mxnet.model import load_checkpoint

from kvstore_ext.checks import ArgumentTypeError, check_bool, check_real
from kvstore_ext.typenames import STORE_TYPE
from . import arguments
from .rules import create_rule
from .gluon_state import init_store
from .trainer import DelayedTrainer

__all__ = ['DelayedModule']

_LOG = logging.getLogger(__name__)


class DelayedModule(mx.mod.Module):
    """A :class:`mxnet.mod.Module` that trains with the k-step delayed update.

    A one-line change for a Module script: create ``mxdelay.DelayedModule(symbol, ...,
    delay=4, warmup_steps=200)`` instead of ``mx.mod.Module(symbol, ...)`` and pass
    ``kvstore='dist_delay'`` to ``fit`` (or ``init_optimizer``). It differs from ``Module``
    in that:

    1. The update is :class:`mxdelay.DelayedTrainer`'s (same schedule, rules, checks and
       checkpoints), over the executors' own arrays. The servers apply the optimizer to
       each round's sum with ``dist_sync``'s ``rescale_grad``: ``1/(batch*N)`` by default,
       an explicit ``rescale_grad`` in ``optimizer_params`` (or an optimizer object's)
       unchanged. With one worker, ``lam = 0`` and no ``local_lr`` it trains as ``Module``
       on ``'local'`` for every k (docs/design.md §1.6).
    2. In the delayed phase each worker trains its own weights: ``get_params`` returns them.
       Call :meth:`sync_weights` (collective) for the global model, e.g. before evaluating
       or saving the final model.
    3. ``save_optimizer_states`` / ``load_optimizer_states`` are collective (every worker
       calls them, with the same `fname`) and resume bit for bit (docs/design.md §6).
       :meth:`save_checkpoint` writes the symbol and parameters on worker 0 only.
    4. With a non-distributed kvstore (``'local'``, ``'device'``, None) it is
       ``gluon.Trainer``'s update on the executors' arrays.

    Parameters
    ----------
    symbol, data_names, label_names, logger, context, work_load_list, fixed_param_names, \
state_names, group2ctxs
        As :class:`mxnet.mod.Module`.
    compression_params : None
        Not supported: every gradient enters its round unchanged.
    delay, warmup_steps, local_lr, local_rule, dc_lambda, slack
        As :class:`mxdelay.DelayedTrainer`.

    Raises
    ------
    TypeError, ValueError
        For a bad argument, at construction (:class:`mxdelay.DelayedTrainer`'s checks).

    Examples
    --------
    >>> mod = mxdelay.DelayedModule(net, context=mx.cpu(), delay=4,  # mxdelay:
    ...                             warmup_steps=200)
    >>> mod.fit(train_iter, kvstore='dist_delay', optimizer='sgd',  # mxdelay:
    ...         optimizer_params={'learning_rate': 0.1, 'momentum': 0.9}, num_epoch=10)
    >>> mod.sync_weights()                                            # mxdelay:
    """

    def __init__(self, symbol, data_names=('data',), label_names=('softmax_label',),
                 logger=logging, context=mx.cpu(), work_load_list=None, fixed_param_names=None,
                 state_names=None, group2ctxs=None, compression_params=None, delay=4,
                 warmup_steps=200, local_lr=None, local_rule='mirror', dc_lambda=None,
                 slack=None):
        # DelayedTrainer checks these again when init_optimizer creates it; here they fail
        # at construction, before any data is bound (docs/design.md §1.7).
        arguments.check_schedule(delay, warmup_steps, slack)
        create_rule(local_rule, dc_lambda)
        if local_lr is not None:
            check_real('local_lr', local_lr, minimum=0,
                       fix="or None for the optimizer's learning rate")
        if compression_params:
            raise ValueError('compression_params=%r: DelayedModule does not compress gradients '
                             '(every gradient enters its round exactly); remove it'
                             % (compression_params,))
        super(DelayedModule, self).__init__(symbol, data_names, label_names, logger, context,
                                            work_load_list, fixed_param_names, state_names,
                                            group2ctxs)
        self._delay_args = dict(delay=delay, warmup_steps=warmup_steps, local_lr=local_lr,
                                local_rule=local_rule, dc_lambda=dc_lambda, slack=slack)
        self._trainer = None
        self._trained = []     # the trainer's Parameters with a gradient

    @staticmethod
    def load(prefix, epoch, load_optimizer_states=False, trusted=False, **kwargs):
        """Create a DelayedModule from a checkpoint, as :meth:`mxnet.mod.Module.load`.

        With `load_optimizer_states`, ``init_optimizer`` (called by ``fit``) resumes from
        ``prefix-<epoch>.states`` (collective), bit for bit; `trusted`: as in
        :meth:`mxdelay.DelayedTrainer.load_states` (a version-1 checkpoint, whose files are
        pickles). `kwargs`: the constructor's.
        """
        sym, args, auxs = load_checkpoint(prefix, epoch)
        mod = DelayedModule(sym, **kwargs)
        mod._arg_params, mod._aux_params = args, auxs
        mod.params_initialized = True
        if load_optimizer_states:
            mod._preload_opt_states = '%s-%04d.states' % (prefix, epoch)
            mod._preload_trusted = check_bool('trusted', trusted)
        return mod

    @property
    def trainer(self):
        """The :class:`mxdelay.DelayedTrainer` (None before ``init_optimizer``)."""
        return self._trainer

    def init_optimizer(self, kvstore='local', optimizer='sgd',
                       optimizer_params=(('learning_rate', 0.01),), force_init=False):
        """Create the :class:`mxdelay.DelayedTrainer` over the executors' arrays.

        Parameters
        ----------
        kvstore : str or KVStore
            ``'dist_delay'`` (or an instance) for distributed training; ``'local'``,
            ``'device'`` or None train as Gluon on one machine.
        optimizer : str or Optimizer
            As ``Module``'s; a str is created with the symbol, so that Variables'
            ``lr_mult``/``wd_mult`` attributes and Module's ``wd_mult=0`` for names not ending
            in ``_weight`` or ``_gamma`` apply.
        optimizer_params : dict
            As ``Module``'s. Without ``rescale_grad`` it is ``1/(batch*N)`` as Module sets it
            for ``'dist_sync'``; an explicit value is kept (so is an optimizer object's).
        force_init : bool
            Must be False once the optimizer is initialised (the trainer holds the
            kvstore and its rounds; it cannot be replaced).

        Raises
        ------
        ValueError
            For another distributed kvstore than ``'dist_delay'``, ``force_init`` on an
            initialised optimizer, sparse parameters, or what ``DelayedTrainer`` refuses
            (e.g. ``MXNET_UPDATE_ON_KVSTORE=0``).
        """
        assert self.binded and self.params_initialized
        if self.optimizer_initialized:
            if force_init:
                raise ValueError('force_init=True: DelayedModule cannot replace its '
                                 'DelayedTrainer (it owns the kvstore and its rounds); create '
                                 'a new DelayedModule instead')
            self.logger.warning('optimizer already initialized, ignoring...')
            return
        if self._params_dirty:
            self._sync_params_from_devices()
        kvstore = _create_store(kvstore)
        num_workers = kvstore.num_workers if isinstance(kvstore, KVStoreBase) else 1
        # Module's rescale_grad for 'dist_sync' (module.py: batch_size *= num_workers),
        # applied through step(1): the trainer's rescale_grad is scale / batch_size.
        rescale_grad = 1.0 / (self._exec_group.batch_size * num_workers)
        names = self._exec_group.param_names
        if isinstance(optimizer, str):
            optimizer_params = dict(optimizer_params)
            optimizer_params.setdefault('rescale_grad', rescale_grad)
            optimizer = mx.optimizer.create(optimizer, sym=self.symbol,
                                            param_idx2name=dict(enumerate(names)),
                                            **optimizer_params)
        elif isinstance(optimizer, mx.optimizer.Optimizer):
            if optimizer.rescale_grad != rescale_grad:
                _LOG.warning('DelayedModule: the optimizer\'s rescale_grad %r is kept (dist_sync '
                             'keeps it too); Module would normalise by 1/(batch*N) = %r',
                             optimizer.rescale_grad, rescale_grad)
            if not optimizer.idx2name:
                optimizer.idx2name = dict(enumerate(names))
        else:
            raise ArgumentTypeError('optimizer must be a str or an mx.optimizer.Optimizer, got '
                                    '%r (%s)' % (optimizer, type(optimizer).__name__))
        params = [_executor_parameter(name, datas, grads, optimizer)
                  for name, datas, grads in zip(names, self._exec_group.param_arrays,
                                                self._exec_group.grad_arrays)]
        self._trainer = DelayedTrainer(params, optimizer, kvstore=kvstore, **self._delay_args)
        self._trained = [p for p in params if p.grad_req != 'null']
        # As Module.init_optimizer: the store exists and every worker starts from rank 0's
        # weights before the first batch (gluon.Trainer would do it at the first step).
        self._kvstore = init_store(self._trainer)
        self._optimizer = self._trainer.optimizer
        self._update_on_kvstore = self._kvstore is not None
        self._updater = None
        self.optimizer_initialized = True
        if self._preload_opt_states is not None:
            self.load_optimizer_states(self._preload_opt_states,
                                       getattr(self, '_preload_trusted', False))
            self._preload_opt_states = None

    def borrow_optimizer(self, shared_module):
        """Not supported: a DelayedTrainer updates one set of executor arrays."""
        raise ValueError('DelayedModule cannot borrow or share an optimizer (BucketingModule, '
                         'shared_module): its DelayedTrainer updates one Module\'s executor '
                         'arrays; use one DelayedModule with fixed shapes')

    def bind(self, data_shapes, label_shapes=None, for_training=True, inputs_need_grad=False,
             force_rebind=False, shared_module=None, grad_req='write'):
        """As :meth:`mxnet.mod.Module.bind`; refuses `shared_module` and a rebind once the
        optimizer exists (the trainer holds the executors' arrays)."""
        if shared_module is not None:
            self.borrow_optimizer(shared_module)
        if self.binded and force_rebind and self._trainer is not None:
            raise ValueError('force_rebind=True after init_optimizer: the DelayedTrainer holds '
                             'the old executors\' arrays; bind once, before init_optimizer')
        super(DelayedModule, self).bind(data_shapes, label_shapes, for_training,
                                        inputs_need_grad, force_rebind, None, grad_req)

    def update(self):
        """Push this worker's gradients and advance its weights: ``trainer.step``."""
        assert self.binded and self.params_initialized and self.optimizer_initialized
        self._params_dirty = True
        for param in self._trained:
            for data in param.list_data():
                data._fresh_grad = True  # forward_backward wrote the executors' grads
        # rescale_grad already is Module's whole normalisation (init_optimizer).
        self._trainer.step(1)

    def sync_weights(self, aux_states=False):
        """Make every worker's parameters the servers' global weights; collective.

        See :meth:`mxdelay.DelayedTrainer.sync_weights`; ``get_params`` returns them after.

        Raises
        ------
        ValueError
            With ``aux_states=True``: a Module's aux states (BatchNorm's moving mean and
            variance) are not keys of the store (stock Module never sends them), so they
            cannot be averaged here yet (docs/design.md §2.13).
        """
        if check_bool('aux_states', aux_states):
            raise ValueError('DelayedModule.sync_weights(aux_states=True) is not supported: a '
                             'Module\'s aux states (%s) are not keys of the store; each worker '
                             'keeps its own. Use mxdelay.DelayedTrainer (Gluon) for averaged '
                             'BatchNorm statistics, or sync_weights() and worker 0\'s aux states'
                             % (', '.join(self._aux_names) or 'none in this symbol'))
        assert self.optimizer_initialized
        self._trainer.sync_weights()
        self._params_dirty = True

    def save_optimizer_states(self, fname):
        """:meth:`mxdelay.DelayedTrainer.save_states`; collective with ``'dist_delay'``."""
        assert self.optimizer_initialized
        self._trainer.save_states(fname)

    def load_optimizer_states(self, fname, trusted=False):
        """:meth:`mxdelay.DelayedTrainer.load_states`: the weights, step counter, local
        state and the servers' state; collective with ``'dist_delay'``. `trusted`: as
        there (a version-1 checkpoint, whose files are pickles)."""
        assert self.optimizer_initialized
        self._trainer.load_states(fname, trusted)
        self._optimizer = self._trainer.optimizer  # the saved one, as gluon.Trainer's
        self._params_dirty = True

    def save_checkpoint(self, prefix, epoch, save_optimizer_states=False, remove_amp_cast=True):
        """As :meth:`mxnet.mod.Module.save_checkpoint`, but only worker 0 writes the symbol
        and the parameters (its own weights: call :meth:`sync_weights` first for the global
        model); the states, if saved, are collective and hold every worker's own weights.
        Every worker must pass the same `prefix`."""
        if self._kvstore is None or self._kvstore.rank == 0:
            super(DelayedModule, self).save_checkpoint(prefix, epoch, False, remove_amp_cast)
        if save_optimizer_states:
            self.save_optimizer_states('%s-%04d.states' % (prefix, epoch))


def _create_store(kvstore):
    """The kvstore for DelayedTrainer: 'dist_delay' created here, as Module does (the number
    of workers fixes rescale_grad before the optimizer exists); another distributed type is
    refused."""
    if kvstore is not None and not isinstance(kvstore, (str, KVStoreBase)):
        raise ArgumentTypeError("kvstore must be a str, a KVStore or None, got %r (%s); use "
                                "kvstore='dist_delay'" % (kvstore, type(kvstore).__name__))
    if isinstance(kvstore, str) and 'dist' in kvstore.lower():
        if kvstore != STORE_TYPE:
            raise ValueError("kvstore=%r: DelayedModule trains distributed only with "
                             "kvstore='dist_delay'; use kvstore='dist_delay' (or 'local', "
                             "'device', None on one machine)" % kvstore)
        return mx.kv.create(kvstore)
    return kvstore


def _executor_parameter(name, datas, grads, optimizer):
    """A Gluon Parameter whose arrays are the executors' `datas` and `grads` (one per
    device; grads None for a fixed parameter), with Module's multipliers for `name`."""
    if any(d.stype != 'default' for d in datas) or any(
            g is not None and g.stype != 'default' for g in grads):
        raise ValueError('parameter %r is sparse: DelayedModule supports dense parameters only '
                         '(use mx.mod.Module with a native kvstore for sparse ones)' % name)
    trained = grads[0] is not None
    param = gluon.Parameter(name, grad_req='write' if trained else 'null',
                            shape=datas[0].shape, dtype=datas[0].dtype)
    # The arrays are the executors' own (Parameter._init_impl would copy them); these are
    # the fields _init_impl and _init_grad set, in MXNet 1.9.1's gluon/parameter.py.
    param._ctx_list = [d.context for d in datas]  # pylint: disable=protected-access
    param._ctx_map = [[], []]                     # pylint: disable=protected-access
    for i, ctx in enumerate(param._ctx_list):     # pylint: disable=protected-access
        devices = param._ctx_map[ctx.device_typeid & 1]  # pylint: disable=protected-access
        devices.extend([None] * (ctx.device_id + 1 - len(devices)))
        devices[ctx.device_id] = i
    param._data = list(datas)                     # pylint: disable=protected-access
    param._grad = list(grads) if trained else None  # pylint: disable=protected-access
    if trained:
        # Gives the arrays the gradient state that the trainer's stale-gradient check reads
        # (update() sets it); nothing records autograd on them.
        autograd.mark_variables(param._data, param._grad, 'write')  # pylint: disable=W0212
    # Module's optimizer keeps its multipliers by name (set_lr_mult/set_wd_mult from the
    # symbol); a Gluon trainer's optimizer reads the Parameter's, which must equal them.
    param.lr_mult = float(optimizer.lr_mult.get(name, 1.0))
    param.wd_mult = float(optimizer.wd_mult.get(name, 1.0))
    return param

