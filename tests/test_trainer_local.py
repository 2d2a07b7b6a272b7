"""``mxdelay.DelayedTrainer`` in one process: non-distributed parity, validation, and the
delayed path through an in-process stand-in for the ``'dist_delay'`` kvstore.

What is tested:

1. Without a distributed kvstore (``kvstore`` None, ``'local'``, ``'device'``; one and two
   CPU contexts ``mx.cpu(0), mx.cpu(1)``) the trainer is ``gluon.Trainer``: the same
   trajectory bit for bit (SGD with momentum and weight decay, a change of batch size and
   of learning rate on the way, and the ``allreduce_grads``/``update`` path), it logs once
   that ``delay`` has no effect, and ``save_states``/``load_states`` write the same file
   as ``gluon.Trainer`` and resume as it does.
2. Constructor validation: each bad argument raises ``ValueError`` at construction, and
   the message names the argument and the value received.
3. The delayed path (warm-up, switch, delayed phase) with a real ``DistDelay`` over an
   in-process native store whose servers are mxdelay's real ones (support/native.py)
   and whose worker is the only one (N = 1; exact rounds are trivial then, and real
   multi-worker jobs are tests/test_trainer_distributed.py's business): the trajectory
   against the numpy reference of docs/design.md §1 (tests/reference.py) on one and two devices, the N = 1
   consequences (``w'`` equals the server's ``W`` at every step for ``'mirror'`` with
   momentum and for ``'sgd'`` without), the pushes and pulls the kvstore sees at each
   step, the phase log, a learning-rate change, and the collective ``save_states`` /
   ``load_states`` (bit-exact resume with a pull pending; refusal of another schedule or a
   foreign file, leaving the trainer unchanged).

Tolerance: the parity tests and the resume are exact (``assert_array_equal``). Against the
numpy reference we allow ``rtol=1e-5, atol=1e-6`` (weights O(0.1-1); the gradients are
injected exactly, so only the update kernels' float32 rounding differs; the largest
difference measured is 1.8e-7), and for the N = 1 invariant (docs/design.md §1.6) ``w' = W``
``rtol=atol=1e-6`` (largest difference measured 2.4e-7, see that test).
"""
import filecmp
import logging

import numpy as np
import pytest

import mxdelay
import mxnet as mx
from mxnet import autograd, gluon, nd

import reference
from support.model import (BATCH, MLP_NAMES as NAMES, backward_with, contexts,
                           mlp_params as make_params, numpy_grad, small_params)
from support.native import delay_store, events, pushes, server_optimizer, server_weights
from kvstore_ext.worker.dist_delay import DistDelay
from scripts import mlp_model
from mxnet.kvstore import KVStoreBase
from mxdelay.rules import LocalRule, MirrorRule


RTOL, ATOL = 1e-5, 1e-6
OPT = {'learning_rate': 0.1, 'momentum': 0.9, 'wd': 1e-3}
TRAINER_LOG = 'mxdelay.trainer'



def weights_of(net):
    """{name: [array on each context]} of a network."""
    return {name: [d.asnumpy() for d in p.list_data()]
            for name, p in net.collect_params().items()}


def assert_same_weights(a, b, what):
    assert a.keys() == b.keys()
    for name in a:
        assert len(a[name]) == len(b[name])
        for dev, (x, y) in enumerate(zip(a[name], b[name])):
            np.testing.assert_array_equal(x, y, err_msg='%s: %s on device %d' % (what, name, dev))


def train_step(net, trainer, ctxs, step, batch=BATCH, manual=False):
    """One step of mlp_job's model on its data for (rank 0, step), split over `ctxs`."""
    x, y = mlp_model.batch(0, step, batch)
    xs = gluon.utils.split_and_load(nd.array(x), ctxs, even_split=False)
    ys = gluon.utils.split_and_load(nd.array(y), ctxs, even_split=False)
    loss_fn = gluon.loss.L2Loss()
    with autograd.record():
        losses = [loss_fn(net(xi), yi) for xi, yi in zip(xs, ys)]
    autograd.backward(losses)
    if manual:
        trainer.allreduce_grads()
        trainer.update(batch)
    else:
        trainer.step(batch)


# -- 1. without a distributed kvstore: exactly gluon.Trainer ----------------------------------
KVSTORES = [None, 'local', 'device']


