"""Fast, single-process tests of the servers' appliers (docs/design.md §3.2) and of the codec
settings a chunk registers with (docs/design.md §4.1).

- :func:`kvstore_ext.server.appliers.choose` picks, per chunk kind, optimizer, AMP and codec, the
  applier the round keeper then calls; the keeper chooses when the information arrives and
  never during the rounds;
- ``sum_scale``: the applier sees the round's sum times s, exactly (float32);
- REGISTER's codec settings are checked (unknown settings, bad values, the finish counter),
  compared between workers, and against a checkpoint (one saved without them has none);
- a user-defined optimizer gets the arrays MXNet's own server hands it: a row_sparse chunk's
  weight is a full-row ``RowSparseNDArray``, its sum row_sparse;
- an update that raises stops the server by default, naming the optimizer, the parameter and
  the round; with ``MXDELAY_UPDATER_ERRORS=log`` it is logged and the rounds go on, each as
  far as the update got (as MXNet's own server).
"""
import numpy as np
import pytest
import mxnet as mx
from mxnet import nd

from kvstore_ext import codecs
from kvstore_ext.checkpoint import files
from kvstore_ext.protocol import commands
from kvstore_ext.protocol.counter import HEAD
from kvstore_ext.server import appliers
from kvstore_ext.server.appliers import (CopyAllRows, CopySum, OptimizerStep, PlainSGD, ScaleSum,
                                  SkipNonFinite, StoreCounter)
from kvstore_ext.protocol.keys import KeyLayout
from kvstore_ext.protocol.commands import Command
from kvstore_ext.server.rounds import RoundKeeper
from kvstore_ext.server.controller import DelayServer


def _updater(optimizer):
    return mx.optimizer.get_updater(optimizer)


def _chain(applier):
    """The classes of a decorated applier, outermost first."""
    out = [type(applier)]
    while hasattr(applier, '_inner'):
        applier = applier._inner  # pylint: disable=protected-access
        out.append(type(applier))
    return out


@pytest.mark.parametrize('kind, optimizer, codec, amp, expected', [
    (appliers.COUNTER, mx.optimizer.Adam(), {}, True, [StoreCounter]),
    ('default', None, {}, False, [CopySum]),
    ('row_sparse', None, {}, False, [CopyAllRows]),
    ('default', mx.optimizer.SGD(momentum=0.9), {}, False, [PlainSGD]),
    ('default', mx.optimizer.SGD(multi_precision=True), {}, False, [OptimizerStep]),
    ('row_sparse', mx.optimizer.SGD(), {}, False, [OptimizerStep]),       # lazy (§2.10)
    ('default', mx.optimizer.Adam(), {}, False, [OptimizerStep]),
    ('default', mx.optimizer.SGD(), {}, True, [SkipNonFinite, PlainSGD]),
    ('default', mx.optimizer.SGD(), {'sum_scale': 0.5}, True,
     [SkipNonFinite, ScaleSum, PlainSGD]),
    ('row_sparse', None, {'sum_scale': 2.0}, False, [ScaleSum, CopyAllRows]),
])
def test_choose_one_applier_per_chunk_kind(kind, optimizer, codec, amp, expected):
    updater = None if optimizer is None else _updater(optimizer)
    assert _chain(appliers.choose(kind, updater, codec, amp, lambda chunk: None)) == expected


class _Recorder(appliers.Applier):
    def __init__(self):
        self.seen = []

    def apply(self, chunk, grad, weight, stored):
        self.seen.append((chunk, grad.asnumpy()))


@pytest.mark.parametrize('scale', [0.1, 1 / 3., 0.7, 4.0])
def test_sum_scale_hands_the_applier_the_sum_times_s_exactly(scale):
    rs = np.random.RandomState(0)
    grad = rs.randn(7).astype(np.float32)
    recorder = _Recorder()
    ScaleSum(recorder, scale).apply(3, nd.array(grad), nd.zeros(7), nd.zeros(7))
    assert recorder.seen[0][0] == 3
    np.testing.assert_array_equal(recorder.seen[0][1], grad * np.float32(scale))
    # Through the keeper, without optimizer: the stored round value is that product too.
    keeper = RoundKeeper(slots=2)
    keeper.updates.register(0, codec={'sum_scale': scale})
    stored = [nd.ones(7), nd.ones(7)]
    keeper.on_round(0, 0, nd.array(grad), stored[0])
    np.testing.assert_array_equal(stored[0].asnumpy(), grad * np.float32(scale))


