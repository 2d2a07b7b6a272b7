"""Size limits (docs/design.md §2.6, §2.7; docs/limits.md's table of size limits): a real job
with many tensors, where each cap lies, and the error past it.

- The job tests run 1,000 parameter tensors (3 elements each), and 100,000,000 parameters
(25 tensors of 4e6 elements, 200 chunks; marked ``big``, run with ``-m big``), on 2 workers
and 2 servers through the synchronous warm-up, the switch and two delayed periods, and
compare every worker's weights at every step with the numpy reference (tests/reference.py),
with the tolerance of the other trainer tests (``rtol=1e-5, atol=1e-6``; the gradient
``x + p`` is elementwise, so only the momentum's float32 rounding differs). The big run
records only a sample of each tensor's elements that includes both sides of every chunk
boundary (``many_tensors_job.sample_indices``).
- The key cap per server (exact: every server holds exactly ``KeyLayout.max_chunks`` chunks,
  with float16 pull keys and state keys too, even when one server is loaded first; the next
  chunk is refused with docs/limits.md's message), a billion parameters on 22 to 9,972 servers,
  row keys of row_sparse chunks below 2**31, the server's local index -> chunk id map,
  1,000 workers' status keys, and ``server_stats()`` past its size.
"""
import json
import os
import sys

import numpy as np
import pytest

import reference
from support.jobs import SCRIPTS, assert_ok, run_job
from support.reference_jobs import ATOL, RTOL
from mxnet import nd

from kvstore_ext.checkpoint import files
from kvstore_ext.protocol import commands
from kvstore_ext.worker import sparse
from kvstore_ext.protocol.keys import MAX_KEY, KeyLayout
from kvstore_ext.worker.layout import Placement
from kvstore_ext.protocol.commands import Command
from kvstore_ext.server.controller import DelayServer

sys.path.insert(0, SCRIPTS)
import many_tensors_job as job  # noqa: E402  pylint: disable=wrong-import-position

CONFIG = dict(tensors=1000, size=3, steps=8, delay=2, warmup_steps=2, lr=0.05, momentum=0.9)


def _assert_job_matches_reference(tmp_path, config, timeout):
    """Run many_tensors_job on 2 workers and 2 servers; compare every recorded element of
    every worker at every step with the reference."""
    out = tmp_path / 'out'
    out.mkdir()
    command = [sys.executable, os.path.join(SCRIPTS, 'many_tensors_job.py'),
               json.dumps(config), str(out)]
    assert_ok(run_job(command, num_workers=2, num_servers=2, timeout=timeout))
    tensors, size = config['tensors'], config['size']
    # The gradient x + p is elementwise: the reference replays the recorded elements alone.
    picked = job.sample_indices(size) if config.get('sampled') else np.arange(size)
    names = [job.name(i) for i in range(tensors)]   # sorted: the trainer's key order
    init = job.init_params(tensors, size)
    trajectory = reference.simulate(
        {n: init[n][picked] for n in names},
        lambda weights, rank, step: job.numpy_grad(
            weights, job.data(tensors, size, rank, step)[:, picked]),
        2, config['steps'], config['delay'], config['warmup_steps'], config['lr'],
        momentum=config['momentum'])
    for rank in range(2):
        got = np.load(str(out / ('worker%d.npz' % rank)))['weights']
        assert got.shape == (config['steps'], tensors, len(picked))
        for t in range(config['steps']):
            want = np.stack([trajectory.local[t][rank][n] for n in names])
            np.testing.assert_allclose(got[t], want, rtol=RTOL, atol=ATOL,
                                       err_msg='worker %d, step %d' % (rank, t))


@pytest.mark.jobs
def test_thousand_tensors_two_servers_match_reference(tmp_path):
    _assert_job_matches_reference(tmp_path, CONFIG, timeout=120)


