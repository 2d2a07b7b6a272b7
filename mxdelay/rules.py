"""Local update rules of the delayed phase ("global-gradient-based local update", claim 1).

A rule is an object with :meth:`LocalRule.update` (and optionally ``create_state``). At
every delayed step the trainer calls it per parameter with the worker's own gradient g
(summed over its devices, not yet multiplied by ``rescale_grad``) and
``grad_sync = w' - pre_weight`` (docs/design.md §1, step 2).

Every built-in rule uses the delay-compensated gradient of DC-ASGD,
``g_dc = g + lam * g * g * grad_sync`` (g rescaled); ``lam = 0`` gives g.

- ``'mirror'`` (default, :class:`MirrorRule`): a local copy of the servers' optimizer
  applied to ``N * g_dc`` (the worker's gradient standing in for the sum of all N), its
  state the servers' after round W, kept across pulls. For plain SGD:
  ``v := mu*v - lr*(N*g_dc + wd*w')``, ``w' := w' + v``; v persists across pulls and starts at
  the server's last step ``W_{W+1} - W_W``. Matches ``dist_sync``'s accuracy at k = 4 and 8
  with server momentum 0.9, where the literal rules collapse (docs/design.md §1).
- ``'sgd'``, ``'dc'`` (:class:`LocalSGDRule`): the patent's literal rule
  ``w' := w' - lr*(g_dc + wd*w')`` with lam 0 and 0.04.
- ``'dc_adaptive'``: ``'dc'`` with lam scaled by ``1/sqrt(MS)``,
  ``MS := m*MS + (1-m)*g*g + 1e-7``.
- ``'drift'`` (:class:`DriftCorrected` around ``'mirror'``): the mirror plus a per-step
  correction learnt at each pull, the difference between the global change and the rule's
  own change over the last period, divided by k (no bytes on the wire).

A row_sparse g (a Parameter with ``grad_stype='row_sparse'``) is a lazy update, as MXNet's
optimizers make it (docs/design.md §1.4): the built-in rules change only the rows g holds,
the weights and the rule's state alike; ``grad_sync`` is read on those rows only. The
trainer tells the rule which kind each Parameter's g is, once (``RuleContext.gradient``,
:mod:`mxdelay.gradients`).
"""
import collections
import pickle

import numpy as np
import mxnet as mx
from mxnet import nd

from kvstore_ext.checks import ArgumentTypeError, check_bool, check_real
from kvstore_ext.optim.frozen_variance import FrozenVarianceAdam
from kvstore_ext.optim.optimizers import flatten_state

from .gradients import BY_STYPE, DENSE

__all__ = ['LocalRule', 'LocalSGDRule', 'MirrorRule', 'DriftCorrected', 'RuleContext',
           'create_rule', 'BUILTIN_RULES']

#: Hyper-parameters of one call: local lr and wd (with the Parameter's multipliers), the
#: optimizer's momentum and clip_gradient, rescale_grad (1/batch size), N workers, the
#: trainer's index of the Parameter and the step (= round) t, less the rounds the servers
#: skipped for an AMP overflow as far as this worker knows (docs/design.md §11).
#: ``pulled``: step 1 applied a pull at this step (the weights are ``W_t``); ``issues_pull``:
#: this step issues a pull; ``delay``: k, the local steps between two applied pulls;
#: ``gradient``: how the Parameter's gradient is stored, chosen once per Parameter
#: (:data:`mxdelay.gradients.DENSE` or ``ROW_SPARSE``; by default each call's g decides).
RuleContext = collections.namedtuple(
    'RuleContext', ['lr', 'wd', 'momentum', 'clip_gradient', 'rescale_grad', 'num_workers',
                    'index', 'step', 'pulled', 'issues_pull', 'delay', 'gradient'],
    defaults=(None, None, False, False, None, BY_STYPE))


