"""Pin tests/reference.py to the closed forms of docs/design.md §1 (fast, numpy only).

Tolerances: ``exact`` means bit-equal float32 (assert_array_equal); ``TIGHT`` is
rtol 1e-6 with atol 1e-7 (weights and gradients here are O(1), float32 eps is 1.2e-7).
Expected values are written from the design's formulas, in their form, not with the reference's
helpers (except where bit-equality with MXNet's arithmetic order is the point).
"""
import types

import numpy as np
import pytest

from reference import simulate

F32 = np.float32
TIGHT = dict(rtol=1e-6, atol=1e-7)
LR, WD, BATCH = 0.1, 0.01, 5
RG = 1.0 / BATCH                      # rescale_grad, as Gluon sets it


def make_init(seed=0):
    rs = np.random.RandomState(seed)
    return {'w': (0.5 * rs.randn(3, 4)).astype(F32), 'b': (0.1 * rs.randn(4)).astype(F32)}


def assert_server_is_updater(traj, updater):
    """The reference's global weights of a 2-worker, 6-step synchronous run `traj` equal
    MXNet's `updater` applied to each round's sum of the two workers' gradients, bit for bit."""
    import mxnet as mx  # pylint: disable=import-outside-toplevel
    grad_fn, init = make_grad_fn(), make_init()
    W = {n: mx.nd.array(a, dtype='float32') for n, a in init.items()}
    for t in range(6):
        w_np = {n: a.asnumpy() for n, a in W.items()}
        for key, n in enumerate(sorted(W)):
            G = grad_fn(w_np, 0, t)[n] + grad_fn(w_np, 1, t)[n]
            updater(key, mx.nd.array(G, dtype='float32'), W[n])
            np.testing.assert_array_equal(traj.glob[t][n], W[n].asnumpy())  # exact


def make_grad_fn(calls=None):
    """Raw (batch-summed) gradient of 0.5*|tanh(x@w + b) - y|^2; data a pure function of
    (rank, step). ``calls[(rank, step)] = (weights, grads)`` records every evaluation."""
    def grad_fn(weights, rank, step):
        rs = np.random.RandomState(1000 * rank + step + 1)
        x = rs.randn(BATCH, 3).astype(F32)
        y = rs.uniform(-0.8, 0.8, (BATCH, 4)).astype(F32)
        p = np.tanh(x @ weights['w'] + weights['b'])
        d = (p - y) * (1 - p * p)
        grads = {'w': x.T @ d, 'b': d.sum(axis=0)}
        if calls is not None:
            calls[(rank, step)] = ({n: a.copy() for n, a in weights.items()}, grads)
        return grads
    return grad_fn


def sync_sgd_step(W, G, mom, lr, mu):
    """MXNet 1.9.1 optimizer.SGD, written out (mom = mu*mom - lr*(rg*G + wd*W); W += mom),
    in the kernels' order: (lr*wd)*W and (lr*rg)*G first."""
    lr, wd, rg, mu = F32(lr), F32(WD), F32(RG), F32(mu)
    if mu > 0:
        mom = mu * mom - (lr * wd) * W - (lr * rg) * G
        return W + mom, mom
    return W - ((lr * wd) * W + (lr * rg) * G), mom


def run(**kw):
    args = dict(init=make_init(), grad_fn=make_grad_fn(), num_workers=2, steps=16, delay=3,
                warmup_steps=2, lr=LR, wd=WD, rescale_grad=RG)
    args.update(kw)
    return simulate(**args)


