"""Per-layer pushes during backward vs pushes after backward, side by side (issue 4).

Runs tests/scripts/timeline_job.py (6-layer MLP with one 2048x784 layer, batch 64, 2
workers + 1 server on loopback, OMP_NUM_THREADS=1) in both modes, alternating ``--rounds``
times, and prints the mean step time of the warm-up (synchronous) and delayed phases and
the share of steps whose first push started before backward ended.

Usage: ``python benchmarks/overlap.py [--rounds 2] [--warmup 30]``
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ('layerwise', 'after_backward')


def run(mode, warmup, folder):
    env = dict(os.environ, OMP_NUM_THREADS='1')
    subprocess.run([sys.executable, os.path.join(ROOT, 'mxdelay', 'launcher.py'), '-n', '2',
                    '-s', '1', '--timeout', '600', sys.executable,
                    os.path.join(ROOT, 'tests', 'scripts', 'timeline_job.py'), mode, folder,
                    str(warmup)], check=True, env=env, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    return [json.load(open(os.path.join(folder, 'timeline%d.json' % r))) for r in (0, 1)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--rounds', type=int, default=2)
    parser.add_argument('--warmup', type=int, default=30)
    args = parser.parse_args()
    results = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            with tempfile.TemporaryDirectory() as folder:
                results[mode].extend(run(mode, args.warmup, folder))
    print('| pushes | warm-up ms/step | delayed (k=2) ms/step | steps with a push during backward |')
    print('|---|---:|---:|---:|')
    for mode, workers in results.items():
        rows = [row for w in workers for row in w['rows']]
        print('| %s | %.1f | %.1f | %d of %d |' % (
            'per layer, during backward' if mode == 'layerwise' else 'after backward (waitall)',
            1000 * np.mean([w['warmup_step_s'] for w in workers]),
            1000 * np.mean([w['delayed_step_s'] for w in workers]),
            sum(r['overlap'] for r in rows), len(rows)))


if __name__ == '__main__':
    main()
