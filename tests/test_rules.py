"""The local update rules (``mxdelay.rules``) against the closed forms of docs/design.md §1.4.

What is tested: every built-in rule (``'mirror'``, ``'sgd'``, ``'dc'``, ``'dc_adaptive'``)
with its default and an explicit ``dc_lambda``, with and without weight decay and
momentum, for 1 and 3 workers and ``rescale_grad`` 1 and 1/4, applied through
``create_rule(...).update`` on ``mx.nd`` arrays for three consecutive steps (so that the
persistent state, the mirror rule's ``v`` and the adaptive rule's ``MS``, is checked
too), against the formulas of docs/design.md §1.4 evaluated in float64 numpy:

- ``g = rescale_grad * raw``, ``g_dc = g + lam * g * g * grad_sync``;
- ``'sgd'``/``'dc'``: ``w := w - lr * (g_dc + wd * w)``;
- ``'dc_adaptive'``: the same with ``lam / sqrt(MS)``, ``MS := m*MS + (1-m)*g*g + 1e-7``;
- ``'mirror'``: ``v := mu*v - lr * (N * g_dc + wd * w)``, ``w := w + v``.

Also: ``needs_grad_sync``, ``create_state``, ``create_rule``'s errors, custom rule objects,
gradient clipping (of the rescaled gradient, and for ``'mirror'`` of ``N * g``, as the
server's optimizer clips the sum it stands in for), and that a rule gives bit-identical
results on ``mx.cpu(0)`` and ``mx.cpu(1)`` with its state on the weight's context.

Tolerance: MXNet computes in float32, the closed forms in float64 from the same float32
inputs; with values O(1) we allow ``rtol=1e-5, atol=1e-6`` (the largest absolute error
measured is 2.2e-7; float32's eps is 1.2e-7), while every term of the rules moves the
weights by at least 1e-4 (checked for the delay-compensation term, the smallest one).
"""
import numpy as np
import pytest
import mxnet as mx
from mxnet import nd

import reference
from mxdelay.rules import (LocalRule, LocalSGDRule, MirrorRule, RuleContext, create_rule,
                           BUILTIN_RULES)

TOL = dict(rtol=1e-5, atol=1e-6)
F32 = np.float32
LR = 0.1
MS_MOMENTUM = 0.95
SHAPE = (3, 5)
STEPS = 3


def make_inputs(seed):
    """Float32 weight, raw gradients, grad_sync and a last global step, all O(1)."""
    rs = np.random.RandomState(seed)
    w = rs.uniform(-1, 1, SHAPE).astype(F32)
    raws = [rs.uniform(-2, 2, SHAPE).astype(F32) for _ in range(STEPS)]
    syncs = [rs.uniform(-0.5, 0.5, SHAPE).astype(F32) for _ in range(STEPS)]
    last_step = rs.uniform(-0.1, 0.1, SHAPE).astype(F32)
    return w, raws, syncs, last_step


def closed_form(rule, w, raws, syncs, last_step, lam, wd, mu, rescale, num_workers,
                with_dc=True):
    """The design's rule (§1.4), float64; returns the weights after each step."""
    w = w.astype(np.float64)
    v = last_step.astype(np.float64)           # 'mirror': starts at the server's last step
    ms = np.zeros_like(w)                      # 'dc_adaptive': MS starts at 0
    out = []
    for raw, sync in zip(raws, syncs):
        g = rescale * raw.astype(np.float64)
        lam_eff = lam
        if rule == 'dc_adaptive':
            ms = MS_MOMENTUM * ms + (1 - MS_MOMENTUM) * g * g + 1e-7
            lam_eff = lam / np.sqrt(ms)
        g_dc = g + lam_eff * g * g * sync.astype(np.float64) if with_dc else g
        if rule == 'mirror':
            v = mu * v - LR * (num_workers * g_dc + wd * w)
            w = w + v
        else:
            w = w - LR * (g_dc + wd * w)
        out.append(w.copy())
    return out


def effective_lambda(rule, dc_lambda):
    return reference.DEFAULT_LAMBDA[rule] if dc_lambda is None else dc_lambda


