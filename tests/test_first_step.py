"""What the store's ``broadcast`` (Gluon's first step) pulls (issue 20, docs/design.md §2.4).

MXNet's native init pushes rank 0's value and no other, so the servers hold rank 0's value
bit for bit: rank 0 copies its own value instead of pulling it back, and the other workers
pull it once, also with compressed pulls, whose initial x̂ that one pull is. Checked in one
process (2 workers in threads over mxdelay's real servers, support/native_workers.py), for
every kind of dense data path (slot keys; float16 and blockwise pushes' pull keys; each
with and without compressed pulls), with chunks:

- every worker ends with rank 0's value, bit for bit, in each out (the value itself, which
  Gluon passes among the outs, and a second array), and in x̂ (the servers start theirs
  from the stored value, rank 0's; that x̂ stays the servers' after every pulled round is
  tests/test_pull_compression.py's);
- the native pulls issued: none on rank 0, one of each chunk on the other worker (before
  the fix: two of each chunk on every worker with compressed pulls, one without).

Issue 37: with compressed pulls a chunk of float16 or blockwise pushes has one float32 pull
key (R before): its bytes in the first step, counted at the native store, and the ordering
that one pull key needs (every push after an exact pull waits for it).
"""
import numpy as np
import pytest

import mxdelay  # noqa: F401  before mxnet
import mxnet as mx
from mxnet import nd

from support.native_workers import run_workers

SHAPES = {0: (16, 8), 1: (7,)}      # chunks of 50: key 0 spans 3 chunks
CASES = [(None, None), ({'type': 'fp16'}, None), ({'type': 'ternary'}, None),
         (None, {'type': 'int8'}), ({'type': 'fp16'}, {'type': 'int8'}),
         ({'type': 'ternary'}, {'type': 'int8'}), ({'type': '2bit', 'threshold': 0.5},
                                                    {'type': 'fp16'})]
IDS = ['%s-pull%s' % (push['type'] if push else 'push32', pull['type'] if pull else '32')
       for push, pull in CASES]


def initial(rank, key):
    """Worker `rank`'s own initial value of `key` (different on every worker)."""
    rng = np.random.default_rng([rank, key])
    return rng.standard_normal(SHAPES[key]).astype(np.float32)


def configure(store, push, pull):
    """A bare store's settings: k = 2, one warm-up step, `push` and `pull` compression."""
    store.delayed.settings.set_config(delay=2, warmup_steps=1)
    if push is not None:
        store.set_gradient_compression(push)
    if pull is not None:
        store.delayed.settings.set_pull_compression(pull)


@pytest.mark.parametrize('push,pull', CASES, ids=IDS)
def test_broadcast_gives_rank0s_value_rank0_pulls_nothing_others_once(monkeypatch, push, pull):
    monkeypatch.setenv('MXDELAY_CHUNK_SIZE', '50')

    def work(rank, store):
        configure(store, push, pull)
        pulled = []
        native = store._session.native
        native_pull = native.pull

        def counting_pull(keys, out=None, priority=0, ignore_sparse=True):
            pulled.extend(keys if isinstance(keys, (list, tuple)) else [keys])
            return native_pull(keys, out=out, priority=priority, ignore_sparse=ignore_sparse)
        native.pull = counting_pull
        values, others = {}, {}
        for key in sorted(SHAPES):
            values[key] = nd.array(initial(rank, key))
            others[key] = nd.zeros(SHAPES[key])
            store.broadcast(key, values[key], [values[key], others[key]])
            values[key].wait_to_read()
            others[key].wait_to_read()
        # The keys that hold W (slot keys, or the pull keys of float16 and blockwise pushes);
        # the other pulls are the commands' status keys.
        tensors = store._session.tensors
        weight_keys = {k for t in tensors.values() for c in t.chunks for k in c.pull_keys}
        pulled = [k for k in pulled if k in weight_keys]
        chunks = {key: len(store._session.tensors[key].chunks) for key in SHAPES}
        models = {key: t.pull_state.model.asnumpy() for key, t in store._session.tensors.items()} \
            if pull is not None else {}
        return ({key: (values[key].asnumpy(), others[key].asnumpy()) for key in SHAPES},
                pulled, chunks, models)

    _, results = run_workers(2, work)
    for rank, (arrays, pulled, chunks, models) in enumerate(results):
        for key in SHAPES:
            expected = initial(0, key)
            mine, other = arrays[key]
            assert mine.tobytes() == expected.tobytes(), (rank, key)
            assert other.tobytes() == expected.tobytes(), (rank, key)
            if pull is not None:   # the servers start x̂ from the same value (rank 0's)
                assert models[key].tobytes() == expected.reshape(-1).tobytes(), (rank, key)
        assert chunks[0] == 3
        expected_pulls = 0 if rank == 0 else sum(chunks.values())
        assert len(pulled) == expected_pulls, (rank, pulled)


def test_rank1_value_does_not_leak_into_the_servers(monkeypatch):
    # The other workers' values are ignored as MXNet's init ignores them: a pull after
    # broadcast, on either worker, reads rank 0's value from the servers.
    monkeypatch.setenv('MXDELAY_CHUNK_SIZE', '50')

    def work(rank, store):
        value = nd.array(initial(rank, 0))
        store.broadcast(0, value, value)
        out = nd.zeros(SHAPES[0])
        store.pull(0, out=out)
        return out.asnumpy()

    _, results = run_workers(2, work)
    for out in results:
        assert out.tobytes() == initial(0, 0).tobytes()