@pytest.mark.jobs
@pytest.mark.big
@pytest.mark.timeout(1200)
def test_hundred_million_parameters_two_servers_match_reference(tmp_path):
    # 25 tensors of 4e6 floats (8 chunks each, 200 chunks on 2 servers). Measured: workers
    # 4.1-4.6 GB RSS, servers 1.8 GB, this process 5.9 GB; 772 s at load 20 on 2 cores. So it
    # runs only when asked for (-m big; see conftest).
    config = dict(CONFIG, tensors=25, size=4 * 10 ** 6, sampled=True)
    _assert_job_matches_reference(tmp_path, config, timeout=900)


# -- the key cap (docs/design.md §2.6) ---------------------------------------------------------
# docs/limits.md's message when every server's keys are used up.
TOO_MANY_CHUNKS = (r"too many chunks for MXNet's keys: the {servers} server\(s\) hold {chunks} "
                   r"chunks, the most they can \(at most \d+ per server, {stride} keys per chunk: "
                   r"{slots} slots \(slack \+ 1\), {pull} pull keys, {state} state keys; MXNet "
                   r"places a key with \(key \* 9973\) % num_servers in a C int, so keys stay at "
                   r"or below 215329\); use larger chunks \(MXDELAY_CHUNK_SIZE, below "
                   r"MXNET_KVSTORE_BIGARRAY_BOUND\), fewer tensors or a smaller slack")


def _every_key(layout, chunk):
    return chunk.keys + [layout.pull_key(chunk.local, s, chunk.server)
                         for s in range(layout.pull_keys)] + \
        [layout.state_key(chunk.local, j, chunk.server) for j in range(layout.state_keys)]


@pytest.mark.parametrize('num_servers,slots,pull_keys,state_keys,job_cap', [
    (1, 5, 0, 0, 43065), (2, 5, 0, 0, 43064), (2, 5, 5, 0, 21532), (3, 9, 0, 2, 19575),
    (8, 5, 5, 3, 16560), (32, 5, 0, 0, 43040), (64, 9, 0, 0, 23872)])
def test_each_server_holds_its_share_of_the_key_range(num_servers, slots, pull_keys,
                                                      state_keys, job_cap):
    # Keys are numbered per server: server s holds max_chunks(s) = (215329 - r(s)) // S //
    # (R + P + J) chunks, whatever the others hold; a full server takes no more chunks, so
    # the job holds their sum (docs/limits.md's numbers), even when one server is loaded first.
    layout = KeyLayout(num_servers, slots, state_keys, pull_keys)
    caps = [layout.max_chunks(s) for s in range(num_servers)]
    assert sum(caps) == job_cap
    placement = Placement(layout, chunk_size=1)
    first = placement.add_chunk(0, 1, load=10 ** 9, pull_keys=bool(pull_keys))  # server 0, fullest
    chunks = [first] + [placement.add_chunk(0, 1, load=1, pull_keys=bool(pull_keys))
                        for _ in range(job_cap - 1)]
    assert placement.server_chunks == caps
    for server in range(num_servers):
        mine = [c for c in chunks if c.server == server]
        assert [c.local for c in mine] == list(range(caps[server]))
        keys = [k for c in mine[-2:] for k in _every_key(layout, c)]   # its largest keys
        assert max(keys) <= MAX_KEY   # so C's int product is Python's: (key * 9973) % S
        assert all((k * 9973) % num_servers == server for k in keys)
        assert layout.decode(max(keys))[1] == caps[server] - 1
    every = [k for c in chunks for k in _every_key(layout, c)]
    every += [layout.status_key(s) for s in range(num_servers)]
    assert len(set(every)) == len(every) == num_servers + job_cap * (slots + pull_keys + state_keys)
    with pytest.raises(ValueError, match=TOO_MANY_CHUNKS.format(
            servers=num_servers, chunks=job_cap, stride=slots + pull_keys + state_keys,
            slots=slots, pull=pull_keys, state=state_keys)):
        placement.place('one more', (1,), np.float32)


