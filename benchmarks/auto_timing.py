"""What ``delay='auto'``'s measurements cost: worker 0's mean step with ``delay='auto'``
against ``delay=4`` (the same job with auto's choice fixed), for one or more versions of
the code, side by side in one invocation.

Procedure: ``benchmarks/bench_worker.py`` as ``benchmarks/scaling.py`` runs it (the model of
``--model``, scaling_report's arguments, seed 1, ``OMP_NUM_THREADS=1``), 2 workers and 1
server on loopback (no shaping: the measurement's cost is CPU), ``--warmup`` warm-up steps
and ``--steps`` timed ones. Each ``--code NAME=PATH`` is a snapshot of the repository put
first on the jobs' ``PYTHONPATH`` (e.g. ``git worktree add --detach /tmp/pin-x COMMIT``).
Per round, every (code, method) runs once, in the order of the ``--code`` options (k=4
first), reversed every other round (``harness.ordered``), so that drifts of the shared
machine hit all alike. Worker 0's step t takes from the end of step t - 1 to the end of step
t (bench_worker's ``all_step_ends``); the table gives its mean over the warm-up's steady
steps (3 to W), over the first two delayed periods after the switch (W + 1 to W + 12) and
over the rest, per run and as the median over the rounds, with each (code) auto's ratio to
its k=4 (of the medians, and the median of each round's ratio). The noise of an 8-step mean
(what the fallback check compares): in each k=4 run, the relative difference between the
means of two consecutive 8-step windows of the same phase (warm-up steps 5-12 and 13-20 for
W = 20; delayed steps W + 5 .. W + 12 and W + 13 .. W + 20, whole periods after the settling
one), and its largest value over the runs.

Writes ``--out``/runs.jsonl (one line a run: every step's ms) and ``--out``/table.md;
``--report-only`` writes the table again from runs.jsonl.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

import harness
from methods import METHODS
from scaling_report import MODELS

__all__ = ['main']

_METHODS = ('k4', 'auto')


def _code(text):
    """``--code NAME=PATH`` as (name, absolute path)."""
    name, _, path = text.partition('=')
    if not name or not os.path.isdir(os.path.join(path, 'mxdelay')):
        raise argparse.ArgumentTypeError('--code %r: give NAME=PATH with PATH a snapshot of '
                                         'the repository (a folder holding mxdelay/)' % text)
    return name, os.path.abspath(path)


def _windows(step_ms, warmup):
    """Mean ms of steps 3..W, W+1..W+12 and W+13..end."""
    spans = ((3, warmup + 1), (warmup + 1, warmup + 13), (warmup + 13, len(step_ms)))
    return [statistics.mean(step_ms[a:b]) if step_ms[a:b] else float('nan') for a, b in spans]


def run(args, code, path, method, round_index):
    """One job of `method` ('k4' or 'auto') with the code at `path`; its row for runs.jsonl."""
    folder = os.path.join(args.out, 'runs', '%s-%s-r%d' % (code, method, round_index))
    worker_args = MODELS[args.model]['args'] + [
        '--warmup-steps', str(args.warmup), '--steps', str(args.steps), '--seed', '1']
    base = METHODS[method]
    chosen = type(base)(base.label, delay=base.delay, env=(('PYTHONPATH', path),))
    try:
        exit_code, results, _, info = harness.run_method(folder, chosen, worker_args, 600)
    except subprocess.TimeoutExpired:
        return dict(code=code, method=method, round=round_index, error='timeout: ' + folder)
    row = dict(code=code, method=method, round=round_index, load_before=info['load_before'])
    if exit_code != 0:
        return dict(row, error='exit %s: %s' % (exit_code, folder))
    ends, cpus = results[0]['all_step_ends'], results[0]['all_step_cpu']
    row['step_ms'] = [None] + [round(1e3 * (b - a), 1) for a, b in zip(ends, ends[1:])]
    row['cpu_ms'] = [None] + [round(1e3 * (b - a), 1) for a, b in zip(cpus, cpus[1:])]
    row['warmup_ms'], row['delayed_ms'], row['rest_ms'] = _windows(row['step_ms'], args.warmup)
    row['warmup_cpu_ms'] = _windows(row['cpu_ms'], args.warmup)[0]
    row['decided'] = results[0]['decided']
    return row


def noise(step_ms, warmup):
    """Relative differences of consecutive 8-step means: warm-up, then delayed."""
    out = []
    for a in (warmup - 15, warmup + 5):
        if a < 3 or len(step_ms) < a + 16:
            out.append(float('nan'))
            continue
        first, second = statistics.mean(step_ms[a:a + 8]), statistics.mean(step_ms[a + 8:a + 16])
        out.append(abs(second - first) / first)
    return out


def _ratios(rows, code, key):
    """(rounds, median k=4, median auto, their ratio, median of each round's auto / k=4) of
    `key` for `code`; None without a pair."""
    runs = {(r['method'], r['round']): r[key] for r in rows
            if r['code'] == code and 'error' not in r and r.get(key) is not None}
    paired = [runs[('auto', n)] / runs[('k4', n)] for m, n in runs
              if m == 'k4' and ('auto', n) in runs]
    if not paired:
        return None
    med = {m: statistics.median(v for (mm, _), v in runs.items() if mm == m) for m in _METHODS}
    return len(paired), med['k4'], med['auto'], med['auto'] / med['k4'], statistics.median(paired)


def table(rows, codes, warmup):
    """table.md's text: every run, the medians and ratios, the noise of 8-step means."""
    lines = ['| code | method | round | steps 3-%d | %d-%d | %d-end | CPU, steps 3-%d | decided |'
             % (warmup, warmup + 1, warmup + 12, warmup + 13, warmup),
             '|---|---|---:|---:|---:|---:|---:|---|']
    for row in rows:
        lines.append('| %s | %s | %d | %s |' % (
            row['code'], row['method'], row['round'], row.get('error') or ' | '.join(
                ['%.1f' % row[key] for key in ('warmup_ms', 'delayed_ms', 'rest_ms')]
                + ['%.1f' % row['warmup_cpu_ms'] if 'warmup_cpu_ms' in row else '-',
                   row.get('decided') or '-'])))
    lines += ['', 'Worker 0\'s warm-up step (steps 3-%d), ms:' % warmup, '',
              '| code | measure | rounds | k=4 (median) | auto (median) | auto / k=4 '
              '| median of the rounds\' auto / k=4 |', '|---|---|---:|---:|---:|---:|---:|']
    for code in codes:
        for key, name in (('warmup_ms', 'wall clock'), ('warmup_cpu_ms', 'CPU')):
            found = _ratios(rows, code, key)
            if found:
                lines.append('| %s | %s | %d | %.1f | %.1f | %.3f | %.3f |'
                             % ((code, name) + found))
    lines += ['', '| k=4 run | warm-up: two 8-step means differ by | delayed: by |',
              '|---|---:|---:|']
    worst = [0.0, 0.0]
    for row in rows:
        if row['method'] == 'k4' and 'error' not in row:
            diffs = noise(row['step_ms'], warmup)
            worst = [max(w, d) for w, d in zip(worst, diffs)]
            lines.append('| %s r%d | %.1f%% | %.1f%% |' % (row['code'], row['round'],
                                                         100 * diffs[0], 100 * diffs[1]))
    lines.append('| largest | %.1f%% | %.1f%% |' % (100 * worst[0], 100 * worst[1]))
    return '\n'.join(lines) + '\n'


def main(argv=None):
    parser = harness.parser(__doc__)
    parser.add_argument('--code', type=_code, action='append', required=True,
                        metavar='NAME=PATH')
    parser.add_argument('--model', default='resnet50', choices=tuple(MODELS))
    parser.add_argument('--warmup', type=int, default=20)
    parser.add_argument('--steps', type=int, default=20)
    parser.add_argument('--rounds', type=int, default=3)
    parser.add_argument('--out', required=True)
    parser.add_argument('--report-only', action='store_true')
    args = parser.parse_args(argv)
    if args.report_only:
        with open(os.path.join(args.out, 'runs.jsonl'), encoding='utf-8') as src:
            rows = [json.loads(line) for line in src][1:]
        return write_table(args, rows)
    os.makedirs(args.out, exist_ok=True)
    jobs = [(code, path, method) for code, path in args.code for method in _METHODS]
    rows = []
    with open(os.path.join(args.out, 'runs.jsonl'), 'w', encoding='utf-8') as out:
        out.write(json.dumps(harness.start_meta(harness.command_line(
            'python benchmarks/auto_timing.py', argv))) + '\n')
        for r in range(1, args.rounds + 1):
            for code, path, method in harness.ordered(jobs, r):
                row = run(args, code, path, method, r)
                print(json.dumps({k: v for k, v in row.items() if not k.endswith('_ms')
                                  or not isinstance(v, list)}), flush=True)
                out.write(json.dumps(row) + '\n')
                out.flush()
                rows.append(row)
    return write_table(args, rows)


def write_table(args, rows):
    """Write --out/table.md from `rows`; the exit code (0)."""
    with open(os.path.join(args.out, 'table.md'), 'w', encoding='utf-8') as out:
        out.write(table(rows, [code for code, _ in args.code], args.warmup))
    return 0


if __name__ == '__main__':
    sys.exit(main())