class _HalvesRows(codecs.Codec):
    """A codec of one row per worker without a kernel: a row holds float32(v / 2) of each
    value; the servers get it back with Codec.decode_sum's default loop over decode."""
    type_name = 'test_halves'
    wire = 'rows'

    def describe(self):
        return {'type': self.type_name}

    def payload_size(self, size):
        return size

    def decode(self, payload, size):
        assert payload.size == size
        return payload * np.float32(2)


def test_a_rows_codec_without_a_kernel_is_decoded_by_the_default_loop(monkeypatch):
    monkeypatch.setitem(codecs._registry(), 'test_halves', lambda params: _HalvesRows())
    n = 5
    # Decoded 2**24, 1, -2**24: rank order sums to 0, the arrival order (1, 2, 0) to 1.
    rows = np.array([[2.0 ** 23] * n, [0.5] * n, [-2.0 ** 23] * n], dtype=np.float32)
    merged = nd.sparse.row_sparse_array((rows[[1, 2, 0]], np.array([1, 2, 0], dtype=np.int64)),
                                        shape=rows.shape)
    recorder = _Recorder()
    applier = appliers.choose('default', None, {'payload': {'type': 'test_halves'}}, False,
                              lambda chunk: None)
    assert _chain(applier) == [appliers.DecodeRows, CopySum]
    applier._inner = recorder   # pylint: disable=protected-access
    applier.apply(4, merged, nd.zeros(n), nd.zeros(n))
    np.testing.assert_array_equal(recorder.seen[0][1], np.zeros(n, dtype=np.float32))


def test_sum_scale_equals_pushing_the_scaled_sum_bit_for_bit():
    # Adam on the scaled sum = Adam on a sum scaled before the round, over several rounds.
    rs = np.random.RandomState(1)
    init = rs.randn(6).astype(np.float32)
    grads = [rs.randn(6).astype(np.float32) for _ in range(4)]
    scale = 0.3
    scaled, plain = RoundKeeper(slots=2), RoundKeeper(slots=2)
    scaled.updates.register(0, codec={'sum_scale': scale})
    plain.updates.register(0)
    for keeper in (scaled, plain):
        keeper.updates.install(mx.optimizer.Adam(learning_rate=0.01))
    stores = {id(k): [nd.array(init), nd.array(init)] for k in (scaled, plain)}
    for t, grad in enumerate(grads):
        scaled.on_round(0, t % 2, nd.array(grad), stores[id(scaled)][t % 2])
        plain.on_round(0, t % 2, nd.array(grad * np.float32(scale)), stores[id(plain)][t % 2])
    np.testing.assert_array_equal(scaled.weight(0).asnumpy(), plain.weight(0).asnumpy())
    assert scaled.applied_rounds(0) == plain.applied_rounds(0) == 4


def test_the_keeper_chooses_when_information_arrives_not_per_round(monkeypatch):
    calls = []
    choose = appliers.choose

    def counting(kind, *args):
        calls.append(kind)
        return choose(kind, *args)
    monkeypatch.setattr(appliers, 'choose', counting)
    keeper = RoundKeeper(slots=2)
    keeper.updates.register(0)                   # kind unknown until the first round
    keeper.updates.register(1, counter=True)
    assert calls == [appliers.COUNTER]
    keeper.updates.install(mx.optimizer.SGD(learning_rate=0.125, rescale_grad=1.0))
    keeper.updates.set_skip_nonfinite(True)
    assert calls == [appliers.COUNTER] * 3
    stored = [nd.ones(3), nd.ones(3)]
    for t in range(6):
        keeper.on_round(0, t % 2, nd.full(3, 1.0), stored[t % 2])
    assert calls == [appliers.COUNTER] * 3 + ['default']   # the first round: once
    assert keeper.applied_rounds(0) == 6 and keeper.weight(0).asnumpy().tolist() == [0.25] * 3