@pytest.mark.parametrize('num_devices', [1, 2])
@pytest.mark.parametrize('kvstore', KVSTORES)
def test_same_trajectory_as_gluon_trainer(kvstore, num_devices):
    ctxs = contexts(num_devices)
    runs = {}
    for cls, extra in ((gluon.Trainer, {}),
                       (mxdelay.DelayedTrainer, dict(delay=2, warmup_steps=1))):
        net, _ = mlp_model.build(ctxs)
        trainer = cls(net.collect_params(), 'sgd', dict(OPT), kvstore=kvstore, **extra)
        history = []
        for step in range(7):
            if step == 4:
                trainer.set_learning_rate(0.03)
            train_step(net, trainer, ctxs, step, batch=4 if step == 2 else BATCH)
            history.append(weights_of(net))
        assert trainer.learning_rate == 0.03
        runs[cls] = history
    initial = mlp_model.init_params()
    assert not np.array_equal(runs[gluon.Trainer][-1]['l1_weight'][0], initial['w1'])
    for step, (want, got) in enumerate(zip(runs[gluon.Trainer], runs[mxdelay.DelayedTrainer])):
        assert_same_weights(want, got, 'step %d' % step)


def test_allreduce_and_update_like_gluon_trainer():
    ctxs = contexts(2)
    results = []
    for cls in (gluon.Trainer, mxdelay.DelayedTrainer):
        net, _ = mlp_model.build(ctxs)
        trainer = cls(net.collect_params(), 'sgd', dict(OPT), kvstore='device',
                      update_on_kvstore=False)
        for step in range(4):
            train_step(net, trainer, ctxs, step, manual=True)
        results.append(weights_of(net))
    assert_same_weights(results[0], results[1], 'after 4 steps')


@pytest.mark.parametrize('num_devices', [1, 2])
@pytest.mark.parametrize('kvstore', KVSTORES)
def test_warns_once_that_delay_has_no_effect(caplog, kvstore, num_devices):
    caplog.set_level(logging.INFO, logger=TRAINER_LOG)
    ctxs = contexts(num_devices)
    net, _ = mlp_model.build(ctxs)
    trainer = mxdelay.DelayedTrainer(net.collect_params(), 'sgd', dict(OPT), kvstore=kvstore,
                                     delay=3, warmup_steps=1)
    assert not [r for r in caplog.records if 'no effect' in r.getMessage()]  # not before use
    for step in range(4):
        train_step(net, trainer, ctxs, step)
    trainer.set_learning_rate(0.05)
    train_step(net, trainer, ctxs, 4)
    notes = [r for r in caplog.records if 'no effect' in r.getMessage()]
    assert len(notes) == 1
    assert notes[0].name == TRAINER_LOG and notes[0].levelno == logging.WARNING
    assert 'delay=3' in notes[0].getMessage()
    # no phase is entered without a distributed kvstore
    assert not [r for r in caplog.records if 'phase' in r.getMessage()]


@pytest.mark.parametrize('num_devices', [1, 2])
@pytest.mark.parametrize('kvstore', [None, 'local'])
def test_save_and_load_states_like_gluon_trainer(tmp_path, kvstore, num_devices):
    ctxs = contexts(num_devices)
    saved, weights_at_save, uninterrupted = {}, None, None
    for cls in (gluon.Trainer, mxdelay.DelayedTrainer):
        net, _ = mlp_model.build(ctxs)
        trainer = cls(net.collect_params(), 'sgd', dict(OPT), kvstore=kvstore)
        for step in range(3):
            train_step(net, trainer, ctxs, step)
        saved[cls] = str(tmp_path / cls.__name__)
        trainer.save_states(saved[cls])
        weights_at_save = weights_of(net)
        if cls is gluon.Trainer:
            for step in range(3, 6):
                train_step(net, trainer, ctxs, step)
            uninterrupted = weights_of(net)
    # the same state file as gluon.Trainer, byte for byte
    assert filecmp.cmp(saved[gluon.Trainer], saved[mxdelay.DelayedTrainer], shallow=False)

    def resume(cls, fname):
        net, _ = mlp_model.build(ctxs)
        for name, param in net.collect_params().items():
            for data, value in zip(param.list_data(), weights_at_save[name]):
                data[:] = value
        trainer = cls(net.collect_params(), 'sgd', dict(OPT), kvstore=kvstore)
        if fname is not None:
            trainer.load_states(fname)
        for step in range(3, 6):
            train_step(net, trainer, ctxs, step)
        return weights_of(net)

    # resumes as gluon.Trainer does, from its own file and from gluon.Trainer's
    want = resume(gluon.Trainer, saved[gluon.Trainer])
    assert_same_weights(want, resume(mxdelay.DelayedTrainer, saved[mxdelay.DelayedTrainer]),
                        'own file')
    assert_same_weights(want, resume(mxdelay.DelayedTrainer, saved[gluon.Trainer]),
                        "gluon.Trainer's file")
    # which is the uninterrupted run (on the first device: without a kvstore, gluon.Trainer
    # keeps one updater per device but saves only the first one's state)
    np.testing.assert_array_equal(want['l1_weight'][0], uninterrupted['l1_weight'][0])
    # the momentum state matters: resuming without it gives other weights
    fresh = resume(mxdelay.DelayedTrainer, None)
    assert not np.array_equal(fresh['l1_weight'][0], uninterrupted['l1_weight'][0])


