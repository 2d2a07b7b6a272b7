"""The 'mirror' local rule for every optimizer it accepts (docs/design.md §1.4), in one
process with a real ``DistDelay`` over the in-process native stand-in (one worker, mxdelay's
real server in process; support/native.py).

What is tested:

- the one-worker invariant: with N = 1, lam = 0 and local_lr None, ``w'`` equals the
  server's ``W`` at every step, for every accepted optimizer and k in {1, 2, 4}. The local
  optimizer continues the server's state (fetched at the switch) with the server's update
  counts, so for every optimizer but plain SGD the local step is the server's arithmetic on
  the same numbers: bit for bit (``assert_array_equal``). Plain SGD keeps its single-kernel
  path, whose momentum buffer starts at ``W_{W+1} - W_W`` instead of the server's buffer:
  equal up to float32 rounding (rtol 1e-6, atol 1e-6; largest measured 2.4e-7);
- the same with an lr scheduler, clip_gradient, lr_mult/wd_mult and two devices, and with
  float16 weights and ``multi_precision`` (a float32 master copy, fetched too);
- refusals at construction, naming the optimizer and what to use instead;
- the store side: state keys in the layout, the server's copy of a chunk's state;
- save and load in the delayed phase (the rule state is a tuple of arrays) resume bit for bit.
"""
import re

import numpy as np
import pytest

import mxdelay
import mxnet as mx
from mxnet import nd

from support.model import (BATCH, backward_at, backward_with, mlp_params as make_params,
                           numpy_grad, train_steps)
from support.native import delay_store, events, server_optimizer, server_weights
from support.native_workers import run_workers
from kvstore_ext.protocol.keys import KeyLayout
from kvstore_ext.optim.optimizers import flatten_state
from kvstore_ext.server.rounds import RoundKeeper
from mxdelay.rules import MIRRORED, MirrorRule

WARMUP = 3
NAMES = ('w1', 'b1', 'w2', 'b2')

#: name -> (optimizer, its parameters): every optimizer the mirror accepts.
OPTIMIZERS = {
    'sgd': ('sgd', {'learning_rate': 0.1, 'momentum': 0.9}),
    'sgd-plain': ('sgd', {'learning_rate': 0.1}),
    'nag': ('nag', {'learning_rate': 0.1, 'momentum': 0.9}),
    'adam': ('adam', {'learning_rate': 0.01}),
    # Frozen two steps into the delayed phase (WARMUP 3): both halves are mirrored.
    'frozenvarianceadam': ('frozenvarianceadam', {'learning_rate': 0.01, 'freeze_after': 5}),
    'rmsprop': ('rmsprop', {'learning_rate': 0.01}),
    'rmsprop-centered': ('rmsprop', {'learning_rate': 0.01, 'centered': True}),
    'adagrad': ('adagrad', {'learning_rate': 0.05}),
    'adadelta': ('adadelta', {}),
    'ftrl': ('ftrl', {'learning_rate': 0.05}),
    'signum': ('signum', {'learning_rate': 0.01, 'momentum': 0.9}),
    'adamax': ('adamax', {'learning_rate': 0.01}),
    'ftml': ('ftml', {'learning_rate': 0.01}),
    'ccsgd': ('ccsgd', {'learning_rate': 0.1, 'momentum': 0.9}),
    # Whole-tensor norms: the servers keep each tensor in one chunk (docs/design.md §1.4).
    'lamb': ('lamb', {'learning_rate': 0.01}),
    'lars': ('lars', {'learning_rate': 0.1, 'momentum': 0.9, 'momentum_correction': False}),
    # momentum_correction=True (LARS's default), without an lr_scheduler: the servers' ratio
    # is 1 at every call, and so is the local copy's
    # (mxdelay.rules.feeds.LarsMomentumCorrection).
    'lars-mc': ('lars', {'learning_rate': 0.1, 'momentum': 0.9}),
    # batch_scale=1, without an lr_scheduler; 'lars' reads whole-tensor norms.
    'lbsgd': ('lbsgd', {'learning_rate': 0.1, 'momentum': 0.9}),
    'lbsgd-lars': ('lbsgd', {'learning_rate': 0.1, 'momentum': 0.9, 'warmup_strategy': 'lars'}),
}
#: The optimizers mirrored only without an lr_scheduler (docs/design.md §1.4).
UNSCHEDULED = ('lars-mc', 'lbsgd', 'lbsgd-lars')
#: Largest |w' - W| per (optimizer name, k), filled by the invariant test (reported with -s).
MAX_DIFFERENCE = {}


