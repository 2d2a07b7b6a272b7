"""Compressed pulls (``pull_compression``, docs/design.md §2.12): the servers keep the model
they last sent, x̂, send ``C(W - x̂)`` at every pulled round, and every worker adds the same
decoded values to its own x̂.

What is tested, and against what:

- the numpy reference (tests/reference.py with ``pull_compression``) **bit for bit**, in
  one process through the real store and servers: one worker (support/native.py) and 2 and
  3 workers in threads (support/native_workers.py), warm-up and k > 1, 'fp16' and 'int8',
  uncompressed, 2bit and float16 pushes, 1 and 2 servers with chunks; the gradients are Gluon's
  backward made exactly mlp_model's numpy gradient (support/model.py), so every bit left
  is the store's, the servers' and the rules'. Each case also checks that the reference
  without compressed pulls differs (the test sees the compression);
- after every applied pull every worker's x̂ is the servers' x̂, bit for bit;
- error feedback: with W fixed, repeated pulls bring x̂ to W (no drift);
- ``sync_weights`` gives exactly W and leaves x̂ (workers' and servers') untouched;
  a checkpoint resumes bit for bit (both also with float16 pushes, whose exact pulls read
  their pull keys while the compressed ones read the model keys);
- the codecs alone (server encode, worker decode: the same float32 bits) and the bytes a
  pull carries, from the model keys' sizes;
- refusals: bad parameters, row_sparse parameters, AMP, a store without a schedule, a
  compressed pull at a round that is not pulled, or after a skipped one; float16 pushes
  are taken (once refused), with both the pull keys and the model keys;
- real 2-worker jobs against the reference (marked ``jobs``): fp16 pulls; int8 pulls with
  2bit pushes; int8 pulls with float16 pushes.
"""
import numpy as np
import pytest

import mxdelay
import mxnet as mx
from mxnet import gluon, nd
from mxnet.contrib.amp.loss_scaler import LossScaler

import reference
from kvstore_ext.codecs import pulls
from kvstore_ext.protocol.schedule import PullSchedule
from kvstore_ext.worker.wires.pulls import Payload
from kvstore_ext.protocol.keys import KeyLayout
from mxdelay.schedule import DelaySchedule
from scripts import mlp_model
from support.model import (BATCH, MLP_NAMES, backward_at, mlp_params, numpy_grad,
                           train_steps)
from support.native import delay_store, server_weights
from support.native_workers import run_workers
from support.reference_jobs import (MLP_BASE, assert_equal_to_reference, differs_from_reference,
                                    run_mlp_job)

FP16 = {'type': 'fp16'}
INT8 = {'type': 'int8', 'block_size': 32}
PUSH_FP16 = {'type': 'fp16'}            # compression_params: float16 pushes (§2.11)
PUSH_2BIT = {'type': '2bit', 'threshold': 0.5}
OPT = {'learning_rate': 0.1, 'momentum': 0.9, 'wd': 1e-3}


def reference_of(pull_compression, chunk_size=None):
    """The reference's name of a pull_compression setting (int8 blocks within chunks of
    `chunk_size`)."""
    if pull_compression is None:
        return None
    if pull_compression['type'] == 'fp16':
        return 'fp16'
    return ('int8', pull_compression.get('block_size', pulls.DEFAULT_BLOCK), chunk_size)


def push_of(compression):
    """The reference's arguments for the pushes of `compression` (compression_params)."""
    return {'fp16': compression == PUSH_FP16,
            'compression_threshold': compression and compression.get('threshold')}


def simulate(num_workers, steps, delay, warmup, pull_compression, compression=None,
             chunk_size=None):
    return reference.simulate(mlp_model.init_params(), numpy_grad, num_workers, steps, delay,
                              warmup, OPT['learning_rate'], momentum=OPT['momentum'],
                              wd=OPT['wd'], rescale_grad=1.0 / BATCH,
                              pull_compression=reference_of(pull_compression, chunk_size),
                              **push_of(compression))


