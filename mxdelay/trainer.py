"""``DelayedTrainer``: a ``gluon.Trainer`` with the k-step delayed update (CN112463189B).

The algorithm is docs/design.md §1; the phase of each step is decided by
:class:`mxdelay.schedule.DelaySchedule` alone.
"""
import logging
import os

import numpy as np

from mxnet import autograd, gluon, nd
from mxnet.kvstore import KVStoreBase

from kvstore_ext import checkpoint, compression
from kvstore_ext.checks import ArgumentTypeError, check_bool, check_int, check_path, check_real
from kvstore_ext.dist_delay import DistDelay
from kvstore_ext.typenames import STORE_TYPE
from kvstore_ext.optimizers import describe_optimizer, type_difference
from .loss_scaling import GlobalOverflows, finite_flag, restore_scaler, scaler_state
from .observer import StepObserver
from .rules import RuleContext, create_rule
from .schedule import DelaySchedule, SWITCH

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
        only). In the delayed phase the local rule steps with what the worker sent. Checked
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
        ``'mirror'``, ``'sgd'``, ``'dc'``, ``'dc_adaptive'`` or a
        :class:`mxdelay.rules.LocalRule` (see :mod:`mxdelay.rules`).
    dc_lambda : float, optional
        Delay-compensation weight added to a built-in rule (default: the rule's own, 0 for
        ``'mirror'`` and ``'sgd'``, 0.04 for ``'dc'`` and ``'dc_adaptive'``).
    slack : int, optional
        Rounds a worker may run ahead of the slowest worker (default and minimum: delay).

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
                 local_lr=None, local_rule='mirror', dc_lambda=None, slack=None):
        self._schedule = DelaySchedule(delay, warmup_steps)  # checks both
        delay = self._schedule.delay
        if local_lr is not None:
            check_real('local_lr', local_lr, minimum=0,
                       fix="or None for the optimizer's learning rate")
        if slack is not None:
            slack = check_int('slack', slack, delay, 'the slack must cover a whole period '
                              '(slack >= delay=%d)' % delay)
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
        compressed = compression.parse(compression_params) if _is_dist_delay(kvstore) else None
        if _is_dist_delay(kvstore):
            # Before Gluon ties a row_sparse Parameter to this trainer.
            _refuse_compressed_sparse_grads(params, compressed)
        self._registration_order = _parameter_names(params)  # before Gluon sorts them
        self._rule = create_rule(local_rule, dc_lambda)
        self._local_lr = None if local_lr is None else float(local_lr)
        self._slack = slack or delay
        super(DelayedTrainer, self).__init__(params, optimizer, optimizer_params, kvstore,
                                             compression_params, update_on_kvstore)
        if _is_dist_delay(kvstore):
            self._rule.check_optimizer(self._optimizer)
        if compressed is not None:
            for param in self._trained_params():
                compressed.check_dtype('parameter %s' % param.name, param.dtype)
        self._base_lr = self._optimizer.learning_rate
        self._pre_weight = {}     # param index -> NDArray on the first context
        self._rule_state = {}     # param index -> rule state
        self._pulled = {}         # param index -> pull target on the first context
        self._grad_sum = {}       # param index -> gradient summed over devices (>1 device)
        self._full = {}           # param index -> w' of a row_sparse weight: every row, dense
        self._logged_phase = None
        self._delayed_mode = None  # decided when the kvstore is created
        self._first_use = []       # param indices in the order the first forward used them
        self._push_order = None    # param indices, last-used first; set at the first step
        self._priority = {}        # param index -> priority (first used: highest)
        self._observer = StepObserver()
        self._amp = None           # AMP (docs/design.md §11): whether the store was told
        self._finite = None        # this step's all-finite flag (AMP)
        self._overflows = GlobalOverflows()
        self._watch_first_forward()
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

    # -- priorities ------------------------------------------------------------------------
    def _watch_first_forward(self):
        # Record the order in which the first forward reads the parameters (every Block reads
        # its weights through Parameter.data, hybridized or not): that order, not Gluon's
        # name-sorted index ('dense10' sorts before 'dense2'), is what the next forward
        # needs first. Removed again at the first step.
        for i, param in enumerate(self._params):
            original = param.data

            def data(ctx=None, _i=i, _original=original):
                if _i not in self._first_use:
                    self._first_use.append(_i)
                return _original(ctx)
            param.data = data

    def _decide_priorities(self):
        for param in self._params:
            param.__dict__.pop('data', None)
        position = {name: n for n, name in enumerate(self._registration_order)}
        unseen = sorted((i for i in range(len(self._params)) if i not in self._first_use),
                        key=lambda i: position.get(self._params[i].name, len(position)))
        order = self._first_use + unseen
        self._priority = {i: -rank for rank, i in enumerate(order)}
        self._push_order = [i for i in reversed(order) if self._params[i].grad_req != 'null']
        _LOG.debug('DelayedTrainer: forward order %s', [self._params[i].name for i in order])

    def priority_order(self):
        """Parameter names from the highest push/pull priority to the lowest (forward order).

        Known after the first step; before it, registration order.
        """
        if self._push_order is None:
            return list(self._registration_order)
        return [self._params[i].name for i in sorted(self._priority, key=self._priority.get,
                                                     reverse=True)]

    # -- kvstore ----------------------------------------------------------------------------
    def _init_kvstore(self):
        super(DelayedTrainer, self)._init_kvstore()
        kvstore = self._kvstore
        self._delayed_mode = bool(self._distributed)
        if not self._delayed_mode:
            # A warning when the user asked for delayed updates they will not get.
            _LOG.log(logging.WARNING if self._schedule.delay > 1 else logging.INFO,
                     'DelayedTrainer: kvstore %r is not distributed: training exactly as '
                     'gluon.Trainer; delay=%d has no effect',
                     getattr(kvstore, 'type', kvstore), self._schedule.delay)
            return
        if not isinstance(kvstore, DistDelay):
            raise ValueError("DelayedTrainer needs kvstore='dist_delay' for distributed training, "
                             'got %r; pass kvstore=\'dist_delay\' (and launch with mxdelay-launch '
                             '... mxdelay-run)' % kvstore.type)
        if not self._update_on_kvstore:
            raise ValueError('update_on_kvstore is False (set by the environment variable '
                             'MXNET_UPDATE_ON_KVSTORE=0?), but with \'dist_delay\' the servers '
                             'apply the optimizer: unset MXNET_UPDATE_ON_KVSTORE')
        state_keys = self._rule.server_state_count(
            self._optimizer, sorted({np.dtype(p.dtype).name for p in self._trained_params()}))
        kvstore.configure(slack=max(self._slack, kvstore.slack), state_keys=state_keys)
        # The kvstore adds its optimizer's description to the hand-shake.
        # amp: the servers skip rounds with a non-finite sum (docs/design.md §11).
        self._amp = self._loss_scaler() is not None
        sparse = [p.name for p in self._params if p._grad_stype != 'default']
        if self._amp and sparse:
            # The store's row_sparse pushes carry no all-finite flag: an overflowed round
            # would be applied on their rows.
            raise ValueError(
                "AMP's dynamic loss scaling cannot be combined with row_sparse gradients "
                "(Parameter %s) on 'dist_delay' yet: an overflowed round would reach the "
                'servers\' row_sparse keys unmarked; train without AMP, or with dense '
                'gradients (e.g. nn.Embedding without sparse_grad)' % ', '.join(sparse))
        if self._amp and kvstore.compression is not None:
            # 2bit quantizes inf to +t (and nan to 0, with a nan residual from then on): an
            # overflowed round would reach the servers finite and be applied. fp16: a
            # loss-scaled gradient that is finite in float32 can overflow float16's range in
            # the push's cast, and the servers would skip a round that no worker's overflow
            # flag (computed before the cast) reported: measured, the loss scales then leave
            # Gluon's sequence. Refused until the flag covers the cast.
            raise ValueError(
                "AMP's dynamic loss scaling cannot be combined with compression_params=%r yet: "
                'an overflowed gradient would be quantized to finite values (2bit), or a '
                'loss-scaled gradient could overflow in the float16 cast without the workers\' '
                'overflow flags seeing it (fp16); use compression_params=None with AMP'
                % (kvstore.compression.describe(),))
        kvstore.set_config(delay=self._schedule.delay, warmup_steps=self._schedule.warmup_steps,
                           local_rule=repr(self._rule), local_lr=self._local_lr, amp=self._amp)

    def _loss_scaler(self):
        """The AMP loss scaler that ``amp.init_trainer(self)`` set, or None."""
        return getattr(self, '_amp_loss_scaler', None)

    def _check_amp(self):
        if (self._loss_scaler() is not None) != self._amp:
            raise ValueError(
                'amp.init_trainer(trainer) was called after the trainer created its kvstore '
                "(at the first step, or trainer.rank / num_workers): with 'dist_delay' the "
                'servers must know at the hand-shake that rounds may overflow. Call '
                'amp.init_trainer(trainer) right after creating the DelayedTrainer')

    def _check_and_rescale_grad(self, scale):
        # gluon.Trainer refuses a new batch size with update_on_kvstore. Here each worker
        # scales its own pushes by its own batch size (DistDelay.scale_gradients): workers
        # with other batch sizes, or a smaller last batch, stay exact; no command is sent.
        self._optimizer.rescale_grad = scale
        if self._delayed_mode:
            self._kvstore.scale_gradients(scale)

    def set_learning_rate(self, lr):
        """Set the learning rate of the optimizer, on the servers too.

        Parameters
        ----------
        lr : float
            The new learning rate.
        """
        check_real('lr', lr, minimum=0, fix='e.g. trainer.set_learning_rate(0.01)')
        super(DelayedTrainer, self).set_learning_rate(lr)
        if self._delayed_mode:
            self._kvstore.set_learning_rate(lr)

    # -- step ---------------------------------------------------------------------------------
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
        if not self._kv_initialized:
            self._init_kvstore()
        if not self._delayed_mode:
            return super(DelayedTrainer, self).step(batch_size, ignore_stale_grad)
        self._check_amp()
        self._check_and_rescale_grad(self._scale / batch_size)
        if self._params_to_init:
            self._init_params()
        if self._push_order is None:
            self._decide_priorities()
        self._check_fresh(ignore_stale_grad)
        self._advance()
        return None

    def _advance(self):
        """Push this worker's gradients as round t and make step t's update."""
        t = self._schedule.step
        self._log_phase(t)
        self._push_all()
        if self._schedule.is_synchronous(t):
            self._synchronous_step(t)
        else:
            self._local_step(t)
        self._schedule.step = t + 1

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
        if not self._kv_initialized:
            self._init_kvstore()
        if not self._delayed_mode:
            return 0
        if self._params_to_init:
            self._init_params()
        if self._push_order is None:
            self._decide_priorities()
        filled = 0
        while not self._kvstore.finish_round():
            if filled == 0:
                for param in self._trained_params():
                    param.zero_grad()
            self._advance()
            filled += 1
        if filled:
            _LOG.info('DelayedTrainer: worker %d had no data for %d rounds of the other '
                      'workers (zero gradients); all workers continue at step %d',
                      self._kvstore.rank, filled, self._schedule.step)
        return filled

    def sync_weights(self):
        """Make every worker's parameters the servers' global weights; collective.

        In the delayed phase each worker trains its own weights ``w'`` (the global weights of
        its last pull plus its local steps since), so they differ between workers and from
        the servers' ``W``. Call this on every worker where the *global* model is wanted:
        before evaluating or saving the final model, or before a worker-0-only evaluation.
        It first meets the other workers (:meth:`join`: uneven data is fine), then replaces
        every trained parameter, on every device, by ``W`` after all rounds pushed so far.
        Training may go on afterwards: the schedule continues unchanged, and the next local
        steps start from ``W``. With a non-distributed kvstore it does nothing.
        """
        if not self._kv_initialized:
            self._init_kvstore()
        if not self._delayed_mode:
            return
        if self._params_to_init:
            self._init_params()
        self.join()
        targets = {i: self._weights(i, param) for i, param in enumerate(self._params)
                   if param.grad_req != 'null'}
        for i, weights in targets.items():
            # After this worker's last pushed round t (the same on every worker after join):
            # exactly W_{t+1}, whatever the arrival order (docs/design.md §2).
            self._kvstore.pull(i, out=weights, priority=self._priority.get(i, 0))
        for weights in targets.values():
            weights[0].wait_to_read()

    def allreduce_grads(self):
        """Not available with ``'dist_delay'``; raises ValueError saying what to do instead.

        ``gluon.Trainer`` offers ``allreduce_grads()`` and ``update()`` only with
        ``update_on_kvstore=False`` (to clip by the global norm of the summed gradient, say);
        on ``'dist_delay'`` the servers apply the optimizer to each round's sum, and a worker
        never holds that sum. Without a distributed kvstore it is ``gluon.Trainer``'s.
        """
        if not self._kv_initialized:
            self._init_kvstore()
        if self._delayed_mode:
            raise ValueError(_NO_MANUAL_UPDATE % 'allreduce_grads()')
        return super(DelayedTrainer, self).allreduce_grads()

    def update(self, batch_size, ignore_stale_grad=False):
        """Not available with ``'dist_delay'``; see :meth:`allreduce_grads`."""
        if not self._kv_initialized:
            self._init_kvstore()
        if self._delayed_mode:
            raise ValueError(_NO_MANUAL_UPDATE % 'update()')
        return super(DelayedTrainer, self).update(batch_size, ignore_stale_grad)

    def _log_phase(self, t):
        phase = self._schedule.phase(t)
        if phase != self._logged_phase:
            self._logged_phase = phase
            _LOG.info('DelayedTrainer: step %d enters the %s phase', t, phase)

    def _check_fresh(self, ignore_stale_grad):
        for param in self._trained_params():
            for data in param._check_and_get(param._data, list):
                if not data._fresh_grad and not ignore_stale_grad:
                    raise UserWarning(
                        'Gradient of Parameter `%s` on context %s has not been updated by '
                        'backward since last `step`. Call step with ignore_stale_grad=True '
                        'to push it anyway.' % (param.name, data.context))
                data._fresh_grad = False

    def _trained_params(self):
        return [p for p in self._params if p.grad_req != 'null']

    def _weights(self, i, param):
        """The arrays that hold w' of Parameter `i`: its data on every device, or for a
        row_sparse weight the trainer's dense copy of every row (docs/design.md §2.10)."""
        if param._stype == 'default':
            return param.list_data()
        return [self._full[i]]

    # -- row_sparse weights (docs/design.md §2.10) ------------------------------------------
    def _init_params(self):
        pending = list(self._params_to_init)
        super(DelayedTrainer, self)._init_params()
        if not self._delayed_mode:
            return
        for param in pending:
            if param._stype != 'default' and param not in self._params_to_init:
                # The worker's copy of every row starts at the servers' W_0 (rank 0's value:
                # the workers' own initial values may differ).
                i = self._param2idx[param.name]
                self._full[i] = nd.zeros(param.shape, ctx=self._contexts[0], dtype=param.dtype)
                self._kvstore.pull(i, out=self._full[i], priority=self._priority.get(i, 0))

    def _row_sparse_pull(self, parameter, out, row_id, full_idx=False):
        # Gluon's row_sparse_data(row_id): on 'dist_delay' the rows of this worker's copy
        # w' (after a pull is applied: W of that round), with no communication.
        if not self._kv_initialized:
            self._init_kvstore()
        if not self._delayed_mode:
            return super(DelayedTrainer, self)._row_sparse_pull(parameter, out, row_id,
                                                                 full_idx)
        if self._params_to_init:
            with autograd.pause():  # Gluon calls this in forward, inside autograd.record()
                self._init_params()
        full = self._full[self._param2idx[parameter.name]]
        rows = np.unique(row_id.asnumpy()).astype(np.int64)  # as row_sparse_pull: once each
        if rows.size and (rows[0] < 0 or rows[-1] >= full.shape[0]):
            raise ValueError('row_sparse_data of Parameter %s: row ids must be in [0, %d), got '
                             '%s' % (parameter.name, full.shape[0],
                                     rows[(rows < 0) | (rows >= full.shape[0])]))
        with autograd.pause():
            if rows.size:
                ids = nd.array(rows, ctx=full.context, dtype='int64')
                value = nd.sparse.row_sparse_array((nd.take(full, ids), ids), shape=full.shape,
                                                   ctx=full.context, dtype=full.dtype)
            else:
                value = nd.sparse.zeros('row_sparse', full.shape, ctx=full.context,
                                        dtype=full.dtype)
            for target in (out if isinstance(out, (list, tuple)) else [out]):
                value.copyto(target)

    def _reduced_grad(self, i, param):
        """This worker's gradient of `param` summed over its devices, on the first device
        (row_sparse gradients: the union of the devices' rows)."""
        grads = param.list_grad()
        if len(grads) == 1:
            return grads[0]
        if i not in self._grad_sum:
            first = grads[0]
            self._grad_sum[i] = (nd.zeros_like(first) if first.stype == 'default' else
                                 nd.sparse.zeros(first.stype, first.shape, ctx=first.context,
                                                 dtype=first.dtype))
        first = grads[0].context
        nd.add_n(*[g.as_in_context(first) for g in grads], out=self._grad_sum[i])
        return self._grad_sum[i]

    def _push_all(self):
        # Issued at once, last layer first: MXNet's engine starts each push as soon as its
        # gradient is written (backward runs in segments of a few operators, see env.py),
        # and the priority lets the layers the next forward needs first overtake.
        grads = {i: self._reduced_grad(i, self._params[i]) for i in self._push_order}
        if self._amp:
            # Every push of the step waits for this flag, i.e. for the whole backward
            # (docs/design.md §11): an overflowed round reaches every chunk as inf/nan.
            self._finite = finite_flag(list(grads.values()))
            self._kvstore.set_finite_flag(self._finite)
        for i in self._push_order:
            grad = grads[i]
            self._kvstore.push(i, grad, priority=self._priority[i])
            name, t = self._params[i].name, self._schedule.step
            self._observer.gradient_written(name, t, grad)
            self._observer.push_acknowledged(name, t, self._kvstore.send_buffer(i))

    def _synchronous_step(self, t):
        # Warm-up (S1) and switch (S2): pull exactly W_{t+1} into the weights.
        switch = self._schedule.phase(t) == SWITCH
        if switch:
            self._rule.start(self._optimizer)
        fetch = {}
        for i, param in enumerate(self._params):
            if param.grad_req == 'null':
                continue
            datas = self._weights(i, param)
            before = datas[0].copy() if switch else None          # W_W
            self._kvstore.pull(i, out=datas, priority=self._priority[i])
            self._observer.pull_received(param.name, t, datas[0])  # straight into the weights
            self._observer.pull_applied(param.name, t, datas[0])
            if switch:
                self._pre_weight[i] = datas[0].copy()             # pre_weight := W_{W+1}
                state = self._rule.create_state_for(i, datas[0], datas[0] - before)
                self._rule_state[i] = state
                arrays = self._rule.server_state(datas[0], state, i)
                if arrays:
                    fetch[i] = arrays
        if fetch:
            # Collective: the servers' optimizer state after round W (docs/design.md §1.4).
            self._kvstore.fetch_optimizer_states(fetch)
        if self._amp:
            # Round t's global overflow flag drives the loss scale of step t + 1, as
            # gluon.Trainer's local one does (docs/design.md §11); waits for round t.
            self._kvstore.pull_overflows()
            self._overflows.apply(self._loss_scaler(), self._kvstore, t)

    def _read_worker_state(self, fname, kv):
        """Read and validate this worker's files of checkpoint `fname`; change nothing."""
        index = checkpoint.read_json(fname, checkpoint.TRAINER_INDEX)
        if index['num_workers'] != kv.num_workers:
            raise ValueError('%s was saved by %d workers, this job has %d'
                             % (fname, index['num_workers'], kv.num_workers))
        state = checkpoint.read_pickle(checkpoint.worker_file(fname, kv.rank), checkpoint.WORKER)
        saved = state['schedule']
        if (saved['delay'], saved['warmup_steps']) != (self._schedule.delay,
                                                        self._schedule.warmup_steps):
            raise ValueError('%s was saved with delay=%d warmup_steps=%d; this trainer has '
                             'delay=%d warmup_steps=%d' % (fname, saved['delay'],
                                                           saved['warmup_steps'],
                                                           self._schedule.delay,
                                                           self._schedule.warmup_steps))
        for i, param in enumerate(self._params):
            if state['weights'][i].shape != param.shape:
                raise ValueError('%s: parameter %s has shape %s, saved %s' % (
                    fname, param.name, param.shape, state['weights'][i].shape))
        current = kv.compression and kv.compression.describe()
        if state.get('compression') != current:
            raise ValueError('%s was saved with compression_params %r, this trainer has %r: '
                             'resume with the same compression'
                             % (fname, state.get('compression'), current))
        if set(state.get('residuals', {})) != set(kv.residuals()):
            raise ValueError('%s holds compression residuals of keys %s, this trainer has %s'
                             % (fname, sorted(state.get('residuals', {})),
                                sorted(kv.residuals())))
        if (state.get('amp') is not None) != bool(self._amp):
            raise ValueError('%s was saved %s AMP, this trainer runs %s it: %s'
                             % ((fname,) + (('with', 'without', 'call amp.init_trainer('
                                             'trainer) before loading') if state.get('amp')
                                            else ('without', 'with', 'resume without AMP'))))
        saved = state.get('optimizer')
        types = saved is not None and type_difference(describe_optimizer(saved),
                                                      describe_optimizer(self._optimizer))
        if types:
            raise ValueError('%s was saved with optimizer %s, this trainer uses %s: create the '
                             'trainer with the checkpoint\'s optimizer to resume from it'
                             % ((fname,) + tuple(types)))
        return state

    def _local_step(self, t):
        # Delayed phase: the local update's steps 1-4 (docs/design.md §1), then the pull
        # that ends a period.
        applies = self._schedule.applies_pull(t)
        issues = self._schedule.issues_pull(t)
        overflowed = False
        if self._amp:
            # docs/design.md §11: the period's global flags reach the loss scale with its
            # pull; this worker skips its own local step only on its own overflow.
            if applies:
                self._overflows.apply(self._loss_scaler(), self._kvstore, t - 1)
            overflowed = not self._finite.asscalar()
        update = t - self._overflows.skipped   # the servers' update of round t, as known
        lr = self._local_learning_rate(update)
        for i, param in enumerate(self._params):
            if param.grad_req == 'null':
                continue
            datas = self._weights(i, param)
            weight = datas[0]
            if applies:
                self._pulled[i].copyto(weight)                   # 1. w' := W_t
                self._observer.pull_applied(param.name, t - 1, weight)
            grad_sync = weight - self._pre_weight[i] if self._rule.needs_grad_sync else None
            if applies:
                weight.copyto(self._pre_weight[i])               # 3. pre_weight := w'
            ctx = RuleContext(lr=lr * param.lr_mult, wd=self._optimizer.wd * param.wd_mult,
                              momentum=getattr(self._optimizer, 'momentum', 0.0) or 0.0,
                              clip_gradient=self._clip_gradient(),
                              rescale_grad=self._optimizer.rescale_grad,
                              num_workers=self._kvstore.num_workers, index=i, step=update,
                              pulled=applies, issues_pull=issues, delay=self._schedule.delay)
            if not overflowed:
                self._rule.update(weight, self._local_gradient(i, param), grad_sync,  # 2., 4.
                                  self._rule_state[i], ctx)
            for other in datas[1:]:
                weight.copyto(other)                             # device copies stay equal
            if issues:
                if i not in self._pulled:
                    self._pulled[i] = nd.zeros_like(weight)
                self._kvstore.pull(i, out=self._pulled[i], priority=self._priority[i])
                self._observer.pull_received(param.name, t, self._pulled[i])
        if issues and self._amp:
            self._kvstore.pull_overflows()

    def _local_gradient(self, i, param):
        """The local rule's g: this worker's gradient, or with compression what it sent
        (so that with one worker the local step is the servers' step, docs/design.md §1.4)."""
        grad = self._reduced_grad(i, param)
        if self._kvstore.compression is None:
            return grad
        return self._kvstore.sent_gradient(i, grad)

    def _clip_gradient(self):
        clip = self._optimizer.clip_gradient
        return -1.0 if clip is None else float(clip)

    def _local_learning_rate(self, update):
        """``local_lr`` scaled by the optimizer's schedule at num_update ``update + 1``
        (round t's is t + 1 less the rounds skipped for overflow)."""
        scheduler = self._optimizer.lr_scheduler
        current = (scheduler(update + 1) if scheduler is not None
                   else self._optimizer.learning_rate)
        if self._local_lr is None:
            return current
        return self._local_lr * current / self._base_lr if self._base_lr else self._local_lr

    # -- state ----------------------------------------------------------------------------------
    @property
    def rank(self):
        """This worker's rank (0 without a distributed kvstore); creates the kvstore if needed,
        so that a script can shard its data before the first step."""
        if not self._kv_initialized:
            self._init_kvstore()
        return self._kvstore.rank if self._distributed else 0

    @property
    def num_workers(self):
        """Number of workers (1 without a distributed kvstore)."""
        if not self._kv_initialized:
            self._init_kvstore()
        return self._kvstore.num_workers if self._distributed else 1

    @property
    def keys_per_step(self):
        """Push operations a step issues (chunks of all trained parameters); for
        :func:`mxdelay.timeline.summarize`."""
        if not self._delayed_mode:
            return 0
        return sum(self._kvstore.num_chunks(i) for i, p in enumerate(self._params)
                   if p.grad_req != 'null')

    @property
    def schedule(self):
        """The :class:`mxdelay.schedule.DelaySchedule` (its ``step`` is the step counter)."""
        return self._schedule

    def save_states(self, fname):
        """Save everything needed to resume; collective: every worker calls it.

        Worker i writes ``fname + '.worker<i>'`` (its weights, ``pre_weight``, rule state and
        any pulled weights not applied yet), the servers write ``fname + '.server<j>'``, and
        worker 0 writes `fname`, the index. Every file is written atomically.

        Parameters
        ----------
        fname : str or os.PathLike
            Path of the index file.
        """
        fname = check_path('fname', fname)
        if not self._kv_initialized:
            self._init_kvstore()
        if not self._delayed_mode:
            return super(DelayedTrainer, self).save_states(fname)
        self._check_amp()
        if self._params_to_init:
            self._init_params()
        self.join()  # every worker at the same round, or a hang in the barriers below
        nd.waitall()
        kv = self._kvstore
        worker_state = {
            'rank': kv.rank,
            'schedule': self._schedule.state_dict(), 'rescale_grad': self._optimizer.rescale_grad,
            'weights': {i: self._weights(i, p)[0].asnumpy() for i, p in enumerate(self._params)},
            'pre_weight': {i: w.asnumpy() for i, w in self._pre_weight.items()},
            'pulled': {i: w.asnumpy() for i, w in self._pulled.items()},
            'rule_state': {i: _to_numpy(s) for i, s in self._rule_state.items()},
            # As gluon.Trainer's states: the optimizer (its param_dict is not pickled) and
            # the learning rate local_lr is scaled against.
            'optimizer': self._optimizer, 'base_lr': self._base_lr,
            # Gradient compression: the setting and this worker's residuals (per key).
            'compression': kv.compression and kv.compression.describe(),
            'residuals': kv.residuals(),
            # AMP: the loss scaler and the rounds it has seen (docs/design.md §11); the
            # overflow marks of rounds not seen yet are restored on the counter's server.
            'amp': None if not self._amp else {
                'scaler': scaler_state(self._loss_scaler()),
                'overflows': self._overflows.state_dict()},
        }
        checkpoint.write_pickle(checkpoint.worker_file(fname, kv.rank), checkpoint.WORKER,
                                worker_state)
        kv.save_optimizer_states(checkpoint.kvstore_file(fname))
        if kv.rank == 0:
            checkpoint.write_json(fname, checkpoint.TRAINER_INDEX, {
                'num_workers': kv.num_workers, 'schedule': self._schedule.state_dict(),
                'kvstore': os.path.basename(checkpoint.kvstore_file(fname))})
        kv.barrier()
        return None

    def load_states(self, fname):
        """Restore what :meth:`save_states` saved; collective: every worker calls it.

        Everything is validated before anything changes: a missing, truncated or foreign
        file raises ``ValueError`` and leaves this trainer and the servers as they were.

        Parameters
        ----------
        fname : str or os.PathLike
            Path of the index file written by :meth:`save_states`.
        """
        fname = check_path('fname', fname)
        if not self._kv_initialized:
            self._init_kvstore()
        if not self._delayed_mode:
            return super(DelayedTrainer, self).load_states(fname)
        self._check_amp()
        if self._params_to_init:
            self._init_params()
        self.join()
        kv = self._kvstore
        state, error = None, None
        try:
            state = self._read_worker_state(fname, kv)
        except ValueError as err:
            error = str(err)
        # Collective: if any worker's or server's file is bad, every worker raises here.
        kv_state = kv.check_states(checkpoint.kvstore_file(fname), error)
        kv.apply_states(kv_state)
        for i, param in enumerate(self._params):
            # Not Parameter.set_data: it resets the trainer's kvstore (impossible when dist).
            for data in self._weights(i, param):
                data[:] = state['weights'][i]
        ctx0 = self._contexts[0]
        self._pre_weight = {i: nd.array(w, ctx=ctx0, dtype=w.dtype)
                            for i, w in state['pre_weight'].items()}
        self._pulled = {i: nd.array(w, ctx=ctx0, dtype=w.dtype)
                        for i, w in state['pulled'].items()}
        self._rule_state = {i: _from_numpy(s, ctx0) for i, s in state['rule_state'].items()}
        kv.set_residuals(state.get('residuals', {}))
        if state.get('optimizer') is not None:
            # The servers apply the saved optimizer from now on; so does the local rule
            # (gluon.Trainer.load_states adopts the saved optimizer too).
            self._optimizer = state['optimizer']
            self._optimizer.param_dict = {i: param for i, param in enumerate(self._params)}
            self._base_lr = state.get('base_lr', self._base_lr)
        if state.get('amp') is not None:
            restore_scaler(self._loss_scaler(), state['amp']['scaler'])
            self._overflows = GlobalOverflows(**state['amp']['overflows'])
        self._schedule.step = state['schedule']['step']
        if self._schedule.step > self._schedule.warmup_steps:
            self._rule.start(self._optimizer)   # the switch's start, with the loaded optimizer
        self._check_and_rescale_grad(state['rescale_grad'])
        self._logged_phase = None
        return None


