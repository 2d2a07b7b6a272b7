"""Worker (and, under a launcher, every other role) of benchmarks/memory.py.

Usage (under a launcher): ``python memory_worker.py MODE K MODEL STEPS OUT_FOLDER [CONFIG]``.

- MODE ``sync``: stock ``gluon.Trainer`` on ``'dist_sync'``; no mxdelay in any process (every
  process records it, ``benchmarks/provenance.py``, and exits with code 3 if it finds it).
- MODE ``delay``: ``mxdelay.DelayedTrainer`` on ``'dist_delay'`` with ``delay=K`` (slack K,
  so R = K + 1 slot buffers), rule ``'mirror'``; mxdelay is imported before mxnet, so that
  the servers are mxdelay's.
- CONFIG (MODE ``delay`` only, default ``plain``): ``plain`` (float32 pushes and pulls),
  ``fp16`` (``compression_params={'type': 'fp16'}``) or ``ternary-int8``
  (``compression_params={'type': 'ternary'}``, ``pull_compression={'type': 'int8'}``).
- MODEL ``mlp``: the Fashion-MNIST MLP of ``examples/train_fashion_mnist.py`` (784-1024-1024-10,
  1,863,690 parameters); ``mid``: 2 Dense layers of 4096 x 4096 (33,554,432 parameters);
  ``big``: 6 Dense layers of 4096 x 4096 (100,663,296 parameters).
  Data is synthetic (a pure function of rank and step); the optimizer is SGD with momentum
  0.9 for both modes.

Each worker runs STEPS steps (with MODE ``delay`` the first ``WARMUP`` are the synchronous
warm-up), waits for all its work (``nd.waitall``), gives the heap's free memory back to the
system (glibc's ``malloc_trim(0)``: freed arrays below the mmap threshold would otherwise
stay in the RSS, so that it counts the arrays the worker holds), writes ``steady-<rank>.json`` (its
parameter count) into OUT_FOLDER and then sleeps ``HOLD`` seconds, so that the driver reads
every process's memory in that steady state, before the job ends.
"""
import argparse
import os
import sys

import provenance  # standard library only: first, before MXNet

_PARSER = argparse.ArgumentParser(description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
_PARSER.add_argument('mode', choices=('sync', 'delay'))
_PARSER.add_argument('k', type=int)
_PARSER.add_argument('model', choices=('mlp', 'mid', 'big'))
_PARSER.add_argument('steps', type=int)
_PARSER.add_argument('out_folder')
_PARSER.add_argument('config', nargs='?', default='plain',
                     choices=('plain', 'fp16', 'ternary-int8'))
_ARGS = _PARSER.parse_args()
MODE, K, MODEL, STEPS, OUT = _ARGS.mode, _ARGS.k, _ARGS.model, _ARGS.steps, _ARGS.out_folder
provenance.record(OUT, MODE, stock=MODE != 'delay')
if MODE == 'delay':
    import mxdelay  # noqa: F401,E402  before mxnet: the servers become mxdelay's

import ctypes  # noqa: E402
import ctypes.util  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import mxnet as mx  # noqa: E402
from mxnet import autograd, gluon, nd  # noqa: E402

WARMUP = 3
HOLD = 3.0
BATCH = {'mlp': 64, 'mid': 8, 'big': 8}
IN_UNITS = {'mlp': 784, 'mid': 4096, 'big': 4096}
LAYERS = {'mid': 2, 'big': 6}
#: CONFIG -> DelayedTrainer's compression arguments
CONFIGS = {'plain': {},
           'fp16': {'compression_params': {'type': 'fp16'}},
           'ternary-int8': {'compression_params': {'type': 'ternary'},
                            'pull_compression': {'type': 'int8'}}}


def build(model):
    net = gluon.nn.HybridSequential()
    if model == 'mlp':
        net.add(gluon.nn.Dense(1024, activation='relu', in_units=784),
                gluon.nn.Dense(1024, activation='relu', in_units=1024),
                gluon.nn.Dense(10, in_units=1024))
    else:
        units = IN_UNITS[model]
        for _ in range(LAYERS[model]):
            net.add(gluon.nn.Dense(units, activation='tanh', in_units=units, use_bias=False))
    net.initialize(mx.init.Xavier())
    return net


def main():
    net = build(MODEL)
    params = net.collect_params()
    optimizer_params = {'learning_rate': 0.001, 'momentum': 0.9}
    if MODE == 'delay':
        trainer = mxdelay.DelayedTrainer(params, 'sgd', optimizer_params, kvstore='dist_delay',
                                         delay=K, warmup_steps=WARMUP,
                                         **CONFIGS[_ARGS.config])
    else:
        trainer = gluon.Trainer(params, 'sgd', optimizer_params, kvstore='dist_sync')
        assert 'mxdelay' not in sys.modules and 'kvstore_ext' not in sys.modules
    loss_fn = gluon.loss.L2Loss()
    rank = int(os.environ.get('MXDELAY_RANK', '0'))
    for step in range(STEPS):
        rs = np.random.RandomState(1000 * step + rank)
        x = nd.array(rs.randn(BATCH[MODEL], IN_UNITS[MODEL]).astype(np.float32))
        with autograd.record():
            out = net(x)
            loss = loss_fn(out, nd.zeros_like(out))
        loss.backward()
        trainer.step(BATCH[MODEL])
        loss.mean().asscalar()
    nd.waitall()
    ctypes.CDLL(ctypes.util.find_library('c') or 'libc.so.6').malloc_trim(0)
    count = sum(int(np.prod(p.shape)) for p in params.values())
    with open(os.path.join(OUT, 'steady-%d.json' % rank), 'w', encoding='utf-8') as dst:
        json.dump({'rank': rank, 'parameters': count, 'time': time.time()}, dst)
    time.sleep(HOLD)


if __name__ == '__main__':
    main()