class LocalRule(object):
    """Base class of local update rules.

    Parameters
    ----------
    dc_lambda : float, default 0
        Weight of the delay-compensation term ``lam * g * g * grad_sync`` (>= 0).

    Raises
    ------
    TypeError
        If an argument has the wrong type (:class:`mxdelay.ArgumentTypeError`).
    ValueError
        If an argument is out of range (here and in subclasses).
    """
    #: Whether :meth:`update` reads ``grad_sync``; the trainer skips computing it otherwise.
    needs_grad_sync = False
    dc_lambda = 0.0

    def __init__(self, dc_lambda=0.0):
        self.dc_lambda = check_real('dc_lambda', dc_lambda, minimum=0,
                                    fix='0 disables delay compensation')
        self.needs_grad_sync = self.dc_lambda > 0

    def create_state(self, weight, last_global_step):
        """Return this rule's state for one parameter, made at the switch (step W).

        Parameters
        ----------
        weight : NDArray
            ``W_{W+1}``, the worker's weights after the switch.
        last_global_step : NDArray
            ``W_{W+1} - W_W``, the server's last update.
        """
        return None

    def start(self, optimizer):
        """Called at the switch (and after a load in the delayed phase), before
        :meth:`create_state_for`, with the trainer's `optimizer`. The base rule ignores it."""

    def server_state_count(self, optimizer, dtypes):
        """J: how many arrays of the servers' optimizer state per tensor this rule fetches
        at the switch (:meth:`server_state`), for weights of `dtypes`; called before the
        kvstore places its keys. The base rule fetches none (0)."""
        return 0

    def create_state_for(self, index, weight, last_global_step):
        """The state of Parameter `index` (the trainer calls this; the base rule returns
        :meth:`create_state`)."""
        return self.create_state(weight, last_global_step)

    def server_state(self, weight, state, index=None):
        """The arrays of `state` (of Parameter `index`) to fill with the servers' optimizer
        state after round W (fetched once, collectively, at the switch), or None (the base
        rule)."""
        return None

    def check_optimizer(self, optimizer):
        """Raise ValueError if this rule cannot follow the servers' `optimizer`.

        Called once, when a trainer on ``'dist_delay'`` is created. The base rule accepts
        every optimizer (a rule that only reads lr and wd, as the literal ``'sgd'`` rule).
        """

    def update(self, weight, grad, grad_sync, state, ctx):
        """Update `weight` in place from raw gradient `grad` (see :data:`RuleContext`).

        For a Parameter with row_sparse gradients `grad` is row_sparse and `weight` dense:
        the update should be lazy, changing only the rows `grad` holds (docs/design.md
        §1.4), as the built-in rules do."""
        raise NotImplementedError()

    def _compensated(self, gradient, grad, grad_sync, ctx, lam=None):
        """Return ``(gradient, rescale)`` for a fused operator: ``(g_dc, 1)``, or
        ``(grad, rescale_grad)`` when there is no compensation term (`grad_sync` is None).
        `gradient`: the kind of `grad` (:mod:`mxdelay.gradients`)."""
        if grad_sync is None:
            return grad, ctx.rescale_grad
        lam = self.dc_lambda if lam is None else lam
        return gradient.compensated(grad, grad_sync, ctx.rescale_grad, lam)

    def __repr__(self):
        return '%s(dc_lambda=%g)' % (type(self).__name__, self.dc_lambda)


