"""Float16 pushes on 'dist_delay' (``compression_params={'type': 'fp16'}``, docs/design.md
§2.11): gradients travel as float16, the servers sum them in float32 and keep float32
weights and optimizer state, pulls return float32 weights.

What is tested, and against what:

- the numpy reference (tests/reference.py with ``fp16=True``: each pushed gradient rounded
  to float16, summed in float32) in real jobs, **bit for bit** (``assert_array_equal``): the
  job records every worker's gradient of every step and the reference replays those
  gradients (``replay``), so that the only arithmetic left is the store's, the servers' and
  the local rule's. (Recomputing the gradients in numpy instead differs from Gluon's
  backward by ~2e-7, and that flips float16 roundings: 5.7 times the usual tolerance, so the
  usual comparison cannot pin float16 pushes.) The replayed gradients themselves are checked
  against numpy's gradient at the recorded weights (atol 1e-5; 2.4e-7 measured). Each job
  test also asserts that the float32 reference (``fp16=False``) does *not* match, so the
  test sees that the pushes were rounded;
- values that encode (rank, round) plus 1/3, exact sums of float16 pushes (kv_job.py);
- a round held on the servers (it completed before the previous round) stays exact;
- the one-worker invariant (w' = W at every step, k in 1, 2, 4) in one process, through the
  real float16 wire and the real server (support/native.py);
- uneven data with join, and checkpoint save/resume, bit for bit;
- refusals: bad parameters, float16 parameters, set after init.
"""
import sys

import numpy as np
import pytest

import mxdelay
import mxnet as mx
from mxnet import gluon, nd

import reference
from support.jobs import KV_JOB, assert_ok, kv_results, run_job
from support.model import backward_at, mlp_params as make_params
from support.reference_jobs import (MLP_BASE as BASE, assert_rounds_equal_reference,
                                    rounds_differ_from_reference, run_mlp_job)
from support.native import delay_store, server_weights
from support.stores import offline_store
from kvstore_ext import codecs
from kvstore_ext.codecs import fp16
from kvstore_ext.protocol.keys import KeyLayout
from kvstore_ext.server.rounds import RoundKeeper
from scripts import mlp_model

FP16 = {'type': 'fp16'}
WARMUP = 3
NAMES = ('w1', 'b1', 'w2', 'b2')


# -- jobs: the trainers against the reference -------------------------------------------------
def replay(histories, config, num_workers, fp16=True, warmup_steps=None):
    """The reference's trajectory on the gradients the job's workers recorded (by round:
    zero in a round where a worker had no data)."""
    def grad_fn(weights, rank, t):
        rounds = list(histories[rank]['rounds'])
        if t not in rounds:
            return {name: np.zeros_like(w) for name, w in weights.items()}
        return {name: histories[rank]['grad_' + name][rounds.index(t)] for name in NAMES}
    steps = max(int(h['rounds'][-1]) for h in histories.values()) + 1
    return reference.simulate(
        mlp_model.init_params(), grad_fn, num_workers, steps, config['delay'],
        config['warmup_steps'] if warmup_steps is None else warmup_steps, config['lr'],
        momentum=config['momentum'], wd=config['wd'], rescale_grad=1.0 / config['batch'],
        rule=config.get('local_rule', 'mirror'), optimizer=config.get('optimizer', 'sgd'),
        fp16=fp16)


def assert_exact(histories, config, num_workers, warmup_steps=None):
    assert_rounds_equal_reference(
        histories, replay(histories, config, num_workers, warmup_steps=warmup_steps))
    for rank, history in histories.items():
        for i, t in enumerate(history['rounds']):
            if i and history['rounds'][i - 1] == t - 1:
                # The recorded gradient is the model's at the recorded weights.
                weights = {name: history[name][i - 1] for name in NAMES}
                x, y = mlp_model.batch(rank, int(t), config['batch'])
                for name, grad in mlp_model.numpy_grad(weights, x, y).items():
                    np.testing.assert_allclose(history['grad_' + name][i], grad, atol=1e-5)
    # The float32 reference differs: the test sees the rounding of the pushes.
    assert rounds_differ_from_reference(histories, replay(
        histories, config, num_workers, fp16=False, warmup_steps=warmup_steps))


