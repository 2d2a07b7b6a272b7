"""The in-process stand-in for MXNet's native store (support/native.py), which fast tests
use to run the real ``DistDelay`` and mxdelay's real servers in one process.

What is tested: the one-worker invariant through the stand-in: ``DelayedTrainer`` with one
worker (warm-up, switch, delayed phase) trains exactly as ``gluon.Trainer`` on ``'local'``
(w' and the servers' W at every step), for SGD with momentum (float32 rounding: the
mirror's single-kernel path, rtol 1e-6 and atol 1e-6 as in test_mirror.py) and Adam (bit for
bit); and that the stand-in routes keys and records the store's calls.
"""
import numpy as np
import pytest

import mxdelay
import mxnet as mx
from mxnet import gluon

from support.model import BATCH, backward_at, mlp_params
from support.native import delay_store, server_weights

OPTIMIZERS = {'sgd': ('sgd', {'learning_rate': 0.1, 'momentum': 0.9}),
              'adam': ('adam', {'learning_rate': 0.01})}


def check(name, got, want):
    if name == 'sgd':
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    else:
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize('num_servers', [1, 2])
@pytest.mark.parametrize('name', sorted(OPTIMIZERS))
def test_one_worker_delayed_trainer_is_gluon_trainer_on_local(name, num_servers):
    optimizer, opt = OPTIMIZERS[name]
    ctxs = [mx.cpu()]
    local = mlp_params(ctxs)
    reference = gluon.Trainer(local, optimizer, dict(opt), kvstore='local')
    params = mlp_params(ctxs)
    store = delay_store(num_servers)
    trainer = mxdelay.DelayedTrainer(params, optimizer, dict(opt), kvstore=store, delay=2,
                                     warmup_steps=3)
    for step in range(12):
        backward_at(local, ctxs, step)
        reference.step(BATCH)
        backward_at(params, ctxs, step)
        trainer.step(BATCH)
        for i, (want, got) in enumerate(zip(local, params)):
            check(name, got.data().asnumpy(), want.data().asnumpy())
            check(name, server_weights(store, i), want.data().asnumpy())
    assert trainer.schedule.step == 12
    native = store._session.native
    assert {native.server_of(k) for op, keys, _ in native.calls for k in keys} \
        == set(range(num_servers))
    assert all(server.applied_rounds(0) >= 0 for server in native.servers)