def models_of(store):
    """{key: (worker's x̂, servers' x̂)} of every tensor of `store`."""
    out = {}
    for key, tensor in store._session.tensors.items():
        servers = store._session.native.servers
        theirs = np.concatenate([servers[c.server].pulled_model(c.chunk_id)
                                 for c in tensor.chunks])
        out[key] = (tensor.pull_state.model.asnumpy(), theirs)
    return out


def train(store, rank, steps, delay, warmup, pull_compression, compression=None, after=None):
    """Train mlp_model's parameters as worker `rank` on `store`; return the weights after
    every step and, per step, whether x̂ equals the servers' on every tensor."""
    ctxs = [mx.cpu()]
    params = mlp_params(ctxs)
    trainer = mxdelay.DelayedTrainer(params, 'sgd', dict(OPT), kvstore=store, delay=delay,
                                     warmup_steps=warmup, pull_compression=pull_compression,
                                     compression_params=compression)
    history, agreed = [], []
    for t in range(steps):
        backward_at(params, ctxs, t, rank=rank)
        trainer.step(BATCH)
        history.append({p.name: p.data().asnumpy() for p in params})
        if pull_compression is not None and reference.pulled_round(t, delay, warmup):
            agreed.append(all(np.array_equal(mine, theirs)
                              for mine, theirs in models_of(store).values()))
    if after is not None:
        after(trainer, params)
    return history, agreed


# -- the schedule ----------------------------------------------------------------------------
@pytest.mark.parametrize('delay,warmup', [(1, 0), (2, 3), (4, 0), (3, 5)])
def test_pulled_rounds_are_the_trainers_pulls(delay, warmup):
    schedule = DelaySchedule(delay, warmup)
    pull_schedule = PullSchedule(delay, warmup)
    pulled = [t for t in range(60) if schedule.is_synchronous(t) or schedule.issues_pull(t)]
    assert [t for t in range(60) if pull_schedule.pulled(t)] == pulled
    assert [t for t in range(60) if reference.pulled_round(t, delay, warmup)] == pulled
    for t in range(60):
        assert pull_schedule.previous(t) == max([r for r in pulled if r < t] + [-1]), t


# -- the codecs ------------------------------------------------------------------------------
@pytest.mark.parametrize('setting', [FP16, INT8, {'type': 'int8'}])
@pytest.mark.parametrize('n', [1, 7, 32, 100, 513])
def test_worker_decodes_the_servers_values_bit_for_bit(setting, n):
    codec = pulls.parse(setting)
    rs = np.random.RandomState(n)
    d = (rs.randn(n) * 10.0 ** rs.randint(-6, 2, size=n)).astype(np.float32)
    d[:min(n, 3)] = 0    # a block of zeros in int8 when n is small
    payload, dec = codec.encode(d)
    assert payload.dtype == np.float32 and payload.size == codec.payload_size(n)
    # The reference's own formula.
    want = reference.pull_fp16(d) if setting is FP16 else reference.pull_int8(
        d, setting.get('block_size', 256))
    if setting is not FP16 and n > 40:   # the reference's chunks: each codes alone
        halves = np.concatenate([codec.encode(d[i:i + 40])[1] for i in range(0, n, 40)])
        np.testing.assert_array_equal(reference.pull_int8(d, setting.get('block_size', 256),
                                                          40), halves)
    np.testing.assert_array_equal(dec, want)
    # The worker: the payload's bytes pulled into its buffer, decoded in MXNet's engine.
    buf = Payload(codec, n)
    nd.array(payload, dtype=np.float32).copyto(buf.payload)
    model = nd.array(np.arange(n, dtype=np.float32))
    buf.decode_into(model)
    np.testing.assert_array_equal(model.asnumpy(), np.arange(n, dtype=np.float32) + dec)


