"""Row-sparse keys on the 'dist_delay' store in real jobs (tests/scripts/sparse_kv_job.py).

Each worker pushes row_sparse gradients whose rows depend on (rank, round) and whose values
are ``mult * rank + round + 1``; the store has no optimizer, so a round's stored value is its
sum, and every pull must equal exactly the sum of its own round (bit-equal, float32 and
float16), or the initial value before the first push. Covered: a one-chunk key, a key of
6000 elements above ``MXNET_KVSTORE_BIGARRAY_BOUND=5000`` (6 chunks of 250 rows), a float16
key; all-zero pushes (worker 0 in round 2, every worker in round 3); dense pulls and
``row_sparse_pull`` with repeated and unsorted, empty, all and cross-chunk row ids; a
straggler (worker 1 sleeps 30 ms per round, slack 3) so that rounds arrive out of order.
"""
import os
import sys

import pytest

from support.jobs import assert_ok, kv_results, run_job

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'scripts', 'sparse_kv_job.py')


@pytest.mark.jobs
@pytest.mark.parametrize('num_workers,num_servers', [(2, 2), (3, 1)])
def test_row_sparse_rounds_are_exact(num_workers, num_servers):
    rounds = 8
    env = {'MXNET_KVSTORE_BIGARRAY_BOUND': 5000, 'MXDELAY_CHUNK_SIZE': 1000,
           'MXDELAY_SLACK': 3, 'MXNET_STORAGE_FALLBACK_LOG_VERBOSE': 0}
    result = run_job([sys.executable, JOB, str(rounds), "0.03"], num_workers=num_workers,
                     num_servers=num_servers, env=env, timeout=90)
    assert_ok(result)
    results = kv_results(result)
    assert sorted(results) == list(range(num_workers))
    for rank, data in results.items():
        assert data['bad'] == [], 'worker %d pulled wrong values: %s' % (rank, data['bad'])
        assert data['chunks'] == {'10': 1, '11': 6, '12': 1}
        applied = [c['rounds'] for s in data['stats'] for c in s['chunks'].values()]
        assert applied == [rounds] * 8
