"""Every role of a stock MXNet 1.9.1 job that checks the premise of the one-row-per-worker
wire (docs/design.md §2.14): MXNet's own server merges a round's row_sparse pushes whose rows
are disjoint without changing a bit of them.

Usage: ``mxdelay-launch -n N -s 1 python rows_wire_job.py WIDTH ROUNDS``. Nothing of mxdelay
is imported (a meta-path finder refuses it): the scheduler and the server are MXNet's own and
exit inside ``import mxnet``. Worker r pushes, in each round, a RowSparseNDArray of shape
(N, WIDTH) holding only row r: float32 words of every kind the codecs send (normal floats
made from codes as kvstore_ext.codecs.quantize packs them, with both signs and every exponent field
1..254, plus scales: +0, subnormal, huge, negative, as the worker may send them), different
per worker and round; the last word of every row is a signalling NaN, which the merge is
known to change (it comes back quieted): the check's own control. After each round the
worker pulls every row and prints ``RESULT {json}``: per round and row, the positions of the
32-bit words that differ from what that row's worker pushed.
"""
import json
import sys

from stock_guard import refuse_mxdelay

refuse_mxdelay()

# pylint: disable=wrong-import-position
import numpy as np  # noqa: E402
import mxnet as mx  # noqa: E402  scheduler and server: MXNet's own, which exit in here

KEY = 7
CODES = 2 * 254 * 2 ** 23   # codes of normal float32 words (docs/design.md §2.14)


def row_words(rank, rnd, width):
    """The float32 words worker `rank` pushes in round `rnd`: packed words, then scales."""
    rng = np.random.RandomState(1000 * rnd + rank)
    codes = rng.randint(0, CODES, size=width - 9, dtype=np.int64)
    codes[:4] = [0, CODES - 1, 254 * 2 ** 23 - 1, 254 * 2 ** 23]   # the extremes
    high, mantissa = np.divmod(codes, 2 ** 23)
    sign, exponent = np.divmod(high, 254)
    bits = (sign << 31) | ((exponent + 1) << 23) | mantissa
    words = bits.astype(np.uint32).view(np.float32)
    scales = np.array([0.0, 1e-40, -1e-40, 3e38, -2.5, 1.0, 1e-30, 7.0], dtype=np.float32)
    signalling_nan = np.array([0x7F800001], dtype=np.uint32).view(np.float32)
    return np.concatenate([words, scales, signalling_nan])


def main():
    width, rounds = int(sys.argv[1]), int(sys.argv[2])
    kv = mx.kv.create('dist_sync')
    if type(kv) is not mx.kvstore.KVStore:  # noqa: E721
        sys.exit('not MXNet\'s own store: %r' % type(kv))
    workers, rank = kv.num_workers, kv.rank
    rows = mx.nd.arange(workers, dtype='int64')
    # init needs stored rows: all of them, zeros.
    kv.init(KEY, mx.nd.sparse.row_sparse_array((mx.nd.zeros((workers, width)), rows),
                                               shape=(workers, width)))
    differing = []
    for rnd in range(rounds):
        mine = row_words(rank, rnd, width).reshape(1, width)
        kv.push(KEY, mx.nd.sparse.row_sparse_array(
            (mx.nd.array(mine, dtype='float32'), mx.nd.array([rank], dtype='int64')),
            shape=(workers, width)))
        out = mx.nd.sparse.zeros('row_sparse', (workers, width))
        kv.row_sparse_pull(KEY, out=out, row_ids=rows)
        got = out.asnumpy().view(np.uint32)
        differing.append([np.flatnonzero(got[r] != row_words(r, rnd, width).view(np.uint32))
                          .tolist() for r in range(workers)])
    print('RESULT ' + json.dumps({'rank': rank, 'differing': differing,
                                  'mxdelay_imported': 'mxdelay' in sys.modules}), flush=True)


if __name__ == '__main__':
    main()