_NO_MANUAL_UPDATE = (
    "%s is not available with kvstore='dist_delay': the servers apply the optimizer to the "
    "sum of all workers' gradients, which no worker holds. To clip gradients, either clip "
    "this worker's own gradients before step() (e.g. gluon.utils.clip_global_norm([p.grad() "
    "for p in params], max_norm), then trainer.step(batch_size): each worker's gradient is "
    "clipped by its own norm), or give the optimizer clip_gradient=... (elementwise, applied "
    "on the servers and in the local rule). docs/design.md §1 has the semantics")


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
        if grad_stype != 'default' and compressed is not None:
            raise ValueError(
                'compression_params=%r cannot be combined with row_sparse gradients '
                '(Parameter %s has grad_stype=%r): row_sparse pushes are not compressed; '
                'use compression_params=None, or dense gradients'
                % (compressed.describe(), param.name, grad_stype))


def _is_dist_delay(kvstore):
    if isinstance(kvstore, str):
        return kvstore == STORE_TYPE
    return isinstance(kvstore, DistDelay)


def _to_numpy(state):
    # A rule state: None, an NDArray, or a (nested) tuple or list of those.
    if isinstance(state, (tuple, list)):
        return type(state)(_to_numpy(s) for s in state)
    return None if state is None else state.asnumpy()


def _from_numpy(state, ctx):
    if isinstance(state, (tuple, list)):
        return type(state)(_from_numpy(s, ctx) for s in state)
    return None if state is None else nd.array(state, ctx=ctx, dtype=state.dtype)