def test_fp16_encoding_rounds_as_numpy_on_every_float16_midpoint():
    # The server casts with MXNet (faster); the reference with numpy: the same bits, ties
    # to even, overflow to inf, subnormals included.
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    h = np.sort(h[np.isfinite(h)].astype(np.float64))
    mid = ((h[:-1] + h[1:]) / 2).astype(np.float32)
    d = np.concatenate([mid, np.nextafter(mid, np.float32(np.inf)),
                        np.nextafter(mid, np.float32(-np.inf)),
                        np.array([65520, 1e6, -1e6, 1e-9], np.float32)])
    payload, dec = pulls.parse(FP16).encode(d)
    want = d.astype(np.float16)
    np.testing.assert_array_equal(payload.view(np.float16)[2:2 + d.size].view(np.uint16),
                                  want.view(np.uint16))
    np.testing.assert_array_equal(dec, want.astype(np.float32))


def test_int8_levels_and_scales():
    codec = pulls.parse({'type': 'int8', 'block_size': 4})
    d = np.array([1.27, -0.635, 0, 0.01, 0, 0, 0, 0, 3], dtype=np.float32)
    _, dec = codec.encode(d)
    scale = np.float32(1.27) / np.float32(127)
    np.testing.assert_array_equal(dec[:4], np.array([127, -64, 0, 1], np.float32) * scale)
    np.testing.assert_array_equal(dec[4:8], 0)          # a block of zeros: scale 0
    assert dec[8] == np.float32(3)                      # max|d| / 127 * 127
    assert codec.payload_size(9) == 1 + 3 + 3           # header, 3 scales, 12 bytes


def test_bytes_per_pull_from_the_model_keys():
    n = 1 << 20
    assert pulls.payload_bytes(None, n) == 4 * n
    assert pulls.payload_bytes(pulls.parse(FP16), n) == 4 + 2 * n
    assert pulls.payload_bytes(pulls.parse({'type': 'int8'}), n) \
        == 4 + 4 * 4096 + n
    # The store's model keys have these sizes (what each pull of the model key carries).
    store = delay_store()
    store.delayed.settings.set_config(delay=2, warmup_steps=1)
    store.delayed.settings.set_pull_compression({'type': 'int8'})
    store.init(0, nd.zeros(1000))
    native = store._session.native
    chunk = store._session.tensors[0].chunks[0]
    assert native._stored[chunk.model_key].size == 1 + 4 + 256 == \
        pulls.parse({'type': 'int8'}).payload_size(1000)


def test_model_keys_follow_the_state_keys_and_leave_other_keys_unchanged():
    plain = KeyLayout(2, 5, state_keys=2)
    with_model = KeyLayout(2, 5, state_keys=2, model_keys=1)
    for server in range(2):
        # Chunk 0's slot and state keys are unchanged; each chunk's block has one more key.
        assert [with_model.slot_key(0, s, server) for s in range(5)] \
            == [plain.slot_key(0, s, server) for s in range(5)]
        assert with_model.state_key(0, 1, server) == plain.state_key(0, 1, server)
        for local in range(3):
            key = with_model.model_key(local, server)
            assert with_model.decode(key) == ('model', local, 0)
            assert with_model.server_of(key) == server
            assert key == with_model.state_key(local, 1, server) + 2   # the next index
            assert with_model.decode(with_model.state_key(local, 1, server)) \
                == ('state', local, 1)
            assert with_model.decode(with_model.slot_key(local + 1, 0, server)) \
                == ('slot', local + 1, 0)
    with pytest.raises(ValueError, match='no model keys'):
        plain.model_key(0, 0)


# -- against the reference, in one process -------------------------------------------------
@pytest.mark.parametrize('setting', [FP16, INT8])
@pytest.mark.parametrize('delay,warmup', [(1, 0), (3, 2)])
@pytest.mark.parametrize('compression', [None, PUSH_FP16], ids=['push32', 'push16'])
def test_one_worker_matches_the_reference_bit_for_bit(setting, delay, warmup, compression):
    history, agreed = train(delay_store(), 0, 12, delay, warmup, setting, compression)
    assert all(agreed) and agreed
    assert_equal_to_reference([history], simulate(1, 12, delay, warmup, setting, compression))
    assert differs_from_reference([history], simulate(1, 12, delay, warmup, None, compression))


