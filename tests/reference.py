"""Exact numpy reference of the k-step delayed update (docs/design.md §1), float32.

N workers and one logical server run in lock step; that loses nothing, because the only
coupling between workers is the server, whose rounds are exact (round t holds each
worker's step-t gradient, whatever the arrival order). Worker i at step t:

- forward/backward at its weights ``w'`` (those after its step t-1; ``init`` at t = 0),
  giving ``raw`` (Gluon's ``param.grad``); its ``g`` is ``rescale_grad * raw``;
- push: the server applies round t to the SUM of the N raw gradients, ``W_t -> W_{t+1}``;
- t < W (S1): ``w' := W_{t+1}``; t == W (S2): the same, then ``pre_weight := w'``;
- t >= t0 = W+1 (S2/S3): the local update, steps 1-4 of docs/design.md §1.3.

Float32 throughout. The server's arithmetic is MXNet 1.9.1's ``optimizer.SGD`` bit for bit
(``multi_sgd_update`` / ``multi_sgd_mom_update``, which its updater calls for dense
weights; checked in test_reference.py). The local rules use the same two kernels.
``optimizer='adam'`` and ``'nag'`` replace the server's SGD by MXNet 1.9.1's ``adam_update``
and ``nag_mom_update`` (:func:`adam_step`, :func:`nag_step`, also pinned there), and rule
``'mirror'`` by a copy of that optimizer: its state starts as the server's after round W.

``compression_threshold=t`` adds MXNet's '2bit' gradient compression on each worker, with one
residual per worker per tensor (:func:`quantize_2bit`): the server sums what the workers send,
and the local rules step with what their worker sent (docs/design.md §1.4, §2.8).

Row_sparse gradients (docs/design.md §1.4, §2.10): ``grad_fn`` returns a
:class:`RowSparseGrad` (the rows the gradient holds and its dense values, zero elsewhere) for
a parameter with ``grad_stype='row_sparse'``. Every update is then MXNet's lazy update: the
server's round t changes only the rows of the union of the workers' rows of round t (weights
and optimizer state; the others keep theirs), a worker's local step only the rows of its own
gradient (weights and rule state), and rule 'mirror' starts from the server's optimizer state
after round W for every optimizer (its momentum buffer included: rows outside round W keep a
momentum that ``W_{W+1} - W_W`` does not show). Pulls bring every row.

Compressed pulls (docs/design.md §2.12), ``pull_compression='fp16'`` or ``('int8', block,
[chunk_size])``:
the server keeps the model it last sent, x̂ (W_0 at first); at every pulled round (t <= W,
and the last round of each period) it sends ``q = C(W_{t+1} - x̂)`` and sets ``x̂ += dec(q)``
(:func:`pull_fp16`, :func:`pull_int8`). A worker's pulls then bring x̂, not W: the warm-up
and switch set ``w' := x̂``, a delayed step that applies a pull sets ``w' := x̂`` of the
round it pulled, and the mirror's momentum of SGD starts at ``x̂_{W+1} - x̂_W``.

AMP (docs/design.md §11), with ``overflow`` the set of (rank, step) whose gradient was not
finite: a round in which any worker overflowed is skipped by the server (weights, state and
update count unchanged); a worker skips its own local step (4.) only when its own gradient
overflowed; the loss scale (:class:`LossScale`, Gluon's rule) advances with the global flag
of round t at step t in the synchronous steps (a fallback's too), and with the flags of a
period's rounds at the step that applies its pull. The update count u of a round (the lr
schedule's argument and Adam's bias correction) counts applied rounds; a worker's local
steps use t less the skipped rounds its loss scale has seen. Loss scales are powers of two,
so the scaled gradient times its ``rescale_grad`` is the unscaled one bit for bit: the
reference works with unscaled gradients.

``delay='auto'``'s fallback (docs/design.md §1.2), ``synchronous_from=F`` (t0 + j k, or t0):
steps t >= F are synchronous as the warm-up's, ``w' := W_{t+1}`` (x̂ of round t: compressed
pulls pull every round from F on). The pull issued at F - 1 is never applied (x̂ still
advances at F - 1); the rule's state is dropped; the residuals and x̂ carry on.
"""
import collections
import math