# -- 2. constructor validation --------------------------------------------------------------
BAD_ARGUMENTS = [
    (dict(delay=0), r"delay must be an integer >= 1, got 0\b"),
    (dict(delay=-2), r"delay.*got -2\b"),
    (dict(delay=2.0), r"delay.*got 2\.0"),
    (dict(delay='4'), r"delay.*got '4'"),
    (dict(delay=True), r"delay.*got True"),
    (dict(delay=None), r"delay.*got None"),
    (dict(warmup_steps=-1), r"warmup_steps must be an integer >= 0, got -1\b"),
    (dict(warmup_steps=1.5), r"warmup_steps.*got 1\.5"),
    (dict(warmup_steps=False), r"warmup_steps.*got False"),
    (dict(local_lr=-0.1), r"local_lr.*got -0\.1"),
    (dict(local_lr='0.1'), r"local_lr.*got '0\.1'"),
    (dict(local_lr=float('nan')), r"local_lr.*got nan"),
    (dict(local_lr=True), r"local_lr.*got True"),
    (dict(local_rule='bogus'), r"local_rule='bogus'"),
    (dict(local_rule=None), r"local_rule=None"),
    (dict(local_rule='dc', dc_lambda=-0.5), r"dc_lambda.*got -0\.5"),
    (dict(local_rule=MirrorRule(), dc_lambda=0.1), r"dc_lambda=0\.1"),
    (dict(delay=4, slack=2), r"slack must be an integer >= 4, got 2\b"),
    (dict(delay=2, slack=3.0), r"slack.*got 3\.0"),
    (dict(delay=1, slack=0), r"slack.*got 0\b"),
    (dict(kvstore='dist_delay', update_on_kvstore=False),
     r"update_on_kvstore=False.*kvstore='dist_delay'"),
    (dict(kvstore='dist_delay', compression_params={'type': '1bit', 'threshold': 0.5}),
     r"Unknown type for gradient compression 1bit: compression_params"),
]


@pytest.mark.parametrize('kwargs,message', BAD_ARGUMENTS,
                         ids=[','.join('%s=%r' % kv for kv in sorted(c[0].items(), key=str))
                              for c in BAD_ARGUMENTS])
def test_bad_argument_raises_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        mxdelay.DelayedTrainer(small_params(), 'sgd', {'learning_rate': 0.1}, **kwargs)


@pytest.mark.parametrize('kwargs,message', [
    (dict(update_on_kvstore=False), r"update_on_kvstore=False.*dist_delay"),
    (dict(compression_params={'type': '2bit', 'threshold': -1}),
     r"threshold must be greater than 0: compression_params"),
])
def test_bad_argument_with_a_dist_delay_instance(kwargs, message):
    with pytest.raises(ValueError, match=message):
        mxdelay.DelayedTrainer(small_params(), 'sgd', {'learning_rate': 0.1},
                               kvstore=delay_store(), **kwargs)


class Halve(LocalRule):
    def update(self, weight, grad, grad_sync, state, ctx):
        weight[:] = weight * 0.5


@pytest.mark.parametrize('kwargs', [
    dict(), dict(delay=np.int64(3), warmup_steps=np.int32(0)), dict(delay=1, warmup_steps=0),
    dict(local_lr=0), dict(local_lr=0.05), dict(local_lr=2), dict(delay=4, slack=4),
    dict(delay=2, slack=9), dict(local_rule='dc_adaptive', dc_lambda=0.0),
    dict(local_rule=Halve()), dict(kvstore='local', update_on_kvstore=False),
    dict(kvstore='device', compression_params=None),
], ids=str)
def test_good_arguments_are_accepted(kwargs):
    trainer = mxdelay.DelayedTrainer(small_params(), 'sgd', {'learning_rate': 0.1}, **kwargs)
    assert trainer.schedule.delay == kwargs.get('delay', 4)
    assert trainer.schedule.warmup_steps == kwargs.get('warmup_steps', 200)
    assert trainer.schedule.step == 0