CASES = [
    # (num_workers, num_servers, delay, warmup, pull setting, compression_params)
    (2, 1, 2, 3, FP16, None),
    (3, 2, 3, 2, FP16, None),
    (2, 2, 4, 0, INT8, None),
    (3, 1, 2, 1, {'type': 'int8'}, None),
    (2, 1, 2, 2, FP16, PUSH_2BIT),
    (3, 2, 3, 1, INT8, PUSH_2BIT),
    (2, 2, 2, 3, FP16, PUSH_FP16),
    (3, 1, 3, 2, FP16, PUSH_FP16),
    (2, 1, 4, 0, INT8, PUSH_FP16),
    (3, 2, 2, 1, INT8, PUSH_FP16),
]


@pytest.mark.parametrize('num_workers,num_servers,delay,warmup,setting,compression', CASES,
                         ids=['N%d-S%d-k%d-W%d-%s-push%s'
                              % (c[0], c[1], c[2], c[3], c[4]['type'],
                                 {None: '32', 'fp16': '16', '2bit': '2bit'}[
                                     c[5] and c[5]['type']]) for c in CASES])
def test_workers_match_the_reference_bit_for_bit(monkeypatch, num_workers, num_servers, delay,
                                                 warmup, setting, compression):
    # Chunks of 50 elements: w1 (128) and w2 (64) span chunks, on both servers with 2.
    monkeypatch.setenv('MXDELAY_CHUNK_SIZE', '50')
    steps = 12

    def work(rank, store):
        return train(store, rank, steps, delay, warmup, setting, compression)
    _, results = run_workers(num_workers, work, num_servers=num_servers)
    histories = [history for history, _ in results]
    for _, agreed in results:
        assert agreed and all(agreed), 'a worker\'s x̂ differed from the servers\''
    assert_equal_to_reference(histories, simulate(num_workers, steps, delay, warmup, setting, compression,
                                       chunk_size=50))
    assert differs_from_reference(histories, simulate(num_workers, steps, delay, warmup, None, compression))


def test_no_drift_repeated_pulls_bring_the_model_to_w():
    # lr 0 after the first rounds: W stays; each pull sends what the last one did not.
    kv = delay_store()
    kv.delayed.settings.set_config(delay=1, warmup_steps=100)
    kv.delayed.settings.set_pull_compression({'type': 'int8', 'block_size': 8})
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=1.0))
    rs = np.random.RandomState(3)
    kv.init(0, nd.array(rs.randn(40)))
    out = nd.zeros(40)
    kv.push(0, nd.array(rs.randn(40)))
    kv.delayed.rounds.pull_compressed(0, out=out)
    W = server_weights(kv, 0)
    first = np.abs(W - out.asnumpy()).max()
    assert first > 1e-4
    kv.set_learning_rate(0.0)
    errors = []
    for _ in range(4):
        kv.push(0, nd.zeros(40))
        kv.delayed.rounds.pull_compressed(0, out=out)
        errors.append(np.abs(W - out.asnumpy()).max())
    np.testing.assert_array_equal(server_weights(kv, 0), W)
    assert errors[0] < first / 50 and errors[-1] <= 4e-7 * np.abs(W).max(), (first, errors)


# -- exact pulls, checkpoints ------------------------------------------------------------------
@pytest.mark.parametrize('setting,compression', [(FP16, None), (INT8, PUSH_FP16)],
                         ids=['fp16-push32', 'int8-push16'])
def test_sync_weights_is_exact_and_leaves_the_pulled_model(monkeypatch, setting, compression):
    # With float16 pushes sync_weights reads the pull keys, the compressed pulls the model
    # keys: both hold what they should after the same rounds.
    monkeypatch.setenv('MXDELAY_CHUNK_SIZE', '50')
    seen = {}

    def after(trainer, params):
        before = {k: v for k, v in trainer._kvstore.delayed.checkpoint.pulled_models().items()}
        trainer.sync_weights()
        store = trainer._kvstore
        for state in trainer._delayed.states:
            np.testing.assert_array_equal(state.param.data().asnumpy(),
                                          server_weights(store, state.index))
        for key, (model, rnd) in store.delayed.checkpoint.pulled_models().items():
            np.testing.assert_array_equal(model, before[key][0])
            assert rnd == before[key][1]
        seen[store.rank] = models_of(store)

    run_workers(2, lambda rank, store: train(store, rank, 9, 2, 1, setting, compression,
                                             after=after))
    for key, (mine, theirs) in seen[0].items():
        np.testing.assert_array_equal(mine, theirs)
        np.testing.assert_array_equal(mine, seen[1][key][0])


