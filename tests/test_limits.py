"""Size limits (docs/design.md §2.6, §2.7; README's limits table): a real job with many
tensors, where each cap lies, and the error past it.

- The job tests run 1,000 parameter tensors (3 elements each), and 100,000,000 parameters
(25 tensors of 4e6 elements, 200 chunks; marked ``big``, run with ``-m big``), on 2 workers
and 2 servers through the synchronous warm-up, the switch and two delayed periods, and
compare every worker's weights at every step with the numpy reference (tests/reference.py),
with the tolerance of the other trainer tests (``rtol=1e-5, atol=1e-6``; the gradient
``x + p`` is elementwise, so only the momentum's float32 rounding differs). The big run
records only a sample of each tensor's elements that includes both sides of every chunk
boundary (``many_tensors_job.sample_indices``).
- The key cap per server (exact: every server holds exactly ``max_chunks_per_server``
  chunks, the next one is refused with the README's message), a billion parameters on 32,
  64 and 1,000 servers, 1,000 workers' status keys, and ``server_stats()`` past its size.
"""
import json
import os
import sys

import numpy as np
import pytest

import reference
from conftest import ATOL, RTOL, SCRIPTS, assert_ok, run_job
from kvstore_ext import protocol
from kvstore_ext.layout import MAX_KEY, KeyLayout, Placement

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
@pytest.mark.parametrize('num_servers,fits', [(16, True), (21, True), (22, False), (64, False)])
def test_a_billion_parameters_and_the_key_cap(num_servers, fits):
    # 1,000 tensors of 1e6 floats at the default chunk size (524288): 2,000 chunks, numbered
    # job-wide: chunk c's keys have index 1 + c * (R + J) + slot on every server, and MXNet
    # needs index * S + residue <= MAX_KEY. At k = 4 (R = 5, J = 0) that is up to 21 servers.
    placement = Placement(KeyLayout(num_servers, 5, 0), chunk_size=524288)
    if fits:
        tensors = [placement.place(i, (1000, 1000), np.float32) for i in range(1000)]
        assert sum(len(t.chunks) for t in tensors) == 2000
        assert max(k for t in tensors for c in t.chunks for k in c.keys) <= MAX_KEY
    else:
        with pytest.raises(ValueError, match=r'key \d+ exceeds %d, the largest key MXNet places '
                                             r'correctly' % MAX_KEY):
            for i in range(1000):
                placement.place(i, (1000, 1000), np.float32)

def test_status_keys_of_1000_workers_fit_the_default_bound():
    assert protocol.reply_len(1000, 10 ** 6) == 999        # 2982 bytes of reply text each
    assert protocol.reply_capacity(999) == 2982


@pytest.mark.parametrize('num_workers,fits', [(2, 1300), (1000, 78)])
def test_stats_of_too_many_chunks_is_an_error_reply(num_workers, fits):
    # server_stats() lists every chunk (about 37 bytes each): README's limit. Past it the
    # worker gets "reply too long", never a wrong or partial answer.
    import types  # pylint: disable=import-outside-toplevel
    from kvstore_ext.server import DelayServer  # pylint: disable=import-outside-toplevel
    server = DelayServer(types.SimpleNamespace(handle=None))   # handlers only, no network
    server._server_rank, server._num_workers = 0, num_workers
    length = protocol.reply_len(num_workers)
    for chunks, ok in ((fits, True), (fits * 11 // 10, False)):
        server._chunks = {c: {} for c in range(1000, 1000 + chunks)}
        server._rounds.next_round = {c: 5000 for c in server._chunks}
        got = protocol.decode_reply(protocol.encode_reply(True, server._on_stats({}), 1, length))
        assert got[0] is ok, (chunks, got[1] if not ok else len(got[1]['chunks']))
        if not ok:
            assert 'is too long for the status key' in got[1]