def test_a_user_defined_optimizer_gets_the_arrays_of_mxnets_server():
    # MXNet's server (src/kvstore/kvstore_dist_server.h, 1.9.1) stores a row_sparse key as a
    # full-row row_sparse array and hands the updater that and the row_sparse sum.
    seen = []

    class Recording(mx.optimizer.Optimizer):
        def create_state(self, index, weight):
            return None

        def update(self, index, weight, grad, state):
            seen.append((type(weight), weight.indices.asnumpy().tolist(), type(grad)))
            weight[:] += grad

    keeper = RoundKeeper(slots=2)
    keeper.updates.install(Recording())
    rows = nd.sparse.row_sparse_array((nd.ones((4, 2)), nd.arange(4, dtype='int64')),
                                      shape=(4, 2))
    grad = nd.sparse.row_sparse_array((nd.full((1, 2), 3.0), nd.array([2], dtype='int64')),
                                      shape=(4, 2))
    keeper.on_round(0, 0, grad, rows)
    assert seen == [(mx.nd.sparse.RowSparseNDArray, [0, 1, 2, 3], mx.nd.sparse.RowSparseNDArray)]
    assert rows.asnumpy().tolist() == [[1, 1], [1, 1], [4, 4], [1, 1]]


class _FailsOnRowSparse(mx.optimizer.Optimizer):
    """Adds the sum, then raises on row_sparse weights (as MXNet's Test optimizer does)."""

    def create_state(self, index, weight):
        return None

    def update(self, index, weight, grad, state):
        weight[:] += grad
        if weight.stype == 'row_sparse':
            raise TypeError('no row_sparse here')


def _failing_rounds(keeper, rounds):
    # Chunk 0 row_sparse (fails), chunk 1 dense (does not); 'emb' and 'dense' their names.
    keeper.updates.register(0, name='emb')
    keeper.updates.register(1, name='dense')
    keeper.updates.install(_FailsOnRowSparse())
    rows = [nd.sparse.row_sparse_array((nd.ones((3, 2)), nd.arange(3, dtype='int64')),
                                       shape=(3, 2)) for _ in range(2)]
    dense = [nd.ones((3, 2)), nd.ones((3, 2))]
    grad = nd.sparse.row_sparse_array((nd.full((1, 2), 2.0), nd.array([1], dtype='int64')),
                                      shape=(3, 2))
    for t in range(rounds):
        keeper.on_round(1, t % 2, nd.full((3, 2), 0.5), dense[t % 2])
        keeper.on_round(0, t % 2, grad, rows[t % 2])
    return keeper


def test_an_update_that_raises_stops_the_server_by_default_naming_optimizer_and_parameter():
    with pytest.raises(appliers.UpdaterError,
                       match=r"optimizer _FailsOnRowSparse raised on chunk 0 \(parameter 'emb'\) "
                             r"in round 0: TypeError: no row_sparse here\. MXNet's own server "
                             r'would log this .* MXDELAY_UPDATER_ERRORS=log'):
        _failing_rounds(RoundKeeper(slots=2), 1)


def test_an_update_that_raises_is_logged_and_the_rounds_go_on_under_log(caplog):
    keeper = _failing_rounds(RoundKeeper(slots=2, updater_errors=appliers.LogAndGoOn()), 3)
    failures = [r for r in caplog.records if r.name == 'kvstore_ext.server.appliers']
    assert [r.getMessage() for r in failures] == [
        "optimizer _FailsOnRowSparse raised on chunk 0 (parameter 'emb') in round %d; going on "
        '(MXDELAY_UPDATER_ERRORS=log), with the weights as far as the update got' % t
        for t in range(3)]
    assert all(r.exc_info[0] is TypeError for r in failures)
    # As MXNet's server: each round stands as far as the update got (the sum was added).
    assert keeper.applied_rounds(0) == keeper.applied_rounds(1) == 3
    assert keeper.weight(0).asnumpy().tolist() == [[1, 1], [7, 7], [1, 1]]
    assert keeper.weight(1).asnumpy().tolist() == [[2.5, 2.5]] * 3