import numpy as np

__all__ = ['simulate', 'Trajectory', 'DEFAULT_LAMBDA', 'sgd_step', 'sgd_mom_step', 'adam_step',
           'nag_step', 'OPTIMIZERS', 'quantize_2bit', 'quantize_blockwise', 'LossScale',
           'RowSparseGrad',
           'pull_fp16', 'pull_int8', 'pulled_round']

F32 = np.float32
DEFAULT_LAMBDA = {'sgd': 0.0, 'dc': 0.04, 'dc_adaptive': 0.04, 'mirror': 0.0, 'drift': 0.0}


def sgd_step(w, grad, lr, wd, rescale, dc=F32(0)):
    """``w - lr*(rescale*grad + wd*w + dc)`` in MXNet's order:
    ``w - ((lr*wd)*w + (lr*rescale)*grad + lr*dc)``; with ``dc = 0`` it is MXNet's SGD bit
    for bit (adding 0 is exact)."""
    return w - ((lr * wd) * w + (lr * rescale) * grad + lr * dc)


def sgd_mom_step(w, grad, mom, lr, wd, rescale, mu, dc=F32(0)):
    """``mom := mu*mom - lr*(rescale*grad + wd*w + dc); w := w + mom`` in MXNet's order (bit
    for bit with ``dc = 0``). Returns the new ``(w, mom)``."""
    mom = mu * mom - (lr * wd) * w - (lr * rescale) * grad - lr * dc
    return w + mom, mom


def adam_step(w, grad, mean, var, lr, wd, rescale, beta1, beta2, epsilon):
    """MXNet 1.9.1's ``adam_update`` (no clipping): ``g = grad*rescale + w*wd``,
    ``mean := b1*mean + (1-b1)*g``, ``var := b2*var + (1-b2)*g*g``,
    ``w := w - lr*mean / (sqrt(var) + eps)``; `lr` already holds Adam's bias correction
    (``lr * sqrt(1 - b2**t) / (1 - b1**t)``, in float64, rounded once). Returns
    ``(w, mean, var)``."""
    g = grad * rescale + w * wd
    mean = beta1 * mean + (F32(1) - beta1) * g
    var = beta2 * var + (F32(1) - beta2) * g * g
    return w - lr * mean / (np.sqrt(var) + epsilon), mean, var


def adam_lr(lr, t, beta1, beta2, freeze_after=None):
    """Adam's learning rate of its update number `t` (from 1), as ``optimizer.Adam``
    computes it in float64, rounded to float32 for the kernel; with `freeze_after`,
    ``mxdelay.FrozenVarianceAdam``'s (the second moment's correction stops at that update)."""
    t2 = t if freeze_after is None else min(t, freeze_after)
    return F32(lr * (math.sqrt(1. - beta2 ** t2) / (1. - beta1 ** t)))


def frozen_adam_step(opt, t, w, grad, mean, var, lr, wd, rescale):
    """Adam's step `t` (:func:`adam_step`), or ``mxdelay.FrozenVarianceAdam``'s after its
    freeze: the kernel with beta2 = 1 (v kept), after ``v := max(v, float32(1 - beta2) * g *
    g)`` with its gradient ``g = grad*rescale + w*wd``."""
    if opt['freeze_after'] is None or t <= opt['freeze_after']:
        return adam_step(w, grad, mean, var, lr, wd, rescale, opt['b1'], opt['b2'], opt['eps'])
    g = grad * rescale + w * wd
    var = np.maximum(var, F32(1.0 - opt['beta2']) * (g * g))
    return adam_step(w, grad, mean, var, lr, wd, rescale, opt['b1'], F32(1), opt['eps'])