class LocalSGDRule(LocalRule):
    """The patent's literal local SGD step ``w' := w' - lr*(g_dc + wd*w')``.

    Parameters
    ----------
    dc_lambda : float, default 0
        lam of the delay-compensation term; ``'dc'`` is this rule with 0.04.
    adaptive : bool, default False
        Scale lam by ``1/sqrt(MS)``, ``MS := ms_momentum*MS + (1-ms_momentum)*g*g + 1e-7``
        (DC-ASGD-a); ``'dc_adaptive'`` is this rule with lam 0.04.
    ms_momentum : float, default 0.95
        m of the mean square.
    """

    def __init__(self, dc_lambda=0.0, adaptive=False, ms_momentum=0.95):
        super(LocalSGDRule, self).__init__(dc_lambda)
        self.adaptive = check_bool('adaptive', adaptive)
        self.ms_momentum = check_real('ms_momentum', ms_momentum, minimum=0, maximum=1,
                                      max_inclusive=False, fix='e.g. ms_momentum=0.95')

    def create_state(self, weight, last_global_step):
        return nd.zeros_like(weight) if self.adaptive else None

    def update(self, weight, grad, grad_sync, state, ctx):
        # With a row_sparse g, a lazy update: the step on the rows g holds (weights and MS).
        ctx.gradient.on_rows(self._update_dense, weight, grad, grad_sync, state, ctx)

    def _update_dense(self, weight, grad, grad_sync, state, ctx):
        lam = None
        if self.adaptive:
            g = grad * ctx.rescale_grad
            m = self.ms_momentum
            state[:] = m * state + (1 - m) * g * g + 1e-7
            lam = self.dc_lambda / nd.sqrt(state)
        g, rescale = self._compensated(DENSE, grad, grad_sync, ctx, lam)
        # The servers' kernel for plain SGD (kvstore_ext.server.rounds.sgd_step), so that with one
        # worker and plain SGD on the servers the local step is the server's, bit for bit.
        nd.multi_sgd_update(weight, g, out=weight, num_weights=1, lrs=(ctx.lr,), wds=(ctx.wd,),
                            rescale_grad=rescale, clip_gradient=ctx.clip_gradient)

    def __repr__(self):
        return 'LocalSGDRule(dc_lambda=%g, adaptive=%s)' % (self.dc_lambda, self.adaptive)


#: Optimizers the mirror runs locally (and their subclasses): their state is elementwise,
#: shaped like the weight, so that a chunk's state on a server is the same elements of the
#: whole tensor's state, and a local instance continues it exactly. LAMB, LARS and LBSGD
#: (``warmup_strategy='lars'``) also read norms of the whole tensor: the servers keep such
#: tensors whole (one chunk; a tensor that would span several is refused when it is
#: registered, docs/design.md §3.4), so the local copy, which holds the whole tensor,
#: computes the same norms. LARS and LBSGD are mirrored on conditions
#: (:func:`_conditional_refusal`) and through a :class:`_Feed` of their own.
MIRRORED = ('SGD', 'NAG', 'Adam', 'RMSProp', 'AdaGrad', 'AdaDelta', 'Ftrl', 'Signum', 'Adamax',
            'FTML', 'LAMB', 'LARS', 'LBSGD')

#: Optimizers the mirror runs with row_sparse gradients (and their subclasses): those with
#: MXNet's lazy update, whose kernels on the servers' full-row weights and on the worker's
#: dense weights are the same.
SPARSE_MIRRORED = ('SGD', 'Adam')

#: Optimizers refused by name, with why and what to use instead.
_NOT_MIRRORED = {
    'Nadam': "its m_schedule is one number for the whole optimizer, multiplied at every update "
             "call: a server calls it once per chunk per round, in the order the chunks' "
             "rounds complete, which varies from run to run (stock MXNet's servers too; two "
             "stock dist_sync jobs differ by 4.5e-2), so no worker can know the factor each "
             "tensor got; use optimizer='adam' or 'nag'",
    'DCASGD': "MXNet 1.9.1's DCASGD fails with momentum; local_rule='dc' adds DC-ASGD's "
              "compensation to the local step of optimizer='sgd'",
    'SGLD': 'its step adds random noise, which a local copy cannot reproduce',
}

#: Why a learning-rate schedule cannot be mirrored, by optimizer (the first part of the
#: sentence: "with an lr_scheduler, ...").
_SCHEDULE_ORDER = (
    'a server calls the optimizer once per chunk, in the order in which the chunks\' rounds '
    'complete, which depends on when each push arrives; stock dist_sync does the same (and '
    'then differs from gluon.Trainer, with one worker too), so no worker can know which '
    'chunk got which value')


