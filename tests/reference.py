"""Exact numpy reference of SPEC section 1 (k-step delayed update), float32.

N workers and one logical server run in lock step; that loses nothing, because the only
coupling between workers is the server, whose rounds are exact (round t holds each
worker's step-t gradient, whatever the arrival order). Worker i at step t:

- forward/backward at its weights ``w'`` (those after its step t-1; ``init`` at t = 0),
  giving ``raw`` (Gluon's ``param.grad``); its ``g`` is ``rescale_grad * raw``;
- push: the server applies round t to the SUM of the N raw gradients, ``W_t -> W_{t+1}``;
- t < W (S1): ``w' := W_{t+1}``; t == W (S2): the same, then ``pre_weight := w'``;
- t >= t0 = W+1 (S2/S3): the local update, steps 1-4 of SPEC section 1.

Float32 throughout. The server's arithmetic is MXNet 1.9.1's ``optimizer.SGD`` bit for bit
(``multi_sgd_update`` / ``multi_sgd_mom_update``, which its updater calls for dense
weights; checked in test_reference.py). The local rules use the same two kernels.
"""
import numpy as np

__all__ = ['simulate', 'Trajectory', 'DEFAULT_LAMBDA', 'sgd_step', 'sgd_mom_step']

F32 = np.float32
DEFAULT_LAMBDA = {'sgd': 0.0, 'dc': 0.04, 'dc_adaptive': 0.04, 'mirror': 0.0}


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


class Trajectory:
    """``local[t][i][name]``: worker i's ``w'`` after its step t (its forward weights at t+1).
    ``glob[t][name]``: the server's ``W_{t+1}``. ``grads[t][i][name]``: worker i's raw
    gradient of step t. ``pulls``: the steps whose local update applied a pull (step 1)."""

    def __init__(self):
        self.local, self.glob, self.grads, self.pulls = [], [], [], []


def _copy(d):
    return {n: a.copy() for n, a in d.items()}


def simulate(init, grad_fn, num_workers, steps, delay, warmup_steps, lr, momentum=0.0, wd=0.0,
             rescale_grad=1.0, local_lr=None, rule='mirror', dc_lambda=None, ms_momentum=0.95,
             lr_fn=None, lr_mult=None, wd_mult=None):
    """Simulate SPEC section 1 for ``steps`` steps; returns a :class:`Trajectory`.

    ``grad_fn(weights, rank, step)`` returns worker ``rank``'s raw gradients (dict) at
    ``weights``. ``lr_fn(t)`` is the server's lr in round t (default ``lr``); the local lr
    is ``local_lr`` (default ``lr``) times ``lr_fn(t) / lr``. ``dc_lambda=None`` takes the
    rule's default from ``DEFAULT_LAMBDA``.

    ``lr_mult`` and ``wd_mult`` ({name: multiplier}, 1 for a name not given) are the
    Parameters' multipliers, which the server and the local rule apply alike, as MXNet's
    optimizer does: parameter n's lr is ``float32(lr * lr_mult[n])`` and its wd
    ``float32(wd * wd_mult[n])``, each product taken in float64 (Python floats) and rounded
    once when it reaches the kernel; the local lr is ``float32(local lr * lr_mult[n])``.
    """
    if rule not in DEFAULT_LAMBDA:
        raise ValueError('rule must be one of %s, got %r' % (sorted(DEFAULT_LAMBDA), rule))
    if delay < 1 or warmup_steps < 0 or num_workers < 1:
        raise ValueError('need delay >= 1, warmup_steps >= 0, num_workers >= 1')
    N, k, warm = num_workers, delay, warmup_steps
    t0 = warm + 1                                  # first step of the delayed phase
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
    workers = [{'w': _copy(W),                                 # w' (before step 0: W_0)
                'pre': None,                                   # pre_weight (set at t = W)
                'v': None,                                     # 'mirror' momentum buffer
                'ms': {n: np.zeros_like(W[n]) for n in names},  # 'dc_adaptive' MS
                'pending': False}                              # a pull issued at t-1
               for _ in range(N)]
    traj = Trajectory()

    for t in range(steps):
        lr_t = lr if lr_fn is None else lr_fn(t)
        lr_s = {n: F32(lr_t * lr_mult[n]) for n in names}  # server lr, round t
        lr_l = local_lr * (lr_t / lr)                      # local lr, same schedule factor
        lr_l = {n: F32(lr_l * lr_mult[n]) for n in names}
        raws = []
        for i, wk in enumerate(workers):                   # forward/backward at w'
            gr = grad_fn(_copy(wk['w']), i, t)
            raws.append({n: np.asarray(gr[n], dtype=F32).copy() for n in names})

        # Server, claim 4: round t = one update with the sum of the N round-t gradients.
        W_t, W = W, {}
        for n in names:
            G = raws[0][n]
            for r in raws[1:]:
                G = G + r[n]                               # rank order
            if momentum > 0:                               # MXNet: state only if momentum > 0
                W[n], mom[n] = sgd_mom_step(W_t[n], G, mom[n], lr_s[n], wd_n[n], rg, mu)
            else:
                W[n] = sgd_step(W_t[n], G, lr_s[n], wd_n[n], rg)

        for i, wk in enumerate(workers):
            if t <= warm:
                # S1 (t < W) and the first switch iteration (t == W): pull W_{t+1}.
                wk['w'] = _copy(W)
                if t == warm:                              # S2: back up the pulled weights
                    wk['pre'] = _copy(W)
                    # 'mirror': v := W_{W+1} - W_W, the server's last step.
                    wk['v'] = {n: W[n] - W_t[n] for n in names}
                continue
            # S2 (t = t0) / S3: the push happened above; now the local update.
            pulled, w = wk['pending'], wk['w']
            if pulled:                                     # 1. apply the pull of t-1: W_t
                w = _copy(W_t)
            for n in names:
                gs = w[n] - wk['pre'][n]                   # 2. grad_sync := w' - pre_weight
                if pulled:
                    wk['pre'][n] = w[n].copy()             # 3. pre_weight := w'
                w[n] = _rule(rule, w[n], raws[i][n], gs, wk, n, lam, lr_l[n], wd_n[n], rg, mu,
                             m, N)
            wk['w'] = w
            # Claim 2: issue a pull at the last iteration of each period, applied at t+1.
            wk['pending'] = (t - t0) % k == k - 1
            if pulled and i == 0:
                traj.pulls.append(t)

        traj.local.append([_copy(wk['w']) for wk in workers])
        traj.glob.append(_copy(W))
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