def nag_step(w, grad, mom, lr, wd, rescale, mu):
    """MXNet 1.9.1's ``nag_mom_update`` in place (``out=weight``, as ``optimizer.NAG``
    calls it; no clipping): ``mom := mu*mom``, ``w := w - mom + (mu+1)*(mom - lr*(rescale*grad
    + wd*w))``, then ``mom := mom - lr*(rescale*grad + wd*w)`` with the *new* w (the kernel
    writes the weight before it reads it again). Returns ``(w, mom)``."""
    mom = mu * mom
    new_w = w - mom + (mu + F32(1)) * (mom - lr * (rescale * grad + wd * w))
    return new_w, mom - lr * (rescale * grad + wd * new_w)


def sgd_update_step(w, grad, lr, wd, rescale):
    """MXNet 1.9.1's single-tensor ``sgd_update`` (what ``optimizer.NAG`` without momentum
    calls): ``(1 - lr*wd)*w - (lr*rescale)*grad``, an order other than :func:`sgd_step`'s."""
    return (F32(1) - lr * wd) * w - (lr * rescale) * grad


def quantize_blockwise(residual, raw, levels, block, chunk_size=None):
    """What a worker sends with ``'int8'``, ``'int4'`` or ``'ternary'`` pushes (docs/design.md
    §2.14) on one tensor, with `levels` h (127, 7, 1): ``p = r + raw`` (float32); per chunk of
    `chunk_size` values of the flattened tensor (the whole tensor if None) and per block of
    `block` values in it, ``s = max|p| / h`` and ``c = clip(rint(p / s), -h, h) * s`` (0
    where s == 0), in float32; ``r := p - c``. Returns ``(c, r)``, shaped as `raw`."""
    p = (residual + raw).astype(F32).reshape(-1)
    sent = np.zeros_like(p)
    step = chunk_size or max(p.size, 1)
    for start in range(0, p.size, step):
        for lo in range(start, min(start + step, p.size), block):
            hi = min(lo + block, start + step, p.size)
            s = F32(np.max(np.abs(p[lo:hi])) / F32(levels))
            if s > 0:
                level = np.clip(np.rint(p[lo:hi] / s), -levels, levels).astype(F32)
                sent[lo:hi] = (level + F32(0)) * s    # + 0: a level -0 sends +0
    return sent.reshape(raw.shape), (p - sent).reshape(raw.shape)


def quantize_2bit(residual, raw, t):
    """MXNet 1.9.1's ``quantize_2bit`` kernel on one tensor: ``r := r + raw``; send ``+t``
    where ``r >= t``, ``-t`` where ``r <= -t``, else 0; ``r := r - sent``. Returns
    ``(sent, r)``."""
    r = residual + raw
    sent = np.where(r >= t, t, np.where(r <= -t, -t, F32(0))).astype(F32)
    return sent, r - sent


def pull_fp16(d):
    """A compressed pull of ``d = W - x̂`` with 'fp16': ``dec(q) = float32(float16(d))``
    (numpy's cast rounds to nearest even, as MXNet's)."""
    return d.astype(np.float16).astype(F32)


