"""mxdelay.FrozenVarianceAdam (docs/design.md §1.4), one process, against MXNet's Adam and a
float64 closed form.

Its updates 1 to ``freeze_after`` are MXNet's Adam bit for bit; later ones keep the second
moment (bit for bit where Adam's bound ``v >= (1 - beta2) g^2`` holds, raised to it where it
does not) and its bias correction, and move the first moment and the weights as Adam does. The mirror and distributed runs are in test_mirror.py (one-worker invariant) and
test_trainer_distributed.py (2 and 3 workers against tests/reference.py).
"""
import pickle

import numpy as np
import pytest

import mxnet as mx

from kvstore_ext.optim.optimizers import build_optimizer, optimizer_record
from mxdelay import ArgumentTypeError
from mxdelay import FrozenVarianceAdam

SHAPE = (5, 3)
STEPS = 8
PARAMS = dict(learning_rate=0.01, wd=1e-3, rescale_grad=0.5)


def gradient(step, index=0):
    return mx.nd.array(np.random.RandomState(100 * index + step).randn(*SHAPE))


def run(optimizer, steps=STEPS, index=0):
    """(weight, mean, var) as numpy after every update of one weight by `optimizer`."""
    weight = mx.nd.array(np.random.RandomState(7).randn(*SHAPE))
    state = optimizer.create_state(index, weight)
    out = []
    for step in range(steps):
        optimizer.update(index, weight, gradient(step, index), state)
        out.append((weight.asnumpy(), state[0].asnumpy(), state[1].asnumpy()))
    return out


@pytest.mark.parametrize('extra', [{}, {'clip_gradient': 0.3}, {'beta1': 0.8, 'beta2': 0.99}])
def test_updates_up_to_freeze_after_are_mxnet_adam_bit_for_bit(extra):
    frozen = run(FrozenVarianceAdam(freeze_after=4, **PARAMS, **extra))
    adam = run(mx.optimizer.Adam(**PARAMS, **extra))
    for step in range(STEPS):
        same = all(np.array_equal(f, a) for f, a in zip(frozen[step], adam[step]))
        assert same == (step < 4), step


def closed_form(freeze_after, lr=0.01, wd=1e-3, rescale=0.5, b1=0.9, b2=0.999, eps=1e-8):
    """The docstring's rule in float64; also how many values the bound raised."""
    w = np.random.RandomState(7).randn(*SHAPE)
    m, v, out, raised = np.zeros(SHAPE), np.zeros(SHAPE), [], 0
    for step in range(STEPS):
        t = step + 1
        g = rescale * gradient(step).asnumpy().astype(np.float64) + wd * w
        m = b1 * m + (1 - b1) * g
        if t <= freeze_after:
            v = b2 * v + (1 - b2) * g * g
        else:
            raised += int(((1 - b2) * g * g > v).sum())
            v = np.maximum(v, (1 - b2) * g * g)
        lr_t = lr * np.sqrt(1 - b2 ** min(t, freeze_after)) / (1 - b1 ** t)
        w = w - lr_t * m / (np.sqrt(v) + eps)
        out.append((w, m, v))
    return out, raised


def test_frozen_updates_follow_the_closed_form():
    got = run(FrozenVarianceAdam(freeze_after=3, **PARAMS))
    want, raised = closed_form(3)
    assert 0 < raised < 5 * SHAPE[0] * SHAPE[1]    # the bound moved some values, kept others
    for step, (w, h) in enumerate(zip(want, got)):
        for name, expected, have in zip(('weight', 'mean', 'var'), w, h):
            np.testing.assert_allclose(have, expected, rtol=1e-5, atol=1e-7,
                                       err_msg='update %d, %s' % (step + 1, name))
        if step >= 3:
            var, held = h[2], got[step - 1][2]
            kept = var == held                       # bit for bit, or raised
            assert (var[~kept] > held[~kept]).all()
            assert not np.array_equal(h[1], got[step - 1][1])  # m still moves


def test_the_bound_keeps_steps_near_the_learning_rate_after_the_freeze():
    # Column 0's gradients are 0 up to the freeze (v = 0 there: nothing measured), column 1's
    # are 1e-4 of the others' (v nearly 0). After the freeze both get full gradients: v rises
    # to (1 - beta2) g^2, Adam's own bound, and the steps stay Adam-sized, where sqrt(v) +
    # epsilon of the warm-up would make them some 1e4 times the learning rate.
    optimizer = FrozenVarianceAdam(freeze_after=3, learning_rate=0.01)
    weight = mx.nd.zeros(SHAPE)
    state = optimizer.create_state(0, weight)
    scale = np.ones(SHAPE, np.float32)
    scale[:, 0], scale[:, 1] = 0, 1e-4
    for step in range(6):
        grad = gradient(step).asnumpy() * (scale if step < 3 else 1)
        before, held = weight.asnumpy(), state[1].asnumpy()
        optimizer.update(0, weight, mx.nd.array(grad), state)
        var = state[1].asnumpy()
        if step < 3:
            assert (var[:, 0] == 0).all() and (var[:, 1:] > 0).all()
            continue
        np.testing.assert_array_equal(var, np.maximum(held, np.float32(0.001) * grad ** 2))
        assert (var[:, :2] > held[:, :2]).all() if step == 3 else True
        assert np.abs(weight.asnumpy() - before).max() < 0.1   # /sqrt(v) of the warm-up: 1e2