@mx.optimizer.register   # the servers build it by name (commands hold no pickles)
class MyAdam(mx.optimizer.Adam):
    """A subclass of a mirrored optimizer (module level: the servers unpickle it)."""


def train(optimizer, optimizer_params, delay, steps, ctxs=None, dtype='float32', **kwargs):
    """Yield (step, name, w', W) for every step and parameter of a one-worker training."""
    ctxs = ctxs or [mx.cpu()]
    lr_mult, wd_mult = kwargs.pop('lr_mult', None), kwargs.pop('wd_mult', None)
    params = make_params(ctxs, dtype, lr_mult, wd_mult)
    kv = delay_store()
    trainer = mxdelay.DelayedTrainer(params, optimizer, dict(optimizer_params), kvstore=kv,
                                     delay=delay, warmup_steps=WARMUP, **kwargs)
    for step in range(steps):
        backward_at(params, ctxs, step)
        trainer.step(BATCH)
        for i, p in enumerate(params):
            for other in p.list_data()[1:]:
                np.testing.assert_array_equal(other.asnumpy(), p.data(ctxs[0]).asnumpy())
            yield step, p.name, p.data(ctxs[0]).asnumpy(), server_weights(kv, i)
    fetched = sorted({key for _, key in events(kv, kinds=('state',))})   # the state keys' rounds
    assert fetched == [0, 1, 2, 3] or optimizer in ('sgd',), fetched


def check_invariant(name, delay, exact, **kwargs):
    optimizer, optimizer_params = OPTIMIZERS[name]
    worst = 0.0
    moved = False
    for step, pname, local, glob in train(optimizer, optimizer_params, delay,
                                          WARMUP + 3 * delay + 3, **kwargs):
        worst = max(worst, float(np.max(np.abs(local.astype(np.float64) - glob))))
        moved = moved or step > WARMUP
        if exact:
            np.testing.assert_array_equal(local, glob, err_msg='step %d, %s' % (step, pname))
        else:
            np.testing.assert_allclose(local, glob, rtol=1e-6, atol=1e-6,
                                       err_msg='step %d, %s' % (step, pname))
    assert moved
    return worst


@pytest.mark.parametrize('delay', [1, 2, 4])
@pytest.mark.parametrize('name', sorted(OPTIMIZERS))
def test_one_worker_local_weights_are_the_global_weights(name, delay):
    # SGD (exactly mx.optimizer.SGD) keeps the single-kernel path: float32 rounding only.
    exact = OPTIMIZERS[name][0] != 'sgd'
    worst = check_invariant(name, delay, exact)
    MAX_DIFFERENCE[(name, delay)] = worst
    print('\nmirror invariant: %-17s k=%d  max |w\' - W| = %.3g' % (name, delay, worst))


@pytest.mark.parametrize('name', ['adam', 'nag', 'rmsprop-centered', 'ftml', 'sgd', 'lamb',
                                  'lars', 'lars-mc', 'lbsgd', 'lbsgd-lars',
                                  'frozenvarianceadam'])
def test_invariant_with_schedule_clipping_multipliers_and_two_devices(name):
    # LARS with momentum_correction and LBSGD without the schedule (refused with one); the
    # multipliers are what LARS's correction would see without mxdelay.rules'
    # _LarsMomentumCorrection (a ratio of lr_mult 0.5 / 1 and 2 / 1 at every step).
    optimizer, optimizer_params = OPTIMIZERS[name]
    params = dict(optimizer_params, wd=1e-3, clip_gradient=0.05)
    if name not in UNSCHEDULED:
        params['lr_scheduler'] = mx.lr_scheduler.FactorScheduler(step=3, factor=0.5)
    OPTIMIZERS['_case'] = (optimizer, params)
    try:
        check_invariant('_case', 3, optimizer != 'sgd', ctxs=[mx.cpu(0), mx.cpu(1)],
                        lr_mult={'w1': 0.5, 'b2': 2.0}, wd_mult={'b1': 0.0})
    finally:
        del OPTIMIZERS['_case']


@pytest.mark.parametrize('name', ['adam', 'sgd', 'nag', 'frozenvarianceadam'])
def test_invariant_with_float16_weights_and_multi_precision(name):
    # The servers keep a float32 master copy; the local optimizer too (fetched with the
    # state), and it is applied to the float16 weights as on the servers: bit for bit.
    optimizer, optimizer_params = OPTIMIZERS[name]
    OPTIMIZERS['_case'] = (optimizer, dict(optimizer_params, multi_precision=True))
    try:
        check_invariant('_case', 2, True, dtype='float16')
    finally:
        del OPTIMIZERS['_case']


