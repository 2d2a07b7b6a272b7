"""The k-step delayed update of a :class:`mxdelay.DelayedTrainer` on ``'dist_delay'``
(docs/design.md §1): the trainer's delayed mode.

Each step pushes the worker's gradients as round t, then either pulls ``W_{t+1}`` into the
weights (warm-up and switch) or makes the local update and, at the end of a period, issues
the pull that the next step applies.

:class:`DelayedUpdate` owns its state: the schedule, the per-parameter states and their
priorities, the local rule and its learning rate, the observer, the step log and, once its
store is connected, the AMP policy and the callables of the data path, chosen there once.
It calls the store's ``KVStoreBase`` methods (push, pull, pushpull, the learning rate) and,
for its own protocol, the store's parts that :meth:`DelayedUpdate.connect` is given
(``DistDelay.delayed``: the settings, rounds, uneven data, state fetch, checkpoint, job,
traffic and aux parts). What it needs of the Gluon trainer it runs in (the optimizer,
Gluon's lazy initialisation and stale-gradient check, the loss scaler, the push seam) it asks
through the adapter's narrow ``gluon`` object (:mod:`mxdelay.trainer`).
"""
import logging

import numpy as np

from mxnet import autograd, nd

from kvstore_ext.checkpoint.host_copies import HostCopies

from . import codec_choice, steplog, traffic, worker_state
from .autodelay import AutoDelay
from .loss_scaling import amp_policy
from .observer import StepObserver
from .priorities import ForwardOrder
from .rules import RuleContext
from .schedule import SWITCH

__all__ = ['DelayedUpdate']

# The trainer's log, where users (and tests) find its phases: one logger for the trainer.
_LOG = logging.getLogger('mxdelay.trainer')

_NO_MANUAL_UPDATE = (
    "%s is not available with kvstore='dist_delay': the servers apply the optimizer to the "
    "sum of all workers' gradients, which no worker holds. To clip gradients, either clip "
    "this worker's own gradients before step() (e.g. gluon.utils.clip_global_norm([p.grad() "
    "for p in params], max_norm), then trainer.step(batch_size): each worker's gradient is "
    "clipped by its own norm), or give the optimizer clip_gradient=... (elementwise, applied "
    "on the servers and in the local rule). docs/design.md §1 has the semantics")