@pytest.mark.parametrize('momentum', [0.0, 0.9])
@pytest.mark.parametrize('rule', ['mirror', 'sgd', 'dc'])
@pytest.mark.parametrize('warmup', [8, 7])       # 7: the switch (t = W) is the last step
def test_warmup_is_synchronous_sgd(momentum, rule, warmup):
    traj = run(num_workers=3, steps=8, warmup_steps=warmup, momentum=momentum, rule=rule)
    grad_fn = make_grad_fn()
    W = make_init()
    mom = {n: np.zeros_like(a) for n, a in W.items()}
    for t in range(8):                           # gluon.Trainer on dist_sync, written out
        grads = [grad_fn(W, i, t) for i in range(3)]
        for n in W:
            W[n], mom[n] = sync_sgd_step(W[n], grads[0][n] + grads[1][n] + grads[2][n],
                                         mom[n], LR, momentum)
            np.testing.assert_array_equal(traj.glob[t][n], W[n])            # exact
            for i in range(3):
                np.testing.assert_array_equal(traj.local[t][i][n], W[n])    # exact
    assert traj.pulls == []


@pytest.mark.parametrize('momentum', [0.0, 0.9])
def test_server_is_mxnet_sgd(momentum):
    """The reference's server (and sync_sgd_step above) is MXNet's SGD updater, bit for bit."""
    mx = pytest.importorskip('mxnet')
    traj = run(num_workers=2, steps=6, warmup_steps=6, momentum=momentum)
    opt = mx.optimizer.SGD(learning_rate=LR, wd=WD, rescale_grad=RG, momentum=momentum)
    updater = mx.optimizer.get_updater(opt)
    assert_server_is_updater(traj, updater)


def _step_lr(t):
    return LR * (0.5 if t >= 9 else 1.0)


@pytest.mark.parametrize('lr_fn', [None, _step_lr])
@pytest.mark.parametrize('warmup', [0, 3])
@pytest.mark.parametrize('k', [1, 2, 3, 5])
@pytest.mark.parametrize('rule, momentum', [('sgd', 0.0), ('mirror', 0.9)])
def test_single_worker_local_equals_global(rule, momentum, k, warmup, lr_fn):
    # docs/design.md §1.6: N = 1, lam = 0, local_lr = lr: 'sgd' with plain server SGD and 'mirror' with
    # SGD + momentum give w' = W at every step, for every k. 'sgd' is bit-exact here (same
    # kernel on the same inputs); 'mirror' within TIGHT (v starts as W_{W+1} - W_W, which
    # differs from the server's buffer by the rounding of W + mom).
    traj = run(num_workers=1, steps=20, delay=k, warmup_steps=warmup, momentum=momentum,
               rule=rule, local_lr=LR, lr_fn=lr_fn)
    for t in range(20):
        for n in traj.glob[t]:
            if rule == 'sgd':
                np.testing.assert_array_equal(traj.local[t][0][n], traj.glob[t][n])
            else:
                np.testing.assert_allclose(traj.local[t][0][n], traj.glob[t][n], **TIGHT)


@pytest.mark.parametrize('momentum', [0.0, 0.9])
@pytest.mark.parametrize('warmup', [0, 2])
def test_k1_sgd_is_one_step_delay(warmup, momentum):
    # docs/design.md §1.6: with k = 1 and rule 'sgd' this is one-step-delay SGD (w'_{t+1} = W_t - lr_l*g_t).
    # Indices, from the step definition: w'_{t+1} is w' after step t (traj.local[t], the
    # forward weights of step t+1) and W_t = traj.glob[t-1]. With k = 1 the pull issued at
    # t-1 is applied at step 1 of step t (for t = t0 the switch already set w' = W_{t0}), so
    # for every t >= t0 = W+1:
    #     local[t][i] == W_t - lr_l*(g_t + wd*W_t),   g_t = rg * grad_fn(local[t-1][i], i, t)
    # g_t is evaluated at local[t-1] = W_{t-1} - lr_l*(...), not at W_t: the worker steps
    # from the newest global weights with the gradient of its previous, one-step-older ones.
    # The identity is local and independent of the server's momentum. At t = W it does not
    # hold (there local = W_{W+1}).
    calls = {}
    traj = run(grad_fn=make_grad_fn(calls), delay=1, warmup_steps=warmup, momentum=momentum,
               rule='sgd', local_lr=0.05)
    lr_l = F32(0.05)
    for t in range(warmup + 1, 16):
        for i in range(2):
            weights, raw = calls[(i, t)]
            for n in raw:
                np.testing.assert_array_equal(weights[n], traj.local[t - 1][i][n])
                Wt = traj.glob[t - 1][n]
                expected = Wt - lr_l * (F32(RG) * raw[n] + F32(WD) * Wt)
                np.testing.assert_allclose(traj.local[t][i][n], expected, **TIGHT)
    assert traj.pulls == list(range(warmup + 2, 16))