def _conditional_refusal(base, optimizer):
    """Why the mirror cannot follow `optimizer` (of MXNet class `base`) with its settings,
    or None. LARS and LBSGD are mirrored exactly only where their servers' step does not
    depend on the order in which a server updates its chunks (docs/design.md §1.4)."""
    name = type(optimizer).__name__
    scheduled = getattr(optimizer, 'lr_scheduler', None) is not None
    if (base == 'LARS' and optimizer.momentum_correction and optimizer.momentum
            and scheduled):
        return (
            '%s with momentum_correction=True and an lr_scheduler: the correction scales the '
            'momentum by the ratio of the learning rates of two successive update calls, kept '
            'once for the whole optimizer, so when the schedule changes the rate only the '
            'chunk that a server updates first gets the ratio, and the others 1; %s. Without '
            'an lr_scheduler the ratio is 1 at every call and the mirror is exact. Pass '
            'momentum_correction=False (mirrored with a schedule too), or drop the '
            'lr_scheduler (trainer.set_learning_rate changes the rate)' % (name, _SCHEDULE_ORDER))
    if base == 'LBSGD' and scheduled:
        return (
            '%s with an lr_scheduler: it reads its learning rate before it counts the update, '
            'from the optimizer-wide count, so in each round the chunk that a server updates '
            "first gets the schedule's previous value and the others the current one; %s. "
            'Without an lr_scheduler the rate is the same for every chunk and the mirror is '
            'exact: drop the lr_scheduler (trainer.set_learning_rate changes the rate)'
            % (name, _SCHEDULE_ORDER))
    if base == 'LBSGD' and optimizer.batch_scale != 1:
        return (
            '%s with batch_scale=%r: it sums batch_scale rounds\' gradients before each update, '
            'in a running sum per tensor kept in the servers\' optimizer object and not in its '
            'state, which the switch cannot fetch (and MXNet\'s first sum aliases the '
            'gradient buffer it was given). Use batch_scale=1 (its default)'
            % (name, optimizer.batch_scale))
    return None


class _Feed(object):
    """How :class:`MirrorRule` hands a step to its local optimizer, beyond lr, wd, the update
    count and ``rescale_grad``; chosen once per optimizer class (:func:`_feed_for`). The
    default feed gives ``(g_dc, N * rescale)``: ``rescale_grad * g`` is then ``N * g``
    wherever the optimizer reads it."""

    def gradient(self, grad, rescale, num_workers):
        """The gradient and ``rescale_grad`` to give the local optimizer."""
        return grad, rescale * num_workers

    def before_update(self, local, ctx):
        """Set what else the local optimizer reads, just before its update call."""


class _LarsMomentumCorrection(_Feed):
    """LARS with ``momentum_correction=True``: it multiplies the momentum by
    ``cur_lr / last_lr``, the base rates of this update call and of the previous one, kept
    once for the optimizer. A server's rate is the optimizer's (the multipliers apply after)
    and, without a schedule, the same at every call: the ratio is 1. The local copy is given
    each Parameter's rate with lr_mult folded in (:class:`_UnitMultipliers`), so its ratio
    would be ``lr_mult / lr_mult of the previous Parameter``; setting the previous rate to
    this call's makes it 1, the servers' ratio (exactly: ``x / x``)."""

    def before_update(self, local, ctx):
        local.cur_lr = ctx.lr   # LARS._get_lrs moves it to last_lr, then sets it to local.lr


class _RawGradientNorms(_Feed):
    """LBSGD with ``warmup_strategy='lars'``: its ratio reads the norm of the raw gradient,
    before ``rescale_grad``, which on the servers is the sum of N workers' gradients. The
    worker's gradient, standing in for each of the N, is given as ``N * g`` with the
    worker's ``rescale_grad`` (with one worker ``1 * g``, the same values)."""

    def gradient(self, grad, rescale, num_workers):
        return grad * num_workers, rescale