@pytest.mark.parametrize('compression', [None, PUSH_FP16], ids=['push32', 'push16'])
def test_save_and_load_resume_bit_for_bit(tmp_path, compression):
    args = dict(delay=3, warmup_steps=1, pull_compression=INT8, compression_params=compression)
    params = mlp_params([mx.cpu()])
    full = train_steps(mxdelay.DelayedTrainer(params, 'sgd', dict(OPT), kvstore=delay_store(),
                                              **args), params, 0, 12)
    params = mlp_params([mx.cpu()])
    trainer = mxdelay.DelayedTrainer(params, 'sgd', dict(OPT), kvstore=delay_store(), **args)
    train_steps(trainer, params, 0, 6)        # step 5 ends a period: a pull pending
    trainer.save_states(str(tmp_path / 'ckpt'))
    params2 = mlp_params([mx.cpu()])
    trainer2 = mxdelay.DelayedTrainer(params2, 'sgd', dict(OPT), kvstore=delay_store(), **args)
    trainer2.load_states(str(tmp_path / 'ckpt'))
    assert (trainer2._kvstore.delayed.checkpoint.pulled_models().keys()
            == trainer._kvstore.delayed.checkpoint.pulled_models().keys())
    resumed = train_steps(trainer2, params2, 6, 6)
    for t, (got, want) in enumerate(zip(resumed, full[6:])):
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w, err_msg='step %d' % (6 + t))
    # Another pull_compression cannot resume from it.
    params3 = mlp_params([mx.cpu()])
    other = mxdelay.DelayedTrainer(params3, 'sgd', dict(OPT), kvstore=delay_store(),
                                   **dict(args, pull_compression=FP16))
    with pytest.raises(ValueError, match="pull_compression .*'int8'.*resume with the same"):
        other.load_states(str(tmp_path / 'ckpt'))


# -- refusals --------------------------------------------------------------------------------
@pytest.mark.parametrize('value,match', [
    ('fp16', "pull_compression must be a dict or None, got 'fp16'"),
    ({'type': 'fp8'}, r"pull_compression=\{'type': 'fp8'\}: 'type' must be one of "
                      r"\['fp16', 'int8'\]"),
    ({'type': 'fp16', 'block_size': 4}, "'fp16' takes no other setting.*block_size"),
    ({'type': 'int8', 'blocks': 4}, "'int8' takes only 'block_size'"),
    ({'type': 'int8', 'block_size': 0}, r"pull_compression\['block_size'\].*0"),
    ({'type': 'int8', 'block_size': 2.5}, r"pull_compression\['block_size'\]"),
])
def test_bad_parameters_are_refused_at_construction(value, match):
    with pytest.raises(ValueError, match=match):
        mxdelay.DelayedTrainer(mlp_params([mx.cpu()]), 'sgd', dict(OPT),
                               kvstore='dist_delay', pull_compression=value)