@pytest.mark.parametrize('k, warmup', [(3, 2), (1, 0), (2, 0), (4, 1), (3, 0), (5, 3)])
def test_pull_timing(k, warmup):
    # Rule 'sgd' (lam = 0): at every t >= t0 the worker takes one SGD step from a base that
    # is W_t = glob[t-1] exactly when the pull issued at t-1 is applied, i.e. at
    # t = t0 + k, t0 + 2k, ..., and its own previous w' = local[t-1] otherwise. Two workers
    # with different data and server momentum keep the two bases far apart.
    calls = {}
    steps, t0 = 20, warmup + 1
    traj = run(grad_fn=make_grad_fn(calls), steps=steps, delay=k, warmup_steps=warmup,
               momentum=0.9, rule='sgd')
    expected_pulls = [t for t in range(t0 + 1, steps) if (t - t0) % k == 0]
    for t in range(steps):
        for i in range(2):
            if t < t0:                           # S1 / switch: w' = W_{t+1}
                for n in traj.glob[t]:
                    np.testing.assert_array_equal(traj.local[t][i][n], traj.glob[t][n])
                continue
            raw = calls[(i, t)][1]
            pulled = t in expected_pulls
            # At t0 both bases are W_{t0}; afterwards only the expected one may match.
            for base_is_global in ((pulled,) if t == t0 else (pulled, not pulled)):
                ok = True
                for n in raw:
                    base = traj.glob[t - 1][n] if base_is_global else traj.local[t - 1][i][n]
                    expected = base - F32(LR) * (F32(RG) * raw[n] + F32(WD) * base)
                    ok &= np.allclose(traj.local[t][i][n], expected, **TIGHT)
                assert ok == (base_is_global == pulled), (t, i, base_is_global)
    assert traj.pulls == expected_pulls


@pytest.mark.parametrize('rule', ['mirror', 'sgd', 'dc', 'dc_adaptive'])
@pytest.mark.parametrize('k, warmup', [(1, 0), (3, 2), (4, 5)])
def test_global_is_sync_sgd_on_the_workers_gradients(rule, k, warmup):
    # Every gradient enters exactly the round of its step, and each is computed at the
    # worker's current w' (local[t-1]); the server is synchronous SGD on those gradients.
    calls = {}
    traj = run(grad_fn=make_grad_fn(calls), num_workers=3, steps=14, delay=k,
               warmup_steps=warmup, momentum=0.9, rule=rule, local_lr=0.07, lr_fn=_step_lr)
    W = make_init()
    mom = {n: np.zeros_like(a) for n, a in W.items()}
    for t in range(14):
        for i in range(3):
            at = calls[(i, t)][0]
            for n in W:
                before = W[n] if t == 0 else traj.local[t - 1][i][n]
                np.testing.assert_array_equal(at[n], before)
        for n in W:
            G = calls[(0, t)][1][n] + calls[(1, t)][1][n] + calls[(2, t)][1][n]
            W[n], mom[n] = sync_sgd_step(W[n], G, mom[n], _step_lr(t), 0.9)
            np.testing.assert_array_equal(traj.glob[t][n], W[n])            # exact