def run_rule(rule_obj, w, raws, syncs, last_step, ctx, wd, mu, rescale, num_workers,
             clip=-1.0):
    """Apply `rule_obj` for len(raws) steps as the trainer does; return numpy weights."""
    weight = nd.array(w, ctx=ctx)
    state = rule_obj.create_state(weight, nd.array(last_step, ctx=ctx))
    rctx = RuleContext(lr=LR, wd=wd, momentum=mu, clip_gradient=clip, rescale_grad=rescale,
                       num_workers=num_workers)
    out = []
    for raw, sync in zip(raws, syncs):
        grad = nd.array(raw, ctx=ctx)
        grad_sync = nd.array(sync, ctx=ctx) if rule_obj.needs_grad_sync else None
        rule_obj.update(weight, grad, grad_sync, state, rctx)
        # the rule must not write into its inputs
        np.testing.assert_array_equal(grad.asnumpy(), raw)
        if grad_sync is not None:
            np.testing.assert_array_equal(grad_sync.asnumpy(), sync)
        out.append(weight.asnumpy())
    return out, state


@pytest.mark.parametrize('num_workers', [1, 3])
@pytest.mark.parametrize('rescale', [1.0, 0.25])
@pytest.mark.parametrize('momentum', [0.0, 0.9])
@pytest.mark.parametrize('wd', [0.0, 0.05])
@pytest.mark.parametrize('dc_lambda', [None, 0.0, 0.5])
@pytest.mark.parametrize('rule', ['mirror', 'sgd', 'dc', 'dc_adaptive'])
def test_rule_matches_closed_form(rule, dc_lambda, wd, momentum, rescale, num_workers):
    w, raws, syncs, last_step = make_inputs(seed=7)
    rule_obj = create_rule(rule, dc_lambda)
    lam = effective_lambda(rule, dc_lambda)
    assert rule_obj.dc_lambda == lam
    assert rule_obj.needs_grad_sync == (lam > 0)
    got, _ = run_rule(rule_obj, w, raws, syncs, last_step, mx.cpu(0), wd, momentum, rescale,
                      num_workers)
    want = closed_form(rule, w, raws, syncs, last_step, lam, wd, momentum, rescale,
                       num_workers)
    for t in range(STEPS):
        np.testing.assert_allclose(got[t], want[t], err_msg='step %d' % t, **TOL)
    if lam > 0:
        # the compensation term is resolved by the tolerance: leaving it out is detected
        without = closed_form(rule, w, raws, syncs, last_step, lam, wd, momentum, rescale,
                              num_workers, with_dc=False)
        assert np.abs(got[0] - without[0]).max() > 1e-4


@pytest.mark.parametrize('rule', ['mirror', 'sgd'])
def test_lambda_zero_needs_no_grad_sync(rule):
    # lam = 0: the trainer passes grad_sync=None; the result is the plain rule
    rule_obj = create_rule(rule)
    assert rule_obj.needs_grad_sync is False
    assert create_rule('dc', 0).needs_grad_sync is False
    assert create_rule('dc_adaptive', 0.0).needs_grad_sync is False
    assert create_rule(rule, 0.01).needs_grad_sync is True
    assert create_rule('dc').needs_grad_sync is True


def test_dc_adaptive_state_is_the_mean_square():
    w, raws, syncs, last_step = make_inputs(seed=3)
    _, state = run_rule(create_rule('dc_adaptive'), w, raws, syncs, last_step, mx.cpu(0),
                        0.0, 0.0, 0.25, 1)
    ms = np.zeros(SHAPE)
    for raw in raws:
        g = 0.25 * raw.astype(np.float64)
        ms = MS_MOMENTUM * ms + (1 - MS_MOMENTUM) * g * g + 1e-7
    np.testing.assert_allclose(state.asnumpy(), ms, **TOL)


def test_mirror_state_is_the_local_velocity():
    # after each update, w_new - w_old == v (the momentum buffer the rule keeps)
    w, raws, syncs, last_step = make_inputs(seed=4)
    rule_obj = create_rule('mirror')
    weight = nd.array(w)
    state = rule_obj.create_state(weight, nd.array(last_step))
    rctx = RuleContext(LR, 0.01, 0.9, -1.0, 0.5, 2)
    for raw in raws:
        before = weight.asnumpy()
        rule_obj.update(weight, nd.array(raw), None, state, rctx)
        np.testing.assert_allclose(weight.asnumpy() - before, state.asnumpy(), **TOL)