def test_numpy_float_local_lr_is_accepted():
    # A numpy float32 local_lr trains as the Python float of the same value, bit for bit,
    # and is used: the optimizer's own rate (0.1) gives another trajectory.
    args = dict(delay=2, warmup_steps=1, local_rule='sgd', optimizer_params=dict(OPT, momentum=0))
    _, _, _, got = run_delayed(6, local_lr=np.float32(0.05), **args)
    _, _, _, want = run_delayed(6, local_lr=float(np.float32(0.05)), **args)
    _, _, _, default = run_delayed(6, **args)
    for name in NAMES:
        for step in range(6):
            np.testing.assert_array_equal(got[name][step], want[name][step],
                                          err_msg='step %d, %s' % (step, name))
        assert not np.array_equal(got[name][-1], default[name][-1]), name


def test_configuration_log_shows_local_lr_zero(caplog):
    caplog.set_level(logging.INFO, logger=TRAINER_LOG)
    mxdelay.DelayedTrainer(small_params(), 'sgd', {'learning_rate': 0.1}, local_lr=0.0)
    config = [r.getMessage() for r in caplog.records if 'local_lr=' in r.getMessage()]
    assert len(config) == 1
    assert 'local_lr=0' in config[0] and 'optimizer lr' not in config[0]


@pytest.mark.parametrize('kvstore', ['dist_DELAY', 'DIST_DELAY', 'dist_sync', 'dist_async',
                                     'dist_device_sync', 'dist_delay '])
def test_other_distributed_type_strings_are_refused(kvstore):
    # MXNet creates a store for each of these ('dist_DELAY' even a DistDelay: mx.kv.create
    # lower-cases the name), but only the exact 'dist_delay' passes the checks above, so
    # DelayedTrainer must refuse them at construction, naming the value.
    assert KVStoreBase.kv_registry['dist_DELAY'.lower()] is DistDelay
    with pytest.raises(ValueError, match=r"kvstore=%r.*'dist_delay'" % kvstore):
        mxdelay.DelayedTrainer(small_params(), 'sgd', {'learning_rate': 0.1}, kvstore=kvstore,
                               update_on_kvstore=False)


# -- 3. the delayed path, with an in-process 'dist_delay' of one worker ---------------------
def run_delayed(steps, ctxs=None, kvstore=None, trainer=None, params=None, first=0,
                optimizer_params=None, **trainer_args):
    """Train with DelayedTrainer on `kvstore` (a fresh delay_store() by default); return
    the trainer, its kvstore and {name: [w' after each step]} (first device)."""
    ctxs = ctxs or contexts(1)
    if trainer is None:
        params = make_params(ctxs)
        kvstore = kvstore or delay_store()
        trainer = mxdelay.DelayedTrainer(params, 'sgd', dict(optimizer_params or OPT),
                                         kvstore=kvstore, **trainer_args)
    history = {name: [] for name in NAMES}
    for step in range(first, first + steps):
        weights = {p.name: p.data(ctxs[0]).asnumpy() for p in params}
        backward_with(params, ctxs, numpy_grad(weights, 0, step))
        trainer.step(BATCH)
        for p in params:
            copies = [d.asnumpy() for d in p.list_data()]
            for other in copies[1:]:
                np.testing.assert_array_equal(copies[0], other, err_msg='device copies differ')
            history[p.name].append(copies[0])
    return trainer, kvstore, params, history


def simulate(steps, delay, warmup_steps, local_rule, dc_lambda=None, local_lr=None,
             momentum=0.9, wd=1e-3, lr=0.1):
    return reference.simulate(mlp_model.init_params(), numpy_grad, 1, steps, delay,
                              warmup_steps, lr, momentum=momentum, wd=wd,
                              rescale_grad=1.0 / BATCH, local_lr=local_lr, rule=local_rule,
                              dc_lambda=dc_lambda)


REFERENCE_CASES = [
    # (delay, warmup_steps, local_rule, dc_lambda, local_lr, momentum, devices)
    (1, 0, 'sgd', None, None, 0.9, 1),
    (3, 2, 'mirror', None, None, 0.9, 1),
    (2, 1, 'dc', 0.5, 0.05, 0.9, 1),
    (4, 0, 'dc_adaptive', 0.02, None, 0.0, 1),
    (2, 3, 'mirror', 0.3, 0.2, 0.9, 2),
    (3, 1, 'sgd', None, 0.03, 0.0, 2),
]