def _feed_for(optimizer):
    """The :class:`_Feed` of `optimizer` (chosen once, at :meth:`MirrorRule.start`)."""
    mro = [cls.__name__ for cls in type(optimizer).__mro__
           if cls.__module__.startswith('mxnet.')]
    if 'LARS' in mro and optimizer.momentum_correction and optimizer.momentum:
        return _LarsMomentumCorrection()
    if 'LBSGD' in mro and optimizer.warmup_strategy == 'lars':
        return _RawGradientNorms()
    return _Feed()


class _UnitMultipliers(dict):
    """A local optimizer's ``param_dict``: every index has ``lr_mult = wd_mult = 1``, because
    the :data:`RuleContext` lr and wd already hold the Parameter's multipliers."""

    class _Unit(object):
        lr_mult = wd_mult = 1.0

    _UNIT = _Unit()

    def __contains__(self, index):
        return True

    def __missing__(self, index):
        return self._UNIT


class MirrorRule(LocalRule):
    """A local instance of the servers' optimizer, applied to ``N * g_dc``.

    The worker's gradient stands in for each of the N gradients that the servers sum. The
    local optimizer is a copy of the servers' (same class and hyper-parameters: wd,
    clip_gradient, multi_precision, the lr schedule through the :data:`RuleContext` lr, and
    lr_mult/wd_mult) with ``rescale_grad`` N times the worker's; its state at the switch is
    the servers' optimizer state after round W (fetched once, collectively, with
    :meth:`kvstore_ext.DistDelay.fetch_optimizer_states`) and is kept across pulls: a pull
    replaces the weights, not the state. Update counts are the servers' (round t is update
    t + 1), so bias corrections (Adam, Adamax, FTML) follow the servers'.

    Plain ``mx.optimizer.SGD`` (with or without momentum, no float16 master copy) keeps a
    single-kernel path whose momentum buffer starts at ``W_{W+1} - W_W``, the servers' last
    step (no state is fetched): ``v := mu*v - lr*(N*g_dc + wd*w')``, ``w' := w' + v``.

    Accepted: SGD, NAG, Adam, RMSProp (centered too), AdaGrad, AdaDelta, Ftrl, Signum,
    Adamax, FTML, LAMB, LARS (with ``momentum_correction=True`` only without an
    lr_scheduler), LBSGD (``batch_scale=1``, without an lr_scheduler) and their subclasses, as
    long as their state is elementwise (arrays shaped like the weight). Refused by
    :meth:`check_optimizer`: Nadam, DCASGD, SGLD, the settings of LARS and LBSGD above, and
    anything else (see docs/design.md §1.4).
    """

    def __init__(self, dc_lambda=0.0):
        super(MirrorRule, self).__init__(dc_lambda)
        self._local = None         # the local optimizer (start)
        self._plain_sgd = False    # the single-kernel path applies (unless float16 + mp)
        self._sparse = frozenset()  # indices of Parameters with row_sparse gradients (start)
        self._feed = _Feed()        # how the local optimizer is given a step (start)

    def check_optimizer(self, optimizer):
        name = type(optimizer).__name__
        mro = [cls.__name__ for cls in type(optimizer).__mro__
               if cls.__module__.startswith('mxnet.')]
        refused = next((n for n in mro if n in _NOT_MIRRORED), None)
        accepted = next((n for n in mro if n in MIRRORED), None)
        if refused is not None or accepted is None:
            why = (_NOT_MIRRORED[refused] if refused is not None else
                   'it is none of the optimizers whose step the mirror can follow (%s)'
                   % ', '.join(MIRRORED))
            raise ValueError(
                "local_rule='mirror' runs a local copy of the servers' optimizer in the "
                'delayed phase and cannot mirror %s: %s. Use one of %s, or local_rule='
                "'sgd' (the literal local SGD step, which reads only the optimizer's learning "
                "rate and wd), or gluon.Trainer on kvstore='dist_delay' (synchronous, any "
                'optimizer)' % (name, why, ', '.join(MIRRORED)))
        condition = _conditional_refusal(accepted, optimizer)
        if condition is not None:
            raise ValueError(
                "local_rule='mirror' runs a local copy of the servers' optimizer in the "
                "delayed phase and cannot mirror %s. Or use local_rule='sgd' (the literal "
                "local SGD step, which reads only the optimizer's learning rate and wd), or "
                "gluon.Trainer on kvstore='dist_delay' (synchronous, any optimizer)"
                % condition)
        probe = mx.nd.zeros((2, 3))
        try:
            arrays = flatten_state(optimizer.create_state(0, probe))
        except TypeError as err:
            arrays = [err]
        if any(not isinstance(a, nd.NDArray) or a.shape != probe.shape for a in arrays):
            raise ValueError(
                "local_rule='mirror' cannot mirror %s: its optimizer state is not elementwise "
                '(arrays shaped like the weight), so the servers\' per-chunk state is not the '
                "tensor's. Use local_rule='sgd' or gluon.Trainer on kvstore='dist_delay'"
                % name)
        sparse = [p.name for p in _sparse_grad_params(optimizer).values()]
        if sparse and isinstance(optimizer, FrozenVarianceAdam):
            raise ValueError(
                "optimizer 'frozenvarianceadam' takes dense gradients only (the bound on its "
                'frozen second moment is written for them, docs/design.md §1.4), and Parameter '
                "%s has row_sparse gradients; use optimizer 'adam'" % ', '.join(sparse))
        lazy = next((n for n in mro if n in SPARSE_MIRRORED), None)
        if sparse and (lazy is None or not getattr(optimizer, 'lazy_update', False)):
            raise ValueError(
                "local_rule='mirror' with row_sparse gradients (Parameter %s) follows MXNet's "
                'lazy update, which the servers make on the rows of each round and the worker '
                'on the rows of its own gradient; %s %s. Use optimizer %s with lazy_update=True '
                "(their default), local_rule='sgd', or gluon.Trainer on kvstore='dist_delay'"
                % (', '.join(sparse), name,
                   'has no lazy update' if lazy is None else 'was given lazy_update=False',
                   ' or '.join(repr(n.lower()) for n in SPARSE_MIRRORED)))

    def start(self, optimizer):
        # A copy: the trainer's optimizer stays as gluon.Trainer's (saved, compared).
        local = pickle.loads(pickle.dumps(optimizer))
        local.lr_scheduler = None       # the RuleContext lr follows the schedule
        local.param_dict = _UnitMultipliers()
        self._local = local
        self._plain_sgd = type(optimizer) is mx.optimizer.SGD  # noqa: E721
        self._sparse = frozenset(_sparse_grad_params(optimizer))
        self._feed = _feed_for(optimizer)

    def _single_kernel(self, weight, index=None):
        if self._local is None:
            return True    # not started by a trainer: the rule of SGD with momentum
        if index in self._sparse:
            # A lazy update leaves the momentum of rows outside round W as it was, which
            # W_{W+1} - W_W does not show: the servers' state is fetched (§1.4).
            return False
        return self._plain_sgd and not (self._local.multi_precision and
                                        weight.dtype == np.float16)

    def server_state_count(self, optimizer, dtypes):
        self.start(optimizer)
        probes = [mx.nd.zeros((1,), dtype=dtype) for dtype in set(dtypes)]
        probes = [p for p in probes if not self._single_kernel(p)]
        probes += [mx.nd.zeros((1,), dtype=p.dtype)
                   for p in _sparse_grad_params(optimizer).values()]
        counts = [len(flatten_state(optimizer.create_state_multi_precision(0, p)))
                  for p in probes]
        return max(counts + [0])

    def create_state(self, weight, last_global_step):
        return last_global_step.copy()   # the single-kernel path's momentum buffer

    def create_state_for(self, index, weight, last_global_step):
        if self._single_kernel(weight, index):
            return last_global_step.copy()
        return self._local.create_state_multi_precision(index, weight.copy())

    def server_state(self, weight, state, index=None):
        return None if self._single_kernel(weight, index) else flatten_state(state)

    def update(self, weight, grad, grad_sync, state, ctx):
        # A row_sparse g stays row_sparse: the local optimizer makes MXNet's lazy update
        # (the kernel the servers run on a round's rows), on this worker's rows.
        g, rescale = self._compensated(ctx.gradient, grad, grad_sync, ctx)
        if self._single_kernel(weight, ctx.index):
            nd.sgd_mom_update(weight, g, state, out=weight, lr=ctx.lr, wd=ctx.wd,
                              momentum=ctx.momentum, rescale_grad=rescale * ctx.num_workers,
                              clip_gradient=ctx.clip_gradient)
            return
        local, feed = self._local, self._feed
        local.lr, local.wd = ctx.lr, ctx.wd
        g, local.rescale_grad = feed.gradient(g, rescale, ctx.num_workers)
        # Round t is the servers' update t + 1 of the chunk (begin_num_update on).
        count = local.begin_num_update + ctx.step
        local._index_update_count[ctx.index] = count  # pylint: disable=protected-access
        local.num_update = count
        feed.before_update(local, ctx)
        if local.aggregate_num > 0:
            # As the servers' mx.optimizer.Updater calls an aggregating optimizer: with lists,
            # which take its multi-tensor kernels (LAMB's multi_lamb_update rounds its norms
            # differently from lamb_update_phase1/2).
            local.update_multi_precision([ctx.index], [weight], [g], [state])
        else:
            local.update_multi_precision(ctx.index, weight, g, state)


