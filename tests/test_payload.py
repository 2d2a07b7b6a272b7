"""Blockwise quantized pushes (``compression_params={'type': 'int8' | 'int4' | 'ternary'}``,
docs/design.md §2.14): one row per worker in a row_sparse (N, P) slot key, decoded and
summed in rank order on the servers, W in float32 pull keys.

What is tested, and against what:

- the packing (:mod:`kvstore_ext.codecs.quantize`): every digit value in every position of a word
  round-trips, every word is a normal float32, blocks of zeros, sizes that are not multiples
  of the block or of the digits per word; the quantized values equal the reference's
  formula (tests/reference.py ``quantize_blockwise``) and the servers' decode equals the
  worker's values **bit for bit**;
- refusals at construction: bad parameters (argument, value, fix), float16 parameters,
  row_sparse keys, AMP; chunks cut below the big-array bound;
- the one-worker invariant (w' == W at every step, k in 1 and 4) through the real wire and
  the real servers (support/native.py);
- 1 to 3 workers in one process (support/native_workers.py) and a real 2-worker job on 2
  servers with chunks, against the numpy reference **bit for bit**, warm-up and delayed
  phase, with exact and compressed pulls; each also differs from the unquantized reference,
  so the test sees the quantization;
- a checkpoint resume bit for bit (the residuals are saved);
- a real job runs the compiled codec kernels (the workers' encode, the servers' sum of the
  rows and their int8 pulls: each process's count of kernel calls) and is the numpy
  reference's bit for bit.
"""
import collections
import json
import os
import sys

import numpy as np
import pytest

import mxdelay
import mxnet as mx
from mxnet import nd
from mxnet.contrib.amp.loss_scaler import LossScaler

import reference
from scripts import mlp_model
from support.model import BATCH, MLP_NAMES, backward_at, contexts, mlp_params, train_steps
from support.native import delay_store, server_weights
from support.native_workers import run_workers
from support.reference_jobs import (MLP_BASE, assert_equal_to_reference,
                                    assert_rounds_equal_reference, batch_size,
                                    differs_from_reference, rounds_differ_from_reference,
                                    run_mlp_job)
from support.stores import offline_store
from support.jobs import SCRIPTS, assert_ok, kv_results, role_lines, run_job
from kvstore_ext import codecs
from kvstore_ext.codecs import kernels, quantize
from kvstore_ext.codecs.blockwise import largest_chunk
from kvstore_ext.server import appliers

OPT = {'learning_rate': 0.1, 'momentum': 0.9, 'wd': 1e-3}
TYPES = ('int8', 'int4', 'ternary')
H = quantize.LEVELS
ROWS_WIRE_JOB = os.path.join(SCRIPTS, 'rows_wire_job.py')


def blockwise(setting, chunk_size=None):
    """The reference's ``blockwise`` argument of a compression_params `setting`."""
    return (H[setting['type']], setting.get('block_size', 256), chunk_size)


def is_normal(words):
    exponent = (words.view(np.uint32) >> 23) & 0xFF
    return bool(np.all((exponent > 0) & (exponent < 255)))


# -- the quantizer and its packing ---------------------------------------------------------
def test_digits_per_word_and_bits_per_value():
    assert {name: quantize.digits_per_word(h) for name, h in H.items()} == \
        {'int8': 4, 'int4': 8, 'ternary': 20}
    for name, h in H.items():
        count = quantize.digits_per_word(h)
        assert (2 * h + 1) ** count <= 2 * 254 * 2 ** 23 < (2 * h + 1) ** (count + 1)
    # Bytes: ternary at B = 256 is 1.6 + 32/256 bits a value.
    n = 256 * 20 * 10
    assert quantize.payload_size(n, 1, 256) * 32 / n == pytest.approx(1.725)
    assert quantize.payload_size(n, 127, 256) * 32 / n == pytest.approx(8.125)
    assert quantize.payload_size(n, 7, 256) * 32 / n == pytest.approx(4.125)