def _nbytes(value):
    if getattr(value, 'stype', 'default') == 'row_sparse':
        return value.data.size * np.dtype(value.dtype).itemsize + 8 * value.indices.size
    return value.size * np.dtype(value.dtype).itemsize


@pytest.mark.parametrize('push,pull', CASES, ids=IDS)
def test_the_first_steps_pull_keys_one_per_chunk_with_compressed_pulls(monkeypatch, push, pull):
    # Issue 37: the pull keys of float16 and blockwise pushes are what the servers' inbound
    # link carries most in the first step: each is initialised with a float32 copy of its
    # chunk (rank 0, MXNet's init) and gets a round of zeros of that size from every worker.
    # With compressed pulls the scheduled pulls read the model key and the pull keys serve
    # only exact pulls: one per chunk (before: R per chunk, R copies of the model each way).
    # Counted here at the native store's calls, with R = 3: every pull-key byte of the
    # initialisation and the chunks' keys.
    monkeypatch.setenv('MXDELAY_CHUNK_SIZE', '50')
    monkeypatch.setenv('MXDELAY_SLACK', '2')
    slots = 3

    def work(rank, store):
        configure(store, push, pull)
        native = store._session.native
        sent = []   # (key, bytes) of every init (rank 0's: MXNet's init sends its alone) and push
        for name in ('init', 'push'):
            original = getattr(native, name)

            def counting(keys, values, priority=0, original=original, name=name):
                if name == 'push' or rank == 0:
                    pairs = zip(keys, values) if isinstance(keys, (list, tuple)) \
                        else [(keys, values)]
                    sent.extend((k, _nbytes(v)) for k, v in pairs)
                return original(keys, values) if name == 'init' else \
                    original(keys, values, priority=priority)
            setattr(native, name, counting)
        for key in sorted(SHAPES):
            value = nd.array(initial(rank, key))
            store.broadcast(key, value, value)
            value.wait_to_read()
        chunks = [c for t in store._session.tensors.values() for c in t.chunks]
        pull_keys = {k: c.stop - c.start for c in chunks for k in c.pull_keys
                     if c.pull_keys is not c.keys}
        return ([len(c.pull_keys) for c in chunks],
                sum(size for k, size in sent if k in pull_keys), 4 * sum(pull_keys.values()))

    _, results = run_workers(2, work)
    elements = sum(int(np.prod(shape)) for shape in SHAPES.values())
    has_pull_keys = push is not None and push['type'] in ('fp16', 'ternary')
    per_chunk = (1 if pull is not None else slots) if has_pull_keys else slots
    for rank, (counts, pull_key_bytes, one_copy) in enumerate(results):
        assert counts == [per_chunk] * 4, (rank, counts)   # 3 chunks of key 0, 1 of key 1
        if not has_pull_keys:
            assert pull_key_bytes == one_copy == 0
            continue
        assert one_copy == 4 * elements * per_chunk
        # rank 0: the init and its round of zeros; the other worker: its round of zeros
        assert pull_key_bytes == one_copy * (2 if rank == 0 else 1), (rank, pull_key_bytes)


@pytest.mark.parametrize('push', [{'type': 'fp16'}, {'type': 'ternary'}], ids=['fp16', 'ternary'])
def test_with_one_pull_key_every_push_after_an_exact_pull_waits_for_it(monkeypatch, push):
    # One pull key holds W after every round, written in place: an exact pull of round t must
    # be served before round t + 1 is applied, so the next push, whatever its slot, first
    # waits in MXNet's engine for that pull (a write of its send buffer that reads the pull
    # key's mark, written right after the pull), once; with R pull keys (no compressed pulls) only a push into the
    # pulled round's slot does (design §2.11).
    from kvstore_ext.worker.wires import pull_keys
    monkeypatch.setenv('MXDELAY_SLACK', '2')
    follows = []
    real_follow = pull_keys.ordering.follow

    def work(rank, store):
        configure(store, push, {'type': 'int8'})
        store.set_optimizer(mx.optimizer.SGD(learning_rate=0.5))
        store.init(0, nd.zeros(SHAPES[0]))
        tensor = store._session.tensors[0]
        state = tensor.wire_state
        monkeypatch.setattr(pull_keys.ordering, 'follow',
                            lambda target, source: follows.append((target, source))
                            or real_follow(target, source))
        grad, out = nd.ones(SHAPES[0]), nd.zeros(SHAPES[0])
        waits = []
        for rnd in range(4):
            store.push(0, grad)
            if rnd in (0, 1):
                store.pull(0, out=out)   # exact, reads the one pull key
            # Of the writes on a send buffer (not the marks' own, after each pull): whether
            # it read the one pull key's mark, whether it wrote this push's send buffer.
            sends = {h.handle.value for h in tensor.heads}
            waits.append([(source.handle.value == state.marks[0].handle.value,
                           target.handle.value == tensor.heads[rnd % 3].handle.value)
                          for target, source in follows if target.handle.value in sends])
            del follows[:]
        return [len(tensor.chunks[0].pull_keys), len(state.marks)], waits

    _, results = run_workers(1, work)
    counts, waits = results[0]
    assert counts == [1, 1]
    # The pushes of rounds 1 and 2 (slots 1 and 2) wait for the pulls of rounds 0 and 1;
    # the push of round 3 pulled nothing before it.
    assert waits == [[], [(True, True)], [(True, True)], []], waits