class DriftCorrected(LocalRule):
    """A rule plus a drift correction learnt from the pulls (docs/design.md §1.4).

    Between two applied pulls a worker's weights move by its own `rule` steps, the global
    weights by the servers' rounds on every worker's gradients. The difference, known at the
    pull, is this worker's drift from the global trajectory over the last period. Every
    local step adds it back, one k-th per step::

        at a step that applies a pull:  d := d + (W_t - w'_before) / k
        every local step:               w' := rule(w', g, grad_sync) + d

    where ``w'_before`` is the worker's weights just before the pull replaced them (the
    rule keeps a copy, made after every local step) and d starts at 0 at the switch. d is
    the per-step difference between the global change and the rule's own change over the
    last period, ``(sum of global steps - sum of the rule's steps) / k``: a control variate
    in the spirit of SCAFFOLD, in weight space. It adds no bytes on the wire; it costs two
    arrays per parameter on the worker (d and the copy) and one copy per step. With one
    worker the rule's steps are the servers' (``'mirror'``), so d stays exactly 0 and the
    trajectory is the wrapped rule's.

    Parameters
    ----------
    rule : LocalRule
        The rule to correct (``local_rule='drift'`` is ``DriftCorrected(MirrorRule())``).

    Raises
    ------
    TypeError
        If `rule` is not a :class:`LocalRule` instance.
    """

    def __init__(self, rule):
        if not isinstance(rule, LocalRule) or isinstance(rule, DriftCorrected):
            raise ArgumentTypeError('rule must be a LocalRule instance (not DriftCorrected), '
                                    'e.g. DriftCorrected(MirrorRule()), got %r' % (rule,))
        super(DriftCorrected, self).__init__(rule.dc_lambda)
        self.rule = rule
        self.needs_grad_sync = rule.needs_grad_sync

    def check_optimizer(self, optimizer):
        self.rule.check_optimizer(optimizer)
        sparse = [p.name for p in _sparse_grad_params(optimizer).values()]
        if sparse:
            raise ValueError(
                'local_rule=%r adds a dense correction to every row at every step, which '
                'would undo the lazy updates of Parameter %s (row_sparse gradients); use '
                "local_rule='mirror' for models with sparse gradients" % (self, ', '.join(sparse)))

    def start(self, optimizer):
        self.rule.start(optimizer)

    def server_state_count(self, optimizer, dtypes):
        return self.rule.server_state_count(optimizer, dtypes)

    def create_state_for(self, index, weight, last_global_step):
        inner = self.rule.create_state_for(index, weight, last_global_step)
        return (inner, nd.zeros_like(weight), weight.copy())

    def server_state(self, weight, state, index=None):
        return self.rule.server_state(weight, state[0], index)

    def update(self, weight, grad, grad_sync, state, ctx):
        inner, drift, before = state
        if ctx.pulled:
            # `weight` is W_t, `before` the weights the pull replaced (after the last local
            # step this worker made: a step skipped for an overflow leaves both as they were).
            nd.elemwise_add(drift, (weight - before) / ctx.delay, out=drift)
        self.rule.update(weight, grad, grad_sync, inner, ctx)
        nd.elemwise_add(weight, drift, out=weight)
        weight.copyto(before)

    def __repr__(self):
        return 'DriftCorrected(%r)' % (self.rule,)