@pytest.mark.parametrize('name', TYPES)
def test_every_digit_in_every_position_round_trips_as_a_normal_float(name):
    h = H[name]
    count = quantize.digits_per_word(h)
    levels = np.arange(-h, h + 1, dtype=np.float32)
    # Each level in each position of a word, and words of all-lowest and all-highest.
    rows = [np.roll(np.concatenate([levels, np.zeros(count, np.float32)])[:count], shift)
            for shift in range(count)] if 2 * h + 1 < count else []
    seqs = [np.tile(levels, count + 1), np.full(count, -h, np.float32),
            np.full(count, h, np.float32), np.zeros(count, np.float32)] + rows
    for position in range(count):
        for level in levels:
            word = np.zeros(count, np.float32)
            word[position] = level
            seqs.append(word)
    for seq in seqs:
        words = quantize.pack(seq, h)
        assert words.dtype == np.float32 and is_normal(words)
        assert words.size == -(-seq.size // count)
        got = quantize.unpack(words, h, seq.size)
        np.testing.assert_array_equal(got, seq)
        assert not np.signbit(got[got == 0]).any()


@pytest.mark.parametrize('name', TYPES)
@pytest.mark.parametrize('n,block', [(1, 256), (7, 3), (256, 256), (257, 256), (1000, 7),
                                     (4099, 64), (21, 1)])
def test_the_servers_decode_is_the_workers_values_bit_for_bit(name, n, block):
    h = H[name]
    rs = np.random.RandomState(n + block)
    p = (rs.randn(n) * 10.0 ** rs.randint(-30, 3, size=n)).astype(np.float32)
    p[:block] = 0                      # a block of zeros: scale 0
    if n > 2 * block:
        p[block:2 * block] = -1e-30    # tiny values, negative: levels -0 must send +0
        p[block] = 1e-3
    payload, sent = quantize.encode(p, h, block)
    assert payload.size == quantize.payload_size(n, h, block) and payload.dtype == np.float32
    assert is_normal(payload[-(-n // block):])
    want, residual = reference.quantize_blockwise(np.zeros_like(p), p, h, block)
    np.testing.assert_array_equal(sent.view(np.uint32), want.view(np.uint32))
    decoded = quantize.decode(payload, h, block, n)
    np.testing.assert_array_equal(decoded.view(np.uint32), sent.view(np.uint32))
    # The error feedback keeps at most half a step per value.
    scales = np.repeat(payload[:-(-n // block)], block)[:n]
    assert np.all(np.abs(residual) <= scales * np.float32(0.5000001))
    np.testing.assert_array_equal(sent[:block], 0)


def test_a_damaged_payload_is_refused():
    payload, _ = quantize.encode(np.ones(10, np.float32), 1, 4)
    with pytest.raises(ValueError, match='a payload of 3 floats for a chunk of 10 values'):
        quantize.decode(payload[:3], 1, 4, 10)
    bad = payload.copy()
    bad[-1] = 0.0
    with pytest.raises(ValueError, match='zero, subnormal, inf or NaN'):
        quantize.decode(bad, 1, 4, 10)


def test_decode_rows_sums_in_rank_order_whatever_the_row_order():
    # Three workers' rows, merged with rank 2's row first: the servers' sum is the float32
    # sum c0 + c1 + c2 of the values each worker sent.
    n, block, h = 300, 32, 7
    rs = np.random.RandomState(0)
    grads = [(rs.randn(n) * 10.0 ** (3 * rank)).astype(np.float32) for rank in range(3)]
    encoded = [quantize.encode(g, h, block) for g in grads]
    rows = [2, 0, 1]
    merged = nd.sparse.row_sparse_array(
        (np.stack([encoded[r][0] for r in rows]), np.array(rows, dtype=np.int64)),
        shape=(3, encoded[0][0].size))
    stored, weight = nd.zeros(n), nd.zeros(n)
    decode = appliers.DecodeRows(appliers.CopySum(), {'type': 'int4', 'block_size': block})
    decode.apply(5, merged, weight, stored)
    want = (encoded[0][1] + encoded[1][1]) + encoded[2][1]
    np.testing.assert_array_equal(stored.asnumpy(), want)
    missing = nd.sparse.row_sparse_array((np.stack([encoded[0][0]] * 2),
                                          np.array([0, 2], dtype=np.int64)),
                                         shape=(3, encoded[0][0].size))
    with pytest.raises(RuntimeError, match=r'the rows of workers \[0, 2\], not of all 3'):
        decode.apply(5, missing, weight, stored)


# -- settings and refusals -------------------------------------------------------------------
@pytest.mark.parametrize('name', TYPES)
def test_the_codecs_are_registered_and_tell_the_servers(name):
    assert name in codecs.known_types()
    codec = codecs.parse({'type': name})
    assert codec.describe() == {'type': name, 'block_size': 256}
    assert codec.server_settings() == {'payload': {'type': name, 'block_size': 256}}
    assert appliers.check_codec(3, codec.server_settings()) == codec.server_settings()
    codec = codecs.parse({'type': name, 'block_size': 16})
    n = 1000
    assert codec.push_bytes(n, 'float32') == 4 * (-(-n // 16) + -(-n // quantize.digits_per_word(
        H[name]))) + 8
    store = offline_store(placed=False)
    store.set_gradient_compression({'type': name, 'block_size': 16})
    assert store.delayed.settings.compression.describe() == {'type': name, 'block_size': 16}


@pytest.mark.parametrize('params,error,message', [
    ({'type': 'int8', 'block_size': 0}, ValueError,
     r"\['block_size'\] must be an integer in 1..1048576, got 0; e.g. compression_params="),
    ({'type': 'int4', 'block_size': 2 ** 20 + 1}, ValueError, r"got 1048577"),
    ({'type': 'ternary', 'block_size': 1.5}, TypeError, r"got 1.5 \(float\)"),
    ({'type': 'ternary', 'block_size': True}, TypeError, r"got True \(bool\)"),
    ({'type': 'int8', 'block_size': '256'}, TypeError, r"got '256' \(str\)"),
    ({'type': 'int8', 'threshold': 0.5}, ValueError,
     r"unknown keys \['threshold'\] for type 'int8', which takes only 'block_size'"),
    ({'type': 'INT8'}, ValueError, r"must be one of .*'int4', 'int8', 'ternary'"),
])
def test_bad_parameters_are_refused_at_construction(params, error, message):
    with pytest.raises(error, match=message):
        codecs.parse(params)
    with pytest.raises(error, match=message):
        offline_store(placed=False).set_gradient_compression(params)
    with pytest.raises(error, match=message):
        mxdelay.DelayedTrainer(mlp_params([mx.cpu()]), 'sgd', dict(OPT), kvstore='dist_delay',
                               compression_params=params)


def test_the_servers_refuse_bad_payload_settings():
    for bad in ({'type': 'int2', 'block_size': 8}, {'type': 'int8', 'block_size': 0},
                {'type': 'int8'}, {'type': 'int8', 'block_size': 8, 'x': 1}):
        with pytest.raises(ValueError, match='codec setting payload='):
            appliers.check_codec(3, {'payload': bad})


def test_float16_parameters_and_row_sparse_keys_are_refused():
    with pytest.raises(ValueError, match=r"compression_params=\{'type': 'int4'\} needs float32 "
                                         r"parameters, but parameter b1 is float16"):
        mxdelay.DelayedTrainer(mlp_params([mx.cpu()], dtype='float16'), 'sgd',
                               {'learning_rate': 0.1, 'multi_precision': True},
                               kvstore='dist_delay', compression_params={'type': 'int4'})
    store = delay_store()
    store.set_gradient_compression({'type': 'ternary'})
    with pytest.raises(ValueError, match="key 3 is row_sparse: compression_params=.*ternary"):
        store.init(3, nd.sparse.zeros('row_sparse', (4, 2)))


@pytest.mark.parametrize('name', TYPES)
def test_amp_is_refused_when_the_store_is_created(name):
    trainer = mxdelay.DelayedTrainer(mlp_params([mx.cpu()]), 'sgd', dict(OPT),
                                     kvstore=delay_store(), compression_params={'type': name})
    trainer._amp_loss_scaler = LossScaler()   # what amp.init_trainer sets
    with pytest.raises(ValueError, match="AMP's dynamic loss scaling cannot be combined with "
                                         "compression_params=.*'%s'.*use "
                                         "compression_params=None with AMP" % name):
        trainer.rank  # pylint: disable=pointless-statement  (creates the kvstore)


@pytest.mark.parametrize('name', TYPES)
def test_a_bare_store_refuses_the_amp_flag_when_it_is_set(name):
    # The payload row cannot carry AMP's all-finite flag: a bare store refuses the flag
    # where it is given, once, not at each push; a codec whose pushes carry it takes it.
    store = offline_store(placed=False)
    store.set_gradient_compression({'type': name})
    with pytest.raises(ValueError, match=r"compression_params=\{'type': '%s', 'block_size': "
                                         r"256\} cannot carry the AMP overflow flag; train "
                                         r"without AMP or without compression_params" % name):
        store.delayed.rounds.set_finite_flag(nd.ones(1))
    carried = offline_store(placed=False)
    carried.set_gradient_compression({'type': 'fp16'})
    carried.delayed.rounds.set_finite_flag(nd.ones(1))


def test_chunks_stay_below_the_big_array_bound(monkeypatch):
    # MXNet splits a row_sparse key of MXNET_KVSTORE_BIGARRAY_BOUND elements or more over
    # the servers by rows: the (N, P) slot keys are kept below it by smaller chunks, and the
    # tensor still trains (w' == W).
    monkeypatch.setenv('MXNET_KVSTORE_BIGARRAY_BOUND', '1000')
    monkeypatch.setenv('MXDELAY_CHUNK_SIZE', '999')
    codec = codecs.parse({'type': 'int8', 'block_size': 1})
    assert largest_chunk(codec, 1, 1000) == 799   # 799 scales + 200 words < 1000
    assert largest_chunk(codec, 2, 1000) == 399   # 2 x (399 + 100) < 1000
    assert largest_chunk(codec, 10 ** 4, 1000) == 0
    kv = delay_store()
    kv.set_gradient_compression({'type': 'int8', 'block_size': 1})
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.5))
    kv.init(0, nd.ones(2000))
    tensor = kv._session.tensors[0]
    assert [(c.start, c.stop) for c in tensor.chunks] == [(0, 799), (799, 1598), (1598, 2000)]
    for chunk in tensor.chunks:
        assert np.prod(kv._session.native._stored[chunk.keys[0]].shape) < 1000
    grad = nd.array(np.linspace(-1, 1, 2000))
    kv.push(0, grad)
    out = nd.zeros(2000)
    kv.pull(0, out=out)
    sent = kv.delayed.rounds.sent_gradient(0, grad).asnumpy()
    np.testing.assert_array_equal(out.asnumpy(), np.float32(1) - np.float32(0.5) * sent)
    np.testing.assert_array_equal(server_weights(kv, 0), out.asnumpy())


# -- one process: the trainer against the servers and the reference ------------------------
@pytest.mark.parametrize('delay', [1, 4])
@pytest.mark.parametrize('name', TYPES)
@pytest.mark.parametrize('optimizer,params', [
    ('sgd', {'learning_rate': 0.1}),
    ('adam', {'learning_rate': 0.01}),
])
def test_one_worker_is_the_servers_model(delay, name, optimizer, params):
    # docs/design.md §1.6: the local rule reads the values this worker sent, c, which the
    # servers decode bit for bit: w' == W at every step.
    ctxs = [mx.cpu()]
    model = mlp_params(ctxs)
    kv = delay_store()
    trainer = mxdelay.DelayedTrainer(model, optimizer, dict(params), kvstore=kv, delay=delay,
                                     warmup_steps=2, compression_params={'type': name,
                                                                         'block_size': 16})
    for step in range(2 + 3 * delay + 2):
        backward_at(model, ctxs, step)
        trainer.step(BATCH)
        for i, param in enumerate(model):
            np.testing.assert_array_equal(param.data().asnumpy(), server_weights(kv, i),
                                          err_msg='step %d' % step)


def train(store, rank, steps, delay, warmup, compression_params, pull_compression=None):
    """Train mlp_model's parameters as worker `rank` on `store`; the weights after each step."""
    ctxs = [mx.cpu()]
    params = mlp_params(ctxs)
    trainer = mxdelay.DelayedTrainer(params, 'sgd', dict(OPT), kvstore=store, delay=delay,
                                     warmup_steps=warmup, compression_params=compression_params,
                                     pull_compression=pull_compression)
    history = []
    for t in range(steps):
        backward_at(params, ctxs, t, rank=rank)
        trainer.step(BATCH)
        history.append({p.name: p.data().asnumpy() for p in params})
    return history


def simulate(num_workers, steps, delay, warmup, setting, pull_compression=None,
             chunk_size=None):
    pull = None
    if pull_compression is not None:
        pull = 'fp16' if pull_compression['type'] == 'fp16' else (
            'int8', pull_compression.get('block_size', 256), chunk_size)
    return reference.simulate(
        mlp_model.init_params(), lambda w, rank, t: mlp_model.numpy_grad(
            w, *mlp_model.batch(rank, t, BATCH)), num_workers, steps, delay, warmup,
        OPT['learning_rate'], momentum=OPT['momentum'], wd=OPT['wd'], rescale_grad=1.0 / BATCH,
        pull_compression=pull,
        blockwise=None if setting is None else blockwise(setting, chunk_size))


CASES = [
    # (num_workers, num_servers, delay, warmup, compression_params, pull_compression)
    (1, 1, 1, 0, {'type': 'int8', 'block_size': 16}, None),
    (1, 2, 4, 2, {'type': 'ternary', 'block_size': 16}, None),
    (2, 1, 2, 3, {'type': 'int8', 'block_size': 16}, None),
    (3, 2, 3, 2, {'type': 'int4', 'block_size': 8}, None),
    (2, 2, 4, 1, {'type': 'ternary'}, None),
    (3, 1, 2, 1, {'type': 'ternary', 'block_size': 7}, None),
    (2, 2, 2, 2, {'type': 'int4', 'block_size': 16}, {'type': 'int8', 'block_size': 32}),
    (3, 2, 4, 1, {'type': 'ternary', 'block_size': 16}, {'type': 'fp16'}),
    (4, 2, 4, 2, {'type': 'ternary', 'block_size': 16}, {'type': 'int8', 'block_size': 16}),
]


@pytest.mark.parametrize('num_workers,num_servers,delay,warmup,setting,pull', CASES, ids=[
    'N%d-S%d-k%d-W%d-%s%d-pull%s' % (c[0], c[1], c[2], c[3], c[4]['type'],
                                      c[4].get('block_size', 256), c[5] and c[5]['type'])
    for c in CASES])
def test_workers_match_the_reference_bit_for_bit(monkeypatch, num_workers, num_servers, delay,
                                                 warmup, setting, pull):
    # Chunks of 50 elements: w1 (128) and w2 (64) span chunks, on both servers with 2; the
    # blocks restart at each chunk.
    monkeypatch.setenv('MXDELAY_CHUNK_SIZE', '50')
    steps = 12
    _, histories = run_workers(num_workers, lambda rank, store: train(
        store, rank, steps, delay, warmup, setting, pull), num_servers=num_servers)
    assert_equal_to_reference(histories, simulate(num_workers, steps, delay, warmup, setting, pull,
                                       chunk_size=50))
    assert differs_from_reference(histories, simulate(num_workers, steps, delay, warmup, None, pull,
                                       chunk_size=50))


def test_save_and_load_resume_bit_for_bit(tmp_path):
    # The residuals are saved with the trainer's states: a resumed trainer continues the
    # trajectory of the one that never stopped, bit for bit.
    args = dict(delay=3, warmup_steps=1, compression_params={'type': 'ternary',
                                                             'block_size': 8})
    params = mlp_params([mx.cpu()])
    full = train_steps(mxdelay.DelayedTrainer(params, 'sgd', dict(OPT), kvstore=delay_store(),
                                              **args), params, 0, 12)
    params = mlp_params([mx.cpu()])
    trainer = mxdelay.DelayedTrainer(params, 'sgd', dict(OPT), kvstore=delay_store(), **args)
    train_steps(trainer, params, 0, 6)
    residuals = trainer._kvstore.delayed.checkpoint.residuals()
    assert residuals and any(np.any(r != 0) for r in residuals.values())
    trainer.save_states(str(tmp_path / 'ckpt'))
    params2 = mlp_params([mx.cpu()])
    trainer2 = mxdelay.DelayedTrainer(params2, 'sgd', dict(OPT), kvstore=delay_store(), **args)
    trainer2.load_states(str(tmp_path / 'ckpt'))
    resumed = train_steps(trainer2, params2, 6, 6)
    for t, (got, want) in enumerate(zip(resumed, full[6:])):
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w, err_msg='step %d' % (6 + t))


# -- a real job ------------------------------------------------------------------------------
def replay(histories, config, setting, chunk_size):
    """The reference on the job's recorded gradients, each worker's quantized with its own
    residual."""
    def grad_fn(weights, rank, t):
        rounds = list(histories[rank]['rounds'])
        if t not in rounds:
            return {name: np.zeros_like(w) for name, w in weights.items()}
        return {name: histories[rank]['grad_' + name][rounds.index(t)] for name in MLP_NAMES}
    steps = max(int(h['rounds'][-1]) for h in histories.values()) + 1
    pull = config.get('pull_compression')
    return reference.simulate(
        mlp_model.init_params(), grad_fn, len(histories), steps, config['delay'],
        config['warmup_steps'], config['lr'], momentum=config['momentum'], wd=config['wd'],
        rescale_grad=1.0 / config['batch'], rule=config.get('local_rule', 'mirror'),
        pull_compression=pull and ('int8', pull.get('block_size', 256), chunk_size),
        blockwise=None if setting is None else blockwise(setting, chunk_size))


@pytest.mark.jobs
@pytest.mark.parametrize('setting,pull', [
    ({'type': 'ternary', 'block_size': 16}, None),
    ({'type': 'int8', 'block_size': 32}, {'type': 'int8', 'block_size': 16}),
], ids=['ternary16', 'int8-32-pull-int8'])
def test_a_two_worker_job_matches_the_reference_bit_for_bit(tmp_path, setting, pull):
    config = dict(MLP_BASE, compression=setting, record_grads=True, delay=2, warmup_steps=3,
                  **({'pull_compression': pull} if pull else {}))
    histories = run_mlp_job(tmp_path, 2, config, num_servers=2,
                            env={'MXDELAY_CHUNK_SIZE': 50})
    trajectory = replay(histories, config, setting, 50)
    assert_rounds_equal_reference(histories, trajectory)
    unquantized = replay(histories, config, None, 50)
    assert rounds_differ_from_reference(histories, unquantized)


@pytest.mark.jobs
def test_a_job_runs_the_compiled_kernels_on_workers_and_servers_bit_for_bit(tmp_path):
    # Ternary pushes and int8 pulls, 2 workers, 2 servers, chunks of 50 values: every push
    # is encoded by the compiled kernel on its worker, every round's rows are summed and
    # every pulled round encoded by the compiled kernels on the servers (their counts: the
    # workers' npz, the servers' last log line), and the job is the numpy reference's.
    kernels.require_compiled()   # built here; the job's processes load the cached library
    setting, pull, chunk = {'type': 'ternary', 'block_size': 16}, {'type': 'int8'}, 50
    config = dict(MLP_BASE, compression=setting, pull_compression=pull, record_grads=True,
                  delay=2, warmup_steps=3)
    out = tmp_path / 'out'
    out.mkdir()
    result = run_job([sys.executable, os.path.join(SCRIPTS, 'mlp_job.py'), json.dumps(config),
                      str(out)], num_workers=2, num_servers=2,
                     env={'MXDELAY_CHUNK_SIZE': chunk})
    assert_ok(result)
    histories = {rank: np.load(str(out / ('worker%d.npz' % rank))) for rank in range(2)}
    steps, sizes = config['steps'], [w.size for w in mlp_model.init_params().values()]
    chunks = sum(-(-size // chunk) for size in sizes)
    pulled = sum(reference.pulled_round(t, config['delay'], config['warmup_steps'])
                 for t in range(steps))
    for history in histories.values():
        assert json.loads(str(history['kernel_calls'])) == {
            'mxd_ternary_encode': steps * len(sizes)}   # one call a tensor a step
    served = collections.Counter()
    for rank in range(2):
        last = role_lines(result.stderr, 'server', rank)[-1]
        assert 'compiled codec kernels: ' in last, last
        served.update({name: int(count) for name, count in (
            call.split() for call in last.split('compiled codec kernels: ')[1].split(', '))})
    assert served == {'mxd_ternary_decode_sum': steps * chunks,
                      'mxd_i8pull_encode': pulled * chunks}
    trajectory = replay(histories, config, setting, chunk)
    assert_rounds_equal_reference(histories, trajectory)
    assert rounds_differ_from_reference(histories, replay(histories, config, None, chunk))


@pytest.mark.jobs
def test_join_with_uneven_data_is_exact(tmp_path):
    # Worker 1 has 5 batches per epoch against worker 0's 8 and joins at each epoch end: in
    # the rounds it fills it pushes zero gradients, through its quantizer (its residual goes
    # on being sent), as the reference does.
    setting = {'type': 'int4', 'block_size': 16}
    config = dict(MLP_BASE, compression=setting, record_grads=True, batches=[8, 5], epochs=2,
                  join=True, delay=2, warmup_steps=3)
    histories = run_mlp_job(tmp_path, 2, config)
    assert list(histories[1]['rounds']) == [t for t in range(16) if t % 8 < 5]
    trajectory = replay(histories, config, setting, None)
    assert_rounds_equal_reference(histories, trajectory)


# -- what else must keep working -------------------------------------------------------------
def test_two_devices_per_worker_and_sync_weights(monkeypatch):
    # Gradients on 2 devices (halves: their sum is exact) are summed, then quantized: the
    # same trajectory as one device, bit for bit; sync_weights then brings the servers' W.
    monkeypatch.setenv('MXDELAY_CHUNK_SIZE', '50')
    setting = {'type': 'ternary', 'block_size': 16}
    steps, delay, warmup = 10, 3, 1

    def work(rank, store):
        ctxs = contexts(2)
        params = mlp_params(ctxs)
        trainer = mxdelay.DelayedTrainer(params, 'sgd', dict(OPT), kvstore=store, delay=delay,
                                         warmup_steps=warmup, compression_params=setting)
        history = []
        for t in range(steps):
            backward_at(params, ctxs, t, rank=rank)
            trainer.step(BATCH)
            history.append({p.name: p.data(ctxs[1]).asnumpy() for p in params})
        trainer.sync_weights()
        synced = [p.data(ctx).asnumpy() for p in params for ctx in ctxs]
        servers = [server_weights(store, i) for i, _ in enumerate(params) for _ in ctxs]
        return history, synced, servers
    _, results = run_workers(2, work, num_servers=2)
    assert_equal_to_reference([r[0] for r in results], simulate(2, steps, delay, warmup, setting,
                                                     chunk_size=50))
    for _, synced, servers in results:
        for mine, theirs in zip(synced, servers):
            np.testing.assert_array_equal(mine, theirs)
    # The delayed phase's local weights were not W: sync_weights changed them.
    history, _, servers = results[0]
    assert any(not np.array_equal(history[-1][name], servers[2 * i])
               for i, name in enumerate(MLP_NAMES))


def test_gluon_trainer_on_dist_delay_is_synchronous_sgd_of_the_quantized_gradients():
    # gluon.Trainer on 'dist_delay' with the codec: every step a push of the quantized
    # gradient and a pull of W, i.e. the reference's warm-up (synchronous) phase.
    from mxnet import gluon
    setting = {'type': 'int8', 'block_size': 32}
    steps = 6

    def work(rank, store):
        params = mlp_params([mx.cpu()])
        trainer = gluon.Trainer(params, 'sgd', dict(OPT), kvstore=store,
                                compression_params=setting)
        history = []
        for t in range(steps):
            backward_at(params, [mx.cpu()], t, rank=rank)
            trainer.step(BATCH)
            history.append({p.name: p.data().asnumpy() for p in params})
        return history
    _, histories = run_workers(2, work)
    assert_equal_to_reference(histories, simulate(2, steps, 1, steps, setting))
    assert differs_from_reference(histories, simulate(2, steps, 1, steps, None))


def test_module_api_trains_with_the_codec_and_holds_the_servers_weights():
    # Module.fit on a 'dist_delay' store with compression_params: one worker, whose weights
    # after each batch are the servers' (update on kvstore), and which learn.
    data = mx.sym.Variable('data')
    net = mx.sym.FullyConnected(data, num_hidden=4, name='fc')
    net = mx.sym.SoftmaxOutput(net, name='softmax')
    rs = np.random.RandomState(0)
    x = rs.randn(48, 5).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.float32) + 2 * (x[:, 1] > 0)
    it = mx.io.NDArrayIter(x, y, batch_size=8)
    kv = delay_store()
    mod = mx.mod.Module(net, compression_params={'type': 'ternary', 'block_size': 8})
    mod.bind(it.provide_data, it.provide_label)
    mod.init_params(mx.init.Xavier())
    mod.init_optimizer(kvstore=kv, optimizer='sgd', optimizer_params={'learning_rate': 0.5})
    assert kv.delayed.settings.compression.describe() == {'type': 'ternary', 'block_size': 8}
    metric = mx.metric.Accuracy()
    accuracy = []
    for _ in range(6):
        it.reset()
        metric.reset()
        for batch in it:
            mod.forward_backward(batch)
            mod.update()
            mod.update_metric(metric, batch.label)
            args, _ = mod.get_params()
            for name in ('fc_weight', 'fc_bias'):
                np.testing.assert_array_equal(args[name].asnumpy(),
                                              server_weights(kv, name).reshape(
                                                  args[name].shape))
        accuracy.append(metric.get()[1])
    assert accuracy[-1] > 0.8 and accuracy[-1] > accuracy[0], accuracy


@pytest.mark.jobs
def test_other_and_smaller_batch_sizes_quantize_the_scaled_gradient(tmp_path):
    # Worker 1 uses batches of 4 against worker 0's 6, every epoch ends with a batch of 2,
    # and worker 1 joins: a worker whose batch differs pushes its gradient times the factor
    # (6 / its size), quantized with its residual; the local rule reads c / factor. The
    # servers' final W (sync_weights) bit for bit (the replayed gradients fix the pushes);
    # the local weights at 1e-6 (the rule scales c / factor by 1 / size, the reference c by
    # 1 / 6).
    setting = {'type': 'ternary', 'block_size': 16}
    config = dict(MLP_BASE, compression=setting, record_grads=True, batches=[3, 5], epochs=2,
                  join=True, delay=2, warmup_steps=2, batch_sizes={'1': 4}, last_batch=2,
                  sync_at_end=True)
    histories = run_mlp_job(tmp_path, 2, config)

    def grad_fn(weights, rank, t):
        rounds = list(histories[rank]['rounds'])
        if t not in rounds:
            return {name: np.zeros_like(w) for name, w in weights.items()}
        factor = np.float32(config['batch'] / batch_size(config, rank, t))
        return {name: histories[rank]['grad_' + name][rounds.index(t)] * factor
                for name in MLP_NAMES}
    steps = config['epochs'] * max(config['batches'])
    trajectory = reference.simulate(
        mlp_model.init_params(), grad_fn, 2, steps, config['delay'], config['warmup_steps'],
        config['lr'], momentum=config['momentum'], wd=config['wd'],
        rescale_grad=1.0 / config['batch'], blockwise=blockwise(setting))
    assert any(batch_size(config, 1, t) != config['batch'] for t in histories[1]['rounds'])
    for rank, history in histories.items():
        for name in MLP_NAMES:
            np.testing.assert_array_equal(history['synced_' + name],
                                          trajectory.glob[steps - 1][name])
    for rank, history in histories.items():
        for i, t in enumerate(history['rounds']):
            for name in MLP_NAMES:
                np.testing.assert_allclose(
                    history[name][i], trajectory.local[t][rank][name], rtol=1e-6, atol=1e-7,
                    err_msg='worker %d, round %d, parameter %s' % (rank, t, name))


@pytest.mark.jobs
def test_a_resumed_job_continues_bit_for_bit(tmp_path):
    # Saved at step 8 (delayed phase, a pull pending), resumed by a new job: steps 9..15
    # equal those of the job that never stopped (residuals, x̂ of the int8 pulls and the
    # servers' W restored).
    config = dict(MLP_BASE, compression={'type': 'int4', 'block_size': 16},
                  pull_compression={'type': 'int8', 'block_size': 16}, delay=3, warmup_steps=3)
    full = run_mlp_job(tmp_path / 'full', 2, config)
    run_mlp_job(tmp_path / 'first', 2, dict(config, save_at=8, stop_after=10))
    resumed = run_mlp_job(tmp_path / 'resumed', 2, dict(
        config, resume_from=str(tmp_path / 'first' / 'out' / 'ckpt')))
    for rank in range(2):
        assert int(resumed[rank]['first']) == 9
        for name in MLP_NAMES:
            np.testing.assert_array_equal(resumed[rank][name], full[rank][name][9:],
                                          err_msg='worker %d %s after resume' % (rank, name))


@pytest.mark.jobs
def test_stock_mxnet_merges_disjoint_row_sparse_pushes_bit_for_bit():
    # The premise of the wire, on MXNet's own server and workers (no mxdelay in any role):
    # 3 workers, 3 rounds, each worker's row of packed words and scales comes back with
    # every bit. The control word, a signalling NaN, shows that the check sees a changed
    # bit: the merge's float additions return it quieted (seen in every row; a merge that
    # copied the first row it received would leave that one, hence 'at least once').
    width, rounds, workers = 4000, 3, 3
    result = run_job([sys.executable, ROWS_WIRE_JOB, str(width), str(rounds)],
                     num_workers=workers, num_servers=1, timeout=120)
    assert_ok(result)
    results = kv_results(result)
    assert sorted(results) == list(range(workers))
    for rank, data in results.items():
        assert not data['mxdelay_imported']
        changed = [words for round_rows in data['differing'] for words in round_rows]
        assert len(changed) == rounds * workers
        assert all(words in ([], [width - 1]) for words in changed), (rank, data['differing'])
        assert [width - 1] in changed, 'the control word came back unchanged: %r' % changed


def test_the_heap_thresholds_are_set_once_where_glibc_accepts_them(monkeypatch):
    from kvstore_ext.codecs import heap  # pylint: disable=import-outside-toplevel
    import platform  # pylint: disable=import-outside-toplevel
    if platform.libc_ver()[0] != 'glibc':
        pytest.skip('mallopt is glibc\'s')
    calls = []
    monkeypatch.setattr(heap, '_DONE', [])
    real = heap._set  # pylint: disable=protected-access
    monkeypatch.setattr(heap, '_set', lambda: calls.append(1) or real())
    assert heap.keep_large_blocks() is True     # glibc accepted both settings
    assert heap.keep_large_blocks() is True and calls == [1]