def test_dc_differs_from_sgd_only_where_grad_sync_is_nonzero():
    # grad_sync = w' - pre_weight is 0 at the first delayed step t0 (the switch left
    # w' = pre_weight = W_{t0}) and nonzero from t0+1 on (w' has moved locally), so 'dc'
    # is bit-equal to 'sgd' through local[t0] (and glob[t0+1], whose gradients are taken at
    # local[t0]) and differs afterwards. With lam = 0, 'dc' is 'sgd' at every step.
    t0 = 3
    sgd = run(momentum=0.9, rule='sgd', warmup_steps=t0 - 1)
    dc = run(momentum=0.9, rule='dc', dc_lambda=2.0, warmup_steps=t0 - 1)
    dc0 = run(momentum=0.9, rule='dc', dc_lambda=0.0, warmup_steps=t0 - 1)
    for t in range(16):
        for n in sgd.glob[t]:
            np.testing.assert_array_equal(dc0.glob[t][n], sgd.glob[t][n])
            assert np.array_equal(dc.glob[t][n], sgd.glob[t][n]) == (t <= t0 + 1), t
            for i in range(2):
                np.testing.assert_array_equal(dc0.local[t][i][n], sgd.local[t][i][n])
                assert np.array_equal(dc.local[t][i][n], sgd.local[t][i][n]) == (t <= t0), t


@pytest.mark.parametrize('k, warmup', [(1, 0), (3, 2), (4, 1), (2, 3)])
def test_dc_rule_closed_form(k, warmup):
    # Every delayed step of 'dc': w' := base - lr_l*(g + wd*base + lam*g*g*grad_sync), with
    # base the w' after step 1 (glob[t-1] = W_t at a pull, else local[t-1]) and
    # grad_sync = base - pre_weight, where pre_weight = W_p of the last pull p < t (W_{t0}
    # before the first one; step 3 backs up after step 2). So at a pull grad_sync is the
    # global change over the last period, W_t - W_p, and in between the worker's own drift
    # since the last pull, local[t-1] - W_p.
    calls, lam, steps = {}, F32(2.0), 18
    t0 = warmup + 1
    traj = run(grad_fn=make_grad_fn(calls), steps=steps, delay=k, warmup_steps=warmup,
               momentum=0.9, rule='dc', dc_lambda=lam)
    pulls = [t for t in range(t0 + 1, steps) if (t - t0) % k == 0]
    assert traj.pulls == pulls
    for i in range(2):
        pre = traj.glob[warmup]                          # W_{t0}, backed up at the switch
        for t in range(t0, steps):
            base = traj.glob[t - 1] if t in pulls else traj.local[t - 1][i]
            for n, raw in calls[(i, t)][1].items():
                g = F32(RG) * raw
                grad_sync = base[n] - pre[n]             # before this step's backup
                expected = base[n] - F32(LR) * (g + F32(WD) * base[n] + lam * g * g * grad_sync)
                np.testing.assert_allclose(traj.local[t][i][n], expected, **TIGHT)
            if t in pulls:
                pre = traj.glob[t - 1]                   # 3. pre_weight := W_t


def test_dc_adaptive_scales_lambda_by_running_ms():
    # MS starts at 0 and is updated at every local update (t0 and t0+1 here), before use:
    # MS_t0 = (1-m)*g_t0^2 + 1e-7; MS_t0+1 = m*MS_t0 + (1-m)*g^2 + 1e-7; lam_eff = lam/sqrt(MS).
    warmup, lam, m = 2, 0.5, 0.95
    t0 = warmup + 1
    calls = {}
    sgd = run(rule='sgd', warmup_steps=warmup)
    ada = run(grad_fn=make_grad_fn(calls), rule='dc_adaptive', dc_lambda=lam, ms_momentum=m,
              warmup_steps=warmup)
    for i in range(2):
        for n in sgd.glob[0]:
            np.testing.assert_array_equal(ada.local[t0][i][n], sgd.local[t0][i][n])
            g0, g1 = (RG * calls[(i, t)][1][n].astype(np.float64) for t in (t0, t0 + 1))
            ms = m * ((1 - m) * g0 * g0 + 1e-7) + (1 - m) * g1 * g1 + 1e-7
            grad_sync = ada.local[t0][i][n] - ada.glob[t0 - 1][n]
            dc_term = -LR * lam / np.sqrt(ms) * g1 * g1 * grad_sync
            np.testing.assert_allclose(ada.local[t0 + 1][i][n] - sgd.local[t0 + 1][i][n],
                                       dc_term, rtol=1e-3, atol=2e-7)
            assert np.abs(dc_term).max() > 1e-4


