"""Worker of benchmarks/kvstore_roundtrip.py: push + pull of a 1.86M-float model per step.

Usage (under a launcher): ``python kv_worker.py KVSTORE STEPS OUT_JSON [none|sgd] [mlp|big]``.
Model ``mlp`` (default): the MLP's 6 tensors; ``big``: one tensor of 4096 x 4096 floats.
OUT_JSON gets every step's time and the wall-clock start and end of every step
(``time.time()``), so that the driver can read the servers' CPU time over chosen steps.
Only ``dist_delay`` imports mxdelay (before mxnet, so that its servers are mxdelay's);
``dist_sync`` is stock MXNet in every process, servers and scheduler included. Every process
records what it imported (``benchmarks/provenance.py``) next to OUT_JSON.
"""
import argparse
import os
import sys

import provenance  # standard library only: first, before MXNet

_PARSER = argparse.ArgumentParser(description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
_PARSER.add_argument('kvstore', choices=('dist_sync', 'dist_delay'))
_PARSER.add_argument('steps', type=int)
_PARSER.add_argument('out_json')
_PARSER.add_argument('optimizer', nargs='?', choices=('none', 'sgd'), default='none')
_PARSER.add_argument('model', nargs='?', choices=('mlp', 'big'), default='mlp')
ARGS = _PARSER.parse_args()
KIND = ARGS.kvstore
provenance.record(os.path.dirname(os.path.abspath(ARGS.out_json)), KIND,
                  stock=KIND != 'dist_delay')
if KIND == 'dist_delay':
    import mxdelay  # noqa: F401,E402  before mxnet: the servers become mxdelay's

import json  # noqa: E402
import time  # noqa: E402

import mxnet as mx  # noqa: E402
from mxnet import nd  # noqa: E402

MODELS = {
    # The Fashion-MNIST MLP 784-1024-1024-10: 1,863,690 floats in 6 tensors.
    'mlp': [(1024, 784), (1024,), (1024, 1024), (1024,), (10, 1024), (10,)],
    # One big tensor: 16,777,216 floats (32 chunks on mxdelay's servers; split over the
    # servers by MXNet's stock store).
    'big': [(4096, 4096)],
}


def main():
    steps, out = ARGS.steps, ARGS.out_json
    kv = mx.kv.create(KIND)
    if KIND != 'dist_delay':
        assert 'mxdelay' not in sys.modules and 'kvstore_ext' not in sys.modules
    if ARGS.optimizer == 'sgd':
        kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.01, momentum=0.9))
    shapes = MODELS[ARGS.model]
    weights = [nd.zeros(s) for s in shapes]
    grads = [nd.ones(s) for s in shapes]
    for i, w in enumerate(weights):
        kv.init(i, w)
    times, stamps = [], []
    for _ in range(steps):
        start = time.time()
        for i, g in enumerate(grads):
            kv.push(i, g, priority=-i)
        for i, w in enumerate(weights):
            kv.pull(i, out=w, priority=-i)
        nd.waitall()
        end = time.time()
        times.append(end - start)
        stamps.append((start, end))
    if kv.rank == 0:
        with open(out, 'w') as dst:
            json.dump({'kvstore': KIND, 'times': times, 'stamps': stamps}, dst)


if __name__ == '__main__':
    main()
