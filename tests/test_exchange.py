"""``DistDelay.pushpull``: one native ``pushpull`` per chunk without compression, a push and
a pull with a codec (docs/design.md §8), in one process with mxdelay's real servers.

- Without compression each chunk of the round travels as one ``pushpull`` request, and the
  weights received are exactly those that a push and a separate pull give (a second store,
  the same rounds; rounds pushed without a pull in between included, and a tensor split into
  chunks over two servers). Chunks 1.. are sent from buffers of their own, not from views of
  the slot buffer (MXNet's engine would serialise pushpulls that write one array).
- With float16 pushes (pulls read other keys) and 2bit (MXNet refuses ``pushpull`` with its
  compression) ``pushpull`` is a push and a pull.
- MXNet's server never answers a plain push in a round that has a pushpull, so every key
  of a round goes as the round is flagged on the finish counter, whatever the call, and a
  worker that votes fills the round as the workers with data send it (docs/design.md §5).
"""
import json
import types

import numpy as np
import pytest
import mxnet as mx
from mxnet import nd

from kvstore_ext.protocol.counter import counter_size
from kvstore_ext.worker.finish import FinishCounter
from kvstore_ext.worker import ordering
from kvstore_ext.worker.wires.slots import ExchangeBuffers
from support.jobs import assert_ok, python_command, run_job, stock_env, worker_lines
from support.native import delay_store, events, server_weights

SHAPE = (7, 6)        # 42 elements: 3 chunks of at most 16, over two servers
CHUNK = 16


def _store(compression=None):
    store = delay_store(num_servers=2)
    store.delayed.settings.configure(chunk_size=CHUNK)
    if compression:
        store.set_gradient_compression(compression)
    store.set_optimizer(mx.optimizer.SGD(learning_rate=0.1, momentum=0.9))
    return store


def test_pushpull_is_one_request_per_chunk_with_the_weights_of_push_and_pull():
    rs = np.random.RandomState(3)
    init = rs.randn(*SHAPE).astype(np.float32)
    exchanged, separate = _store(), _store()
    for store in (exchanged, separate):
        store.init(0, nd.array(init))
    tensor = exchanged._session.tensors[0]
    assert len(tensor.chunks) == 3 and len({c.server for c in tensor.chunks}) == 2
    out_a, out_b = nd.zeros(SHAPE), nd.zeros(SHAPE)
    # pushpull, pushpull, push, push, pushpull: rounds without a pull in between included
    for rnd, pulls in enumerate([True, True, False, False, True]):
        grad = nd.array(rs.randn(*SHAPE).astype(np.float32))
        if pulls:
            before = len(exchanged._session.native.calls)
            exchanged.pushpull(0, grad, out=out_a)
            new = exchanged._session.native.calls[before:]
            assert [op for op, _, _ in new if op != 'push'] == ['pushpull'], rnd
            assert len(new[-1][1]) == 3, rnd           # every chunk in the one call
            separate.push(0, grad)
            separate.pull(0, out=out_b)
            np.testing.assert_array_equal(out_a.asnumpy(), out_b.asnumpy(), err_msg=str(rnd))
            np.testing.assert_array_equal(out_a.asnumpy(), server_weights(exchanged, 0))
        else:
            exchanged.push(0, grad)
            separate.push(0, grad)
    assert exchanged.delayed.rounds.rounds(0) == separate.delayed.rounds.rounds(0) == 5
    # Chunks 1 and 2 were sent from arrays of their own, of their sizes.
    own_buffers = tensor.wire_state.own
    assert [own.size for own in own_buffers] == [c.stop - c.start for c in tensor.chunks[1:]]
    for own, chunk in zip(own_buffers, tensor.chunks[1:]):   # no view of a slot buffer
        own[:] = 1e9
        assert all((buf[chunk.start:chunk.stop].asnumpy() != 1e9).all() for buf in tensor.buffers)