@pytest.mark.parametrize('k, warmup', [(3, 2), (2, 0), (4, 1)])
def test_mirror_momentum_persists_across_pulls(k, warmup):
    # 'mirror', N = 2: v_t = w'_after - base_t, where base_t is the w' the step started from
    # (glob[t-1] at a pull, local[t-1] otherwise), satisfies for every t >= t0
    #     v_t = mu*v_{t-1} - lr_l*(N*g_t + wd*base_t),   v_{t0-1} = W_{W+1} - W_W,
    # i.e. the buffer is initialised from the server's last step and never reset at pulls.
    calls, mu, N = {}, F32(0.9), 2
    t0 = warmup + 1
    traj = run(grad_fn=make_grad_fn(calls), steps=18, delay=k, warmup_steps=warmup,
               momentum=0.9, rule='mirror')
    prev_glob = make_init() if warmup == 0 else traj.glob[warmup - 1]
    for i in range(2):
        v = {n: traj.glob[warmup][n] - prev_glob[n] for n in prev_glob}
        for t in range(t0, 18):
            pulled = t in traj.pulls
            for n, raw in calls[(i, t)][1].items():
                base = traj.glob[t - 1][n] if pulled else traj.local[t - 1][i][n]
                v_t = traj.local[t][i][n] - base
                expected = mu * v[n] - F32(LR) * (N * F32(RG) * raw + F32(WD) * base)
                np.testing.assert_allclose(v_t, expected, rtol=1e-5, atol=3e-7)
                v[n] = v_t
    assert traj.pulls == [t for t in range(t0 + 1, 18) if (t - t0) % k == 0]


# -- per-parameter multipliers (Gluon's Parameter.lr_mult and wd_mult) ------------------------
MULTS = dict(lr_mult={'w': 0.5}, wd_mult={'b': 0.0})


def _mult_lrs(lr):
    """Each parameter's lr and wd under MULTS, as float32 kernel arguments."""
    return {'w': F32(lr * 0.5), 'b': F32(lr)}, {'w': F32(WD), 'b': F32(0.0)}


@pytest.mark.parametrize('rule', ['mirror', 'sgd'])
def test_multipliers_in_the_warmup_are_per_parameter_sync_sgd(rule):
    # SGD with momentum, written out per parameter in MXNet's order: 'w' at half the lr
    # (wd as usual), 'b' at the full lr without weight decay; bit-equal.
    traj = run(steps=6, warmup_steps=6, momentum=0.9, rule=rule, **MULTS)
    grad_fn, W = make_grad_fn(), make_init()
    mom = {n: np.zeros_like(a) for n, a in W.items()}
    lrs, wds = _mult_lrs(LR)
    for t in range(6):
        grads = [grad_fn(W, i, t) for i in range(2)]
        for n in W:
            G = grads[0][n] + grads[1][n]
            mom[n] = F32(0.9) * mom[n] - (lrs[n] * wds[n]) * W[n] - (lrs[n] * F32(RG)) * G
            W[n] = W[n] + mom[n]
            np.testing.assert_array_equal(traj.glob[t][n], W[n])            # exact
            for i in range(2):
                np.testing.assert_array_equal(traj.local[t][i][n], W[n])    # exact
    plain = run(steps=6, warmup_steps=6, momentum=0.9, rule=rule)
    for n in W:                                   # both multipliers change the trajectory
        assert np.abs(plain.glob[5][n] - traj.glob[5][n]).max() > 1e-3, n


