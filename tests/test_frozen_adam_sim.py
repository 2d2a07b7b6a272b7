"""benchmarks/frozen_adam_sim.py simulates the optimizers it names: its numpy update against
MXNet's Adam and mxdelay.FrozenVarianceAdam across the freeze, and its summary."""
import os
import sys

import numpy as np
import pytest

import mxnet as mx

from mxdelay import FrozenVarianceAdam

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                'benchmarks'))
import frozen_adam_sim as sim  # noqa: E402  pylint: disable=wrong-import-position

SHAPE = (4, 3)


def _gradient(step):
    g = np.random.RandomState(step).randn(*SHAPE).astype(np.float32)
    g[0, 0] = 0.0 if step < sim.WARMUP else 50.0     # silent in the warm-up, large after it
    g[0, 1] *= 1e-4 if step < sim.WARMUP else 1.0      # nearly silent, then grows
    return g


@pytest.mark.parametrize('rule, optimizer', [
    ('adam', lambda: mx.optimizer.Adam(learning_rate=sim.LR, rescale_grad=1.0 / sim.BATCH)),
    ('bound', lambda: FrozenVarianceAdam(freeze_after=sim.WARMUP, learning_rate=sim.LR,
                                         rescale_grad=1.0 / sim.BATCH)),
])
def test_update_is_the_optimizer_across_the_freeze(rule, optimizer):
    optimizer = optimizer()
    start = np.random.RandomState(7).randn(*SHAPE).astype(np.float32)
    weight, w = mx.nd.array(start), start.copy()
    state = optimizer.create_state(0, weight)
    m, v = np.zeros(SHAPE, np.float32), np.zeros(SHAPE, np.float32)
    for step in range(sim.WARMUP + 5):
        g = _gradient(step)
        optimizer.update(0, weight, mx.nd.array(g), state)
        sim.adam_update(w, g, m, v, step + 1, rule, 1.0 / sim.BATCH)
        # The simulation's 1 - beta is float32(1) - float32(beta) (4.7e-5 off MXNet's
        # float32(1 - beta2)): a rounding, not another rule.
        np.testing.assert_allclose(w, weight.asnumpy(), rtol=1e-4, atol=1e-6,
                                   err_msg='update %d' % (step + 1))
        np.testing.assert_allclose(v, state[1].asnumpy(), rtol=5e-5, atol=1e-12)


def test_fill_keeps_v_but_its_zeros():
    w, m, v = np.zeros(SHAPE, np.float32), np.zeros(SHAPE, np.float32), np.zeros(SHAPE, np.float32)
    for step in range(sim.WARMUP):
        sim.adam_update(w, _gradient(step), m, v, step + 1, 'fill', 1.0)
    frozen = v.copy()
    assert frozen[0, 0] == 0 and (frozen.ravel()[1:] > 0).all()
    sim.adam_update(w, _gradient(sim.WARMUP), m, v, sim.WARMUP + 1, 'fill', 1.0)
    assert v[0, 0] > 0
    np.testing.assert_array_equal(v.ravel()[1:], frozen.ravel()[1:])   # [0, 1] too: no bound


def test_summary_and_report(tmp_path):
    records = [
        {'rule': 'fill', 'seed': 1, 'step': 210, 'loss': [0.3, 0.4], 'max_ratio': [5.0, 9.0]},
        {'rule': 'fill', 'seed': 1, 'diverged_at': 219, 'loss': [41.0, 0.7]},
        {'rule': 'bound', 'seed': 1, 'step': 210, 'loss': [0.3, 0.4], 'max_ratio': [2.0, 3.0]},
        {'rule': 'bound', 'seed': 1, 'epoch': 1, 'accuracy': 0.85},
    ]
    rows = sim.summarize(records)
    assert rows == [
        {'rule': 'fill', 'seed': 1, 'diverged_at': 219, 'accuracy': [], 'max_ratio': 9.0},
        {'rule': 'bound', 'seed': 1, 'diverged_at': None, 'accuracy': [0.85], 'max_ratio': 3.0}]
    sim.write_report(str(tmp_path), records, 'python benchmarks/frozen_adam_sim.py --out x')
    text = (tmp_path / 'results.md').read_text()
    assert '| fill | 1 | 219 | 9 | - |' in text and '| bound | 1 | - | 3 | 0.8500 |' in text
