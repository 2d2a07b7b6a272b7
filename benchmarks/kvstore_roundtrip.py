"""Push + pull round trip of 'dist_delay' vs MXNet's native 'dist_sync', side by side.

Runs benchmarks/kv_worker.py (a 1.86M-float model: the Fashion-MNIST MLP's 6 tensors;
every step pushes all and pulls all, then waits) under mxdelay-launch with 2 workers and 1
server on loopback, alternating the two stores ``--rounds`` times so that the machine's
noise hits both alike, and prints the median step time and the throughput ratio.

With ``--optimizer sgd`` both stores' servers apply SGD with momentum (as in training: the
server's Python updater runs for every round); without it, they store the round's sum, which
MXNet's native server does in C++ alone, while mxdelay's server always runs its Python
updater (it orders the rounds).

Usage: ``python benchmarks/kvstore_roundtrip.py [--rounds 3] [--steps 100] [--optimizer sgd]``
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
LAUNCHER = os.path.join(os.path.dirname(HERE), 'mxdelay', 'launcher.py')


def run(kind, steps, folder, optimizer):
    out = os.path.join(folder, kind + '.json')
    env = dict(os.environ, OMP_NUM_THREADS='1')
    subprocess.run([sys.executable, LAUNCHER, '-n', '2', '-s', '1', '--timeout', '600',
                    sys.executable, os.path.join(HERE, 'kv_worker.py'), kind, str(steps), out,
                    optimizer],
                   check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(out) as src:
        return json.load(src)['times'][10:]   # the first steps allocate buffers


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--rounds', type=int, default=3)
    parser.add_argument('--steps', type=int, default=100)
    parser.add_argument('--optimizer', choices=('none', 'sgd'), default='none')
    args = parser.parse_args()
    times = {'dist_sync': [], 'dist_delay': []}
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(args.rounds):
            for kind in times:
                times[kind].extend(run(kind, args.steps, folder, args.optimizer))
    median = {kind: 1000 * float(np.median(t)) for kind, t in times.items()}
    print('| store | median ms per push+pull of 1.86M floats | throughput vs dist_sync |')
    print('|---|---:|---:|')
    for kind in times:
        print('| %s | %.1f | %.2fx |' % (kind, median[kind], median['dist_sync'] / median[kind]))


if __name__ == '__main__':
    main()
