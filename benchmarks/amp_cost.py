"""What AMP's overflow machinery costs DelayedTrainer on loopback (docs/design.md §11).

Runs ``mlp_speed.py`` (the Fashion-MNIST MLP, 2 workers, 1 server, warm-up 20, k = 4)
without and with AMP (no operator cast: float32 arithmetic), alternating, ROUNDS times,
and the same model without any communication (``compute``: gluon.Trainer without a
kvstore, where AMP's cost is MXNet's own: its wrappers, the scaled backward, Gluon's
overflow check), and writes the median step time of the warm-up (steps 2-19) and of the delayed phase
(steps 22 on) to ``docs/benchmarks/amp/results.md`` and ``results.json``.

Usage: ``python benchmarks/amp_cost.py [ROUNDS] [STEPS]`` (default 3 rounds of 80 steps).
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile

import harness
from positional import positional

HERE, REPO = harness.HERE, harness.REPO
OUT = os.path.join(REPO, 'docs', 'benchmarks', 'amp')
MODES = ('compute', 'compute-amp', 'delay4', 'delay4-amp')


def run(mode, steps, folder):
    out = os.path.join(folder, mode)
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS='1', DMLC_NODE_HOST='127.0.0.1')
    job = harness.Job([sys.executable, os.path.join(HERE, 'mlp_speed.py'), mode, str(steps),
                       out], None, environ=env)
    subprocess.run(job.argv, check=True, env=job.env, stdout=subprocess.DEVNULL)
    times = []
    for rank in range(2):
        with open('%s.%d' % (out, rank)) as src:
            times.append(json.load(src)['times'])
    return times


def main():
    args = positional(__doc__, 0)
    rounds = int(args[0]) if args else 3
    steps = int(args[1]) if len(args) > 1 else 80
    phases = {'warm-up': slice(2, 20), 'delayed': slice(22, None)}
    samples = {(m, p): [] for m in MODES for p in phases}
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(rounds):
            for mode in MODES:
                for times in run(mode, steps, folder):
                    for phase, part in phases.items():
                        samples[(mode, phase)].extend(times[part])
    result = {'%s %s' % key: 1000 * statistics.median(v) for key, v in samples.items()}
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, 'results.json'), 'w') as dst:
        json.dump({'rounds': rounds, 'steps': steps, 'median_ms': result}, dst, indent=1)
    lines = ['# AMP overhead of DelayedTrainer on loopback', '',
             'Command: `python benchmarks/amp_cost.py %d %d` (2 workers, 1 server, the MLP of '
             '`benchmarks/mlp_speed.py`, warm-up 20, k = 4; AMP without casts). Median step '
             'time over both workers and %d alternating runs.' % (rounds, steps, rounds), '',
             '| mode and phase | without AMP (ms) | with AMP (ms) | cost |', '|---|---|---|---|']
    for mode in ('compute', 'delay4'):
        for phase in phases:
            off, on = result['%s %s' % (mode, phase)], result['%s-amp %s' % (mode, phase)]
            lines.append('| %s %s | %.1f | %.1f | %+.1f%% |' % (
                mode, phase, off, on, 100 * (on / off - 1)))
    with open(os.path.join(OUT, 'results.md'), 'w') as dst:
        dst.write('\n'.join(lines) + '\n')
    print('\n'.join(lines))


if __name__ == '__main__':
    main()
