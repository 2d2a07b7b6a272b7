"""``DelayedTrainer``: a ``gluon.Trainer`` with the k-step delayed update (CN112463189B).

The algorithm is docs/design.md §1; the phase of each step is decided by
:class:`mxdelay.schedule.DelaySchedule` alone. This module holds the trainer's face: its
arguments, checked at construction, and its public methods, each of which asks the mode
chosen when the kvstore is created (:mod:`mxdelay.modes`: pass-through or delayed).
"""
import logging

from mxnet import gluon
from mxnet.kvstore import KVStoreBase

from kvstore_ext import compression, pull_codecs
from kvstore_ext import frozen_variance  # noqa: F401  registers 'frozenvarianceadam' by name
from kvstore_ext.checks import (ArgumentTypeError, check_bool, check_int, check_path,
                                 check_real, check_rounds)
from kvstore_ext.dist_delay import DistDelay
from kvstore_ext.typenames import STORE_TYPE
from . import autosave, steplog
from .modes import Delayed, PassThrough
from .observer import StepObserver
from .param_state import ParamState
from .priorities import ForwardOrder
from .rules import create_rule
from .schedule import DelaySchedule

__all__ = ['DelayedTrainer']

_LOG = logging.getLogger(__name__)


class DelayedTrainer(gluon.Trainer):
    """Applies an optimizer on a set of Parameters with the k-step delayed update.

    A drop-in replacement for :class:`mxnet.gluon.Trainer` in distributed training with
    ``kvstore='dist_delay'``. It differs from ``gluon.Trainer`` in that:

    1. After ``warmup_steps`` synchronous steps and a switch step, a worker pulls the
       global weights only every ``delay`` steps; in between it pushes its gradient every
       step (every gradient enters the global model exactly once, in its own round) and
       advances its own weights with ``local_rule``. The pulled weights are applied at the
       next step and waited for only there.
    2. The servers run the optimizer once per round on the sum of all workers' gradients
       (as ``dist_sync``); ``set_learning_rate`` reaches them. Each worker's gradient is
       scaled by its own ``1/batch_size``: workers may use different batch sizes, and a
       batch size may change between steps (e.g. a smaller last batch).
    3. ``save_states`` and ``load_states`` are collective (every worker calls them) and
       restore everything needed to continue bit for bit: the step counter, each worker's
       weights, ``pre_weight`` and rule state, and the servers' weights and optimizer state.
    4. With a non-distributed kvstore (``'local'``, ``'device'``, None) it is exactly
       ``gluon.Trainer`` and warns once (logging) that ``delay`` has no effect.
    5. Sparse parameters (a dense weight with ``grad_stype='row_sparse'``, or a row_sparse
       weight) get lazy local updates: only the rows of the worker's gradient change. Each
       worker keeps a row_sparse weight's rows in a dense copy, which pulls replace and
       ``row_sparse_data(ids)`` reads (docs/design.md §1.4, §2.10).

    Parameters
    ----------
    params : ParameterDict or list of Parameter
        The parameters to optimize.
    optimizer : str or Optimizer
        The servers' optimizer (e.g. ``'sgd'``).
    optimizer_params : dict, optional
        Arguments of the optimizer, e.g. ``{'learning_rate': 0.1, 'momentum': 0.9}``.
    kvstore : str or KVStore, default 'dist_delay'
        ``'dist_delay'`` (or an instance of it) for distributed training; a
        non-distributed type trains as ``gluon.Trainer``.
    compression_params : dict, optional
        Gradient compression as in ``gluon.Trainer``: MXNet's ``{'type': '2bit',
        'threshold': 0.5}`` (each worker sends its quantized gradient and keeps the error in a
        residual), or ``{'type': 'fp16'}`` (float16 pushes, half the bytes; the servers sum
        them in float32 and keep float32 weights, which the pulls return; float32 parameters
        only), or ``{'type': 'int8' | 'int4' | 'ternary', 'block_size': 256}`` (8, 4 or 1.6
        bits a value plus a float32 scale per block, with error feedback; float32 dense
        parameters, no AMP; docs/design.md §2.14). In the delayed phase the local rule steps with what the worker sent. Checked
        at construction.
    update_on_kvstore : bool or None, default None
        Must not be False with ``'dist_delay'``: the servers own the global update.
    delay : int, default 4
        k: pull the global weights every k steps in the delayed phase.
    warmup_steps : int, default 200
        W: synchronous steps before the switch.
    local_lr : float, optional
        Learning rate of the local rule; default: the optimizer's. It follows the
        optimizer's schedule by the same factor.
    local_rule : str or LocalRule, default 'mirror'
        ``'mirror'``, ``'sgd'``, ``'dc'``, ``'dc_adaptive'``, ``'drift'`` or a
        :class:`mxdelay.rules.LocalRule` (see :mod:`mxdelay.rules`).
    dc_lambda : float, optional
        Delay-compensation weight added to a built-in rule (default: the rule's own, 0 for
        ``'mirror'`` and ``'sgd'``, 0.04 for ``'dc'`` and ``'dc_adaptive'``).
    slack : int, optional
        Rounds a worker may run ahead of the slowest worker (default and minimum: delay).
    pull_compression : dict, optional
        Compress the pulls of the warm-up, the switch and every period's end:
        ``{'type': 'fp16'}`` (2 bytes a value) or ``{'type': 'int8', 'block_size': 256}``
        (a level per value and a float32 scale per block, about 1 byte a value). The
        servers send the compressed difference between ``W`` and the model they last sent;
        every worker then holds the same pulled model, which lags ``W`` by what was not sent
        yet (it goes out with the next pull). ``sync_weights`` and checkpoints stay exact.
        With any compression_params (float16 pushes too); not with AMP or row_sparse
        parameters (docs/design.md §2.12).
    checkpoint_dir, checkpoint_every, keep_checkpoints : str, int, int, optional
        Save checkpoints every N steps, resume from the newest (:mod:`mxdelay.autosave`).

    Raises
    ------
    TypeError
        For an argument of the wrong type (:class:`mxdelay.ArgumentTypeError`, also a
        ``ValueError``), with its value and the fix.
    ValueError
        For an argument out of range, with its value and the fix.

    Examples
    --------
    >>> trainer = mxdelay.DelayedTrainer(net.collect_params(), 'sgd',
    ...                                  {'learning_rate': 0.05, 'momentum': 0.9},
    ...                                  kvstore='dist_delay', delay=4, warmup_steps=200)
    >>> with autograd.record():
    ...     loss = loss_fn(net(x), y)
    >>> loss.backward()
    >>> trainer.step(batch_size)
    """

    def __init__(self, params, optimizer, optimizer_params=None, kvstore='dist_delay',
                 compression_params=None, update_on_kvstore=None, delay=4, warmup_steps=200,
                 local_lr=None, local_rule='mirror', dc_lambda=None, slack=None,
                 pull_compression=None, checkpoint_dir=None, checkpoint_every=None,
                 keep_checkpoints=None):
        self._schedule = DelaySchedule(delay, warmup_steps)  # checks both
        delay = self._schedule.delay
        if local_lr is not None:
            check_real('local_lr', local_lr, minimum=0,
                       fix="or None for the optimizer's learning rate")
        if slack is not None:
            slack = check_int('slack', slack, delay, 'the slack must cover a whole period '
                              '(slack >= delay=%d)' % delay)
            check_rounds('slack', slack)
        if kvstore is not None and not isinstance(kvstore, (str, KVStoreBase)):
            # gluon.Trainer raises the same TypeError, but only at the first step.
            raise ArgumentTypeError("kvstore must be a str, a KVStore or None, got %r (%s); use "
                                    "kvstore='dist_delay'" % (kvstore, type(kvstore).__name__))
        if update_on_kvstore is not None:
            check_bool('update_on_kvstore', update_on_kvstore, 'or None to let the trainer choose')
        if isinstance(kvstore, str) and 'dist' in kvstore.lower() and not _is_dist_delay(kvstore):
            # MXNet's native distributed stores (and MXNet's fallback for a misspelt type,
            # kvstore_ext.typenames.check_kvstore_type) have no delayed update.
            raise ValueError("kvstore=%r: DelayedTrainer trains distributed only with "
                             "kvstore='dist_delay'; use kvstore='dist_delay' (or 'local', "
                             "'device', None on one machine)" % kvstore)
        if update_on_kvstore is False and _is_dist_delay(kvstore):
            raise ValueError("update_on_kvstore=False cannot be used with kvstore='dist_delay': "
                             'the servers apply the optimizer once per round; leave it None')
        # Compression is validated here, at construction; once the store exists, its own
        # parsed codec (kvstore.compression) is the one the trainer asks.
        compressed = compression.parse(compression_params) if _is_dist_delay(kvstore) else None
        if compressed is not None:
            # Before Gluon ties a row_sparse Parameter to this trainer.
            _refuse_compressed_sparse_grads(params, compressed)
        self._pull_codec = pull_codecs.parse(pull_compression)   # checks it
        if self._pull_codec is not None:
            _refuse_compressed_pulls(params, self._pull_codec)
        registration_order = _parameter_names(params)  # before Gluon sorts them
        self._rule = create_rule(local_rule, dc_lambda)
        self._local_lr = None if local_lr is None else float(local_lr)
        self._slack = slack or delay
        super(DelayedTrainer, self).__init__(params, optimizer, optimizer_params, kvstore,
                                             compression_params, update_on_kvstore)
        if _is_dist_delay(kvstore):
            self._rule.check_optimizer(self._optimizer)
        self._states = [ParamState(i, param) for i, param in enumerate(self._params)]
        if compressed is not None:
            for s in self._states:
                if s.trained:
                    compressed.check_dtype('parameter %s' % s.param.name, s.param.dtype)
        self._base_lr = self._optimizer.learning_rate
        self._order = ForwardOrder(self._states, registration_order)  # priorities (§8)
        self._observer = StepObserver()
        # MXDELAY_TIMELINE: record the first steps without code changes (it sets the observer).
        from .timeline import record_from_env  # pylint: disable=import-outside-toplevel
        self._timeline = record_from_env(self)
        # MXDELAY_LOG_EVERY: a log line every N steps, or the no-op log (chosen once).
        self._step_log = steplog.from_env(self)
        self._autosave = autosave.create(self, _is_dist_delay(kvstore), checkpoint_dir,
                                         checkpoint_every, keep_checkpoints)
        _LOG.info('DelayedTrainer: delay=%d warmup_steps=%d local_rule=%r local_lr=%s slack=%d',
                  delay, warmup_steps, self._rule,
                  'optimizer lr' if self._local_lr is None else self._local_lr, self._slack)

    def set_observer(self, observer):
        """Send this trainer's events (gradient written, push acknowledged, pull received,
        pull applied) to `observer`, a :class:`mxdelay.observer.StepObserver`; None: to
        nobody (the default).

        Raises
        ------
        TypeError
            If `observer` is neither None nor a StepObserver.
        """
        if observer is not None and not isinstance(observer, StepObserver):
            raise ArgumentTypeError('observer must be an mxdelay.observer.StepObserver or None, '
                                    'got %r (%s)' % (observer, type(observer).__name__))
        self._observer = observer or StepObserver()

    def priority_order(self):
        """Parameter names from the highest push/pull priority to the lowest (forward order).

        Known after the first step; before it, registration order.
        """
        return self._order.names()

    # -- the mode ---------------------------------------------------------------------------
    def _init_kvstore(self):
        # The mode is chosen here, once:
        # - a non-distributed kvstore: PassThrough, every step is gluon.Trainer's;
        # - 'dist_delay': Delayed. Each step pushes the gradients as round t; warm-up and
        #   switch pull W_{t+1} into the weights; the delayed phase updates locally and, at
        #   the end of each period, issues a pull that the next step applies (§1.2).
        super(DelayedTrainer, self)._init_kvstore()
        kvstore = self._kvstore
        if not self._distributed:
            # A warning when the user asked for delayed updates they will not get.
            _LOG.log(logging.WARNING if self._schedule.delay > 1 else logging.INFO,
                     'DelayedTrainer: kvstore %r is not distributed: training exactly as '
                     'gluon.Trainer; delay=%d has no effect',
                     getattr(kvstore, 'type', kvstore), self._schedule.delay)
            self._kv_mode = PassThrough(self)
            return
        # Chosen before the checks below: a store that fails them never trains pass-through.
        self._kv_mode = mode = Delayed(self)
        if not isinstance(kvstore, DistDelay):
            raise ValueError("DelayedTrainer needs kvstore='dist_delay' for distributed training, "
                             'got %r; pass kvstore=\'dist_delay\' (and launch with mxdelay-launch '
                             '... mxdelay-run)' % kvstore.type)
        if not self._update_on_kvstore:
            raise ValueError('update_on_kvstore is False (set by the environment variable '
                             'MXNET_UPDATE_ON_KVSTORE=0?), but with \'dist_delay\' the servers '
                             'apply the optimizer: unset MXNET_UPDATE_ON_KVSTORE')
        mode.configure(self._slack)

    def _reset_kvstore(self):
        # Gluon's: no kvstore (yet, or again). Until it is created, the calls that do not
        # create it (set_learning_rate, keys_per_step) have nobody else to tell.
        super(DelayedTrainer, self)._reset_kvstore()
        self._kv_mode = PassThrough(self)

    def _mode(self):
        """The mode chosen when the kvstore was created; creates the kvstore if needed."""
        if not self._kv_initialized:
            self._init_kvstore()
        return self._kv_mode

    def _loss_scaler(self):
        """The AMP loss scaler that ``amp.init_trainer(self)`` set, or None."""
        return getattr(self, '_amp_loss_scaler', None)

    # -- gluon.Trainer's seams ----------------------------------------------------------------
    def _check_and_rescale_grad(self, scale):
        # gluon.Trainer refuses a new batch size with update_on_kvstore; on 'dist_delay' each
        # worker scales its own pushes instead (Delayed.rescale).
        self._optimizer.rescale_grad = scale
        self._kv_mode.rescale(scale)

    def _init_params(self):
        pending = list(self._params_to_init)
        super(DelayedTrainer, self)._init_params()
        self._kv_mode.init_params(pending)

    def _row_sparse_pull(self, parameter, out, row_id, full_idx=False):
        return self._mode().row_sparse_pull(parameter, out, row_id, full_idx)

    def _push_all(self):
        """Push this worker's gradients of the step (a seam: a subclass may wait first)."""
        self._kv_mode.push_all()

    # -- public API ---------------------------------------------------------------------------
    def set_learning_rate(self, lr):
        """Set the learning rate of the optimizer, on the servers too.

        Parameters
        ----------
        lr : float
            The new learning rate.
        """
        check_real('lr', lr, minimum=0, fix='e.g. trainer.set_learning_rate(0.01)')
        super(DelayedTrainer, self).set_learning_rate(lr)
        self._kv_mode.set_learning_rate(lr)

    def step(self, batch_size, ignore_stale_grad=False):
        """Make one step: push this worker's gradients and advance its weights.

        Parameters
        ----------
        batch_size : int
            Batch size of this worker's data; gradients are normalised by 1/batch_size.
            It may change between steps.
        ignore_stale_grad : bool, default False
            As in ``gluon.Trainer``: do not raise for Parameters whose gradient is stale
            (their gradient is still pushed: every worker contributes to every round).

        Raises
        ------
        TypeError
            If `batch_size` is not a number.
        ValueError
            If `batch_size` is not finite and > 0.
        """
        _check_batch_size(batch_size)
        if not self._autosave.before_step():   # saves if due; True: resumed now, drop this step
            self._mode().step(batch_size, ignore_stale_grad)

    def join(self):
        """End this worker's epoch: take part in the other workers' remaining rounds with zero
        gradients until every worker has called ``join``.

        With uneven data (workers with different numbers of batches) call it on every worker
        after its last batch of an epoch (and before any collective call such as
        :meth:`save_states`, which calls it itself). It returns on every worker after the same
        round, so the step counters stay equal. A round in which a worker had no data is a
        round in which its gradient is zero: the servers apply the optimizer to the sum of the
        gradients of the workers that had data (each scaled by 1/its batch size), so such a
        round moves the weights less, while momentum, weight decay and the learning-rate
        schedule advance as in any round. The round in which the last worker calls ``join``
        is not pushed at all. A worker in its delayed phase also makes its local update
        (with a zero gradient) and its pulls in these rounds, exactly as in a step.

        Without ``join`` a worker whose script ends first fills the others' rounds with zero
        gradients at exit (same arithmetic); ``join`` is needed only where the workers must
        meet, e.g. at the end of an epoch before evaluation or a checkpoint.

        Returns
        -------
        int
            The number of rounds this worker filled with zero gradients.
        """
        filled = self._mode().join()
        self._autosave.after_join()
        return filled

    def sync_weights(self, aux_states=False):
        """Make every worker's parameters the servers' global weights; collective.

        In the delayed phase each worker trains its own weights ``w'`` (the global weights of
        its last pull plus its local steps since), so they differ between workers and from
        the servers' ``W``. Call this on every worker where the *global* model is wanted:
        before evaluating or saving the final model, or before a worker-0-only evaluation.
        It first meets the other workers (:meth:`join`: uneven data is fine), then replaces
        every trained parameter, on every device, by ``W`` after all rounds pushed so far.
        Training may go on afterwards: the schedule continues unchanged, and the next local
        steps start from ``W``. With a non-distributed kvstore it does nothing.

        Parameters
        ----------
        aux_states : bool, default False
            Also replace the aux states (Parameters with ``differentiable=False``:
            BatchNorm's running mean and variance), which each worker computes from its own
            data and no server holds, by their mean over the workers, on every device: each
            worker sends the mean of its devices' copies once and receives the sum
            (docs/design.md §2.13; with ``'2bit'`` compression, whose native store
            quantizes every push, the values go to the servers in a command). Frozen weights
            (``grad_req='null'``) are left as they are.

        Raises
        ------
        TypeError
            If `aux_states` is not a bool.
        """
        aux_states = check_bool('aux_states', aux_states, 'e.g. sync_weights(aux_states=True)')
        return self._mode().sync_weights(aux_states)

    def allreduce_grads(self):
        """Not available with ``'dist_delay'``; raises ValueError saying what to do instead.

        ``gluon.Trainer`` offers ``allreduce_grads()`` and ``update()`` only with
        ``update_on_kvstore=False`` (to clip by the global norm of the summed gradient, say);
        on ``'dist_delay'`` the servers apply the optimizer to each round's sum, and a worker
        never holds that sum. Without a distributed kvstore it is ``gluon.Trainer``'s.
        """
        return self._mode().allreduce_grads()

    def update(self, batch_size, ignore_stale_grad=False):
        """Not available with ``'dist_delay'``; see :meth:`allreduce_grads`."""
        return self._mode().update(batch_size, ignore_stale_grad)

    @property
    def rank(self):
        """This worker's rank (0 without a distributed kvstore); creates the kvstore if needed,
        so that a script can shard its data before the first step."""
        return self._mode().rank

    @property
    def num_workers(self):
        """Number of workers (1 without a distributed kvstore)."""
        return self._mode().num_workers

    @property
    def keys_per_step(self):
        """Push operations a step issues (chunks of all trained parameters); for
        :func:`mxdelay.timeline.summarize`."""
        return self._kv_mode.keys_per_step()

    def round_bytes(self):
        """Bytes a step's pushes and a pull carry (:func:`mxdelay.traffic.round_bytes`:
        as configured and with each compression); None without a distributed kvstore."""
        return self._mode().round_bytes()

    @property
    def resumed_step(self):
        """The step resumed at from checkpoint_dir (0: none; the first read resumes)."""
        return self._autosave.resumed_step

    @property
    def schedule(self):
        """The :class:`mxdelay.schedule.DelaySchedule` (its ``step`` is the step counter)."""
        return self._schedule

    def save_states(self, fname):
        """Save everything needed to resume; collective: every worker calls it.

        Worker i writes ``fname + '.worker<i>'`` (its weights, ``pre_weight``, rule state and
        any pulled weights not applied yet), the servers write ``fname + '.kvstore.server<j>'``,
        and worker 0 writes ``fname + '.kvstore'`` and, last, `fname`, the index, which lists
        every other part's sha256. Every file is written atomically, holds no pickle, and
        carries the save's id (docs/design.md §6).

        Parameters
        ----------
        fname : str or os.PathLike
            Path of the index file.
        """
        fname = check_path('fname', fname)
        return self._mode().save_states(fname)

    def load_states(self, fname, trusted=False):
        """Restore what :meth:`save_states` saved; collective: every worker calls it.

        Everything is validated before anything changes: a missing, truncated or foreign
        file, or parts of different saves, raise ``ValueError`` and leave this trainer and
        the servers as they were.

        Parameters
        ----------
        fname : str or os.PathLike
            Path of the index file written by :meth:`save_states`.
        trusted : bool
            Also load a version-1 checkpoint (written by mxdelay before pickle-free
            checkpoints), whose worker and server files are pickles: loading a pickle runs
            whatever code it names, so pass True only for a checkpoint whose writer you
            trust. Version-2 checkpoints never unpickle anything.
        """
        fname = check_path('fname', fname)
        return self._mode().load_states(fname, check_bool('trusted', trusted))


