"""The default rule, ``'mirror'``: a local copy of the servers' optimizer
(:class:`MirrorRule`), and which optimizers it can follow (:data:`MIRRORED`,
:data:`SPARSE_MIRRORED`; the others are refused, naming why)."""
import pickle

import numpy as np
import mxnet as mx
from mxnet import nd

from kvstore_ext.optim.frozen_variance import FrozenVarianceAdam
from kvstore_ext.optim.optimizers import flatten_state

from .base import LocalRule, sparse_grad_params
from .feeds import Feed, UnitMultipliers, feed_for

__all__ = ['MirrorRule', 'MIRRORED', 'SPARSE_MIRRORED']


#: Optimizers the mirror runs locally (and their subclasses): their state is elementwise,
#: shaped like the weight, so that a chunk's state on a server is the same elements of the
#: whole tensor's state, and a local instance continues it exactly. LAMB, LARS and LBSGD
#: (``warmup_strategy='lars'``) also read norms of the whole tensor: the servers keep such
#: tensors whole (one chunk; a tensor that would span several is refused when it is
#: registered, docs/design.md §3.4), so the local copy, which holds the whole tensor,
#: computes the same norms. LARS and LBSGD are mirrored on conditions
#: (:func:`_conditional_refusal`) and through a feed of their own (:mod:`mxdelay.rules.feeds`).
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


class MirrorRule(LocalRule):
    """A local instance of the servers' optimizer, applied to ``N * g_dc``.

    The worker's gradient stands in for each of the N gradients that the servers sum. The
    local optimizer is a copy of the servers' (same class and hyper-parameters: wd,
    clip_gradient, multi_precision, the lr schedule through the :data:`RuleContext` lr, and
    lr_mult/wd_mult) with ``rescale_grad`` N times the worker's; its state at the switch is
    the servers' optimizer state after round W (fetched once, collectively, by the store's
    ``state_fetch`` part, :mod:`kvstore_ext.worker.statefetch`) and is kept across pulls: a
    pull replaces the weights, not the state. Update counts are the servers' (round t is
    update t + 1), so bias corrections (Adam, Adamax, FTML) follow the servers'.

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
        self._feed = Feed()        # how the local optimizer is given a step (start)

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
        sparse = [p.name for p in sparse_grad_params(optimizer).values()]
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
        local.param_dict = UnitMultipliers()
        self._local = local
        self._plain_sgd = type(optimizer) is mx.optimizer.SGD  # noqa: E721
        self._sparse = frozenset(sparse_grad_params(optimizer))
        self._feed = feed_for(optimizer)

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
                   for p in sparse_grad_params(optimizer).values()]
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