def test_mirror_one_worker_equals_server_sgd_momentum():
    # N = 1, lam = 0: exactly MXNet's SGD with momentum (the server's optimizer), bit for bit
    w, raws, _, last_step = make_inputs(seed=5)
    opt = mx.optimizer.SGD(learning_rate=LR, momentum=0.9, wd=0.01, rescale_grad=0.25)
    server_w, server_mom = nd.array(w), nd.array(last_step)
    rule_obj = create_rule('mirror')
    local_w = nd.array(w)
    state = rule_obj.create_state(local_w, nd.array(last_step))
    for raw in raws:
        opt.update(0, server_w, nd.array(raw), server_mom)
        rule_obj.update(local_w, nd.array(raw), None, state,
                        RuleContext(LR, 0.01, 0.9, -1.0, 0.25, 1))
        np.testing.assert_array_equal(local_w.asnumpy(), server_w.asnumpy())


@pytest.mark.parametrize('rule,num_workers', [('sgd', 1), ('sgd', 3), ('mirror', 1),
                                              ('mirror', 3)])
def test_clip_gradient(rule, num_workers):
    w, raws, syncs, last_step = make_inputs(seed=6)
    clip, rescale, mu, wd = 0.3, 0.5, 0.9, 0.01
    got, _ = run_rule(create_rule(rule), w, raws[:1], syncs[:1], last_step, mx.cpu(0), wd,
                      mu, rescale, num_workers, clip=clip)
    g = rescale * raws[0].astype(np.float64)
    if rule == 'mirror':
        v = mu * last_step - LR * (np.clip(num_workers * g, -clip, clip) + wd * w)
        want = w + v
    else:
        want = w - LR * (np.clip(g, -clip, clip) + wd * w)
    np.testing.assert_allclose(got[0], want, **TOL)
    assert np.abs(g).max() * num_workers > 2 * clip  # clipping is active


@pytest.mark.parametrize('rule', ['mirror', 'sgd', 'dc', 'dc_adaptive'])
def test_context_agnostic(rule):
    w, raws, syncs, last_step = make_inputs(seed=8)
    dc_lambda = None if rule in ('dc', 'dc_adaptive') else 0.2
    results = {}
    for ctx in (mx.cpu(0), mx.cpu(1)):
        rule_obj = create_rule(rule, dc_lambda)
        weight = nd.array(w, ctx=ctx)
        state = rule_obj.create_state(weight, nd.array(last_step, ctx=ctx))
        if state is not None:
            assert state.context == ctx
        rctx = RuleContext(LR, 0.01, 0.9, -1.0, 0.25, 2)
        for raw, sync in zip(raws, syncs):
            rule_obj.update(weight, nd.array(raw, ctx=ctx), nd.array(sync, ctx=ctx), state,
                            rctx)
        assert weight.context == ctx
        results[ctx] = weight.asnumpy()
    np.testing.assert_array_equal(results[mx.cpu(0)], results[mx.cpu(1)])
    assert not np.array_equal(results[mx.cpu(0)], w)


def test_create_state():
    weight = nd.array(np.ones(SHAPE, F32))
    last = nd.array(np.full(SHAPE, 0.25, F32))
    state = create_rule('mirror').create_state(weight, last)
    np.testing.assert_array_equal(state.asnumpy(), last.asnumpy())
    # a copy, not an alias, in both directions
    last[:] = 7.0
    assert float(state.asnumpy().max()) == 0.25
    state[:] = -1.0
    assert float(last.asnumpy().min()) == 7.0
    assert create_rule('sgd').create_state(weight, last) is None
    assert create_rule('dc').create_state(weight, last) is None
    ms = create_rule('dc_adaptive').create_state(weight, last)
    assert ms.shape == SHAPE and not ms.asnumpy().any()


def test_builtin_names_and_defaults():
    assert set(BUILTIN_RULES) == {'mirror', 'sgd', 'dc', 'dc_adaptive', 'drift'}
    assert isinstance(create_rule('mirror'), MirrorRule)
    assert create_rule('drift').dc_lambda == reference.DEFAULT_LAMBDA['drift']
    for name in ('sgd', 'dc', 'dc_adaptive'):
        rule_obj = create_rule(name)
        assert isinstance(rule_obj, LocalSGDRule)
        assert rule_obj.adaptive == (name == 'dc_adaptive')
        assert rule_obj.dc_lambda == reference.DEFAULT_LAMBDA[name]
    assert create_rule('mirror', 0.3).dc_lambda == 0.3
    assert create_rule('dc', 0.5).dc_lambda == 0.5