def _trajectory(num_workers, optimizer, optimizer_params, delay, steps, scale):
    """Every worker's weights after every step of a job of `num_workers` workers in one
    process (support/native_workers.py), each worker's gradient `scale` times mlp_model's
    gradient of worker 0 at step t; and the servers' final W."""
    def train_one(rank, store):
        ctxs = [mx.cpu()]
        params = make_params(ctxs)
        trainer = mxdelay.DelayedTrainer(params, optimizer, dict(optimizer_params),
                                         kvstore=store, delay=delay, warmup_steps=WARMUP)
        out = []
        for step in range(steps):
            weights = {p.name: p.data().asnumpy() for p in params}
            backward_with(params, ctxs, {name: scale * g for name, g in
                                         numpy_grad(weights, 0, step).items()})
            trainer.step(BATCH)
            out.append([p.data().asnumpy() for p in params])
        return out, store
    _, results = run_workers(num_workers, train_one)
    store = results[0][1]
    return [r[0] for r in results], [server_weights(store, i) for i in range(len(NAMES))]


@pytest.mark.parametrize('name', ['lars-mc', 'lbsgd-lars', 'lamb', 'adam'])
def test_two_workers_with_equal_gradients_are_one_worker_with_twice_the_gradient(name):
    # Two workers whose gradients are both g: the servers sum g + g = 2g, and each worker's
    # mirror applies the servers' optimizer to N * g = 2g, the same numbers (scaling by 2 is
    # exact). Their weights are then those of one worker whose gradient is 2g (where
    # w' = W), bit for bit at every step: a check of how each feed scales the worker's
    # gradient by N (LBSGD 'lars' reads the norm of the raw gradient: without
    # mxdelay.rules.feeds.RawGradientNorms its ratio would see g, not the servers' 2g).
    optimizer, optimizer_params = OPTIMIZERS[name]
    steps = WARMUP + 2 * 3 + 2
    two, two_final = _trajectory(2, optimizer, optimizer_params, 3, steps, 1.0)
    one, one_final = _trajectory(1, optimizer, optimizer_params, 3, steps, 2.0)
    moved = False
    for step in range(steps):
        for i, pname in enumerate(NAMES):
            want = one[0][step][i]
            moved = moved or (step > WARMUP and (want != one[0][WARMUP][i]).any())
            for rank in range(2):
                np.testing.assert_array_equal(two[rank][step][i], want, err_msg='worker %d, '
                                              'step %d, %s' % (rank, step, pname))
    assert moved
    for got, want in zip(two_final, one_final):
        np.testing.assert_array_equal(got, want)


def test_local_optimizer_is_a_copy_with_n_times_rescale_grad():
    params = make_params([mx.cpu()])
    kv = delay_store()
    trainer = mxdelay.DelayedTrainer(params, 'adam', {'learning_rate': 0.01}, kvstore=kv,
                                     delay=2, warmup_steps=1)
    for step in range(4):
        backward_at(params, [mx.cpu()], step)
        trainer.step(BATCH)
    local = trainer._delayed.rule._local  # pylint: disable=protected-access
    assert local is not trainer.optimizer and type(local) is mx.optimizer.Adam
    assert local.rescale_grad == 1.0 / BATCH          # N = 1
    assert local._index_update_count[0] == 4          # rounds 0..3 applied
    assert server_optimizer(kv)._index_update_count[0] == 4
    assert trainer.optimizer._index_update_count == {}   # the trainer's is untouched


# -- refusals --------------------------------------------------------------------------------
REFUSED = [
    ('nadam', 'Nadam', r"m_schedule .* in the order the chunks' rounds complete, .* "
                       r"optimizer='adam' or 'nag'"),
    ('dcasgd', 'DCASGD', r"local_rule='dc'"),
    ('sgld', 'SGLD', r'random noise'),
    ('groupadagrad', 'GroupAdaGrad', r'none of the optimizers'),
    ('test', 'Test', r'none of the optimizers'),
]


@pytest.mark.parametrize('optimizer,name,why', REFUSED, ids=[r[0] for r in REFUSED])
def test_refused_at_construction_naming_it_and_what_to_use(optimizer, name, why):
    with pytest.raises(ValueError) as info:
        mxdelay.DelayedTrainer(make_params([mx.cpu()]), optimizer, {}, kvstore=delay_store())
    message = str(info.value)
    assert 'cannot mirror %s' % name in message
    assert re.search(why, message), message
    assert "local_rule='sgd'" in message and "gluon.Trainer on kvstore='dist_delay'" in message


def _schedule():
    return mx.lr_scheduler.FactorScheduler(step=3, factor=0.5)