@pytest.mark.parametrize('delay,warmup_steps,local_rule,dc_lambda,local_lr,momentum,devices',
                         REFERENCE_CASES, ids=['-'.join(map(str, c)) for c in REFERENCE_CASES])
def test_one_worker_matches_reference(delay, warmup_steps, local_rule, dc_lambda, local_lr,
                                      momentum, devices):
    steps = 14
    opt = dict(OPT, momentum=momentum)
    _, _, _, history = run_delayed(steps, ctxs=contexts(devices), optimizer_params=opt,
                                   delay=delay, warmup_steps=warmup_steps,
                                   local_rule=local_rule, dc_lambda=dc_lambda,
                                   local_lr=local_lr)
    traj = simulate(steps, delay, warmup_steps, local_rule, dc_lambda, local_lr, momentum)
    for name in NAMES:
        for t in range(steps):
            np.testing.assert_allclose(history[name][t], traj.local[t][0][name], rtol=RTOL,
                                       atol=ATOL, err_msg='step %d, %s' % (t, name))


def local_and_global(delay, warmup_steps, local_rule, momentum):
    """Train N = 1 with lam = 0 and local_lr = lr; yield (step, name, w', W) at every step."""
    ctxs = contexts(1)
    params = make_params(ctxs)
    kv = delay_store()
    trainer = mxdelay.DelayedTrainer(params, 'sgd', dict(OPT, momentum=momentum), kvstore=kv,
                                     delay=delay, warmup_steps=warmup_steps,
                                     local_rule=local_rule)
    initial = params[2].data().asnumpy()
    for step in range(warmup_steps + 3 * delay + 2):
        weights = {p.name: p.data().asnumpy() for p in params}
        backward_with(params, ctxs, numpy_grad(weights, 0, step))
        trainer.step(BATCH)
        for i, p in enumerate(params):
            yield step, p.name, p.data().asnumpy(), server_weights(kv, i)
    assert not np.array_equal(params[2].data().asnumpy(), initial)


@pytest.mark.parametrize('delay', [1, 2, 3, 5])
@pytest.mark.parametrize('warmup_steps', [0, 2])
@pytest.mark.parametrize('local_rule,momentum', [('mirror', 0.9), ('sgd', 0.0)])
def test_one_worker_local_weights_are_the_global_weights(delay, warmup_steps, local_rule,
                                                         momentum):
    # docs/design.md §1.6: with N = 1, lam = 0 and local_lr = lr, rule 'sgd' with plain SGD on the
    # server and rule 'mirror' with SGD + momentum give w' = W at every step, for every k.
    # Up to float32 rounding: the mirror rule's v starts at W_{W+1} - W_W, which rounds
    # differently from the server's momentum buffer (largest difference measured: 2.4e-7).
    for step, name, local, glob in local_and_global(delay, warmup_steps, local_rule,
                                                    momentum):
        np.testing.assert_allclose(local, glob, rtol=1e-6, atol=1e-6,
                                   err_msg='step %d, %s' % (step, name))


@pytest.mark.parametrize('delay', [1, 3])
def test_one_worker_sgd_rule_is_the_server_bit_for_bit(delay):
    for step, name, local, glob in local_and_global(delay, 1, 'sgd', 0.0):
        np.testing.assert_array_equal(local, glob, err_msg='step %d, %s' % (step, name))


@pytest.mark.parametrize('delay,warmup_steps', [(1, 0), (3, 2), (4, 1)])
def test_pushes_every_step_and_pulls_on_schedule(delay, warmup_steps):
    steps = warmup_steps + 3 * delay + 2
    trainer, kv, _, _ = run_delayed(0, delay=delay, warmup_steps=warmup_steps)
    params = trainer._params  # pylint: disable=protected-access
    ctxs = contexts(1)
    for step in range(steps):
        start = len(events(kv))
        weights = {p.name: p.data().asnumpy() for p in params}
        backward_with(params, ctxs, numpy_grad(weights, 0, step))
        trainer.step(BATCH)
        step_events = [(op, k) for op, k in events(kv)[start:] if k != 'finish']
        if ('init', 0) in step_events:
            # Gluon's first step initialises the store: its broadcast (init, pull) comes
            # before the step's pushes and is not the step's pull.
            ops = [op for op, _ in step_events]
            step_events = step_events[min(ops.index(op) for op in ('push', 'pushpull')
                                          if op in ops):]
        pushed = [k for op, k in step_events if op in ('push', 'pushpull')]
        pulls = [k for op, k in step_events if op in ('pull', 'pushpull')]
        assert sorted(pushed) == list(range(len(NAMES))), step      # every key, every step
        synchronous = step <= warmup_steps
        t0 = warmup_steps + 1
        issues = step >= t0 and (step - t0) % delay == delay - 1
        want = list(range(len(NAMES))) if synchronous or issues else []
        assert sorted(pulls) == want, step
        # A synchronous step pulls with the push's own request (one pushpull per chunk);
        # a delayed one queues its pull after its push (the pull must return W_{t+1}).
        assert [op for op, _ in step_events if op in ('push', 'pushpull')] == \
            ['pushpull' if synchronous else 'push'] * len(pushed), step
        for key in pulls if not synchronous else ():
            assert step_events.index(('push', key)) < step_events.index(('pull', key))
    assert trainer.schedule.step == steps