def test_unknown_rule_name():
    with pytest.raises(ValueError, match=r"local_rule='bogus'.*'mirror'"):
        create_rule('bogus')
    with pytest.raises(ValueError, match=r"local_rule=42"):
        create_rule(42)
    with pytest.raises(ValueError, match=r"MirrorRule"):
        create_rule(MirrorRule)  # the class, not an instance


@pytest.mark.parametrize('rule', ['mirror', 'sgd', 'dc', 'dc_adaptive'])
@pytest.mark.parametrize('bad', [-0.1, float('nan')])
def test_negative_dc_lambda(rule, bad):
    with pytest.raises(ValueError, match=r'dc_lambda.*got %s' % ('-0\\.1' if bad < 0 else 'nan')):
        create_rule(rule, bad)


def test_rule_constructors_validate():
    with pytest.raises(ValueError, match=r'dc_lambda.*-1'):
        MirrorRule(-1)
    with pytest.raises(ValueError, match=r'ms_momentum.*1\.0'):
        LocalSGDRule(0.04, adaptive=True, ms_momentum=1.0)


def test_dc_lambda_with_rule_object():
    rule_obj = MirrorRule(0.1)
    with pytest.raises(ValueError, match=r'dc_lambda=0\.2.*MirrorRule'):
        create_rule(rule_obj, 0.2)


class HalfStep(LocalRule):
    """A custom rule: w := w - lr/2 * g."""

    def update(self, weight, grad, grad_sync, state, ctx):
        weight[:] = weight - 0.5 * ctx.lr * ctx.rescale_grad * grad


def test_custom_rule_object_is_used_as_given():
    rule_obj = HalfStep()
    assert create_rule(rule_obj) is rule_obj
    assert rule_obj.needs_grad_sync is False
    weight = nd.array(np.ones(4, F32))
    assert rule_obj.create_state(weight, weight) is None
    rule_obj.update(weight, nd.array(np.full(4, 2.0, F32)), None, None,
                    RuleContext(0.5, 0.0, 0.0, -1.0, 1.0, 1))
    np.testing.assert_allclose(weight.asnumpy(), np.full(4, 0.5), **TOL)
    assert 'HalfStep' in repr(rule_obj)


@pytest.mark.parametrize('num_workers', [1, 3])
@pytest.mark.parametrize('wd', [0.0, 0.05])
def test_mirror_dc_term_with_adam(wd, num_workers):
    # dc_lambda with a non-SGD mirror: the local Adam copy gets N * g_dc, g_dc = g + lam*g*g*
    # grad_sync (g = rescale * raw), its update count continuing the servers' (docs/design.md
    # §1.4). Closed form: MXNet 1.9.1's adam_update as pinned in tests/reference.py.
    lam, rescale, b1, b2, eps = 0.5, 0.25, 0.9, 0.999, 1e-8
    w, raws, syncs, _ = make_inputs(seed=11)
    rule = create_rule('mirror', lam)
    optimizer = mx.optimizer.Adam(learning_rate=LR, wd=wd, beta1=b1, beta2=b2, epsilon=eps)
    rule.check_optimizer(optimizer)
    rule.start(optimizer)
    weight = nd.array(w)
    state = rule.create_state_for(0, weight, nd.zeros(SHAPE))
    assert not isinstance(state, nd.NDArray)         # Adam's (mean, var): the general path
    mean = np.zeros(SHAPE, F32)
    var = np.zeros(SHAPE, F32)
    want_w = w.copy()
    compensation_moved = False
    for t, (raw, sync) in enumerate(zip(raws, syncs)):
        ctx = RuleContext(lr=LR, wd=wd, momentum=0.0, clip_gradient=-1.0, rescale_grad=rescale,
                          num_workers=num_workers, index=0, step=t)
        rule.update(weight, nd.array(raw), nd.array(sync), state, ctx)
        g = F32(rescale) * raw
        g_dc = g + F32(lam) * g * g * sync
        lr_t = reference.adam_lr(LR, t + 1, b1, b2)
        plain = reference.adam_step(want_w, g, mean, var, lr_t, F32(wd), F32(num_workers),
                                    F32(b1), F32(b2), F32(eps))[0]
        want_w, mean, var = reference.adam_step(want_w, g_dc, mean, var, lr_t, F32(wd),
                                                F32(num_workers), F32(b1), F32(b2), F32(eps))
        np.testing.assert_allclose(weight.asnumpy(), want_w, err_msg='step %d' % t, **TOL)
        compensation_moved |= np.abs(plain - want_w).max() > 1e-4
    assert compensation_moved   # the tolerance resolves the compensation term