#: (optimizer, params, what the message says) of the settings refused for LARS and LBSGD.
REFUSED_SETTINGS = [
    ('lars', {'momentum': 0.9, 'lr_scheduler': _schedule},
     r'cannot mirror LARS with momentum_correction=True and an lr_scheduler: .* only the '
     r"chunk that a server updates first gets the ratio, .* in the order in which the chunks' "
     r'rounds complete, .* Without an lr_scheduler the ratio is 1 at every call and the mirror '
     r'is exact\. Pass momentum_correction=False'),
    ('lbsgd', {'momentum': 0.9, 'lr_scheduler': _schedule},
     r'cannot mirror LBSGD with an lr_scheduler: it reads its learning rate before it counts '
     r"the update, .* the chunk that a server updates first gets the schedule's previous "
     r'value and the others the current one; .* drop the lr_scheduler'),
    ('lbsgd', {'momentum': 0.9, 'warmup_strategy': 'lars', 'batch_scale': 2},
     r"cannot mirror LBSGD with batch_scale=2: it sums batch_scale rounds' gradients before "
     r"each update, .* not in its state, which the switch cannot fetch .* Use batch_scale=1"),
]


@pytest.mark.parametrize('optimizer,params,why', REFUSED_SETTINGS,
                         ids=['lars-mc-schedule', 'lbsgd-schedule', 'lbsgd-batch-scale'])
def test_settings_of_lars_and_lbsgd_that_the_servers_apply_by_order_are_refused(
        optimizer, params, why):
    params = {k: v() if callable(v) else v for k, v in params.items()}
    with pytest.raises(ValueError, match=why) as info:
        mxdelay.DelayedTrainer(make_params([mx.cpu()]), optimizer, params,
                               kvstore=delay_store())
    assert "local_rule='sgd'" in str(info.value)
    assert "gluon.Trainer on kvstore='dist_delay'" in str(info.value)


@pytest.mark.parametrize('params', [
    {'momentum': 0.9, 'momentum_correction': False, 'lr_scheduler': _schedule},
    {'momentum': 0.0, 'lr_scheduler': _schedule},    # no momentum: nothing to correct
    {'momentum': 0.9}], ids=['no-correction', 'no-momentum', 'no-schedule'])
def test_lars_is_accepted_where_its_correction_is_deterministic(params):
    # Accepted, and mirrored exactly: with one worker w' is the servers' W at every step.
    params = {k: v() if callable(v) else v for k, v in params.items()}
    weights = make_params([mx.cpu()])
    kv = delay_store()
    trainer = mxdelay.DelayedTrainer(weights, 'lars', params, kvstore=kv, delay=2,
                                     warmup_steps=WARMUP)
    for step in range(WARMUP + 7):
        backward_at(weights, [mx.cpu()], step)
        trainer.step(BATCH)
        for i, p in enumerate(weights):
            np.testing.assert_array_equal(p.data().asnumpy(), server_weights(kv, i),
                                          err_msg='step %d, %s' % (step, p.name))


def test_refused_optimizer_is_accepted_by_the_literal_rule():
    # The mirror refuses Nadam (REFUSED); the literal rule takes it. The servers then apply
    # Nadam, every warm-up step's weights are theirs, and a delayed step that applies no
    # pull is MXNet's plain SGD step with Nadam's learning rate (0.001) on g / batch.
    params = make_params([mx.cpu()])
    kv = delay_store()
    trainer = mxdelay.DelayedTrainer(params, 'nadam', {}, kvstore=kv, local_rule='sgd',
                                     delay=2, warmup_steps=WARMUP)
    for step in range(WARMUP + 1):   # the warm-up and the switch
        backward_at(params, [mx.cpu()], step)
        trainer.step(BATCH)
        for i, p in enumerate(params):
            np.testing.assert_array_equal(p.data().asnumpy(), server_weights(kv, i),
                                          err_msg='step %d, %s' % (step, p.name))
    assert isinstance(server_optimizer(kv), mx.optimizer.Nadam)
    before = [p.data().copy() for p in params]
    backward_at(params, [mx.cpu()], WARMUP + 1)   # the first delayed step: no pull applied
    grads = [p.grad().copy() for p in params]
    trainer.step(BATCH)
    for p, weight, grad in zip(params, before, grads):
        want = nd.sgd_update(weight, grad, lr=0.001, wd=0.0, rescale_grad=1.0 / BATCH)
        np.testing.assert_array_equal(p.data().asnumpy(), want.asnumpy(), err_msg=p.name)