def test_fp16_pushes_take_compressed_pulls_with_pull_keys_and_model_keys():
    # Once refused: float16 pushes pull from float32 pull keys of their own. Now a chunk has
    # both, and the trainer takes the combination.
    mxdelay.DelayedTrainer(mlp_params([mx.cpu()]), 'sgd', dict(OPT), kvstore='dist_delay',
                           compression_params=PUSH_FP16, pull_compression=INT8)
    store = delay_store()
    store.set_gradient_compression(PUSH_FP16)
    store.delayed.settings.set_config(delay=2, warmup_steps=0)
    store.delayed.settings.set_pull_compression(INT8)
    store.set_optimizer(mx.optimizer.SGD(learning_rate=0.5))
    rs = np.random.RandomState(5)
    w0 = rs.randn(70).astype(np.float32)
    store.init(0, nd.array(w0))
    chunk = store._session.tensors[0].chunks[0]
    native = store._session.native
    assert chunk.pull_keys != chunk.keys and chunk.model_key not in chunk.pull_keys
    assert {np.dtype(native._stored[k].dtype) for k in chunk.keys} == {np.dtype(np.float16)}
    assert {np.dtype(native._stored[k].dtype) for k in chunk.pull_keys + [chunk.model_key]} \
        == {np.dtype(np.float32)}
    out, exact = nd.zeros(70), nd.zeros(70)
    xhat = w0
    for rnd in range(5):
        grad = rs.randn(70).astype(np.float32)
        store.push(0, nd.array(grad))
        w = server_weights(store, 0)
        np.testing.assert_array_equal(w, w0 - np.float32(0.5) * grad.astype(np.float16)
                                      .astype(np.float32))
        w0 = w
        if rnd % 2 == 0:          # rounds 0, 2, 4 are pulled (k = 2, W = 0)
            store.delayed.rounds.pull_compressed(0, out=out)
            xhat = xhat + reference.pull_int8(w - xhat, INT8['block_size'])
            np.testing.assert_array_equal(out.asnumpy(), xhat)
            np.testing.assert_array_equal(store._session.tensors[0].pull_state.model.asnumpy(),
                                          native.servers[0].pulled_model(chunk.chunk_id))
        store.pull(0, out=exact)  # the pull key: W exactly, every round
        np.testing.assert_array_equal(exact.asnumpy(), w)
    assert not np.array_equal(xhat, w)


def test_row_sparse_parameters_are_refused():
    net = gluon.nn.Embedding(20, 3, sparse_grad=True)
    net.initialize()
    with pytest.raises(ValueError, match="(?s)pull_compression=.*row_sparse parameters.*"
                                         "grad_stype='row_sparse'.*pull_compression=None"):
        mxdelay.DelayedTrainer(net.collect_params(), 'sgd', dict(OPT), kvstore='dist_delay',
                               pull_compression=FP16)
    store = delay_store()
    store.delayed.settings.set_config(delay=2, warmup_steps=1)
    store.delayed.settings.set_pull_compression(FP16)
    with pytest.raises(ValueError, match='key 0 is row_sparse, which pull_compression'):
        store.init(0, nd.sparse.zeros('row_sparse', (4, 2)))


@pytest.mark.parametrize('compression,match', [
    (None, 'pull_compression=.*cannot be combined with AMP'),
    # Float16 pushes take compressed pulls now, but not AMP (its own refusal, §11).
    (PUSH_FP16, "AMP's dynamic loss scaling cannot be combined with compression_params=.*fp16")],
    ids=['push32', 'push16'])
def test_amp_is_refused_when_the_store_is_created(compression, match):
    trainer = mxdelay.DelayedTrainer(mlp_params([mx.cpu()]), 'sgd', dict(OPT),
                                     kvstore=delay_store(), pull_compression=FP16,
                                     compression_params=compression)
    trainer._amp_loss_scaler = LossScaler()   # what amp.init_trainer sets
    with pytest.raises(ValueError, match=match):
        trainer.rank  # pylint: disable=pointless-statement  (creates the kvstore)


def test_bare_store_needs_the_schedule():
    store = delay_store()
    store.delayed.settings.set_pull_compression(FP16)
    with pytest.raises(ValueError, match=r'(?s)needs the pull schedule.*delay and '
                                         r'warmup_steps.*set_config\(delay=k, warmup_steps=W\)'):
        store.init(0, nd.zeros(3))


