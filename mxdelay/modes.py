"""How a :class:`mxdelay.DelayedTrainer` trains: one mode, chosen when its kvstore is created.

- :class:`PassThrough`: a non-distributed kvstore (``'local'``, ``'device'``, None): every
  method is ``gluon.Trainer``'s;
- :class:`Delayed`: ``'dist_delay'``: the k-step delayed update (docs/design.md §1). Each
  step pushes the worker's gradients as round t, then either pulls ``W_{t+1}`` into the
  weights (warm-up and switch) or makes the local update and, at the end of a period,
  issues the pull that the next step applies.

The trainer asks its mode (``DelayedTrainer._mode()``) and never re-derives it. A mode is
the trainer's other half: it reads the trainer's Gluon state (parameters, optimizer,
contexts) and the trainer's own (schedule, rule, observer, per-parameter state).
"""
# pylint: disable=protected-access
import logging

import numpy as np

from mxnet import autograd, gluon, nd

from kvstore_ext import checkpoint, store_checkpoint
from . import traffic, worker_state
from .loss_scaling import amp_policy
from .rules import RuleContext
from .schedule import SWITCH

__all__ = ['PassThrough', 'Delayed']

# The trainer's log, where users (and tests) find its phases: one logger for the trainer.
_LOG = logging.getLogger('mxdelay.trainer')

_NO_MANUAL_UPDATE = (
    "%s is not available with kvstore='dist_delay': the servers apply the optimizer to the "
    "sum of all workers' gradients, which no worker holds. To clip gradients, either clip "
    "this worker's own gradients before step() (e.g. gluon.utils.clip_global_norm([p.grad() "
    "for p in params], max_norm), then trainer.step(batch_size): each worker's gradient is "
    "clipped by its own norm), or give the optimizer clip_gradient=... (elementwise, applied "
    "on the servers and in the local rule). docs/design.md §1 has the semantics")


class PassThrough(object):
    """Exactly ``gluon.Trainer`` (also the trainer's mode until its kvstore exists).

    Each method of a mode is the trainer's of the same name (``rescale``: after
    ``_check_and_rescale_grad``; ``init_params``: after Gluon's ``_init_params``).
    """

    def __init__(self, trainer):
        self._trainer = trainer

    def step(self, batch_size, ignore_stale_grad):
        return gluon.Trainer.step(self._trainer, batch_size, ignore_stale_grad)

    def join(self):
        return 0

    def sync_weights(self, aux_states):  # pylint: disable=unused-argument
        return None

    def save_states(self, fname):
        return gluon.Trainer.save_states(self._trainer, fname)

    def load_states(self, fname, trusted=False):  # pylint: disable=unused-argument
        # gluon.Trainer's own file (a pickle, as gluon.Trainer reads it): see docs/api.md.
        return gluon.Trainer.load_states(self._trainer, fname)

    def allreduce_grads(self):
        return gluon.Trainer.allreduce_grads(self._trainer)

    def update(self, batch_size, ignore_stale_grad):
        return gluon.Trainer.update(self._trainer, batch_size, ignore_stale_grad)

    @property
    def rank(self):
        return 0

    @property
    def num_workers(self):
        return 1

    def keys_per_step(self):
        return 0

    def round_bytes(self):
        return None

    def set_learning_rate(self, lr):
        """Called after the optimizer's learning rate is set: nothing else to tell."""

    def rescale(self, scale):
        """Called after the optimizer's rescale_grad is set: nothing else to tell."""

    def init_params(self, pending):
        """Called after gluon.Trainer's ``_init_params`` with the parameters it had to init."""

    def row_sparse_pull(self, parameter, out, row_id, full_idx):
        return gluon.Trainer._row_sparse_pull(self._trainer, parameter, out, row_id, full_idx)