@pytest.mark.parametrize('momentum', [0.0, 0.9])
def test_multipliers_on_the_server_are_mxnet_sgd(momentum):
    """The reference's server with multipliers is MXNet's SGD updater given Parameters with
    lr_mult and wd_mult (its param_dict, as gluon.Trainer sets it), bit for bit."""
    mx = pytest.importorskip('mxnet')
    traj = run(num_workers=2, steps=6, warmup_steps=6, momentum=momentum, **MULTS)
    names = sorted(make_init())                   # keys 0, 1 = 'b', 'w'
    params = {key: types.SimpleNamespace(lr_mult=MULTS['lr_mult'].get(n, 1.0),
                                         wd_mult=MULTS['wd_mult'].get(n, 1.0))
              for key, n in enumerate(names)}
    opt = mx.optimizer.SGD(learning_rate=LR, wd=WD, rescale_grad=RG, momentum=momentum,
                           param_dict=params)
    updater = mx.optimizer.get_updater(opt)
    grad_fn, init = make_grad_fn(), make_init()
    W = {n: mx.nd.array(a, dtype='float32') for n, a in init.items()}
    for t in range(6):
        w_np = {n: a.asnumpy() for n, a in W.items()}
        for key, n in enumerate(names):
            G = grad_fn(w_np, 0, t)[n] + grad_fn(w_np, 1, t)[n]
            updater(key, mx.nd.array(G, dtype='float32'), W[n])
            np.testing.assert_array_equal(traj.glob[t][n], W[n].asnumpy())  # exact


@pytest.mark.parametrize('k, warmup', [(2, 1), (3, 0), (1, 2)])
def test_multipliers_in_the_local_sgd_rule(k, warmup):
    # Rule 'sgd', every delayed step: w' := base - lr_l*lr_mult*(g + wd*wd_mult*base), with
    # base = W_t at a pull and the worker's previous w' otherwise (see test_pull_timing).
    calls, steps, t0 = {}, 14, warmup + 1
    traj = run(grad_fn=make_grad_fn(calls), steps=steps, delay=k, warmup_steps=warmup,
               momentum=0.9, rule='sgd', local_lr=0.07, **MULTS)
    assert traj.pulls == [t for t in range(t0 + 1, steps) if (t - t0) % k == 0]
    lrs, wds = _mult_lrs(0.07)
    for t in range(t0, steps):
        for i in range(2):
            base = traj.glob[t - 1] if t in traj.pulls else traj.local[t - 1][i]
            for n, raw in calls[(i, t)][1].items():
                expected = base[n] - lrs[n] * (F32(RG) * raw + wds[n] * base[n])
                np.testing.assert_allclose(traj.local[t][i][n], expected, **TIGHT)


@pytest.mark.parametrize('k, warmup', [(2, 1), (3, 0)])
def test_multipliers_in_the_mirror_rule(k, warmup):
    # 'mirror', N = 2: v_t = mu*v_{t-1} - lr*lr_mult*(N*g_t + wd*wd_mult*base_t), v starting at
    # the server's last synchronous step (see test_mirror_momentum_persists_across_pulls).
    calls, mu, N, steps = {}, F32(0.9), 2, 14
    traj = run(grad_fn=make_grad_fn(calls), steps=steps, delay=k, warmup_steps=warmup,
               momentum=0.9, rule='mirror', **MULTS)
    lrs, wds = _mult_lrs(LR)
    prev_glob = make_init() if warmup == 0 else traj.glob[warmup - 1]
    for i in range(2):
        v = {n: traj.glob[warmup][n] - prev_glob[n] for n in prev_glob}
        for t in range(warmup + 1, steps):
            for n, raw in calls[(i, t)][1].items():
                base = traj.glob[t - 1][n] if t in traj.pulls else traj.local[t - 1][i][n]
                v_t = traj.local[t][i][n] - base
                expected = mu * v[n] - lrs[n] * (N * F32(RG) * raw + wds[n] * base)
                np.testing.assert_allclose(v_t, expected, rtol=1e-5, atol=3e-7)
                v[n] = v_t