def test_compressed_pull_only_at_pulled_rounds_and_none_skipped():
    store = delay_store()
    store.delayed.settings.set_config(delay=2, warmup_steps=0)
    store.delayed.settings.set_pull_compression(FP16)
    store.init(0, nd.zeros(3))
    out = nd.zeros(3)
    with pytest.raises(ValueError, match='after round -1: with pull_compression'):
        store.delayed.rounds.pull_compressed(0, out=out)
    store.push(0, nd.ones(3))
    store.delayed.rounds.pull_compressed(0, out=out)          # round 0: warm-up/switch
    store.push(0, nd.ones(3))
    with pytest.raises(ValueError, match=r'after round 1: .*every delay=2-th\); use pull\(\)'):
        store.delayed.rounds.pull_compressed(0, out=out)
    store.push(0, nd.ones(3))                  # round 2 is pulled
    store.push(0, nd.ones(3))
    store.push(0, nd.ones(3))                  # round 4 too; round 2 was skipped
    with pytest.raises(ValueError, match='the compressed pull of round 2 was skipped'):
        store.delayed.rounds.pull_compressed(0, out=out)
    store.pull(0, out=out)                     # the exact pull is always there
    np.testing.assert_array_equal(out.asnumpy(), server_weights(store, 0))
    with pytest.raises(ValueError, match='set_pull_compression must be called before'):
        store.delayed.settings.set_pull_compression(FP16)


# -- a real job -----------------------------------------------------------------------------
@pytest.mark.jobs
@pytest.mark.parametrize('setting,compression', [(FP16, None), (INT8, PUSH_2BIT),
                                                 (INT8, PUSH_FP16)],
                         ids=['fp16-push32', 'int8-push2bit', 'int8-push16'])
def test_two_worker_job_matches_the_reference_bit_for_bit(tmp_path, setting, compression):
    config = dict(MLP_BASE, delay=3, warmup_steps=2, pull_compression=setting,
                  record_grads=True, sync_at_end=True,
                  **({'compression': compression} if compression else {}))
    histories = run_mlp_job(tmp_path, 2, config, env={'MXDELAY_CHUNK_SIZE': 50})

    def replay(pull_compression):
        def grad_fn(weights, rank, t):
            return {name: histories[rank]['grad_' + name][t] for name in MLP_NAMES}
        return reference.simulate(
            mlp_model.init_params(), grad_fn, 2, config['steps'], config['delay'],
            config['warmup_steps'], config['lr'], momentum=config['momentum'], wd=config['wd'],
            rescale_grad=1.0 / config['batch'], pull_compression=pull_compression,
            **push_of(compression))
    trajectory = replay(reference_of(setting, 50))
    for rank, history in histories.items():
        for t in range(config['steps']):
            for name in MLP_NAMES:
                np.testing.assert_array_equal(history[name][t], trajectory.local[t][rank][name],
                                              err_msg='worker %d, step %d, %s' % (rank, t, name))
            if t:   # the recorded gradient is the model's at the recorded weights
                x, y = mlp_model.batch(rank, t, config['batch'])
                weights = {name: history[name][t - 1] for name in MLP_NAMES}
                for name, grad in mlp_model.numpy_grad(weights, x, y).items():
                    np.testing.assert_allclose(history['grad_' + name][t], grad, atol=1e-5)
        for name in MLP_NAMES:   # sync_weights: exactly W
            np.testing.assert_array_equal(history['synced_' + name],
                                          trajectory.glob[-1][name])
    plain = replay(None)
    assert any(not np.array_equal(h[name][t], plain.local[t][r][name])
               for r, h in histories.items() for name in MLP_NAMES
               for t in range(config['steps']))


