"""Worker of benchmarks/kvstore_roundtrip.py: push + pull of a 1.86M-float model per step.

Usage (under mxdelay-launch): ``python kv_worker.py KVSTORE STEPS OUT_JSON [none|sgd]``.
"""
import mxdelay  # noqa: F401  before mxnet: the servers become mxdelay's

import json
import sys
import time

import mxnet as mx
from mxnet import nd

# The Fashion-MNIST MLP 784-1024-1024-10: 1,863,690 floats in 6 tensors.
SHAPES = [(1024, 784), (1024,), (1024, 1024), (1024,), (10, 1024), (10,)]


def main():
    kind, steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    kv = mx.kv.create(kind)
    if sys.argv[4:] == ['sgd']:
        kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.01, momentum=0.9))
    weights = [nd.zeros(s) for s in SHAPES]
    grads = [nd.ones(s) for s in SHAPES]
    for i, w in enumerate(weights):
        kv.init(i, w)
    times = []
    for step in range(steps):
        start = time.time()
        for i, g in enumerate(grads):
            kv.push(i, g, priority=-i)
        for i, w in enumerate(weights):
            kv.pull(i, out=w, priority=-i)
        nd.waitall()
        times.append(time.time() - start)
    if kv.rank == 0:
        with open(out, 'w') as dst:
            json.dump({'kvstore': kind, 'times': times}, dst)


if __name__ == '__main__':
    main()