@pytest.mark.parametrize('num_servers,slots,pull_keys,state_keys', [
    (32, 5, 0, 0), (22, 5, 0, 0), (32, 5, 5, 3), (1000, 9, 0, 0), (9972, 5, 5, 0)])
def test_a_billion_parameters_fit_the_key_space(num_servers, slots, pull_keys, state_keys):
    # 1,000 tensors of 1e6 floats at the default chunk size (524288): 2,000 chunks, placed
    # without allocating anything. Numbered job-wide (before), they were refused from 22
    # servers at k = 4 (R = 5).
    layout = KeyLayout(num_servers, slots, state_keys, pull_keys)
    placement = Placement(layout, chunk_size=524288)
    tensors = [placement.place(i, (1000, 1000), np.float32, 'float16' if pull_keys else None)
               for i in range(1000)]
    chunks = [c for t in tensors for c in t.chunks]
    assert len(chunks) == 2000 and sum(c.stop - c.start for c in chunks) == 10 ** 9
    assert max(placement.server_load) - min(placement.server_load) <= 524288
    keys = [k for c in chunks for k in _every_key(layout, c)]
    assert max(keys) <= MAX_KEY and len(set(keys)) == len(keys)
    assert all((k * 9973) % num_servers == c.server for c in chunks for k in _every_key(layout, c))


def test_past_the_job_cap_is_refused():
    # A billion parameters in chunks of 20,000 elements: 50,000 chunks at k = 4, past the
    # 43,040 keys of 32 servers; refused while placing, with docs/limits.md's message.
    placement = Placement(KeyLayout(32, 5, 0), chunk_size=20000)
    with pytest.raises(ValueError, match=TOO_MANY_CHUNKS.format(
            servers=32, chunks=43040, stride=5, slots=5, pull=0, state=0)):
        for i in range(1000):
            placement.place(i, (1000, 1000), np.float32)


def test_row_keys_of_row_sparse_chunks_stay_below_2_31():
    # MXNet sends row r of a row_sparse key k as ps-lite key k + r and decodes it in a C int.
    # The last server-side key of a full layout plus its chunk's rows stays far below 2**31;
    # a chunk of rows that would reach it is refused (only with a bound raised past 2**31).
    layout = KeyLayout(2, 5)
    placement = Placement(layout, chunk_size=999999)
    placement.server_chunks = [c - 1 for c in placement.capacity]   # one chunk left each
    tensor = sparse.place_rows(placement, 'emb', (1999998, 1), np.float32, 'row_sparse')
    assert [c.local for c in tensor.chunks] == [c - 1 for c in placement.capacity]
    assert max(max(c.keys) + c.stop - c.start - 1 for c in tensor.chunks) < 2 ** 31
    huge = Placement(KeyLayout(1, 5), chunk_size=2 ** 31)
    with pytest.raises(ValueError, match=r"row_sparse key 'big': a chunk of 2147483648 rows "
                                         r'from key 5 reaches 2\*\*31'):
        sparse.place_rows(huge, 'big', (2 ** 31, 1), np.float32, 'row_sparse')


def _hello(server, slots=2):
    server.command(Command.HELLO, {'rank': 0, 'protocol': commands.PROTOCOL_VERSION,
                                   'slots': slots, 'config': {}})