def test_phase_changes_are_logged_once_each(caplog):
    caplog.set_level(logging.INFO, logger=TRAINER_LOG)
    run_delayed(8, delay=2, warmup_steps=3)
    phases = [r.getMessage() for r in caplog.records if 'enters the' in r.getMessage()]
    assert phases == ['DelayedTrainer: step 0 enters the warm-up phase',
                      'DelayedTrainer: step 3 enters the switch phase',
                      'DelayedTrainer: step 4 enters the delayed phase']
    assert not [r for r in caplog.records if 'no effect' in r.getMessage()]


def test_learning_rate_change_reaches_server_and_local_rule():
    # 'sgd' with local_lr = lr / 2: after set_learning_rate both move by the same factor.
    trainer, kv, params, _ = run_delayed(4, delay=2, warmup_steps=1, local_rule='sgd',
                                         local_lr=0.05, optimizer_params=dict(OPT, momentum=0))
    trainer.set_learning_rate(0.02)
    assert server_optimizer(kv).learning_rate == 0.02
    _, _, _, history = run_delayed(4, trainer=trainer, params=params, first=4)
    want = reference.simulate(mlp_model.init_params(), numpy_grad, 1, 8, 2, 1, 0.1, momentum=0,
                              wd=OPT['wd'], rescale_grad=1.0 / BATCH, local_lr=0.05,
                              rule='sgd', lr_fn=lambda t: 0.1 if t < 4 else 0.02)
    for name in NAMES:
        for t in range(4):
            np.testing.assert_allclose(history[name][t], want.local[4 + t][0][name],
                                       rtol=RTOL, atol=ATOL, err_msg='step %d' % (4 + t))


def test_delayed_load_adopts_the_saved_optimizer_like_gluon(tmp_path):
    # gluon.Trainer.load_states takes the saved optimizer; so must the local rule, since the
    # servers apply the saved optimizer after a load. A trainer created with another
    # learning rate and momentum resumes exactly as the uninterrupted run.
    args = dict(delay=2, warmup_steps=1, local_rule='mirror')
    _, _, _, uninterrupted = run_delayed(8, **args)
    trainer, _, _, _ = run_delayed(4, **args)
    fname = str(tmp_path / 'ckpt')
    trainer.save_states(fname)
    params2 = make_params(contexts(1))
    trainer2 = mxdelay.DelayedTrainer(params2, 'sgd', dict(OPT, learning_rate=0.7, momentum=0.5),
                                      kvstore=delay_store(), **args)
    trainer2.load_states(fname)
    assert (trainer2.learning_rate, trainer2.optimizer.momentum) == (0.1, 0.9)
    assert trainer2.optimizer.param_dict[0] is params2[0]
    _, _, _, resumed = run_delayed(4, trainer=trainer2, params=params2, first=4)
    for name in NAMES:
        np.testing.assert_array_equal(resumed[name], uninterrupted[name][4:])
    # (local_rule='sgd': the default 'mirror' refuses NAG at construction already)
    wrong = mxdelay.DelayedTrainer(make_params(contexts(1)), 'nag', dict(OPT),
                                   kvstore=delay_store(), **dict(args, local_rule='sgd'))
    with pytest.raises(ValueError, match=r"saved with optimizer SGD, this trainer uses NAG"):
        wrong.load_states(fname)


def test_delayed_save_and_load_resume_bit_for_bit(tmp_path):
    args = dict(delay=3, warmup_steps=1, local_rule='mirror', dc_lambda=0.2)
    _, _, _, uninterrupted = run_delayed(10, **args)
    trainer, _, params, _ = run_delayed(5, **args)   # saved while a pull is pending (t=4)
    fname = str(tmp_path / 'ckpt')
    trainer.save_states(fname)
    # a new process: new parameters, trainer and kvstore, then load and continue
    params2 = make_params(contexts(1))
    kv2 = delay_store()
    trainer2 = mxdelay.DelayedTrainer(params2, 'sgd', dict(OPT), kvstore=kv2, **args)
    trainer2.load_states(fname)  # raised RuntimeError with Parameter.set_data (fixed)
    assert trainer2.schedule.step == 5
    _, _, _, resumed = run_delayed(5, trainer=trainer2, params=params2, first=5)
    for name in NAMES:
        for t in range(5):
            np.testing.assert_array_equal(resumed[name][t], uninterrupted[name][5 + t])