CASES = [
    # (num_workers, num_servers, overrides); MXDELAY_CHUNK_SIZE 50: w1 (128) and w2 (64)
    # span chunks, on both servers with 2
    (2, 1, {'delay': 2, 'warmup_steps': 3}),
    (3, 2, {'delay': 3, 'warmup_steps': 2}),
    (2, 2, {'delay': 1, 'warmup_steps': 0, 'local_rule': 'sgd'}),
    (2, 2, {'trainer': 'gluon', 'kvstore': 'dist_delay', 'delay': 1, 'warmup_steps': 16}),
    # the Adam mirror: its state comes through the state keys, after the pull keys
    (2, 2, {'optimizer': 'adam', 'lr': 0.01, 'delay': 2, 'warmup_steps': 2}),
]


@pytest.mark.jobs
@pytest.mark.parametrize('num_workers,num_servers,overrides', CASES, ids=[
    '%s-%s-N%d-S%d-k%d-W%d' % (c[2].get('trainer', 'delayed'), c[2].get('optimizer', 'sgd'),
                               c[0], c[1], c[2]['delay'], c[2]['warmup_steps'])
    for c in CASES])
def test_fp16_pushes_match_the_reference_bit_for_bit(tmp_path, num_workers, num_servers,
                                                     overrides):
    config = dict(BASE, compression=FP16, record_grads=True, **overrides)
    histories = run_mlp_job(tmp_path, num_workers, config, num_servers=num_servers,
                            env={'MXDELAY_CHUNK_SIZE': 50})
    assert_exact(histories, config, num_workers)


@pytest.mark.jobs
def test_fp16_join_with_uneven_data_is_exact(tmp_path):
    # Worker 1 has 5 batches per epoch against worker 0's 8 and joins at each epoch end:
    # zero gradients (rounded to float16: still zero) in the rounds it fills.
    config = dict(BASE, compression=FP16, record_grads=True, batches=[8, 5], epochs=2,
                  join=True, delay=2, warmup_steps=3)
    histories = run_mlp_job(tmp_path, 2, config)
    assert list(histories[1]['rounds']) == [t for t in range(16) if t % 8 < 5]
    assert_exact(histories, config, 2)


@pytest.mark.jobs
def test_fp16_save_and_resume_continue_bit_for_bit(tmp_path):
    # Saved at step 8 (delayed phase, a pull pending), resumed by a new job: steps 9..15
    # equal those of the job that never stopped, which equals the reference.
    config = dict(BASE, compression=FP16, record_grads=True, delay=3, warmup_steps=3)
    full = run_mlp_job(tmp_path / 'full', 2, config)
    assert_exact(full, config, 2)
    run_mlp_job(tmp_path / 'first', 2, dict(config, save_at=8, stop_after=10))
    resumed = run_mlp_job(tmp_path / 'resumed', 2, dict(
        config, resume_from=str(tmp_path / 'first' / 'out' / 'ckpt')))
    for rank in range(2):
        assert int(resumed[rank]['first']) == 9
        for name in NAMES:
            np.testing.assert_array_equal(resumed[rank][name], full[rank][name][9:],
                                          err_msg='worker %d %s after resume' % (rank, name))


# -- jobs: the store ----------------------------------------------------------------------------
def run_kv(mode, args, num_workers, num_servers, env=None):
    return run_job([sys.executable, KV_JOB, mode] + [str(a) for a in args],
                   num_workers=num_workers, num_servers=num_servers, timeout=90,
                   env=dict({'MXDELAY_CHUNK_SIZE': '1000'}, **(env or {})))


@pytest.mark.jobs
def test_fp16_rounds_with_a_straggler_are_exact_float32_sums_of_float16_pushes():
    # Worker r pushes round + 1000 r + 1/3 (rounded to float16 on the wire); rank 1 sleeps
    # before each push. Every pull of every round (3 keys, 5 chunks on 2 servers) is exactly
    # the float32 sum of the three float16 values.
    result = run_kv('rounds', [3, 12, 0.03, 'fp16'], 3, 2)
    assert_ok(result)
    results = kv_results(result)
    assert sorted(results) == [0, 1, 2]
    for rank, data in results.items():
        assert data['bad'] == [], 'worker %d pulled wrong sums: %s' % (rank, data['bad'])
        applied = [c['rounds'] for s in data['stats'] for c in s['chunks'].values()]
        assert sorted(applied) == [12] * 5