def test_sparse_gradients_are_refused():
    optimizer = FrozenVarianceAdam(freeze_after=1)
    weight = mx.nd.ones(SHAPE)
    grad = mx.nd.sparse.row_sparse_array((np.ones((1, 3)), [1]), shape=SHAPE)
    with pytest.raises(ValueError, match="dense gradients only, got a row_sparse gradient for "
                                         "the weight of index 0; use optimizer 'adam'"):
        optimizer.update(0, weight, grad, optimizer.create_state(0, weight))


@pytest.mark.parametrize('value,error,match', [
    (0, ValueError, 'freeze_after must be an integer >= 1, got 0'),
    (-3, ValueError, 'freeze_after must be an integer >= 1, got -3'),
    (200.0, ArgumentTypeError, r'freeze_after must be an integer >= 1, got 200\.0'),
    (True, ArgumentTypeError, 'freeze_after must be an integer >= 1, got True'),
    (None, ArgumentTypeError, 'freeze_after must be an integer >= 1, got None'),
])
def test_bad_freeze_after_is_refused(value, error, match):
    with pytest.raises(error, match=match) as info:
        FrozenVarianceAdam(freeze_after=value)
    assert 'warmup_steps' in str(info.value)      # the fix
    with pytest.raises(TypeError, match='freeze_after'):
        FrozenVarianceAdam()                          # no default: the freeze is a choice


def test_registered_pickled_and_checkpointed_by_name():
    optimizer = mx.optimizer.create('frozenvarianceadam', freeze_after=2, **PARAMS)
    assert type(optimizer) is FrozenVarianceAdam and optimizer.freeze_after == 2
    want = run(FrozenVarianceAdam(freeze_after=2, **PARAMS))
    for copy in (lambda o: pickle.loads(pickle.dumps(o)),
                 lambda o: build_optimizer(optimizer_record(o))):
        # Half way through (update 2 of 4 done), a copy continues bit for bit.
        optimizer = FrozenVarianceAdam(freeze_after=2, **PARAMS)
        weight = mx.nd.array(np.random.RandomState(7).randn(*SHAPE))
        state = optimizer.create_state(0, weight)
        for step in range(STEPS):
            if step == 2:
                optimizer = copy(optimizer)
            optimizer.update(0, weight, gradient(step), state)
            np.testing.assert_array_equal(weight.asnumpy(), want[step][0])


def test_reference_step_is_the_optimizer_bit_for_bit():
    # tests/reference.py's frozen_adam_step (the numpy reference of the distributed tests)
    # against the optimizer, across the freeze, with wd and a coordinate unmeasured until
    # after it (v = 0 raised to the bound).
    import reference  # pylint: disable=import-outside-toplevel
    f32 = np.float32
    optimizer = FrozenVarianceAdam(freeze_after=3, **PARAMS)
    opt = dict(freeze_after=3, b1=f32(0.9), b2=f32(0.999), eps=f32(1e-8), beta2=0.999)
    start = np.random.RandomState(7).randn(*SHAPE)
    start[:, 0] = 0     # with a zero gradient, wd * w is 0 too: v stays 0 until update 6
    weight = mx.nd.array(start)
    state = optimizer.create_state(0, weight)
    w, m, v = weight.asnumpy(), np.zeros(SHAPE, f32), np.zeros(SHAPE, f32)
    for step in range(STEPS):
        grad = gradient(step).asnumpy()
        grad[:, 0] *= step >= 5
        assert (state[1].asnumpy()[:, 0] == 0).all() == (step <= 5)
        optimizer.update(0, weight, mx.nd.array(grad), state)
        lr = reference.adam_lr(0.01, step + 1, 0.9, 0.999, 3)
        w, m, v = reference.frozen_adam_step(opt, step + 1, w, grad, m, v, lr, f32(1e-3),
                                             f32(0.5))
        for have, want in zip((weight, state[0], state[1]), (w, m, v)):
            np.testing.assert_array_equal(have.asnumpy(), want, err_msg='update %d' % (step + 1))