@pytest.mark.parametrize('other', [dict(delay=2), dict(warmup_steps=0)])
def test_delayed_load_refuses_another_schedule(tmp_path, other):
    args = dict(delay=3, warmup_steps=1)
    trainer, _, _, _ = run_delayed(4, **args)
    fname = str(tmp_path / 'ckpt')
    trainer.save_states(fname)
    params2 = make_params(contexts(1))
    before = params2[2].data().asnumpy()
    trainer2 = mxdelay.DelayedTrainer(params2, 'sgd', dict(OPT), kvstore=delay_store(),
                                      **dict(args, **other))
    with pytest.raises(ValueError, match=r'saved with delay=3 warmup_steps=1'):
        trainer2.load_states(fname)
    assert trainer2.schedule.step == 0
    np.testing.assert_array_equal(params2[2].data().asnumpy(), before)


@pytest.mark.parametrize('content', [b'', b'{"format": "gluon"}', b'\x80\x04garbage'])
def test_delayed_load_refuses_foreign_files(tmp_path, content):
    fname = tmp_path / 'ckpt'
    fname.write_bytes(content)
    trainer = mxdelay.DelayedTrainer(make_params(contexts(1)), 'sgd', dict(OPT),
                                     kvstore=delay_store(), delay=2, warmup_steps=1)
    with pytest.raises(ValueError, match='not an mxdelay trainer state file'):
        trainer.load_states(str(fname))
    with pytest.raises(ValueError, match='does not exist'):
        trainer.load_states(str(tmp_path / 'missing'))


def test_update_on_kvstore_environment_cannot_drop_the_optimizer(monkeypatch):
    # The servers apply the optimizer: the first step refuses, naming the variable, before
    # anything reaches the store or the weights.
    monkeypatch.setenv('MXNET_UPDATE_ON_KVSTORE', '0')
    params = make_params(contexts(1))
    kv = delay_store()
    trainer = mxdelay.DelayedTrainer(params, 'sgd', dict(OPT), kvstore=kv, delay=2,
                                     warmup_steps=1)
    before = {p.name: p.data().asnumpy() for p in params}
    backward_with(params, contexts(1), numpy_grad(before, 0, 0))
    with pytest.raises(ValueError, match=r'update_on_kvstore is False \(set by the environment '
                                         r'variable MXNET_UPDATE_ON_KVSTORE=0\?\), .*: unset '
                                         r'MXNET_UPDATE_ON_KVSTORE$'):
        trainer.step(BATCH)
    assert server_optimizer(kv) is None and not pushes(kv)
    for p in params:
        np.testing.assert_array_equal(p.data().asnumpy(), before[p.name], err_msg=p.name)


def test_priorities_follow_the_forward_order_not_the_names():
    # Block names sort differently from their order of use ('dense10' < 'dense2' < 'dense9'):
    # the first layer the forward uses must get the highest priority, and the pushes are
    # issued last layer first (its gradient is ready first).
    net = gluon.nn.Sequential()
    for prefix, units, in_units in (('dense9_', 6, 4), ('dense10_', 5, 6), ('dense2_', 3, 5)):
        net.add(gluon.nn.Dense(units, in_units=in_units, prefix=prefix))
    net.initialize()
    kv = delay_store()
    trainer = mxdelay.DelayedTrainer(net.collect_params(), 'sgd', {'learning_rate': 0.1},
                                     kvstore=kv, delay=2, warmup_steps=1)
    assert trainer.priority_order() == list(net.collect_params().keys())  # registration
    with autograd.record():
        loss = net(nd.ones((2, 4))).sum()
    loss.backward()
    trainer.step(2)
    forward = ['dense9_weight', 'dense9_bias', 'dense10_weight', 'dense10_bias',
               'dense2_weight', 'dense2_bias']
    assert trainer.priority_order() == forward
    names = [p.name for p in trainer._params]  # pylint: disable=protected-access
    assert names != forward                     # Gluon's index is name-sorted
    pushed = [(names[key], priority) for key, priority in pushes(kv)]
    assert [name for name, _ in pushed] == forward[::-1]
    assert [priority for _, priority in pushed] == sorted(p for _, p in pushed)
    assert pushed[-1][1] > pushed[0][1]
    # Data() is not wrapped any more after the first step.
    assert all('data' not in vars(p) for p in net.collect_params().values())