def test_server_maps_local_indexes_to_chunk_ids(monkeypatch):
    # Server 1 holds chunks 0, 2 and 4 (local 0, 1, 2): it learns the local indexes from the
    # registration order (chunk ids increase), routes each key's round to its chunk id, and
    # refuses a chunk registered out of order.
    monkeypatch.setenv('DMLC_NUM_SERVER', '2')
    server = DelayServer.offline(rank=1, num_workers=2)      # commands only, no network
    _hello(server, slots=3)
    layout = KeyLayout(2, 3)
    body = {'rank': 0, 'chunks': [[c, [1, 0][c % 2], c, 'p%d' % c, 1.0, 1.0, 4] for c in range(5)]}
    server.command(Command.REGISTER, body)
    server.command(Command.REGISTER, dict(body, rank=1))    # the second worker: the same
    assert sorted(server.stats()['chunks']) == ['0', '2', '4']

    def held():
        return {int(c) for c, chunk in server.stats()['chunks'].items() if chunk['held']}
    routed = []
    for local in (2, 0, 1):
        # Slot 1 completes before slot 0: the round is held by the chunk the key routes to.
        before = held()
        server.complete_round(layout.slot_key(local, 1, 1), nd.zeros(1), nd.zeros(1))
        routed.extend((chunk, 1) for chunk in held() - before)
    assert routed == [(4, 1), (0, 1), (2, 1)]
    with pytest.raises(ValueError, match=r'worker 1 registers chunk 3 after chunk 4: every '
                                         r'worker must initialise the same keys in the same '
                                         r'order'):
        server.command(Command.REGISTER, {'rank': 1, 'chunks': [[3, 1, 9, 'late', 1.0, 1.0, 4]]})


def test_status_keys_of_1000_workers_fit_the_default_bound():
    assert commands.reply_len(1000, 10 ** 6) == 999        # 2982 bytes of reply text each
    assert commands.reply_capacity(999) == 2982


@pytest.mark.parametrize('num_workers,fits', [(2, 1300), (1000, 78)])
def test_stats_of_too_many_chunks_is_an_error_reply(tmp_path, num_workers, fits):
    # server_stats() lists every chunk (about 37 bytes each): docs/limits.md's limit. Past it the
    # worker gets "reply too long", never a wrong or partial answer.
    length = commands.reply_len(num_workers)
    for chunks, ok in ((fits, True), (fits * 11 // 10, False)):
        server = DelayServer.offline(rank=0, num_workers=num_workers)   # no network
        _hello(server)
        ids = range(1000, 1000 + chunks)
        server.command(Command.REGISTER, {'rank': 0, 'chunks': [[c, 0, c, 'p', 1.0, 1.0, 1]
                                                                for c in ids]})
        # 5000 rounds applied on every chunk, as a checkpoint restores them.
        path = str(tmp_path / ('%d.server0' % chunks))
        files.write_archive(path, files.SERVER, {
            'server': 0, 'num_workers': num_workers, 'updater': None,
            'chunks': {c: {'param_index': c, 'name': 'p', 'lr_mult': 1.0, 'wd_mult': 1.0,
                           'size': 1, 'weight': None, 'next_round': 5000} for c in ids}},
            save_id=None)
        server.command(Command.LOAD, {'rank': 0, 'paths': [path]})
        got = commands.decode_reply(commands.encode_reply(True, server.stats(), 1, length))
        assert got[0] is ok, (chunks, got[1] if not ok else len(got[1]['chunks']))
        if not ok:
            assert 'is too long for the status key' in got[1]


def test_whole_tensors_are_one_chunk_below_the_bound_only():
    # Placement(whole_below=bound) (an optimizer with whole-tensor norms): a tensor below the
    # bound is one chunk whatever the chunk size; one at the bound is chunked as usual; a
    # codec's smaller chunks (chunk_size given) still apply.
    placement = Placement(KeyLayout(2, 5), chunk_size=100, whole_below=1000)
    assert [len(placement.place(k, shape, np.float32).chunks) for k, shape in (
        ('small', (50,)), ('large', (999,)), ('bound', (1000,)), ('empty', (0,)))] == [1, 1, 10, 1]
    spans = placement.spans(999, chunk_size=30)
    assert len(spans) == 34 and spans[0] == (0, 30) and spans[-1] == (990, 999)
    assert Placement(KeyLayout(2, 5), chunk_size=100).spans(999)[-1] == (900, 999)
