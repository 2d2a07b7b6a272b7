"""A worker of the row_sparse kvstore test: row_sparse pushes whose rows and values encode
(rank, round, row) into a 'dist_delay' store without optimizer (a round's stored value is
its sum), dense pulls and row_sparse pulls of every round. Prints ``RESULT {...}``.

Usage: ``mxdelay-launch -n N -s S python sparse_kv_job.py ROUNDS SLEEP``; worker 1 sleeps
SLEEP seconds before each round (a straggler: the others run ahead within the slack).
Run with ``MXNET_KVSTORE_BIGARRAY_BOUND=5000`` and ``MXDELAY_CHUNK_SIZE=1000``: key 11 has
6000 elements, above the bound, and is split into 6 chunks of 250 rows.
"""
import mxdelay  # noqa: F401

import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import mxnet as mx  # noqa: E402
from mxnet import nd  # noqa: E402

#: key -> (shape, dtype, multiplier of the rank in the pushed values)
KEYS = {10: ((6, 2), 'float32', 1000.0), 11: ((1500, 4), 'float32', 1000.0),
        12: ((8, 3), 'float16', 100.0)}
#: dtype of the row ids, by round mod 2
ID_DTYPES = ('int64', 'float32')
#: row ids asked for, by round mod 4: repeated and unsorted, empty, all rows, across chunks
ROW_CASES = [lambda n: [3, 1, 3, 0, n - 1, 1], lambda n: [], lambda n: list(range(n)),
             lambda n: [n - 1, 0, 250 % n, 251 % n, 749 % n, 0, n // 2]]


def rows_of(rank, rnd, num_rows):
    """The rows worker `rank` pushes in round `rnd`: none for worker 0 in round 2 (an
    all-zero gradient) and for everyone in round 3."""
    if rnd == 3 or (rnd == 2 and rank == 0):
        return np.zeros(0, dtype=np.int64)
    return np.array([i for i in range(num_rows) if (i + rank + rnd) % 3 == 0], dtype=np.int64)


def gradient(rank, rnd, key):
    shape, dtype, mult = KEYS[key]
    rows = rows_of(rank, rnd, shape[0])
    data = np.full((len(rows),) + shape[1:], mult * rank + rnd + 1, dtype=dtype)
    return nd.sparse.row_sparse_array((data, rows), shape=shape, dtype=dtype)


def expected_sum(num_workers, rnd, key):
    shape, dtype, _ = KEYS[key]
    total = np.zeros(shape, dtype=np.float64)
    for rank in range(num_workers):
        total += gradient(rank, rnd, key).asnumpy()
    return total


def initial(key):
    shape, dtype, _ = KEYS[key]
    return (np.arange(int(np.prod(shape))).reshape(shape) % 97).astype(dtype)


def main():
    rounds, sleep = int(sys.argv[1]), float(sys.argv[2])
    kv = mx.kv.create('dist_delay')
    for key, (shape, dtype, _) in sorted(KEYS.items()):
        kv.init(key, nd.array(initial(key), dtype=dtype).tostype('row_sparse'))
    pulls = []   # (key, round, case, ids, out): round -1 is before the first push
    for key, (shape, dtype, _) in sorted(KEYS.items()):
        out = nd.zeros(shape, dtype=dtype)
        kv.pull(key, out=out)
        pulls.append((key, -1, 'dense', None, out))
    for rnd in range(rounds):
        if kv.rank == 1:
            time.sleep(sleep)
        for key, (shape, dtype, _) in sorted(KEYS.items()):
            kv.push(key, gradient(kv.rank, rnd, key), priority=-key)
            dense = nd.zeros(shape, dtype=dtype)
            kv.pull(key, out=dense, priority=-key)
            pulls.append((key, rnd, 'dense', None, dense))
            ids = ROW_CASES[rnd % len(ROW_CASES)](shape[0])
            sparse = nd.sparse.zeros('row_sparse', shape, dtype=dtype)
            # Odd rounds ask with float32 ids, nd.array's default (MXNet's own tests do, an
            # empty nd.array([]) included): the store takes any dtype, as MXNet's does.
            kv.row_sparse_pull(key, out=sparse, row_ids=nd.array(ids, dtype=ID_DTYPES[rnd % 2]),
                               priority=-key)
            pulls.append((key, rnd, 'rows', ids, sparse))
    bad = []
    for key, rnd, case, ids, out in pulls:
        want = initial(key) if rnd < 0 else expected_sum(kv.num_workers, rnd, key)
        if case == 'dense':
            if not np.array_equal(out.asnumpy(), want):
                bad.append([key, rnd, case])
            continue
        rows = np.unique(np.array(ids, dtype=np.int64))
        got_rows = out.indices.asnumpy()
        if not np.array_equal(got_rows, rows) or not np.array_equal(out.data.asnumpy(),
                                                                    want[rows]):
            bad.append([key, rnd, case, got_rows.tolist()[:8]])
    stats = kv.delayed.job.server_stats()
    print('RESULT ' + json.dumps({'rank': kv.rank, 'bad': bad, 'stats': stats,
                                  'chunks': {k: kv.delayed.traffic.num_chunks(k) for k in KEYS}}))


if __name__ == '__main__':
    main()