def test_subclass_of_a_mirrored_optimizer_is_accepted_and_mirrored():
    params = make_params([mx.cpu()])
    kv = delay_store()
    trainer = mxdelay.DelayedTrainer(params, MyAdam(learning_rate=0.01), kvstore=kv, delay=2,
                                     warmup_steps=1)
    for step in range(6):
        backward_at(params, [mx.cpu()], step)
        trainer.step(BATCH)
        for i, p in enumerate(params):
            np.testing.assert_array_equal(p.data().asnumpy(), server_weights(kv, i))


def test_state_that_is_not_elementwise_is_refused():
    class RowState(mx.optimizer.AdaGrad):
        def create_state(self, index, weight):
            return nd.zeros((weight.shape[0], 1))
    with pytest.raises(ValueError, match=r'cannot mirror RowState: its optimizer state is not '
                                         r'elementwise'):
        mxdelay.DelayedTrainer(make_params([mx.cpu()]), RowState(), kvstore=delay_store())


def test_every_mirrored_name_is_an_mxnet_optimizer():
    assert {n.lower() for n in MIRRORED} <= set(mx.optimizer.Optimizer.opt_registry)


# -- the store side ----------------------------------------------------------------------------
@pytest.mark.parametrize('num_servers', [1, 3])
def test_state_keys_follow_the_slots_and_leave_j0_keys_unchanged(num_servers):
    plain, layout = KeyLayout(num_servers, 3), KeyLayout(num_servers, 3, state_keys=2)
    seen = set()
    for chunk in range(5):
        server = chunk % num_servers
        assert plain.decode(plain.slot_key(chunk, 1, server)) == ('slot', chunk, 1)
        for slot in range(3):
            key = layout.slot_key(chunk, slot, server)
            assert layout.decode(key) == ('slot', chunk, slot)
            assert layout.server_of(key) == server
            seen.add(key)
        for j in range(2):
            key = layout.state_key(chunk, j, server)
            assert layout.decode(key) == ('state', chunk, j)
            assert layout.server_of(key) == server
            seen.add(key)
    assert len(seen) == 5 * 5
    assert layout.status_key(0) == plain.status_key(0)
    with pytest.raises(ValueError, match='has 2 state keys per chunk'):
        layout.state_key(0, 2, 0)


def test_server_writes_a_chunks_state_into_the_state_key():
    rounds = RoundKeeper(slots=2)
    rounds.updates.install(mx.optimizer.Adam(learning_rate=0.01))
    stored = nd.array([1.0, 2.0, 3.0])
    rounds.on_round(7, 0, nd.array([0.5, -1.0, 2.0]), stored)
    mean, var = rounds.updates.updater.states[7]
    for j, want in enumerate((mean, var)):
        out = nd.zeros(3)
        rounds.updates.copy_state(7, j, out)
        np.testing.assert_array_equal(out.asnumpy(), want.asnumpy())
    with pytest.raises(ValueError, match='has 2 arrays'):
        rounds.updates.copy_state(7, 2, nd.zeros(3))


def test_flatten_state_order():
    a, b, c = nd.zeros(1), nd.ones(1), nd.zeros(2)
    assert flatten_state(None) == []
    assert flatten_state((a, (b, None), [c])) == [a, b, c]
    with pytest.raises(TypeError):
        flatten_state((a, 3))


# -- checkpoints -------------------------------------------------------------------------------
def test_delayed_save_and_load_with_adam_resume_bit_for_bit(tmp_path):
    args = dict(delay=3, warmup_steps=1)
    opt = {'learning_rate': 0.01, 'wd': 1e-3}
    params = make_params([mx.cpu()])
    full = train_steps(mxdelay.DelayedTrainer(params, 'adam', dict(opt), kvstore=delay_store(),
                                              **args), params, 0, 10)
    params = make_params([mx.cpu()])
    trainer = mxdelay.DelayedTrainer(params, 'adam', dict(opt), kvstore=delay_store(), **args)
    train_steps(trainer, params, 0, 5)
    trainer.save_states(str(tmp_path / 'ckpt'))
    params2 = make_params([mx.cpu()])
    trainer2 = mxdelay.DelayedTrainer(params2, 'adam', dict(opt), kvstore=delay_store(),
                                      **args)
    trainer2.load_states(str(tmp_path / 'ckpt'))
    resumed = train_steps(trainer2, params2, 5, 5)
    for t, (got, want) in enumerate(zip(resumed, full[5:])):
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w, err_msg='step %d' % (5 + t))


def test_mirror_rule_alone_is_the_sgd_momentum_rule():
    # Without a trainer (not started) MirrorRule is the single-kernel SGD-momentum rule.
    assert isinstance(mxdelay.rules.create_rule('mirror'), MirrorRule)