class Delayed(object):
    """The k-step delayed update on ``'dist_delay'`` (docs/design.md §1).

    Parameters
    ----------
    trainer : DelayedTrainer
        The trainer, whose kvstore (a ``DistDelay``) has just been created.
    """

    def __init__(self, trainer):
        self._trainer = trainer
        self._kv = trainer._kvstore
        self._logged_phase = None
        # amp: the servers skip rounds with a non-finite sum (docs/design.md §11).
        self.amp = amp_policy(trainer._loss_scaler)

    def configure(self, slack):
        """Check and configure the store before its hand-shake (its first ``init``)."""
        trainer, kv = self._trainer, self._kv
        state_keys = trainer._rule.server_state_count(
            trainer._optimizer, sorted({np.dtype(s.param.dtype).name
                                        for s in trainer._states if s.trained}))
        kv.configure(slack=max(slack, kv.slack), state_keys=state_keys)
        # The kvstore adds its optimizer's description to the hand-shake.
        # The local rule's g: this worker's gradient, or with compression what it sent (so
        # that with one worker the local step is the servers' step, docs/design.md §1.4).
        self._rule_gradient = _own_gradient if kv.compression is None else kv.sent_gradient
        self.amp.refuse([s.param.name for s in trainer._states
                         if s.param._grad_stype != 'default'], kv.compression)
        if trainer._pull_codec is not None:
            kv.set_pull_compression(trainer._pull_codec)
        if kv.pull_compression is not None and self.amp.enabled:
            # (Also when the store was given the setting itself.)
            raise ValueError(
                'pull_compression=%r cannot be combined with AMP (amp.init_trainer) yet: the '
                'skipped rounds of an overflow have not been tested with compressed pulls; use '
                'pull_compression=None with AMP' % (kv.pull_compression.describe(),))
        # The pulls of the schedule (warm-up, switch, the end of each period): compressed
        # with pull_compression (docs/design.md §2.12); sync_weights always pulls exactly.
        self._scheduled_pull = kv.pull_compressed if kv.pull_compression else kv.pull
        # A synchronous step's exchange: one pushpull per tensor, whose weights come back
        # while later tensors' pushes still arrive (docs/design.md §8); with compressed pulls
        # the push and the compressed pull of the same round (§2.12).
        self._exchange = self._push_and_pull_compressed if kv.pull_compression else kv.pushpull
        kv.set_config(delay=trainer._schedule.delay,
                      warmup_steps=trainer._schedule.warmup_steps,
                      local_rule=repr(trainer._rule), local_lr=trainer._local_lr,
                      amp=self.amp.enabled)

    # -- the store ----------------------------------------------------------------------------
    @property
    def rank(self):
        return self._kv.rank

    @property
    def num_workers(self):
        return self._kv.num_workers

    def keys_per_step(self):
        return sum(self._kv.num_chunks(s.index) for s in self._trainer._states if s.trained)

    def round_bytes(self):
        return traffic.round_bytes(self._kv, [s.index for s in self._trainer._states
                                              if s.trained])

    def set_learning_rate(self, lr):
        self._kv.set_learning_rate(lr)

    def rescale(self, scale):
        # Each worker scales its own pushes by its own batch size (DistDelay.scale_gradients):
        # workers with other batch sizes, or a smaller last batch, stay exact; no command.
        self._kv.scale_gradients(scale)

    def allreduce_grads(self):
        raise ValueError(_NO_MANUAL_UPDATE % 'allreduce_grads()')

    def update(self, batch_size, ignore_stale_grad):
        raise ValueError(_NO_MANUAL_UPDATE % 'update()')

    # -- steps --------------------------------------------------------------------------------
    def _prepare(self, priorities=True):
        trainer = self._trainer
        if trainer._params_to_init:
            trainer._init_params()
        if priorities and trainer._order.push_order is None:
            trainer._order.decide()

    def step(self, batch_size, ignore_stale_grad):
        trainer = self._trainer
        self.amp.check_unchanged()
        trainer._check_and_rescale_grad(trainer._scale / batch_size)
        self._prepare()
        self._check_fresh(ignore_stale_grad)
        t = trainer._schedule.step
        self._advance()
        trainer._step_log.stepped(t, batch_size, self)

    def awaited(self, t):
        """For the step log (:mod:`mxdelay.steplog`), once step `t` is issued: its gradients,
        the arrays whose arrival ends the communication its next computation needs (a
        synchronous step's weights, a delayed step's pull), and whether it pulled."""
        schedule = self._trainer._schedule
        states = [s for s in self._trainer._states if s.trained]
        gradients = [g for s in states for g in s.param.list_grad()]
        if schedule.is_synchronous(t):
            return gradients, [s.weights()[0] for s in states], True
        if schedule.issues_pull(t):
            return gradients, [s.pulled for s in states], True
        return gradients, [], False

    def join(self):
        trainer = self._trainer
        self._prepare()
        filled = 0
        while not self._kv.finish_round():
            if filled == 0:
                for s in trainer._states:
                    if s.trained:
                        s.param.zero_grad()
            self._advance()
            filled += 1
        if filled:
            _LOG.info('DelayedTrainer: worker %d had no data for %d rounds of the other '
                      'workers (zero gradients); all workers continue at step %d',
                      self._kv.rank, filled, trainer._schedule.step)
        return filled

    def sync_weights(self, aux_states):
        self._prepare(priorities=False)
        self._trainer.join()
        targets = [(s, s.weights()) for s in self._trainer._states if s.trained]
        for s, weights in targets:
            # After this worker's last pushed round t (the same on every worker after join):
            # exactly W_{t+1}, whatever the arrival order (docs/design.md §2).
            self._kv.pull(s.index, out=weights, priority=s.priority)
        for _, weights in targets:
            weights[0].wait_to_read()
        aux = [s for s in self._trainer._states if s.aux]
        if aux_states and aux:
            # One round of the aux keys' own, all at once: the mean over the workers (§2.13).
            self._kv.average([s.index for s in aux], [s.param.list_data() for s in aux])

    def _advance(self):
        """Push this worker's gradients as round t and make step t's update."""
        schedule = self._trainer._schedule
        t = schedule.step
        self._log_phase(t)
        synchronous = schedule.is_synchronous(t)
        before = self._weights_before_switch(t) if synchronous else None
        self._trainer._push_all()
        if synchronous:
            self._synchronous_step(t, before)
        else:
            self._local_step(t)
        schedule.step = t + 1

    def _log_phase(self, t):
        phase = self._trainer._schedule.phase(t)
        if phase != self._logged_phase:
            self._logged_phase = phase
            _LOG.info('DelayedTrainer: step %d enters the %s phase', t, phase)

    def _check_fresh(self, ignore_stale_grad):
        for s in self._trainer._states:
            if not s.trained:
                continue
            for data in s.param._check_and_get(s.param._data, list):
                if not data._fresh_grad and not ignore_stale_grad:
                    raise UserWarning(
                        'Gradient of Parameter `%s` on context %s has not been updated by '
                        'backward since last `step`. Call step with ignore_stale_grad=True '
                        'to push it anyway.' % (s.param.name, data.context))
                data._fresh_grad = False

    def push_all(self):
        # Issued at once, last layer first: MXNet's engine starts each push as soon as its
        # gradient is written (backward runs in segments of a few operators, see env.py),
        # and the priority lets the layers the next forward needs first overtake. A
        # synchronous step pulls W_{t+1} into the weights with the same request
        # (DistDelay.pushpull): each chunk's weights come back once its round is applied,
        # while later chunks' pushes still arrive (docs/design.md §8).
        trainer = self._trainer
        order = [trainer._states[i] for i in trainer._order.push_order]
        grads = [s.reduced_grad() for s in order]
        self.amp.before_pushes(grads, self._kv)
        t = trainer._schedule.step
        synchronous = trainer._schedule.is_synchronous(t)
        for s, grad in zip(order, grads):
            if synchronous:
                self._exchange(s.index, grad, out=s.weights(), priority=s.priority)
            else:
                self._kv.push(s.index, grad, priority=s.priority)
            trainer._observer.gradient_written(s.param.name, t, grad)
            trainer._observer.push_acknowledged(s.param.name, t, self._kv.send_buffer(s.index))

    def _push_and_pull_compressed(self, key, grad, out, priority):
        self._kv.push(key, grad, priority=priority)
        self._kv.pull_compressed(key, out=out, priority=priority)

    def _weights_before_switch(self, t):
        """At the switch, before its pushes (whose pulls overwrite the weights): a copy of
        W_W per trained parameter index; else None."""
        if self._trainer._schedule.phase(t) != SWITCH:
            return None
        return {s.index: s.weights()[0].copy() for s in self._trainer._states if s.trained}

    def _synchronous_step(self, t, before):
        # Warm-up (S1) and switch (S2): push_all pulled exactly W_{t+1} (x̂ with compressed
        # pulls) into the weights;
        # `before`: W_W at the switch (_weights_before_switch).
        trainer = self._trainer
        rule = trainer._rule
        switch = trainer._schedule.phase(t) == SWITCH
        if switch:
            rule.start(trainer._optimizer)
        fetch = {}
        for s in trainer._states:
            if not s.trained:
                continue
            datas = s.weights()
            trainer._observer.pull_received(s.param.name, t, datas[0])  # into the weights
            trainer._observer.pull_applied(s.param.name, t, datas[0])
            if switch:
                s.pre_weight = datas[0].copy()                    # pre_weight := W_{W+1}
                s.rule_state = rule.create_state_for(s.index, datas[0],
                                                     datas[0] - before[s.index])
                arrays = rule.server_state(datas[0], s.rule_state, s.index)
                if arrays:
                    fetch[s.index] = arrays
        if fetch:
            # Collective: the servers' optimizer state after round W (docs/design.md §1.4).
            self._kv.fetch_optimizer_states(fetch)
        self.amp.after_synchronous_step(self._kv, t)

    def _local_step(self, t):
        # Delayed phase: the local update's steps 1-4 (docs/design.md §1), then the pull
        # that ends a period.
        trainer = self._trainer
        optimizer, observer = trainer._optimizer, trainer._observer
        applies = trainer._schedule.applies_pull(t)
        issues = trainer._schedule.issues_pull(t)
        skipped = self.amp.skips_local_step(self._kv, t, applies)
        update = t - self.amp.skipped   # the servers' update of round t, as known
        lr = self._local_learning_rate(update)
        for s in trainer._states:
            if not s.trained:
                continue
            param = s.param
            datas = s.weights()
            weight = datas[0]
            if applies:
                s.pulled.copyto(weight)                          # 1. w' := W_t
                observer.pull_applied(param.name, t - 1, weight)
            grad_sync = weight - s.pre_weight if trainer._rule.needs_grad_sync else None
            if applies:
                weight.copyto(s.pre_weight)                      # 3. pre_weight := w'
            ctx = RuleContext(lr=lr * param.lr_mult, wd=optimizer.wd * param.wd_mult,
                              momentum=getattr(optimizer, 'momentum', 0.0) or 0.0,
                              clip_gradient=_clip_gradient(optimizer),
                              rescale_grad=optimizer.rescale_grad,
                              num_workers=self._kv.num_workers, index=s.index, step=update,
                              pulled=applies, issues_pull=issues, delay=trainer._schedule.delay)
            if not skipped:
                grad = self._rule_gradient(s.index, s.reduced_grad())
                trainer._rule.update(weight, grad, grad_sync, s.rule_state, ctx)  # 2., 4.
            for other in datas[1:]:
                weight.copyto(other)                             # device copies stay equal
            if issues:
                if s.pulled is None:
                    s.pulled = nd.zeros_like(weight)
                self._scheduled_pull(s.index, out=s.pulled, priority=s.priority)
                observer.pull_received(param.name, t, s.pulled)
        if issues:
            self.amp.after_pulls(self._kv)

    def _local_learning_rate(self, update):
        """``local_lr`` scaled by the optimizer's schedule at num_update ``update + 1``
        (round t's is t + 1 less the rounds skipped for overflow)."""
        trainer = self._trainer
        scheduler = trainer._optimizer.lr_scheduler
        current = (scheduler(update + 1) if scheduler is not None
                   else trainer._optimizer.learning_rate)
        if trainer._local_lr is None:
            return current
        if trainer._base_lr:
            return trainer._local_lr * current / trainer._base_lr
        return trainer._local_lr

    # -- row_sparse weights (docs/design.md §2.10) ------------------------------------------
    def init_params(self, pending):
        trainer = self._trainer
        for param in pending:
            if param._stype != 'default' and param not in trainer._params_to_init:
                # The worker's copy of every row starts at the servers' W_0 (rank 0's value:
                # the workers' own initial values may differ).
                s = trainer._states[trainer._param2idx[param.name]]
                s.full = nd.zeros(param.shape, ctx=trainer._contexts[0], dtype=param.dtype)
                self._kv.pull(s.index, out=s.full, priority=s.priority)

    def row_sparse_pull(self, parameter, out, row_id, full_idx):
        # Gluon's row_sparse_data(row_id): on 'dist_delay' the rows of this worker's copy
        # w' (after a pull is applied: W of that round), with no communication.
        trainer = self._trainer
        if trainer._params_to_init:
            with autograd.pause():  # Gluon calls this in forward, inside autograd.record()
                trainer._init_params()
        trainer._states[trainer._param2idx[parameter.name]].row_sparse_data(row_id, out)

    # -- checkpoints (docs/design.md §6) ------------------------------------------------------
    def snapshot(self):
        """The worker file's body now, for :mod:`mxdelay.autosave` (after a join: no round
        in flight), which writes it later."""
        trainer = self._trainer
        self.amp.check_unchanged()
        self._prepare(priorities=False)
        nd.waitall()
        return worker_state.collect(self._kv, trainer._schedule, trainer._optimizer,
                                    trainer._base_lr, trainer._states, self.amp)

    def save_states(self, fname):
        trainer, kv = self._trainer, self._kv
        self.amp.check_unchanged()
        self._prepare(priorities=False)
        trainer.join()  # every worker at the same round, or a hang in the barriers below
        nd.waitall()
        body = worker_state.collect(kv, trainer._schedule, trainer._optimizer,
                                    trainer._base_lr, trainer._states, self.amp)
        worker_state.write(fname, kv, body, trainer._schedule)
        kv.barrier()

    def load_states(self, fname, trusted=False):
        trainer, kv = self._trainer, self._kv
        self.amp.check_unchanged()
        self._prepare(priorities=False)
        trainer.join()
        state, error, part_of = None, None, None
        try:
            state, part_of = worker_state.read(fname, kv, trainer._schedule, trainer._params,
                                               trainer._optimizer, self.amp, trusted)
        except Exception as err:  # pylint: disable=broad-except
            # Any error, not only ValueError, goes to the vote: one that escaped here would
            # leave the other workers waiting in it (read turns them into ValueErrors).
            error = store_checkpoint.failure_message(fname, err)
        # Collective: if any worker's or server's file is bad, every worker raises here.
        kv.apply_states(kv.check_states(checkpoint.kvstore_file(fname), error, trusted,
                                        part_of))
        worker_state.restore_arrays(state, trainer._states, trainer._contexts[0])
        kv.set_residuals(state.get('residuals', {}))
        kv.set_pulled_models(state.get('pulled_models', {}))
        if state.get('optimizer') is not None:
            # The servers apply the saved optimizer from now on; so does the local rule
            # (gluon.Trainer.load_states adopts the saved optimizer too).
            trainer._optimizer = state['optimizer']
            trainer._optimizer.param_dict = dict(enumerate(trainer._params))
            trainer._base_lr = state.get('base_lr', trainer._base_lr)
        self.amp.load_state_dict(state.get('amp'))
        trainer._schedule.step = state['schedule']['step']
        if trainer._schedule.step > trainer._schedule.warmup_steps:
            trainer._rule.start(trainer._optimizer)   # the switch's, with the loaded optimizer
        trainer._check_and_rescale_grad(state['rescale_grad'])
        self._logged_phase = None


def _own_gradient(key, grad):  # pylint: disable=unused-argument
    return grad


def _clip_gradient(optimizer):
    clip = optimizer.clip_gradient
    return -1.0 if clip is None else float(clip)
