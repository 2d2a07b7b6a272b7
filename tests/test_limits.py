"""Size limits (docs/design.md §2.6, §2.7): a real job with many tensors, and the errors a
job gets past each cap.

The job test runs 1,000 parameter tensors (3 elements each) on 2 workers and 2 servers
through the synchronous warm-up, the switch and two delayed periods, and compares every
worker's weights at every step with the numpy reference (tests/reference.py), with the
tolerance of the other trainer tests (``rtol=1e-5, atol=1e-6``; the gradient ``x + p`` is
elementwise, so only the momentum's float32 rounding differs).
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


@pytest.mark.jobs
def test_thousand_tensors_two_servers_match_reference(tmp_path):
    out = tmp_path / 'out'
    out.mkdir()
    command = [sys.executable, os.path.join(SCRIPTS, 'many_tensors_job.py'),
               json.dumps(CONFIG), str(out)]
    assert_ok(run_job(command, num_workers=2, num_servers=2, timeout=120))
    tensors, size = CONFIG['tensors'], CONFIG['size']
    trajectory = reference.simulate(
        job.init_params(tensors, size),
        lambda weights, rank, step: job.numpy_grad(weights, job.data(tensors, size, rank, step)),
        2, CONFIG['steps'], CONFIG['delay'], CONFIG['warmup_steps'], CONFIG['lr'],
        momentum=CONFIG['momentum'])
    names = sorted(job.init_params(tensors, size))
    for rank in range(2):
        got = np.load(str(out / ('worker%d.npz' % rank)))['weights']
        assert got.shape == (CONFIG['steps'], tensors, size)
        for t in range(CONFIG['steps']):
            want = np.stack([trajectory.local[t][rank][n] for n in names])
            np.testing.assert_allclose(got[t], want, rtol=RTOL, atol=ATOL,
                                       err_msg='worker %d, step %d' % (rank, t))