# -- the servers' rounds ----------------------------------------------------------------------
def test_a_held_round_writes_its_payload_when_it_is_applied():
    # delay 2, warmup 0: rounds 0, 2, 4 are pulled. Round 2 completes before round 1 and is
    # held; its payload is written when it is applied, after round 1 (rounds in order,
    # docs/design.md §3.2). (A round after a pulled one cannot complete before that pull
    # was served: each worker's next push waits for it, §2.12.)
    from kvstore_ext.server.rounds import RoundKeeper
    codec = pulls.parse(FP16)
    n = 5

    def keeper_with(order):
        keeper = RoundKeeper(slots=3)
        keeper.updates.install(mx.optimizer.SGD(learning_rate=0.5))
        keeper.updates.register(0)
        keeper.models.set_codec(codec, PullSchedule(2, 0))
        store = nd.zeros(codec.payload_size(n))
        keeper.models.set_store(0, store)
        slots = [nd.ones(n) * 0.25 for _ in range(3)]
        payloads = {}
        for rnd in order:
            keeper.on_round(0, rnd % 3, nd.array(np.arange(n) * 0.1 + rnd), slots[rnd % 3])
            payloads[rnd] = store.asnumpy().copy()
        return keeper, payloads
    in_order, want = keeper_with([0, 1, 2])
    held, got = keeper_with([0, 2, 1])
    assert held.applied_rounds(0) == 3
    np.testing.assert_array_equal(got[2], want[0])   # held: the payload is still round 0's
    np.testing.assert_array_equal(got[1], want[2])   # round 2's, once applied
    np.testing.assert_array_equal(held.models.model(0), in_order.models.model(0))
    # x̂ after rounds 0 and 2: W_0 + dec(q_0) + dec(q_2), computed as the reference does.
    w = [np.full(n, 0.25, np.float32)]
    for rnd in range(3):
        w.append(w[-1] - np.float32(0.5) * (np.arange(n) * 0.1 + rnd).astype(np.float32))
    xhat = w[0] + reference.pull_fp16(w[1] - w[0])
    xhat = xhat + reference.pull_fp16(w[3] - xhat)
    np.testing.assert_array_equal(held.models.model(0), xhat)


# -- uneven data, devices --------------------------------------------------------------------
def test_join_with_uneven_data_matches_the_reference():
    # Worker 1 has 6 batches, worker 0 has 11: worker 1 joins and pushes zero gradients in
    # rounds 6-10, with its local steps and its compressed pulls.
    steps, short, delay, warmup = 11, 6, 2, 2

    def work(rank, store):
        ctxs = [mx.cpu()]
        params = mlp_params(ctxs)
        trainer = mxdelay.DelayedTrainer(params, 'sgd', dict(OPT), kvstore=store, delay=delay,
                                         warmup_steps=warmup, pull_compression=INT8)
        history = []
        for t in range(steps if rank == 0 else short):
            backward_at(params, ctxs, t, rank=rank)
            trainer.step(BATCH)
            history.append({p.name: p.data().asnumpy() for p in params})
        filled = trainer.join()
        return history, filled, trainer.schedule.step
    _, results = run_workers(2, work)
    assert [r[1:] for r in results] == [(0, steps), (steps - short, steps)]

    def grad_fn(weights, rank, t):
        if rank == 1 and t >= short:
            return {name: np.zeros_like(w) for name, w in weights.items()}
        return numpy_grad(weights, rank, t)
    trajectory = reference.simulate(
        mlp_model.init_params(), grad_fn, 2, steps, delay, warmup, OPT['learning_rate'],
        momentum=OPT['momentum'], wd=OPT['wd'], rescale_grad=1.0 / BATCH,
        pull_compression=reference_of(INT8))
    assert_equal_to_reference([results[0][0], results[1][0]], trajectory)


def test_two_devices_get_the_pulled_model():
    ctxs = [mx.cpu(0), mx.cpu(1)]
    params = mlp_params(ctxs)
    trainer = mxdelay.DelayedTrainer(params, 'sgd', dict(OPT), kvstore=delay_store(), delay=2,
                                     warmup_steps=2, pull_compression=FP16)
    history = []
    for t in range(9):
        backward_at(params, ctxs, t)
        trainer.step(BATCH)
        for p in params:
            np.testing.assert_array_equal(p.data(ctxs[0]).asnumpy(), p.data(ctxs[1]).asnumpy())
        history.append({p.name: p.data(ctxs[0]).asnumpy() for p in params})
    assert_equal_to_reference([history], simulate(1, 9, 2, 2, FP16))