def test_the_server_reads_its_updater_error_policy_once(monkeypatch):
    monkeypatch.setenv('MXDELAY_UPDATER_ERRORS', 'LOG')
    assert isinstance(DelayServer.offline()._rounds.updates._updater_errors, appliers.LogAndGoOn)  # pylint: disable=protected-access
    monkeypatch.delenv('MXDELAY_UPDATER_ERRORS')
    assert isinstance(DelayServer.offline()._rounds.updates._updater_errors, appliers.StopOnError)  # pylint: disable=protected-access
    monkeypatch.setenv('MXDELAY_UPDATER_ERRORS', 'ignore')
    with pytest.raises(ValueError, match=r"MXDELAY_UPDATER_ERRORS='ignore' is not one of stop, "
                                         r'log; unset it \(stop\) or set one of them'):
        DelayServer.offline()


# -- REGISTER's codec settings ----------------------------------------------------------------
def _server():
    server = DelayServer.offline(rank=0, num_workers=2)
    server.command(Command.HELLO, {'rank': 0, 'protocol': commands.PROTOCOL_VERSION,
                                   'slots': 2, 'config': {}})
    return server


def _entry(codec=None, chunk=0):
    entry = [chunk, 0, chunk, 'w%d' % chunk, 1.0, 1.0, 3]
    return entry if codec is None else entry + [codec]


@pytest.mark.parametrize('codec, message', [
    ({'scale': 2.0}, r"chunk 0: unknown codec setting 'scale'=2\.0; known: aux, payload, sum_scale"),
    ({'sum_scale': 0.0}, r'chunk 0: codec setting sum_scale=0\.0 is not a finite number above 0'),
    ({'sum_scale': -1}, r'chunk 0: codec setting sum_scale=-1 is not a finite number above 0'),
    ({'sum_scale': float('inf')}, r'sum_scale=inf is not a finite number above 0'),
    ({'sum_scale': float('nan')}, r'sum_scale=nan is not a finite number above 0'),
    ({'sum_scale': True}, r'sum_scale=True is not a finite number above 0'),
    ({'sum_scale': '2'}, r"sum_scale='2' is not a finite number above 0"),
    ([2.0], r'chunk 0: codec settings must be a dict, got \[2\.0\]'),
])
def test_register_refuses_bad_codec_settings(codec, message):
    server = _server()
    with pytest.raises(ValueError, match=message):
        server.command(Command.REGISTER, {'rank': 0, 'chunks': [_entry(codec)]})
    assert server.stats()['chunks'] == {}


def test_register_takes_entries_with_and_without_codec_settings():
    server = _server()
    counter = [9, 0, commands.FINISH_KEY, commands.FINISH_KEY, 1.0, 1.0, 2]
    body = {'rank': 0, 'chunks': [_entry({'sum_scale': 0.5}), _entry(chunk=1),
                                  _entry({}, chunk=2), counter]}
    assert server.command(Command.REGISTER, body) == {'chunks': 4}
    # A 7-element entry is an entry with no settings: the second worker may send either.
    body['chunks'][1] = _entry({}, chunk=1)
    assert server.command(Command.REGISTER, dict(body, rank=1)) == {'chunks': 4}
    with pytest.raises(ValueError, match=r"worker 1 registers chunk 0 as .*'codec': "
                                         r"\{'sum_scale': 0\.25\}.* but another worker as .*"
                                         r"'codec': \{'sum_scale': 0\.5\}"):
        server.command(Command.REGISTER, {'rank': 1, 'chunks': [_entry({'sum_scale': 0.25})]})
    with pytest.raises(ValueError, match=r'chunk 9 is the finish counter, which takes no codec '
                                         r"settings, got \{'sum_scale': 2\}"):
        server.command(Command.REGISTER, {'rank': 1, 'chunks': [counter + [{'sum_scale': 2}]]})
    with pytest.raises(ValueError, match=r'a registered chunk is \[chunk_id, server, '):
        server.command(Command.REGISTER, {'rank': 1, 'chunks': [[0, 0, 0]]})