@pytest.mark.jobs
@pytest.mark.parametrize('fp16', [True, False], ids=['fp16', 'fp32'])
def test_a_held_round_stays_exact(fp16):
    # Round 0's gradient is slow, round 1's ready: round 1 completes first on every chunk's
    # server and is held; the pull after round 1 must still return W_2 (SGD lr 0.5, N = 2,
    # W_0 = 1, 3 chunks on 2 servers), never the value the native server had copied before.
    result = run_kv('held', ['fp16' if fp16 else 'fp32'], 2, 2,
                    env={'MXDELAY_LOG_LEVEL': 'DEBUG'})
    assert_ok(result)
    assert 'completed before round 0; held' in result.stderr   # the case really happened
    cast = (lambda g: np.float32(np.float16(g))) if fp16 else np.float32
    weight = np.float32(1)
    for grad in (0.1, 0.3):
        total = cast(grad) + cast(grad)                    # the float32 sum of N = 2 pushes
        weight = weight - (np.float32(0) * weight + np.float32(0.5) * total)
    for data in kv_results(result).values():
        assert data['pulled'] == [float(weight)]
        assert sorted(c['rounds'] for s in data['stats'] for c in s['chunks'].values()) == [2] * 3


# -- one process --------------------------------------------------------------------------------
@pytest.mark.parametrize('delay', [1, 2, 4])
@pytest.mark.parametrize('optimizer,params,rule', [
    ('adam', {'learning_rate': 0.01}, 'mirror'),
    ('sgd', {'learning_rate': 0.1, 'momentum': 0.9}, 'mirror'),
    ('sgd', {'learning_rate': 0.1}, 'sgd'),
])
def test_one_worker_with_fp16_pushes_is_the_servers_model(delay, optimizer, params, rule):
    # docs/design.md §1.4: the local rule reads the gradient as this worker pushed it, so
    # with one worker w' = W at every step: bit for bit, except the SGD-momentum mirror,
    # whose buffer starts at W_{W+1} - W_W (float32 rounding, as without fp16).
    ctxs = [mx.cpu()]
    model = make_params(ctxs)
    kv = delay_store()   # float16 pushes: the trainer's compression_params, the real wire
    trainer = mxdelay.DelayedTrainer(model, optimizer, dict(params), kvstore=kv, delay=delay,
                                     warmup_steps=WARMUP, local_rule=rule,
                                     compression_params=FP16)
    tight = not (optimizer == 'sgd' and 'momentum' in params)
    for step in range(WARMUP + 3 * delay + 3):
        backward_at(model, ctxs, step)
        trainer.step(6)
        for i, param in enumerate(model):
            local, glob = param.data().asnumpy(), server_weights(kv, i)
            if tight:
                np.testing.assert_array_equal(local, glob, err_msg='step %d' % step)
            else:
                np.testing.assert_allclose(local, glob, rtol=1e-6, atol=1e-6,
                                           err_msg='step %d' % step)


@pytest.mark.parametrize('params,error,message', [
    ({'type': 'FP16'}, ValueError, r"Unknown type for gradient compression FP16"),
    ({'type': 'fp16', 'threshold': 0.5}, ValueError, r"no other setting, got \['threshold'\]"),
    ({}, ValueError, r"Required parameter type of string is not presented"),
    ('fp16', TypeError, r"must be a dict or None, got 'fp16' \(str\)"),
])
def test_bad_compression_params_are_refused(params, error, message):
    with pytest.raises(error, match=message):
        codecs.parse(params)
    with pytest.raises(error, match=message):
        offline_store(placed=False).set_gradient_compression(params)
    with pytest.raises(error, match=message):
        mxdelay.DelayedTrainer(make_params([mx.cpu()]), 'sgd', {'learning_rate': 0.1},
                               kvstore='dist_delay', compression_params=params)