def pull_int8(d, block, chunk_size=None):
    """A compressed pull of ``d`` with 'int8', blocks of `block` values in flat order within
    each chunk of `chunk_size` values (None: one chunk): per block ``s = max|d| / 127``
    (float32), ``l = clip(rint(d / s), -127, 127)`` (0 where s = 0), ``dec(q) = l * s`` in
    float32."""
    flat = d.reshape(-1)
    out = np.empty_like(flat)
    chunk_size = chunk_size or max(flat.size, 1)
    starts = [c + b for c in range(0, flat.size, chunk_size)
              for b in range(0, min(chunk_size, flat.size - c), block)]
    for start in starts:
        stop = min(start + block, (start // chunk_size + 1) * chunk_size, flat.size)
        part = flat[start:stop]
        s = F32(np.max(np.abs(part)) / F32(127))
        if s == 0:
            out[start:stop] = 0
            continue
        levels = np.clip(np.rint(part / s), -127, 127).astype(F32)
        out[start:stop] = levels * s
    return out.reshape(d.shape)


def aux_mean(values):
    """The aux states after ``sync_weights(aux_states=True)`` (docs/design.md §2.13):
    `values[i]` lists worker i's copies of one aux state, one per device. Each worker's
    mean over its devices (float32 sum in device order, divided by float32(D)), summed over
    the workers in rank order in float32 (the server's sum), divided by float32(N)."""
    total = None
    for copies in values:
        mine = copies[0].astype(F32)
        for other in copies[1:]:
            mine = mine + other.astype(F32)
        if len(copies) > 1:
            mine = mine / F32(len(copies))
        total = mine if total is None else total + mine
    return total / F32(len(values))


def pulled_round(t, delay, warmup_steps, synchronous_from=None):
    """Whether every worker pulls round `t`: ``t <= W``, the last round of a period, or
    ``t >= synchronous_from`` (a ``delay='auto'`` fallback)."""
    t0 = warmup_steps + 1
    if synchronous_from is not None and t >= synchronous_from:
        return True
    return t < t0 or (t - t0) % delay == delay - 1


#: A row_sparse gradient: the (unique) row ids it holds and its dense values (zero elsewhere).
RowSparseGrad = collections.namedtuple('RowSparseGrad', ['rows', 'values'])


def _row_mask(rows, shape):
    mask = np.zeros(shape[0], dtype=bool)
    mask[np.asarray(rows, dtype=np.int64)] = True
    return mask.reshape((-1,) + (1,) * (len(shape) - 1))


def _lazy(mask, new, old):
    """`new` on the rows of `mask`, `old` elsewhere (a lazy update's result)."""
    return new if mask is None or new is None else np.where(mask, new, old)


#: The servers' optimizers the reference knows.
OPTIMIZERS = ('sgd', 'adam', 'nag', 'frozenvarianceadam')


class LossScale:
    """Gluon's dynamic loss scale (``mxnet.contrib.amp.LossScaler``), written from its rule:
    the scale of the next step is the one decided a round earlier; an overflow halves the
    following one and restarts the count; ``window`` rounds in a row without overflow
    double it, up to 2**24. Starts at 2**16."""

    def __init__(self, window=2000):
        self.scale = self.next = 2.0 ** 16
        self.window, self.count = window, 0

    def advance(self, overflow):
        self.scale = self.next
        self.count = 0 if overflow else self.count + 1
        if overflow:
            self.next = self.scale / 2
        if self.count == self.window:
            self.count, self.next = 0, min(2.0 ** 24, self.scale * 2)


class Trajectory:
    """``local[t][i][name]``: worker i's ``w'`` after its step t (its forward weights at t+1).
    ``glob[t][name]``: the server's ``W_{t+1}``. ``grads[t][i][name]``: worker i's raw
    gradient of step t. ``pulls``: the steps whose local update applied a pull (step 1).
    ``scales[t]``: the loss scale after step t (every worker's). ``skipped``: the rounds the
    server skipped."""

    def __init__(self):
        self.local, self.glob, self.grads, self.pulls = [], [], [], []
        self.scales, self.skipped = [], []
        self.xhat = []    # compressed pulls: the pulled model x̂ after round t


def _copy(d):
    return {n: a.copy() for n, a in d.items()}


def simulate(init, grad_fn, num_workers, steps, delay, warmup_steps, lr, momentum=0.0, wd=0.0,
             rescale_grad=1.0, local_lr=None, rule='mirror', dc_lambda=None, ms_momentum=0.95,
             lr_fn=None, lr_mult=None, wd_mult=None, optimizer='sgd', beta1=0.9, beta2=0.999,
             epsilon=1e-8, freeze_after=None, fp16=False, compression_threshold=None, overflow=(),
             scale_window=2000, pull_compression=None, blockwise=None, synchronous_from=None):
    """Simulate docs/design.md §1 for ``steps`` steps; returns a :class:`Trajectory`.

    ``grad_fn(weights, rank, step)`` returns worker ``rank``'s raw gradients (dict) at
    ``weights``; a :class:`RowSparseGrad` for a parameter with row_sparse gradients (lazy
    updates, see the module's docstring). ``lr_fn(u)`` is the server's lr of its update
    u + 1 (default ``lr``; u = t without overflows); the local lr is ``local_lr`` (default
    ``lr``) times ``lr_fn(u) / lr``. ``overflow`` ({(rank, step)}) and ``scale_window`` (the loss scale's
    window) model AMP (see the module's docstring). ``dc_lambda=None`` takes the
    rule's default from ``DEFAULT_LAMBDA``.

    ``lr_mult`` and ``wd_mult`` ({name: multiplier}, 1 for a name not given) are the
    Parameters' multipliers, which the server and the local rule apply alike, as MXNet's
    optimizer does: parameter n's lr is ``float32(lr * lr_mult[n])`` and its wd
    ``float32(wd * wd_mult[n])``, each product taken in float64 (Python floats) and rounded
    once when it reaches the kernel; the local lr is ``float32(local lr * lr_mult[n])``.

    ``fp16=True`` models float16 pushes (docs/design.md §2.11): each worker's raw gradient is
    rounded to float16 (numpy's ``astype``: to nearest even, as MXNet's cast) and back to
    float32 before the server's float32 sum and before the worker's own local rule (which
    reads what it pushed, docs/design.md §1.4).

    `optimizer` is the servers' (:data:`OPTIMIZERS`; ``beta1``, ``beta2``, ``epsilon`` are
    Adam's, `momentum` NAG's too; ``'frozenvarianceadam'`` is Adam whose second moment stops
    after update `freeze_after`). With 'adam' or 'nag', rule 'mirror' runs that optimizer
    on each worker with rescale ``float32(N * rescale_grad)`` and the server's update count
    (round t is update t + 1), its state a copy of the server's after round W; lam must be 0.

    ``rule='drift'`` is 'mirror' plus the drift correction of docs/design.md §1.4: at a
    step that applies a pull ``d := d + (W_t - w'_before) / k`` (``w'_before``: the worker's
    weights after its last local step), then every local step adds d after the mirror's
    step; d starts at 0 at the switch.

    `compression_threshold` t: each worker's raw gradient goes through
    :func:`quantize_2bit` with its own residual per tensor; ``grads`` then holds what was sent.

    `blockwise` ``(h, block, chunk_size)``: blockwise pushes (``'int8'``: h 127, ``'int4'``:
    7, ``'ternary'``: 1), each worker's raw gradient through :func:`quantize_blockwise` with
    its own residual per tensor; ``grads`` then holds what was sent.

    `pull_compression` ('fp16', ``('int8', block)`` or ``('int8', block, chunk_size)``):
    compressed pulls (see the module's docstring); ``xhat`` then holds the pulled model
    after every round. int8 blocks run over the flattened tensor, within chunks of
    `chunk_size` elements (the store's, docs/design.md §2.5) if given.

    `synchronous_from` F: ``delay='auto'``'s fallback, synchronous steps from round F on
    (see the module's docstring); None: no fallback. F is t0 = W + 1 or ``t0 + j k``.
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError('optimizer must be one of %s, got %r' % (OPTIMIZERS, optimizer))
    if optimizer != 'sgd' and rule in ('mirror', 'drift') and dc_lambda:
        raise ValueError('the reference mirrors %s with dc_lambda 0 only' % optimizer)
    if rule not in DEFAULT_LAMBDA:
        raise ValueError('rule must be one of %s, got %r' % (sorted(DEFAULT_LAMBDA), rule))
    if delay < 1 or warmup_steps < 0 or num_workers < 1:
        raise ValueError('need delay >= 1, warmup_steps >= 0, num_workers >= 1')
    N, k, warm = num_workers, delay, warmup_steps
    t0 = warm + 1                                  # first step of the delayed phase
    if synchronous_from is not None and (synchronous_from < t0 or (synchronous_from - t0) % k):
        raise ValueError('synchronous_from must be t0 = %d or t0 + j*delay (delay %d), got %r'
                         % (t0, k, synchronous_from))
    fallback = math.inf if synchronous_from is None else synchronous_from
    lam = F32(DEFAULT_LAMBDA[rule] if dc_lambda is None else dc_lambda)
    mu, rg, m = F32(momentum), F32(rescale_grad), F32(ms_momentum)
    local_lr = lr if local_lr is None else local_lr
    names = sorted(init)
    for what, mults in (('lr_mult', lr_mult), ('wd_mult', wd_mult)):
        if set(mults or {}) - set(names):
            raise ValueError('%s names %s, not parameters (%s)'
                             % (what, sorted(set(mults) - set(names)), names))
    lr_mult = {n: float((lr_mult or {}).get(n, 1.0)) for n in names}
    wd_n = {n: F32(wd * float((wd_mult or {}).get(n, 1.0))) for n in names}

    W = {n: np.array(init[n], dtype=F32) for n in names}       # server: W_0
    mom = {n: np.zeros_like(W[n]) for n in names}              # server momentum state
    var = {n: np.zeros_like(W[n]) for n in names}              # Adam's second moment
    if (optimizer == 'frozenvarianceadam') != (freeze_after is not None):
        raise ValueError('freeze_after goes with optimizer frozenvarianceadam only')
    optimizer = 'adam' if optimizer == 'frozenvarianceadam' else optimizer
    opt = dict(optimizer=optimizer, freeze_after=freeze_after, mu=mu, b1=F32(beta1),
               b2=F32(beta2), eps=F32(epsilon),
               beta1=beta1, beta2=beta2, N=N, rg_n=F32(N * rescale_grad))
    workers = [{'w': _copy(W),                                 # w' (before step 0: W_0)
                'pre': None,                                   # pre_weight (set at t = W)
                'v': None,                                     # 'mirror' momentum buffer
                'ms': {n: np.zeros_like(W[n]) for n in names},  # 'dc_adaptive' MS
                'pending': False}                              # a pull issued at t-1
               for _ in range(N)]
    traj = Trajectory()
    residuals = [{n: np.zeros_like(W[n]) for n in names} for _ in range(N)]
    overflowed = {t for _, t in overflow}          # rounds with a non-finite sum
    loss_scale, seen, seen_skipped = LossScale(scale_window), 0, 0
    u = 0                                          # the server's applied rounds
    xhat = _copy(W)                                # compressed pulls: the pulled model
    if pull_compression is None:
        compress = None
    elif pull_compression == 'fp16':
        compress = pull_fp16
    elif isinstance(pull_compression, tuple) and pull_compression[0] == 'int8':
        compress = lambda d: pull_int8(d, *pull_compression[1:])  # noqa: E731
    else:
        raise ValueError("pull_compression must be None, 'fp16', ('int8', block) or ('int8', "
                         "block, chunk_size), got %r"
                         % (pull_compression,))

    def see(last):                                 # the loss scale learns rounds .. last
        nonlocal seen, seen_skipped
        for r in range(seen, last + 1):
            loss_scale.advance(r in overflowed)
            seen_skipped += r in overflowed
        seen = max(seen, last + 1)

    for t in range(steps):
        lr_t = lr if lr_fn is None else lr_fn(u)
        lr_s = {n: F32(lr_t * lr_mult[n]) for n in names}  # server lr, round t
        synchronous = t <= warm or t >= fallback           # warm-up, switch, fallback
        if not synchronous and (t - t0) % k == 0 and t > t0:   # this step applies a pull
            see(t - 1)
        known = t - seen_skipped                           # a worker's update number - 1
        lr_k = lr if lr_fn is None else lr_fn(known)
        lr_l = local_lr * (lr_k / lr)                      # local lr, same schedule factor
        lr_l64 = {n: lr_l * lr_mult[n] for n in names}   # float64, as the optimizer has it
        lr_l = {n: F32(lr_l64[n]) for n in names}
        raws, masks = [], []                               # masks: rows of sparse gradients
        for i, wk in enumerate(workers):                   # forward/backward at w'
            gr = grad_fn(_copy(wk['w']), i, t)
            masks.append({n: _row_mask(gr[n].rows, W[n].shape) for n in names
                          if isinstance(gr[n], RowSparseGrad)})
            if masks[-1] and (fp16 or compression_threshold is not None or overflow
                              or blockwise):
                raise ValueError('the reference has row_sparse gradients without fp16, '
                                 'compression and overflows only')
            gr = {n: gr[n].values if n in masks[-1] else gr[n] for n in names}
            raws.append({n: np.asarray(gr[n], dtype=F32).copy() for n in names})
            if fp16:
                raws[-1] = {n: g.astype(np.float16).astype(F32) for n, g in raws[-1].items()}
            if compression_threshold is not None:          # what worker i sends
                for n in names:
                    raws[i][n], residuals[i][n] = quantize_2bit(
                        residuals[i][n], raws[i][n], F32(compression_threshold))
            if blockwise is not None:
                for n in names:
                    raws[i][n], residuals[i][n] = quantize_blockwise(
                        residuals[i][n], raws[i][n], *blockwise)

        # Server, claim 4: round t = one update with the sum of the N round-t gradients.
        W_t, W = W, {}
        if t in overflowed:                                # AMP: skipped, u unchanged
            W = _copy(W_t)
            traj.skipped.append(t)
        else:
            u += 1
        for n in ([] if t in overflowed else names):
            G = raws[0][n]
            for r in raws[1:]:
                G = G + r[n]                               # rank order
            rows = None                                    # lazy: the round's rows
            if n in masks[0]:
                rows = np.logical_or.reduce([mk[n] for mk in masks])
            kept = (mom[n], var[n])
            if optimizer == 'adam':                        # update number u
                W[n], mom[n], var[n] = frozen_adam_step(
                    opt, u, W_t[n], G, mom[n], var[n],
                    adam_lr(lr_t * lr_mult[n], u, beta1, beta2, freeze_after), wd_n[n], rg)
            elif optimizer == 'nag' and momentum > 0:
                W[n], mom[n] = nag_step(W_t[n], G, mom[n], lr_s[n], wd_n[n], rg, mu)
            elif optimizer == 'nag':
                W[n] = sgd_update_step(W_t[n], G, lr_s[n], wd_n[n], rg)
            elif momentum > 0:                             # MXNet: state only if momentum > 0
                W[n], mom[n] = sgd_mom_step(W_t[n], G, mom[n], lr_s[n], wd_n[n], rg, mu)
            else:
                W[n] = sgd_step(W_t[n], G, lr_s[n], wd_n[n], rg)
            W[n] = _lazy(rows, W[n], W_t[n])
            mom[n], var[n] = _lazy(rows, mom[n], kept[0]), _lazy(rows, var[n], kept[1])

        xhat_t = xhat                                      # x̂ as pulled up to round t-1
        if compress is not None and pulled_round(t, k, warm, synchronous_from):
            xhat = {n: xhat[n] + compress(W[n] - xhat[n]) for n in names}
        if synchronous:
            see(t)                                         # synchronous: round t at once
        for i, wk in enumerate(workers):
            if synchronous:
                # S1 (t < W), the first switch iteration (t == W) and from the fallback
                # round F on: pull W_{t+1}. At F the pull issued at F - 1 ('pending') is
                # dropped, and so is the rule's state: the local rule never runs again.
                w_before = wk['w']
                wk['w'] = _copy(W if compress is None else xhat)
                if t == warm:                              # S2: back up the pulled weights
                    wk['pre'] = _copy(wk['w'])
                    # 'mirror': v := W_{W+1} - W_W, the server's last step (SGD), or a
                    # copy of the server's optimizer state after round W (Adam, NAG).
                    wk['v'] = {n: mom[n].copy() if n in masks[i] else W[n] - W_t[n]
                               for n in names}
                    if compress is not None:               # the pulled weights' step
                        wk['v'] = {n: xhat[n] - w_before[n] for n in names}
                    if optimizer != 'sgd':
                        wk['v'] = {n: mom[n].copy() for n in names}
                        wk['var'] = {n: var[n].copy() for n in names}
                    # 'drift': the correction d and the weights after the last local step.
                    wk['d'] = {n: np.zeros_like(W[n]) for n in names}
                    wk['before'] = _copy(wk['w'])
                continue
            # S2 (t = t0) / S3: the push happened above; now the local update.
            pulled, w = wk['pending'], wk['w']
            if pulled:                                     # 1. apply the pull of t-1: W_t
                w = _copy(W_t if compress is None else xhat_t)
            for n in names:
                gs = w[n] - wk['pre'][n]                   # 2. grad_sync := w' - pre_weight
                if pulled:
                    wk['pre'][n] = w[n].copy()             # 3. pre_weight := w'
                if (i, t) in overflow:                     # 4. skipped: own overflow
                    continue
                rows = masks[i].get(n)                     # lazy: this worker's rows
                kept = {key: wk[key][n] for key in ('v', 'var', 'ms') if wk.get(key)}
                w_kept = w[n]
                if rule == 'drift' and pulled:             # d += (W_t - w'_before) / k
                    wk['d'][n] = wk['d'][n] + (w[n] - wk['before'][n]) / F32(k)
                if rule in ('mirror', 'drift') and optimizer != 'sgd':
                    w[n] = _mirror(opt, w[n], raws[i][n], wk, n, lr_l[n], lr_l64[n], wd_n[n],
                                   known)
                else:
                    w[n] = _rule('mirror' if rule == 'drift' else rule, w[n], raws[i][n], gs,
                                 wk, n, lam, lr_l[n], wd_n[n], rg, mu, m, N)
                if rule == 'drift':                        # + d; keep w' for the next pull
                    w[n] = w[n] + wk['d'][n]
                    wk['before'][n] = w[n].copy()
                w[n] = _lazy(rows, w[n], w_kept)
                for key, old in kept.items():
                    wk[key][n] = _lazy(rows, wk[key][n], old)
            wk['w'] = w
            # Claim 2: issue a pull at the last iteration of each period, applied at t+1.
            wk['pending'] = (t - t0) % k == k - 1
            if pulled and i == 0:
                traj.pulls.append(t)

        traj.scales.append(loss_scale.scale)
        traj.local.append([_copy(wk['w']) for wk in workers])
        traj.glob.append(_copy(W))
        traj.xhat.append(_copy(xhat))
        traj.grads.append(raws)
    return traj


def _rule(rule, w, raw, gs, wk, n, lam, lr_l, wd, rg, mu, m, N):
    """4. ``w' := rule(w', g, grad_sync)`` for one parameter; returns the new ``w'``."""
    g = rg * raw                                           # the worker's g
    if rule == 'dc_adaptive':                              # MS updated at every local update
        wk['ms'][n] = m * wk['ms'][n] + (F32(1) - m) * g * g + F32(1e-7)
        lam = lam / np.sqrt(wk['ms'][n])                   # lam_eff, elementwise
    # g_dc = g + dc. g stays in MXNet's (raw, rescale) form, so that with dc = 0 (lam = 0
    # or grad_sync = 0) every rule is bit-equal to the plain kernel (N = 1 'sgd' to the server).
    dc = lam * g * g * gs
    if rule == 'mirror':
        # The server's SGD-with-momentum applied to N*g_dc, own buffer v (never reset).
        w, wk['v'][n] = sgd_mom_step(w, raw, wk['v'][n], lr_l, wd, F32(N) * rg, mu, F32(N) * dc)
        return w
    return sgd_step(w, raw, lr_l, wd, rg, dc)              # 'sgd', 'dc', 'dc_adaptive'


def _mirror(opt, w, raw, wk, n, lr_l, lr_l64, wd, t):
    """Rule 'mirror' with Adam or NAG on the servers: that optimizer on ``N * g``."""
    if opt['optimizer'] == 'adam':
        w, wk['v'][n], wk['var'][n] = frozen_adam_step(
            opt, t + 1, w, raw, wk['v'][n], wk['var'][n],
            adam_lr(lr_l64, t + 1, opt['beta1'], opt['beta2'], opt['freeze_after']),
            wd, opt['rg_n'])
        return w
    if opt['mu'] > 0:
        w, wk['v'][n] = nag_step(w, raw, wk['v'][n], lr_l, wd, opt['rg_n'], opt['mu'])
        return w
    return sgd_update_step(w, raw, lr_l, wd, opt['rg_n'])