def test_pushpull_into_its_value_returns_the_weights_there():
    store = _store()
    store.init(0, nd.ones(SHAPE))
    grad = nd.ones(SHAPE)
    store.pushpull(0, grad)
    np.testing.assert_array_equal(grad.asnumpy(), server_weights(store, 0))


@pytest.mark.parametrize('compression', [{'type': 'fp16'}, {'type': '2bit', 'threshold': 0.5}])
def test_with_a_codec_pushpull_is_a_push_and_a_pull(compression):
    store = _store(compression)
    store.init(0, nd.zeros(SHAPE))
    before = len(store._session.native.calls)
    out = nd.zeros(SHAPE)
    store.pushpull(0, nd.ones(SHAPE), out=out)
    ops = [op for op, _, _ in store._session.native.calls[before:]]
    assert 'pushpull' not in ops and 'push' in ops and ops[-1] == 'pull'
    assert not isinstance(store._session.tensors[0].wire_state, ExchangeBuffers)
    np.testing.assert_array_equal(out.asnumpy(), server_weights(store, 0).astype(np.float32))


def _counter_heads(store):
    """The finish counter's (finished, leaving, exchanged) sums as its server holds them."""
    chunk, = store._session.finish.tensor.chunks
    return list(store._session.native.servers[chunk.server].weight(chunk.chunk_id).asnumpy()[:3])


def test_every_key_of_a_round_goes_as_the_round_is_flagged():
    # MXNet's server answers only the pushpulls of a round that has one and never
    # acknowledges its plain pushes: all workers must send a round alike. A worker's flag
    # says how it sends its round (the counter's third element: a worker that fills rounds
    # without data reads it, test_uneven_data), and every key that can be exchanged then
    # goes so: as its first key asks, or, if that is row_sparse, as the last dense key did.
    rs = np.random.RandomState(5)
    shapes = [SHAPE, (3,), (4, 2)]
    inits = [rs.randn(*shape).astype(np.float32) for shape in shapes]
    flagged, separate = _store(), _store()
    for store in (flagged, separate):
        store.init([0, 1, 2], [nd.array(inits[0]), nd.array(inits[1]),
                               nd.array(inits[2]).tostype('row_sparse')])
    outs = [nd.zeros(SHAPE), nd.zeros((3,))]
    rounds = [  # (calls in order, what keys 0 and 1 then send, the counter's exchanged)
        ([('pushpull', 0), ('push', 1), ('push', 2)], 'pushpull', 1),
        ([('push', 0), ('pushpull', 1), ('push', 2)], 'push', 0),
        ([('push', 2), ('pushpull', 0), ('pushpull', 1)], 'pushpull', 1),   # as key 1 last
        ([('push', 2), ('push', 0), ('push', 1)], 'pushpull', 1),           # as key 1 last
        ([('push', 2), ('push', 0), ('pushpull', 1)], 'push', 0),
    ]
    for rnd, (calls, sent, exchanged) in enumerate(rounds):
        before = len(events(flagged))
        for op, key in calls:
            grad = nd.array(rs.randn(*shapes[key]).astype(np.float32))
            if key == 2:
                grad = grad.tostype('row_sparse')
            if op == 'pushpull':
                flagged.pushpull(key, grad, out=outs[key])
            else:
                flagged.push(key, grad)
            separate.push(key, grad)
        new = [(op, key) for op, key in events(flagged)[before:] if key in (0, 1)]
        assert sorted(set(op for op, _ in new) - {'pull'}) == [sent], (rnd, new)
        assert _counter_heads(flagged) == [0, 0, exchanged], rnd
        for key in (0, 1, 2):
            np.testing.assert_array_equal(server_weights(flagged, key),
                                          server_weights(separate, key), err_msg=str(rnd))
        for key, out in enumerate(outs):
            if ('pushpull', key) in calls:   # the weights after this round
                np.testing.assert_array_equal(out.asnumpy(), server_weights(flagged, key))