# -- the global model, and clipping ----------------------------------------------------------

def test_sync_weights_replaces_every_device_copy_by_the_servers_weights():
    # One worker, rule 'sgd' with momentum on the server: w' and W differ (the literal rule
    # has no momentum), so sync_weights has something to do.
    trainer, kv, params, history = run_delayed(7, ctxs=contexts(2), delay=3, warmup_steps=2,
                                               local_rule='sgd')
    before = {p.name: p.data(mx.cpu(0)).asnumpy() for p in params}
    assert any(not np.array_equal(before[p.name], server_weights(kv, i))
               for i, p in enumerate(params))
    assert events(kv)[-1][1] != 'finish'
    trainer.sync_weights()
    # it joined first: the finish counter's vote was read before the weights' pulls
    assert events(kv)[-1 - len(params)] == ('pull', 'finish')
    for i, param in enumerate(params):
        for data in param.list_data():
            np.testing.assert_array_equal(data.asnumpy(), server_weights(kv, i))


def test_sync_weights_without_a_distributed_kvstore_changes_nothing():
    params = make_params(contexts(1))
    trainer = mxdelay.DelayedTrainer(params, 'sgd', dict(OPT), kvstore='local')
    before = [p.data().asnumpy() for p in params]
    trainer.sync_weights()
    for param, old in zip(params, before):
        np.testing.assert_array_equal(param.data().asnumpy(), old)


@pytest.mark.parametrize('method', ['allreduce_grads', 'update'])
def test_manual_update_says_how_to_clip_instead(method):
    params = make_params(contexts(1))
    trainer = mxdelay.DelayedTrainer(params, 'sgd', dict(OPT), kvstore=delay_store())
    args = () if method == 'allreduce_grads' else (BATCH,)
    with pytest.raises(ValueError, match=r"%s\(\) is not available with kvstore='dist_delay'.*"
                                         r"clip this worker's own gradients before step\(\)"
                                         r".*clip_gradient=" % method):
        getattr(trainer, method)(*args)


def test_manual_update_without_a_distributed_kvstore_is_gluons():
    params = make_params(contexts(1))
    trainer = mxdelay.DelayedTrainer(params, 'sgd', dict(OPT), kvstore='device',
                                     update_on_kvstore=False)
    stock_params = make_params(contexts(1))
    stock = gluon.Trainer(stock_params, 'sgd', dict(OPT), kvstore='device',
                          update_on_kvstore=False)
    for step in range(3):
        for ps, tr in ((params, trainer), (stock_params, stock)):
            weights = {p.name: p.data().asnumpy() for p in ps}
            backward_with(ps, contexts(1), numpy_grad(weights, 0, step))
            tr.allreduce_grads()
            tr.update(BATCH)
    for mine, theirs in zip(params, stock_params):
        np.testing.assert_array_equal(mine.data().asnumpy(), theirs.data().asnumpy())


def test_clipping_own_gradients_before_step_trains_like_gluon_with_the_same_clipping():
    # The documented way to clip on 'dist_delay': each worker clips its own gradient by its
    # global norm before step(). With one worker that is what gluon.Trainer does with the
    # same clipping (the mirror rule keeps w' = W), through warm-up and delayed steps.
    runs = {}
    for name, make in (('gluon', lambda ps: gluon.Trainer(ps, 'sgd', dict(OPT), kvstore=None)),
                       ('delayed', lambda ps: mxdelay.DelayedTrainer(
                           ps, 'sgd', dict(OPT), kvstore=delay_store(), delay=3,
                           warmup_steps=2))):
        params = make_params(contexts(1))
        trainer = make(params)
        clipped_norms = []
        for step in range(9):
            weights = {p.name: p.data().asnumpy() for p in params}
            backward_with(params, contexts(1), numpy_grad(weights, 0, step))
            clipped_norms.append(gluon.utils.clip_global_norm([p.grad() for p in params], 0.5))
            trainer.step(BATCH)
        runs[name] = ([p.data().asnumpy() for p in params], clipped_norms)
    assert max(runs['gluon'][1]) > 0.5              # the clipping did something
    for mine, theirs in zip(runs['delayed'][0], runs['gluon'][0]):
        np.testing.assert_allclose(mine, theirs, rtol=RTOL, atol=ATOL)