def test_fp16_pushes_need_float32_parameters():
    with pytest.raises(ValueError, match=r"needs float32 parameters, but parameter b1 is "
                                         r"float16; cast the model"):
        mxdelay.DelayedTrainer(make_params([mx.cpu()], dtype='float16'), 'sgd',
                               {'learning_rate': 0.1, 'multi_precision': True},
                               kvstore='dist_delay', compression_params=FP16)
    store = offline_store(placed=False)
    store.set_gradient_compression(FP16)
    with pytest.raises(ValueError, match=r"but key 3 is float16"):
        store.init(3, nd.zeros(4, dtype='float16'))   # refused before any network use
    # A parameter that is not trained is never pushed: it may be of any dtype.
    frozen = make_params([mx.cpu()])
    frozen.append(gluon.Parameter('frozen', shape=(2,), dtype='float16', grad_req='null'))
    frozen[-1].initialize()
    mxdelay.DelayedTrainer(frozen, 'sgd', {'learning_rate': 0.1}, kvstore='dist_delay',
                           compression_params=FP16)


def test_fp16_must_be_set_before_init():
    store = offline_store()   # a key is placed
    with pytest.raises(ValueError, match=r"must be called before the first init\(\) .* this "
                                         r"store has started"):
        store.set_gradient_compression(FP16)
    assert store.delayed.settings.wire_dtype is None
    fresh = offline_store(placed=False)
    fresh.set_gradient_compression(None)
    assert fresh.delayed.settings.wire_dtype is None
    fresh.set_gradient_compression(FP16)
    assert fresh.delayed.settings.wire_dtype == 'float16'


def test_pull_keys_in_the_layout():
    # R = 3 pull keys per chunk between the slot keys and J = 2 state keys, on the chunk's
    # server; without pull keys every key is what it was.
    layout, plain = KeyLayout(3, 3, 2, pull_keys=3), KeyLayout(3, 3, 2)
    seen = set()
    for chunk in range(4):
        server = chunk % 3
        for kind, count, key_of in (('slot', 3, layout.slot_key), ('pull', 3, layout.pull_key),
                                    ('state', 2, layout.state_key)):
            for j in range(count):
                key = key_of(chunk, j, server)
                assert layout.decode(key) == (kind, chunk, j)
                assert layout.server_of(key) == server
                seen.add(key)
        # without pull keys: index 1 + chunk * (R + J) + R + j, as before float16 pushes
        assert plain.state_key(chunk, 1, server) == layout.status_key(server) + 3 * (
            1 + chunk * 5 + 3 + 1)
    assert len(seen) == 4 * 8
    with pytest.raises(ValueError, match='has 0 pull keys per chunk'):
        plain.pull_key(0, 0, 0)


def test_held_round_writes_the_pull_key_not_the_slot():
    # Round 1 (slot 1) completes before round 0: held; when round 0 completes both are
    # applied in order, each W into its slot's pull key; the slots' own stored values
    # (float16 keys' float32 copies, which MXNet copies into what their pulls would read)
    # are never written.
    rounds = RoundKeeper(slots=2)
    rounds.updates.install(mx.optimizer.SGD(learning_rate=0.5, rescale_grad=1.0))
    pulls = [nd.ones(3), nd.ones(3)]
    rounds.pulls.set_store(4, 0, pulls[0])
    rounds.pulls.set_store(4, 1, pulls[1])
    slot_stored = [nd.full(3, 7.0), nd.full(3, 7.0)]
    rounds.on_round(4, 1, nd.full(3, 2.0), slot_stored[1])
    assert rounds.held_rounds(4) and pulls[1].asnumpy().tolist() == [1.0] * 3
    rounds.on_round(4, 0, nd.full(3, 1.0), slot_stored[0])
    assert pulls[0].asnumpy().tolist() == [0.5] * 3            # W_1 = 1 - 0.5 * 1
    assert pulls[1].asnumpy().tolist() == [-0.5] * 3           # W_2 = W_1 - 0.5 * 2
    assert [s.asnumpy().tolist() for s in slot_stored] == [[7.0] * 3] * 2
    assert not rounds.in_flight()


def test_fp16_push_rounds_to_nearest_and_scales_in_float32():
    source = nd.array([1.0 / 3, 1e-8, 70000.0, 2049.0])
    buf = nd.zeros(4, dtype='float16')
    fp16.fill_send_buffer(source, buf, None)
    np.testing.assert_array_equal(buf.asnumpy(), source.asnumpy().astype(np.float16))
    fp16.fill_send_buffer(source, buf, 0.5)
    np.testing.assert_array_equal(buf.asnumpy(),
                                  (source.asnumpy() * np.float32(0.5)).astype(np.float16))
