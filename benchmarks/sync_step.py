"""Worker 0's mean step on ResNet-50: stock ``dist_sync`` against ``dist_delay``'s
synchronous steps and delayed steps, snapshots side by side.

Each job is ``bench_worker.py --model resnet50`` (the model zoo's ``resnet50_v1(classes=10)``,
193 trained tensors of 299, batch 8 of synthetic 32x32 images), 2 workers and 1 server on
loopback; its workers record every step's end and their CPU seconds by then.
Methods, per round in this order:

- ``stock``: ``gluon.Trainer`` on ``'dist_sync'``, stock MXNet in every process;
- ``sync-NAME``: ``DelayedTrainer`` (k=4) of snapshot NAME, whose first W steps are its
  synchronous warm-up: steps ``SKIP+1 .. W`` are timed;
- ``sync-NAME+VAR=VALUE`` (``--env VAR=VALUE``, the last snapshot only): ``sync-NAME``
  with that variable set in every process (e.g.
  ``MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN_BWD=15``, stock's bulk size, which ``import
  mxdelay`` sets to 4 when unset);
- ``k4-NAME`` (``--delayed``): the same with 8 warm-up steps, the switch at step 9 and
  delayed steps: steps ``14 .. W+1`` (whole periods after the first) are timed.

Snapshots (``--snapshots NAME=DIR,...``): each delayed job runs with ``PYTHONPATH=DIR`` (a
pinned worktree; ``stock`` runs this checkout's ``bench_worker.py``, no mxdelay imported).
A method's figures are worker 0's mean step (ms) in each round and its process's CPU per
step (ms, every thread: Python, MXNet's engine and ps-lite; less sensitive to the other
processes of a busy machine than the step's time); the table gives the rounds' medians and
their ratios to stock's.

Usage (writes ``OUT/results.json``, ``OUT/table.md`` and each job's files under
``OUT/raw/``)::

    python benchmarks/sync_step.py --snapshots main=/tmp/pin-main,new=/tmp/pin-new \
        --rounds 3 --delayed --out docs/benchmarks/syncstep
"""
import json
import os
import statistics
import sys

import harness

__all__ = ['main']

SKIP = 4            # steps before the timed ones: the first steps make buffers and caches
DELAYED_WARMUP = 8  # k4-NAME's warm-up (then the switch, and delayed steps)


def _methods(snapshots, delayed, env):
    """(name, job environment, bench_worker arguments) of one round's jobs."""
    methods = [('stock', {}, ['--mode', 'sync'])]
    sync = ['--mode', 'delayed', '--delay', '4']
    for name, path in snapshots:
        methods.append(('sync-' + name, {'PYTHONPATH': path}, sync))
        if env and path == snapshots[-1][1]:
            variable, value = env.split('=', 1)
            methods.append(('sync-%s+%s' % (name, env),
                            {'PYTHONPATH': path, variable: value}, sync))
        if delayed:
            methods.append(('k4-' + name, {'PYTHONPATH': path},
                            sync + ['--warmup-steps', str(DELAYED_WARMUP)]))
    return methods


def mean_step_ms(ends, first, last):
    """Mean of steps `first` .. `last` (1-based) from `ends`, the steps' end times (or the
    CPU seconds at their ends)."""
    return 1000.0 * (ends[last - 1] - ends[first - 2]) / (last - first + 1)


def main(argv=None):
    parser = harness.parser(__doc__)
    parser.add_argument('--snapshots', required=True,
                        help='NAME=DIR,... (pinned worktrees of mxdelay)')
    parser.add_argument('--rounds', type=int, default=3)
    parser.add_argument('--warmup-steps', type=int, default=40,
                        help='W: the jobs\' length (default: %(default)s)')
    parser.add_argument('--delayed', action='store_true', help='also the k4-NAME jobs')
    parser.add_argument('--env', metavar='VAR=VALUE', help='also the sync-NAME+VAR=VALUE jobs')
    parser.add_argument('--out', required=True)
    args = parser.parse_args(argv)
    snapshots = [item.split('=', 1) for item in args.snapshots.split(',')]
    for name, path in snapshots:
        if not os.path.isdir(os.path.join(path, 'mxdelay')):
            parser.error('--snapshots %s=%s: no mxdelay package in %s; pin one with git '
                         'worktree add --detach DIR' % (name, path, path))
    methods = _methods(snapshots, args.delayed, args.env)
    meta = harness.start_meta(harness.command_line('python benchmarks/sync_step.py', argv),
                              snapshots=dict(snapshots))
    rows = {name: [] for name, _, _ in methods}
    for round_index in range(args.rounds):
        for name, env, method_args in methods:
            folder = os.path.join(args.out, 'raw', 'round%d-%s' % (round_index, name))
            synchronous = name.startswith(('stock', 'sync-'))
            # Both kinds of job run W + 2 steps or more; a k4 job's timed periods end at W + 1.
            if synchronous:
                first, last = SKIP + 1, args.warmup_steps
                length = ['--warmup-steps', str(args.warmup_steps), '--steps', '1']
            else:
                first, last = DELAYED_WARMUP + 2 + 4, args.warmup_steps + 1
                length = ['--steps', str(args.warmup_steps + 1 - DELAYED_WARMUP)]
            worker_args = ['--model', 'resnet50'] + method_args + length
            code, results, _, _ = harness.run_worker(folder, worker_args, 900, env=env or None)
            if code != 0:
                sys.exit('%s failed (exit code %d): %s/log.txt' % (name, code, folder))
            ms = mean_step_ms(results[0]['all_step_ends'], first, last)
            cpu_ms = mean_step_ms(results[0]['all_step_cpu'], first, last)
            rows[name].append(dict(ms=ms, cpu_ms=cpu_ms, first=first, last=last,
                                   load=os.getloadavg()[0]))
            print('round %d %-12s %.1f ms, CPU %.1f ms' % (round_index, name, ms, cpu_ms),
                  flush=True)
    lines = ['| method | step, rounds (ms) | step, median (ms) | / stock | CPU, rounds (ms) '
             '| CPU, median (ms) | / stock |', '|---|---|---:|---:|---|---:|---:|']
    stock = {field: statistics.median(r[field] for r in rows['stock'])
             for field in ('ms', 'cpu_ms')}
    for name, runs in rows.items():
        cells = []
        for field in ('ms', 'cpu_ms'):
            median = statistics.median(r[field] for r in runs)
            cells.append('%s | %.1f | %.3f' % (' '.join('%.1f' % r[field] for r in runs),
                                               median, median / stock[field]))
        lines.append('| %s | %s |' % (name, ' | '.join(cells)))
    with open(os.path.join(args.out, 'results.json'), 'w', encoding='utf-8') as out:
        json.dump(dict(harness.finish_meta(meta), rows=rows), out, indent=1)
    with open(os.path.join(args.out, 'table.md'), 'w', encoding='utf-8') as out:
        out.write('\n'.join(lines) + '\n')
    print('\n'.join(lines))
    return 0


if __name__ == '__main__':
    harness.run_stoppable(main)