def test_the_server_applies_a_chunks_sum_scale():
    server = _server()
    server.command(Command.REGISTER, {'rank': 0, 'chunks': [_entry({'sum_scale': 0.25})]})
    grad = np.array([1.0, -2.0, 3.0], np.float32)
    stored = nd.array([5.0, 5.0, 5.0])
    server.complete_round(KeyLayout(1, 2).slot_key(0, 0, 0), nd.array(grad), stored)
    assert server.applied_rounds(0) == 1
    np.testing.assert_array_equal(server.weight(0).asnumpy(), grad * np.float32(0.25))


def _old_checkpoint(path):
    # A checkpoint saved before codec settings: 5 info fields per chunk.
    files.write_archive(path, files.SERVER, {
        'server': 0, 'num_workers': 2, 'updater': None,
        'chunks': {0: {'param_index': 0, 'name': 'w0', 'lr_mult': 1.0, 'wd_mult': 1.0,
                       'size': 3, 'weight': np.arange(3, dtype=np.float32), 'next_round': 4}}},
        save_id=None)


def test_a_checkpoint_saved_without_codec_settings_has_none(tmp_path):
    path = str(tmp_path / 'old.server0')
    _old_checkpoint(path)
    server = _server()
    server.command(Command.REGISTER, {'rank': 0, 'chunks': [_entry()]})
    assert server.command(Command.LOAD, {'rank': 0, 'paths': [path]}) == {'path': path,
                                                                          'chunks': 1}
    assert server.applied_rounds(0) == 4
    assert server.weight(0).asnumpy().tolist() == [0.0, 1.0, 2.0]
    scaled = _server()
    scaled.command(Command.REGISTER, {'rank': 0, 'chunks': [_entry({'sum_scale': 0.5})]})
    with pytest.raises(ValueError, match=r"chunk 0 was .*'codec': \{\}.* when saved, is .*"
                                         r"'codec': \{'sum_scale': 0\.5\}.* now"):
        scaled.command(Command.LOAD, {'rank': 0, 'paths': [path]})
    # Saved with settings, loaded with the same ones.
    again = str(tmp_path / 'new.server0')
    scaled.command(Command.SAVE, {'rank': 0, 'paths': [again]})
    assert scaled.command(Command.LOAD, {'rank': 0, 'paths': [again]})['chunks'] == 1


def _store_counter_numpy(total, counter):
    """The finish counter's round in numpy: the head always takes the round's sums, the ring
    the elements that are not 0."""
    taken = total != 0
    taken[:HEAD] = True
    return np.where(taken, total, counter)


@pytest.mark.parametrize('dtype', [np.float32, np.float16])
@pytest.mark.parametrize('into', ['counter', 'out'])
def test_store_counter_takes_the_head_and_the_marked_ring_elements_bit_for_bit(dtype, into):
    # Zeros (+0 and -0) in the head and on the ring, a NaN and an inf mark (an overflowed
    # round's flag can be neither, but a selection must not care), a changed head of 0.
    total = np.array([0, 2, -0.0, 0, 3, -0.0, np.nan, 0, np.inf], dtype=dtype)
    counter = np.array([5, 1, 7, 4, 9, 8, 6, -2, 0], dtype=dtype)
    expected = _store_counter_numpy(total, counter)
    counter_nd = nd.array(counter, dtype=dtype)
    out = nd.zeros(counter.shape, dtype=dtype) if into == 'out' else None
    appliers.store_counter(nd.array(total, dtype=dtype), counter_nd, out)
    got = (counter_nd if out is None else out).asnumpy()
    assert got.dtype == expected.dtype
    assert got.tobytes() == expected.tobytes()
    if out is not None:
        assert counter_nd.asnumpy().tobytes() == counter.tobytes()   # the input unchanged