def _sparse_grad_params(optimizer):
    """{index: Parameter} of the optimizer's Parameters with row_sparse gradients."""
    return {i: p for i, p in (getattr(optimizer, 'param_dict', None) or {}).items()
            if getattr(p, '_grad_stype', 'default') == 'row_sparse'}


#: name -> (factory taking dc_lambda or None, default lam)
BUILTIN_RULES = {
    'mirror': lambda lam: MirrorRule(0.0 if lam is None else lam),
    'sgd': lambda lam: LocalSGDRule(0.0 if lam is None else lam),
    'dc': lambda lam: LocalSGDRule(0.04 if lam is None else lam),
    'dc_adaptive': lambda lam: LocalSGDRule(0.04 if lam is None else lam, adaptive=True),
    'drift': lambda lam: DriftCorrected(MirrorRule(0.0 if lam is None else lam)),
}


def create_rule(local_rule, dc_lambda=None):
    """Return a rule object for a built-in name or a :class:`LocalRule` instance.

    Parameters
    ----------
    local_rule : str or LocalRule
        A name of :data:`BUILTIN_RULES` or a rule object.
    dc_lambda : float, optional
        lam of a built-in rule (>= 0); None: the rule's default.

    Raises
    ------
    TypeError
        (:class:`mxdelay.ArgumentTypeError`) If `local_rule` is neither a str nor a
        LocalRule instance (a LocalRule class, say), or `dc_lambda` is not a number.
    ValueError
        For an unknown name, a negative or non-finite `dc_lambda`, or `dc_lambda` given
        with a rule object.
    """
    names = ', '.join(repr(n) for n in BUILTIN_RULES)
    if isinstance(local_rule, LocalRule):
        if dc_lambda is not None:
            raise ValueError('dc_lambda=%r applies to built-in rules; set it on the rule '
                             'object %r instead' % (dc_lambda, local_rule))
        return local_rule
    if not isinstance(local_rule, str):
        raise ArgumentTypeError('local_rule=%r is not a rule: use one of %s or an instance of '
                                'mxdelay.rules.LocalRule (e.g. MirrorRule(), not MirrorRule)'
                                % (local_rule, names))
    if local_rule not in BUILTIN_RULES:
        raise ValueError('local_rule=%r is not a rule: use one of %s or a '
                         'mxdelay.rules.LocalRule instance' % (local_rule, names))
    if dc_lambda is not None:
        check_real('dc_lambda', dc_lambda, minimum=0, fix='0 disables delay compensation')
    return BUILTIN_RULES[local_rule](dc_lambda)