class _Sums(object):
    """A finish counter's data path whose pull brings the round's sums given."""

    def __init__(self, sums):
        self.sums = sums

    def push(self, tensor, arrays, priority):
        pass

    def pull(self, tensor, outs, priority):
        outs[0][:] = nd.array(self.sums)


@pytest.mark.parametrize('exchanged,expected', [(0, False), (2, True), (1, None)])
def test_a_vote_fills_the_round_as_the_workers_with_data_send_it(exchanged, expected):
    # 3 workers, this one votes; the other 2 have data and flagged (0, 0, exchanged): the
    # vote's round is sent as pushpulls if they exchange it. One pushpull and one push
    # among them cannot complete (MXNet leaves the push unanswered): an error, not a hang.
    counter = FinishCounter(types.SimpleNamespace(size=counter_size(2)),
                            _Sums([1, 1, exchanged, 3, 0]), num_workers=3)
    if expected is None:
        with pytest.raises(RuntimeError, match='1 of the 2 workers with data sent pushpulls'):
            counter.vote(leaving=True)
        return
    assert counter.vote(leaving=True) is False
    assert counter.exchanged is expected


def test_a_round_after_an_exchanged_round_orders_by_reading_without_touching(monkeypatch):
    # docs/design.md §8: the pushpulls of an exchanged round write their send buffers until
    # their answers arrive, so the next round orders behind them by reading them (one engine
    # operation less per chunk); after plain pushes, which only read, the buffers are touched.
    store = _store()
    store.init(0, nd.zeros(SHAPE))
    touched = []
    real_touch = ordering.touch
    monkeypatch.setattr(ordering, 'touch', lambda head: (touched.append(1), real_touch(head)))
    out = nd.zeros(SHAPE)
    counts = []
    for exchanged in [True, True, True, False, True, True]:
        del touched[:]
        if exchanged:
            store.pushpull(0, nd.ones(SHAPE), out=out)
        else:
            store.push(0, nd.ones(SHAPE))
        counts.append(len(touched))
    # Round 4 orders behind the pushed round 3 (its chunk 0's slot buffer) and the exchanged
    # round 2's own buffers of chunks 1 and 2: touched. Rounds 1, 2 and 5 follow an exchange.
    assert counts == [0, 0, 0, 0, 3, 0]
    np.testing.assert_array_equal(out.asnumpy(), server_weights(store, 0))


_PUSHPULL_WAIT = '''
import json, sys, time
import mxnet as mx
from mxnet import nd
kv = mx.kv.create('dist_sync')
kv.init(3, nd.zeros(10))
sent, out, target = nd.ones(10), nd.zeros(10), nd.zeros(1)
kv._barrier()
if kv.rank == 1:
    time.sleep(2.0)              # worker 0's round completes only then
start = time.time()
if sys.argv[1] == 'pushpull':
    kv.pushpull(3, sent, out=out)
else:
    kv.push(3, sent)
nd.elemwise_add(target, sent[0:1], out=target)   # reads the sent array's first element
target.wait_to_read()
print(json.dumps({'rank': kv.rank, 'read_s': time.time() - start}))
kv._barrier()
'''


@pytest.mark.jobs
@pytest.mark.parametrize('call', ['pushpull', 'push'])
def test_mxnet_pushpull_writes_the_sent_array_until_its_answer_arrives(call):
    # The MXNet fact the ordering above rests on (stock MXNet 1.9.1, no mxdelay in the job):
    # a read of the array a pushpull sent waits for the answer (the pushpull writes it), a
    # read of an array a plain push sent does not (the push only reads it).
    result = run_job(python_command(_PUSHPULL_WAIT, call), num_workers=2, env=stock_env())
    assert_ok(result)
    lines = [json.loads(worker_lines(result.stdout, index)[-1]) for index in (0, 1)]
    read_s, = [line['read_s'] for line in lines if line['rank'] == 0]   # ps-lite's rank
    if call == 'pushpull':
        assert read_s > 1.5, read_s
    else:
        assert read_s < 1.0, read_s