@pytest.mark.parametrize('rule', ['mirror', 'sgd', 'dc'])
def test_uniform_multipliers_are_a_global_lr_or_wd(rule):
    # lr_mult 0.5 on every parameter is lr (and local_lr) halved, wd_mult 0 everywhere is
    # wd = 0: bit-equal, because 0.1 * 0.5 and 0.07 * 0.5 are exact in binary.
    args = dict(steps=12, delay=3, warmup_steps=2, momentum=0.9, rule=rule)
    halved = run(lr=LR / 2, local_lr=0.035, **args)
    mult = run(lr=LR, local_lr=0.07, lr_mult={'w': 0.5, 'b': 0.5}, **args)
    no_wd = run(wd=0.0, **args)
    wd_mult = run(wd_mult={'w': 0.0, 'b': 0.0}, **args)
    for t in range(12):
        for n in halved.glob[t]:
            np.testing.assert_array_equal(mult.glob[t][n], halved.glob[t][n])
            np.testing.assert_array_equal(wd_mult.glob[t][n], no_wd.glob[t][n])
            for i in range(2):
                np.testing.assert_array_equal(mult.local[t][i][n], halved.local[t][i][n])
                np.testing.assert_array_equal(wd_mult.local[t][i][n], no_wd.local[t][i][n])


def test_multipliers_for_unknown_parameters_are_refused():
    with pytest.raises(ValueError, match=r"lr_mult names \['weight'\]"):
        run(lr_mult={'weight': 0.5})
    with pytest.raises(ValueError, match=r"wd_mult names \['bias'\]"):
        run(wd_mult={'bias': 0.0})


# -- Adam and NAG on the servers, mirrored ----------------------------------------------------
@pytest.mark.parametrize('optimizer,params', [('adam', {'learning_rate': 0.01}),
                                              ('nag', {'learning_rate': LR, 'momentum': 0.9}),
                                              ('nag', {'learning_rate': LR})])
def test_server_is_mxnet_adam_and_nag(optimizer, params):
    """The reference's Adam and NAG servers are MXNet's updaters, bit for bit (NAG's kernel
    reads the weight it has just written when it updates the momentum)."""
    mx = pytest.importorskip('mxnet')
    lr = params['learning_rate']
    traj = run(num_workers=2, steps=6, warmup_steps=6, optimizer=optimizer, lr=lr,
               momentum=params.get('momentum', 0.0))
    updater = mx.optimizer.get_updater(mx.optimizer.create(optimizer, wd=WD, rescale_grad=RG,
                                                           **params))
    assert_server_is_updater(traj, updater)


def test_server_is_mxdelay_frozen_variance_adam():
    """The reference's 'frozenvarianceadam' server is mxdelay.FrozenVarianceAdam's updater
    bit for bit, across its freeze (update 3 of 6), and differs from Adam after it."""
    mx = pytest.importorskip('mxnet')
    from mxdelay import FrozenVarianceAdam  # pylint: disable=import-outside-toplevel
    traj = run(num_workers=2, steps=6, warmup_steps=6, optimizer='frozenvarianceadam', lr=0.01,
               freeze_after=3)
    assert_server_is_updater(traj, mx.optimizer.get_updater(FrozenVarianceAdam(
        freeze_after=3, learning_rate=0.01, wd=WD, rescale_grad=RG)))
    adam = run(num_workers=2, steps=6, warmup_steps=6, optimizer='adam', lr=0.01)
    for t in range(6):
        same = all(np.array_equal(traj.glob[t][n], adam.glob[t][n]) for n in adam.glob[t])
        assert same == (t < 3), t
    with pytest.raises(ValueError, match='freeze_after goes with'):
        run(optimizer='adam', freeze_after=3)