class DelayedUpdate(object):
    """The k-step delayed update of one trainer (docs/design.md §1).

    Created with the trainer; trains once :meth:`connect` has given it the trainer's store
    and the store's parts.
    Each public method is the trainer's of the same name (``params_initialized``: after
    Gluon's ``_init_params``; ``row_sparse_pull``: Gluon's ``_row_sparse_pull``).

    Parameters
    ----------
    gluon : object
        The trainer's Gluon side (``mxdelay.trainer``): ``optimizer``, ``scale``, ``context``,
        ``adopt_optimizer``, ``init_params``, ``check_fresh``, ``push_all``, ``loss_scaler``.
    schedule : DelaySchedule
    states : list of ParamState
        One per parameter, in the trainer's index order.
    registration_order : list of str
        The parameters' names in the order the user gave them (priorities, §8).
    rule : LocalRule
    local_lr : float or None
        The local rule's learning rate; None: the optimizer's.
    slack : int
    pull_codec : codec or None
        ``pull_compression``, parsed.
    auto_codec : callable or None
        ``compression_params='auto'`` (docs/design.md §2.16): ``auto_codec()`` returns the
        codecs of the checkpoint the job will resume from (kept), or None (rank 0
        measures and chooses); None: the codecs are the trainer's arguments.

    Attributes
    ----------
    schedule, states, rule
        As given.
    order : ForwardOrder
        The forward order and the priorities decided from it.
    observer : StepObserver
        Receives the step's events (``DelayedTrainer.set_observer``).
    step_log : object
        :func:`mxdelay.steplog.from_env`'s.
    amp : NoAmp or LossScaledAmp
        The AMP policy, chosen by :meth:`connect` (None before).
    """

    def __init__(self, gluon, schedule, states, registration_order, rule, local_lr, slack,
                 pull_codec, auto_codec=None):
        self.schedule, self.states, self.rule = schedule, states, rule
        self._named = {s.param.name: s for s in states}
        self.order = ForwardOrder(states, registration_order)
        self.observer = StepObserver()
        self.step_log = steplog.from_env(self)
        self.amp = None
        self._gluon = gluon
        self._local_lr = local_lr
        self._base_lr = gluon.optimizer.learning_rate   # what local_lr is scaled against
        self._slack, self._pull_codec = slack, pull_codec
        # compression_params='auto' (docs/design.md §2.16): the codecs a resume keeps.
        self._kept_codecs = codec_choice.KeptCodecs(auto_codec) if auto_codec else None
        self._kv = self._parts = None
        self._rule_gradient = self._scheduled_pull = self._exchange = None
        self._logged_phase = None
        # delay='auto': the measurements and the job's decisions (mxdelay.autodelay).
        self._auto = AutoDelay(self) if schedule.auto else None

    def connect(self, kv, parts):
        """Take the trainer's store `kv` (a ``DistDelay``, just created) and its parts
        `parts` (``kv.delayed``), configure the store before its hand-shake (its first
        ``init``) and choose the data path's callables."""
        self._kv, self._parts = kv, parts
        settings = parts.settings
        # amp: the servers skip rounds with a non-finite sum (docs/design.md §11).
        self.amp = amp_policy(self._gluon.loss_scaler)
        state_keys = self.rule.server_state_count(
            self._gluon.optimizer, sorted({np.dtype(s.param.dtype).name
                                           for s in self.states if s.trained}))
        settings.configure(slack=max(self._slack, settings.slack), state_keys=state_keys)
        # The kvstore adds its optimizer's description to the hand-shake.
        if self._kept_codecs is not None:
            # The hand-shake chooses the codecs; the data path follows at the first step.
            settings.set_auto_codec(codec_choice.request(self.states, self.amp,
                                                         self.schedule.delay, self._kept_codecs))
        else:
            self._choose_data_path()
        # The schedule itself: delay='auto''s decisions reach the compressed pulls too.
        settings.set_schedule(self.schedule)
        settings.set_config(local_rule=repr(self.rule), local_lr=self._local_lr,
                            amp=self.amp.enabled)

    def _choose_data_path(self):
        """The callables of the data path, which depend on the codecs: at :meth:`connect`,
        or with compression_params='auto' at the first step, once the hand-shake chose."""
        settings, rounds, kv = self._parts.settings, self._parts.rounds, self._kv
        # The local rule's g: this worker's gradient, or with compression what it sent (so
        # that with one worker the local step is the servers' step, docs/design.md §1.4).
        self._rule_gradient = _own_gradient if settings.compression is None \
            else rounds.sent_gradient
        self.amp.refuse([s.param.name for s in self.states if s.gradient.sparse],
                        settings.compression)
        if self._pull_codec is not None:
            settings.set_pull_compression(self._pull_codec)
        pull_codec = settings.pull_compression
        if pull_codec is not None and self.amp.enabled:
            # (Also when the store was given the setting itself.)
            raise ValueError(
                'pull_compression=%r cannot be combined with AMP (amp.init_trainer) yet: the '
                'skipped rounds of an overflow have not been tested with compressed pulls; use '
                'pull_compression=None with AMP' % (pull_codec.describe(),))
        # The pulls of the schedule (warm-up, switch, the end of each period): compressed
        # with pull_compression (docs/design.md §2.12); sync_weights always pulls exactly.
        self._scheduled_pull = rounds.pull_compressed if pull_codec else kv.pull
        # A synchronous step's exchange: one pushpull per tensor, whose weights come back
        # while later tensors' pushes still arrive (docs/design.md §8); with compressed pulls
        # the push and the compressed pull of the same round (§2.12).
        self._exchange = rounds.push_then_pull_compressed if pull_codec else rounds.exchange

    # -- the store ----------------------------------------------------------------------------
    @property
    def rank(self):
        return self._kv.rank

    @property
    def num_workers(self):
        return self._kv.num_workers

    @property
    def parts(self):
        """The store's delayed-protocol parts (``kv.delayed``), for :mod:`mxdelay.autosave`."""
        return self._parts

    def keys_per_step(self):
        return sum(self._parts.traffic.num_chunks(s.index) for s in self.states if s.trained)

    def codecs(self):
        settings = self._parts.settings
        if settings.auto_codec is not None:
            return None      # 'auto', before the hand-shake chose
        return worker_state.codecs_of(settings)

    def round_bytes(self):
        return traffic.round_bytes(self._parts.traffic, self._parts.settings,
                                   [s.index for s in self.states if s.trained])

    def set_learning_rate(self, lr):
        self._kv.set_learning_rate(lr)

    def allreduce_grads(self):
        raise ValueError(_NO_MANUAL_UPDATE % 'allreduce_grads()')

    def update(self, batch_size, ignore_stale_grad):
        raise ValueError(_NO_MANUAL_UPDATE % 'update()')

    def _rescale(self, scale):
        # Each worker scales its own pushes by its own batch size (Rounds.scale_gradients):
        # workers with other batch sizes, or a smaller last batch, stay exact; no command.
        self._gluon.optimizer.rescale_grad = scale
        self._parts.rounds.scale_gradients(scale)

    # -- steps --------------------------------------------------------------------------------
    def _prepare(self, priorities=True):
        self._gluon.init_params()
        if priorities and self.order.push_order is None:
            self.order.decide()

    def step(self, batch_size, ignore_stale_grad):
        self.amp.check_unchanged()
        self._rescale(self._gluon.scale / batch_size)
        self._prepare()
        self._gluon.check_fresh(ignore_stale_grad)
        t = self.schedule.step
        self._advance()
        self.step_log.stepped(t, batch_size)
        if self._auto is not None:
            self._auto.stepped(t, batch_size)

    def awaited(self, t):
        """For the step log (:mod:`mxdelay.steplog`), once step `t` is issued: its gradients,
        the arrays whose arrival ends the communication its next computation needs (a
        synchronous step's weights, a delayed step's pull), and whether it pulled."""
        states = [s for s in self.states if s.trained]
        grads = [g for s in states for g in s.param.list_grad()]
        if self.schedule.is_synchronous(t):
            return grads, [s.weights()[0] for s in states], True
        if self.schedule.issues_pull(t):
            return grads, [s.pulled for s in states], True
        return grads, [], False

    def join(self, before_round=None):
        """``DelayedTrainer.join``; ``before_round()``, if given, runs at every counter this
        worker votes at, before its vote (the trainer's periodic checkpoint, due there as at
        a step)."""
        self._prepare()
        filled = 0
        while True:
            if before_round is not None:
                before_round()
            if self._parts.uneven.finish_round():
                break
            if filled == 0:
                for s in self.states:
                    if s.trained:
                        s.param.zero_grad()
            self._advance()
            filled += 1
        if filled:
            _LOG.info('DelayedTrainer: worker %d had no data for %d rounds of the other '
                      'workers (zero gradients); all workers continue at step %d',
                      self._kv.rank, filled, self.schedule.step)
        return filled

    def sync_weights(self, aux_states):
        self._prepare(priorities=False)
        self.join()
        targets = [(s, s.weights()) for s in self.states if s.trained]
        for s, weights in targets:
            # After this worker's last pushed round t (the same on every worker after join):
            # exactly W_{t+1}, whatever the arrival order (docs/design.md §2).
            self._kv.pull(s.index, out=weights, priority=s.priority)
        for _, weights in targets:
            weights[0].wait_to_read()
        aux = [s for s in self.states if s.aux]
        if aux_states and aux:
            # One round of the aux keys' own, all at once: the mean over the workers (§2.13).
            self._parts.aux.average([s.index for s in aux], [s.param.list_data() for s in aux])

    def _advance(self):
        """Push this worker's gradients as round t and make step t's update."""
        if self._exchange is None:   # compression_params='auto': the hand-shake has chosen
            self._choose_data_path()
        t = self.schedule.step
        if self._auto is not None:
            self._auto.before_step(t)   # collective: the decisions due before round t
        self._log_phase(t)
        synchronous = self.schedule.is_synchronous(t)
        before = self._weights_before_switch(t) if synchronous else None
        self._gluon.push_all()   # the trainer's seam: push_all, unless a subclass waits first
        if synchronous:
            self._synchronous_step(t, before)
        else:
            self._local_step(t)
        self.schedule.step = t + 1

    def _log_phase(self, t):
        phase = self.schedule.phase(t)
        if phase != self._logged_phase:
            self._logged_phase = phase
            _LOG.info('DelayedTrainer: step %d enters the %s phase', t, phase)

    def push_all(self):
        """Push this worker's gradients of the step (a synchronous step also pulls)."""
        # Issued at once, last layer first: MXNet's engine starts each push as soon as its
        # gradient is written (backward runs in segments of a few operators, see env.py),
        # and the priority lets the layers the next forward needs first overtake. A
        # synchronous step pulls W_{t+1} into the weights with the same request
        # (Rounds.exchange, a pushpull): each chunk's weights come back once its round is applied,
        # while later chunks' pushes still arrive (docs/design.md §8).
        order = [self.states[i] for i in self.order.push_order]
        grads = [s.reduced_grad() for s in order]
        rounds = self._parts.rounds
        self.amp.before_pushes(grads, rounds)
        t = self.schedule.step
        synchronous = self.schedule.is_synchronous(t)
        for s, grad in zip(order, grads):
            if synchronous:
                self._exchange(s.index, grad, out=s.weights(), priority=s.priority)
            else:
                rounds.send_next(s.index, [grad], None, s.priority, exchange=False)
            # Read at each event: an observer may replace itself (the timeline's, when done).
            self.observer.gradient_written(s.param.name, t, grad)
            self.observer.push_acknowledged(s.param.name, t, rounds.send_buffer(s.index))

    def _weights_before_switch(self, t):
        """At the switch, before its pushes (whose pulls overwrite the weights): a copy of
        W_W per trained parameter index; else None."""
        if self.schedule.phase(t) != SWITCH:
            return None
        return {s.index: s.weights()[0].copy() for s in self.states if s.trained}

    def _synchronous_step(self, t, before):
        # Warm-up (S1) and switch (S2): push_all pulled exactly W_{t+1} (x̂ with compressed
        # pulls) into the weights; `before`: W_W at the switch (_weights_before_switch).
        rule = self.rule
        switch = self.schedule.phase(t) == SWITCH
        if switch:
            rule.start(self._gluon.optimizer)
        fetch = {}
        for s in self.states:
            if not s.trained:
                continue
            datas = s.weights()
            self.observer.pull_received(s.param.name, t, datas[0])  # into the weights
            self.observer.pull_applied(s.param.name, t, datas[0])
            if switch:
                s.started = True
                if rule.needs_grad_sync:
                    s.pre_weight = datas[0].copy()                # pre_weight := W_{W+1}
                s.rule_state = rule.create_state_for(s.index, datas[0],
                                                     datas[0] - before[s.index])
                arrays = rule.server_state(datas[0], s.rule_state, s.index)
                if arrays:
                    fetch[s.index] = arrays
        if fetch:
            # Collective: the servers' optimizer state after round W (docs/design.md §1.4).
            self._parts.state_fetch.fetch_optimizer_states(fetch)
        self.amp.after_synchronous_step(self._parts.rounds, t)

    def _local_step(self, t):
        # Delayed phase: the local update's steps 1-4 (docs/design.md §1), then the pull
        # that ends a period.
        optimizer, observer, rule = self._gluon.optimizer, self.observer, self.rule
        applies = self.schedule.applies_pull(t)
        issues = self.schedule.issues_pull(t)
        skipped = self.amp.skips_local_step(self._parts.rounds, t, applies)
        update = t - self.amp.skipped   # the servers' update of round t, as known
        lr = self._local_learning_rate(optimizer, update)
        for s in self.states:
            if not s.trained:
                continue
            param = s.param
            datas = s.weights()
            weight = datas[0]
            if applies:
                s.pulled.copyto(weight)                          # 1. w' := W_t
                observer.pull_applied(param.name, t - 1, weight)
            grad_sync = None
            if rule.needs_grad_sync:                              # (else no pre_weight)
                grad_sync = weight - s.pre_weight
                if applies:
                    weight.copyto(s.pre_weight)                  # 3. pre_weight := w'
            ctx = RuleContext(lr=lr * param.lr_mult, wd=optimizer.wd * param.wd_mult,
                              momentum=getattr(optimizer, 'momentum', 0.0) or 0.0,
                              clip_gradient=_clip_gradient(optimizer),
                              rescale_grad=optimizer.rescale_grad,
                              num_workers=self._kv.num_workers, index=s.index, step=update,
                              pulled=applies, issues_pull=issues, delay=self.schedule.delay,
                              gradient=s.gradient)
            if not skipped:
                grad = self._rule_gradient(s.index, s.reduced_grad())
                rule.update(weight, grad, grad_sync, s.rule_state, ctx)  # 2., 4.
            for other in datas[1:]:
                weight.copyto(other)                             # device copies stay equal
            if issues:
                self._pull_period(s, weight)
                observer.pull_received(param.name, t, s.pulled)
        if issues:
            self.amp.after_pulls(self._parts.rounds)

    def _pull_period(self, s, weight):
        """Issue the pull that ends a period; ``s.pulled`` is where it lands. A dense key's
        pull lands in memory the store keeps anyway (x̂, or its receive buffer), held until
        the next step applies it: no pull buffer (docs/design.md §2.3); other keys' in an
        array of `s`'s own, made once like `weight`."""
        held = self._parts.rounds.pull_held(s.index, priority=s.priority)
        if held is not None:
            s.pulled = held
            return
        if s.pulled is None:
            s.pulled = nd.zeros_like(weight)
        self._scheduled_pull(s.index, out=s.pulled, priority=s.priority)

    def _local_learning_rate(self, optimizer, update):
        """``local_lr`` scaled by the optimizer's schedule at num_update ``update + 1``
        (round t's is t + 1 less the rounds skipped for overflow)."""
        scheduler = optimizer.lr_scheduler
        current = scheduler(update + 1) if scheduler is not None else optimizer.learning_rate
        if self._local_lr is None:
            return current
        if self._base_lr:
            return self._local_lr * current / self._base_lr
        return self._local_lr

    # -- row_sparse weights (docs/design.md §2.10) ------------------------------------------
    def params_initialized(self, indices):
        """The store holds the initial values of the parameters of `indices` now."""
        for i in indices:
            self.states[i].initialized(self._kv, self._gluon.context)

    def row_sparse_pull(self, parameter, out, row_id, full_idx):  # pylint: disable=W0613
        # Gluon's row_sparse_data(row_id): on 'dist_delay' the rows of this worker's copy
        # w' (after a pull is applied: W of that round), with no communication.
        with autograd.pause():  # Gluon calls this in forward, inside autograd.record()
            self._gluon.init_params()
        self._named[parameter.name].row_sparse_data(row_id, out)

    # -- checkpoints (docs/design.md §6) ------------------------------------------------------
    def snapshot(self):
        """The worker file's body before step ``schedule.step``, for :mod:`mxdelay.autosave`,
        which writes it later, and the copies to wait for before
        (:class:`~kvstore_ext.checkpoint.host_copies.HostCopies`): MXNet's engine copies the
        parameters' arrays after every queued update and pull (no wait here, where a step
        would not wait)."""
        self.amp.check_unchanged()
        self._prepare(priorities=False)
        copies = HostCopies()
        return worker_state.collect(self._kv, self._parts, self.schedule, self._gluon.optimizer,
                                    self._base_lr, self.states, self.amp, copies), copies

    def save_states(self, fname):
        self.amp.check_unchanged()
        self._prepare(priorities=False)
        self.join()  # every worker at the same round, or a hang in the barriers below
        worker_state.save(fname, self._kv, self._parts, self.schedule, self._gluon.optimizer,
                          self._base_lr, self.states, self.amp)

    def load_states(self, fname, trusted=False):
        self.amp.check_unchanged()
        with codec_choice.loading(self._kept_codecs, fname):
            self._prepare(priorities=False)   # the hand-shake, if it is still to come
        self.join()
        state = worker_state.load(fname, self._kv, self._parts, self.schedule, self.states,
                                  self._gluon.optimizer, self.amp, self._gluon.context, trusted)
        if state.get('optimizer') is not None:
            # The servers apply the saved optimizer from now on; so does the local rule
            # (gluon.Trainer.load_states adopts the saved optimizer too).
            self._gluon.adopt_optimizer(state['optimizer'])
            self._base_lr = state.get('base_lr', self._base_lr)
        if not self.rule.needs_grad_sync:
            for s in self.states:
                s.pre_weight = None   # a file of a rule that read grad_sync: not read here
        self.amp.load_state_dict(state.get('amp'))
        self.schedule.step = state['schedule']['step']
        if self._auto is not None:
            self._auto.restore(state['schedule']['amendments'])
        if self.schedule.step > self.schedule.warmup_steps:
            self.rule.start(self._gluon.optimizer)   # the switch's, with the loaded optimizer
        self._rescale(state['rescale_grad'])
        self._logged_phase = None


def _own_gradient(key, grad):  # pylint: disable=unused-argument
    return grad


def _clip_gradient(optimizer):
    clip = optimizer.clip_gradient
    return -1.0 if clip is None else float(clip)