def _check_batch_size(batch_size):
    # gluon.Trainer divides by it unchecked: 0 raises ZeroDivisionError at the step, a
    # negative or NaN size silently corrupts the update.
    check_real('batch_size', batch_size, minimum=0, min_inclusive=False,
               fix='pass the number of samples of this step, e.g. trainer.step(data.shape[0])')


def _parameter_names(params):
    if isinstance(params, (dict, gluon.ParameterDict)):
        return [params[key].name for key in params.keys()]
    if isinstance(params, (list, tuple)):
        return [getattr(p, 'name', None) for p in params]
    return []


def _refuse_compressed_sparse_grads(params, compressed):
    """Refuse row_sparse gradients with compression on 'dist_delay' (docs/design.md §2.10).
    Non-Parameters are left to gluon.Trainer's own check."""
    for param in (params.values() if hasattr(params, 'values') else params):
        grad_stype = getattr(param, '_grad_stype', 'default')
        if grad_stype != 'default':
            raise ValueError(
                'compression_params=%r cannot be combined with row_sparse gradients '
                '(Parameter %s has grad_stype=%r): row_sparse pushes are not compressed; '
                'use compression_params=None, or dense gradients'
                % (compressed.describe(), param.name, grad_stype))


def _refuse_compressed_pulls(params, pull_codec):
    """Refuse what compressed pulls do not support (docs/design.md §2.12)."""
    for param in (params.values() if hasattr(params, 'values') else params):
        stypes = (getattr(param, '_grad_stype', 'default'), getattr(param, '_stype', 'default'))
        if stypes != ('default', 'default'):
            raise ValueError(
                'pull_compression=%r cannot be used with row_sparse parameters (Parameter %s '
                'has stype=%r, grad_stype=%r): their pulls bring rows, not a model every '
                'worker holds; use pull_compression=None, or dense parameters'
                % (pull_codec.describe(), param.name, stypes[1], stypes[0]))


def _is_dist_delay(kvstore):
    if isinstance(kvstore, str):
        return kvstore == STORE_TYPE
    return isinstance(kvstore, DistDelay)