def adam_closed_form(w, g, m, v, lr, t, wd, rescale):
    """Adam's step t (from 1) as Kingma and Ba write it, with MXNet's weight decay inside the
    gradient and its bias correction folded into the learning rate; float64."""
    b1, b2, eps = 0.9, 0.999, 1e-8
    g = rescale * g + wd * w
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    lr_t = lr * np.sqrt(1 - b2 ** t) / (1 - b1 ** t)
    return w - lr_t * m / (np.sqrt(v) + eps), m, v


@pytest.mark.parametrize('k,warmup', [(1, 0), (3, 2)])
def test_adam_mirror_closed_form(k, warmup):
    # Worker i between pulls: Adam on N * its own gradient, with the server's update count
    # and, from the switch, a copy of the server's moments that it keeps across pulls.
    N, lr = 3, 0.01
    traj = run(num_workers=N, steps=12, delay=k, warmup_steps=warmup, optimizer='adam', lr=lr)
    grad_fn = make_grad_fn()
    W, m, v = make_init(), None, None
    m = {n: np.zeros(a.shape) for n, a in W.items()}
    v = {n: np.zeros(a.shape) for n, a in W.items()}
    local = None
    for t in range(12):
        ws = [W] * N if t <= warmup else local[0]
        grads = [grad_fn({n: a.astype(F32) for n, a in ws[i].items()}, i, t) for i in range(N)]
        W_t, W = W, {}
        new_m, new_v = {}, {}
        for n in W_t:
            G = sum(g[n].astype(np.float64) for g in grads)
            W[n], new_m[n], new_v[n] = adam_closed_form(W_t[n], G, m[n], v[n], lr, t + 1, WD, RG)
            np.testing.assert_allclose(traj.glob[t][n], W[n], rtol=1e-4, atol=1e-6)
        m, v = new_m, new_v
        if t == warmup:
            local = ([dict(W) for _ in range(N)],
                     [({n: a.copy() for n, a in m.items()}, {n: a.copy() for n, a in v.items()})
                      for _ in range(N)])
        elif t > warmup:
            pulled = (t - warmup - 2) % k == k - 1 and t - 1 > warmup
            for i in range(N):
                w_i = dict(W_t) if pulled else local[0][i]
                mi, vi = local[1][i]
                out = {}
                for n in w_i:
                    out[n], mi[n], vi[n] = adam_closed_form(w_i[n], grads[i][n], mi[n], vi[n],
                                                            lr, t + 1, WD, N * RG)
                local[0][i] = out
        for i in range(N):
            want = W if t <= warmup else local[0][i]
            for n in want:
                np.testing.assert_allclose(traj.local[t][i][n], want[n], rtol=1e-4, atol=1e-6,
                                           err_msg='step %d worker %d %s' % (t, i, n))


def test_adam_and_nag_mirror_with_one_worker_is_the_server_bit_for_bit():
    for optimizer, lr, mu in (('adam', 0.01, 0.0), ('nag', LR, 0.9)):
        for k in (1, 2, 4):
            traj = run(num_workers=1, steps=14, delay=k, warmup_steps=2, optimizer=optimizer,
                       lr=lr, momentum=mu)
            for t in range(14):
                for n in traj.glob[t]:
                    np.testing.assert_array_equal(traj.local[t][0][n], traj.glob[t][n])


def test_nag_mirror_is_not_the_sgd_mirror():
    # The reference really switches the arithmetic (a guard against a silent SGD fallback).
    nag = run(num_workers=2, steps=10, delay=2, warmup_steps=2, optimizer='nag', momentum=0.9)
    sgd = run(num_workers=2, steps=10, delay=2, warmup_steps=2, momentum=0.9)
    assert not np.allclose(nag.local[-1][0]['w'], sgd.local[-1][0]['w'], rtol=1e-3)
    with pytest.raises(ValueError, match='dc_lambda 0 only'):
        run(optimizer='adam', dc_lambda=0.1)
