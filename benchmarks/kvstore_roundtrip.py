"""Push + pull round trip of 'dist_delay' vs MXNet's own stock 'dist_sync', side by side.

Runs benchmarks/kv_worker.py (model ``mlp``, a 1.86M-float model, the Fashion-MNIST MLP's 6
tensors; ``big``, one tensor of 16.8M floats; every step pushes all and pulls all, then
waits) with 2 workers and 1 server on loopback,
launched by ``mxdelay/launcher.py`` as a plain file (it imports neither mxdelay's package nor
MXNet) with an explicit environment: this one minus every ``DMLC_*``, ``MXNET_*`` and
``MXDELAY_*`` variable, plus ``OMP_NUM_THREADS=1``. The ``dist_sync`` jobs are stock MXNet in
every process (no mxdelay import anywhere; each process checks it and records it).

Procedure, fixed by the arguments: for each case of ``--cases`` (``model:optimizer``), and
each of ``--rounds`` rounds, one job per store, the stores alternating (every other round in
the reverse order). Each job runs ``--steps`` steps (``--big-steps`` with model ``big``);
the first 10 of every job are dropped (the
first steps allocate buffers); nothing else is excluded. The figure is the median step time
over all kept steps of all rounds, and the ratio is dist_sync's median over dist_delay's
(above 1: dist_delay is faster).

Server cost: while a job runs, ``benchmarks/monitor.py`` samples every 0.1 s the CPU
time (``/proc/<pid>/stat`` utime + stime) of every process of the job, by role. The server's
CPU seconds over the kept steps (from the start of the first kept step to the end of the
last, worker 0's clock, interpolated between samples) divided by the number of kept steps
is its CPU time per round; divided by the bytes the workers pushed in those steps, per byte
(reported per MB). The ratio is dist_delay's over stock dist_sync's (below 1: cheaper).

With ``sgd`` both stores' servers apply SGD with momentum (as in training); with ``none``,
they store the round's sum, which MXNet's native server does in C++ alone, while mxdelay's
server always runs its Python updater (it orders the rounds).

Writes ``results.json`` (every step time, the commit, command, machine and load) and
``results.md`` into ``--out``.

Usage: ``python benchmarks/kvstore_roundtrip.py [--rounds 4] [--steps 100] [--big-steps 30]
[--cases mlp:none,mlp:sgd,big:sgd]``
"""
import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile

import numpy as np

import harness
from monitor import CpuMonitor
import provenance
import report

HERE, REPO = harness.HERE, harness.REPO

STORES = ('dist_sync', 'dist_delay')
DROPPED = 10
NUM_WORKERS = 2
FLOATS = {'mlp': 1863690, 'big': 4096 * 4096}


def run(kind, steps, folder, optimizer, model):
    out = os.path.join(folder, 'rank0.json')
    popen = harness.Job([sys.executable, os.path.join(HERE, 'kv_worker.py'), kind, str(steps),
                         out, optimizer, model], 600, NUM_WORKERS).start(
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=False)
    with CpuMonitor({popen.pid: 'launcher'}, interval=0.1) as monitor:
        if popen.wait() != 0:
            raise RuntimeError('%s %s %s job failed with code %d' % (model, optimizer, kind,
                                                                    popen.returncode))
    with open(out, encoding='utf-8') as src:
        result = json.load(src)
    times = result['times']
    start, end = result['stamps'][DROPPED][0], result['stamps'][-1][1]
    usage = monitor.usage(start, end)
    server_seconds = usage.get('server 0', 0.0) * (end - start)
    roles, imported = provenance.read_records(folder)
    env = sorted({' '.join('%s=%s' % kv for kv in records[-1]['env'].items()
                           if kv[0].startswith('MXNET_')) or '(none)'
                  for name, records in roles.items() if name.startswith('worker')})
    kept = len(times) - DROPPED
    return times, dict(roles=sorted(roles), mxdelay_imported_in=imported, worker_mxnet_env=env,
                       server_cpu_seconds=server_seconds, kept_steps=kept,
                       server_cpu_ms_per_round=1000 * server_seconds / kept,
                       server_cpu_ms_per_mb=1000 * server_seconds / (
                           kept * NUM_WORKERS * 4 * FLOATS[model] / 1e6),
                       cpu_other_cores=usage.get('other', 0.0))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--rounds', type=int, default=4)
    parser.add_argument('--steps', type=int, default=100)
    parser.add_argument('--cases', default='mlp:none,mlp:sgd,big:sgd',
                        help='model:optimizer pairs; models mlp, big; optimizers none, sgd')
    parser.add_argument('--big-steps', type=int, default=30)
    parser.add_argument('--out', default=os.path.join(REPO, 'docs', 'benchmarks', 'roundtrip'))
    args = parser.parse_args(argv)
    cases = [tuple(c.split(':')) for c in args.cases.split(',') if c]
    meta = dict(command='python benchmarks/kvstore_roundtrip.py ' + shlex.join(
                    sys.argv[1:] if argv is None else argv),
                started=provenance.now(),
                load_before=os.getloadavg(), code=provenance.code_version(),
                machine=provenance.machine(),
                job_env_mxnet={k: v for k, v in harness.job_env().items()
                               if k.startswith('MXNET_')},
                rounds=args.rounds, steps=args.steps, big_steps=args.big_steps,
                dropped_per_job=DROPPED)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for model, optimizer in cases:
            for round_index in range(1, args.rounds + 1):
                for kind in harness.ordered(STORES, round_index):
                    folder = os.path.join(tmp, '%s-%s-%s-%d' % (model, optimizer, kind,
                                                                round_index))
                    os.makedirs(folder)
                    load = os.getloadavg()[0]
                    steps = args.big_steps if model == 'big' else args.steps
                    times, check = run(kind, steps, folder, optimizer, model)
                    runs.append(dict(model=model, optimizer=optimizer, store=kind,
                                     round=round_index, load_before=load, times=times, **check))
                    print('%s %s %s round %d: median %.1f ms; server %.2f ms CPU per round; '
                          'mxdelay imported in: %s; MXNET_* %s'
                          % (model, optimizer, kind, round_index,
                             1000 * np.median(times[DROPPED:]), check['server_cpu_ms_per_round'],
                             check['mxdelay_imported_in'] or 'none', check['worker_mxnet_env']),
                          flush=True)
    meta.update(finished=provenance.now(), load_after=os.getloadavg())
    summary = []
    for model, optimizer in cases:
        median, cpu = {}, {}
        for kind in STORES:
            mine = [r for r in runs if (r['model'], r['optimizer'], r['store'])
                    == (model, optimizer, kind)]
            kept = [t for r in mine for t in r['times'][DROPPED:]]
            per_round = [1000 * float(np.median(r['times'][DROPPED:])) for r in mine]
            median[kind] = 1000 * float(np.median(kept))
            # CPU per round over all rounds of the store: total server seconds / kept steps
            cpu[kind] = 1000 * sum(r['server_cpu_seconds'] for r in mine) / sum(
                r['kept_steps'] for r in mine)
            summary.append(dict(model=model, optimizer=optimizer, store=kind,
                                median_ms=median[kind], round_medians_ms=per_round,
                                kept_steps=len(kept), server_cpu_ms_per_round=cpu[kind],
                                server_cpu_ms_per_mb=cpu[kind] / (
                                    NUM_WORKERS * 4 * FLOATS[model] / 1e6),
                                round_server_cpu_ms=[r['server_cpu_ms_per_round'] for r in mine]))
        for row in summary[-2:]:
            row['x_dist_sync'] = median['dist_sync'] / row['median_ms']
            row['server_cpu_x_dist_sync'] = row['server_cpu_ms_per_round'] / cpu['dist_sync']
    stock_ok = all(not r['mxdelay_imported_in'] for r in runs if r['store'] == 'dist_sync')
    result = dict(meta=meta, summary=summary, stock_baseline_verified=stock_ok, runs=runs)
    os.makedirs(args.out, exist_ok=True)
    report.write_json(os.path.join(args.out, 'results.json'), result)
    print('\n'.join(write_markdown(args.out, result)[-2 - len(summary):]))
    return 0 if stock_ok else 1


def write_markdown(out, result):
    """``results.md`` in `out` from `result` (``results.json``'s content); returns its lines."""
    meta, runs = result['meta'], result['runs']
    lines = ['# Push + pull round trip: dist_delay vs stock dist_sync', '',
             '%s; load average (1 min) %.2f before, %.2f after. Raw step times: '
             '[results.json](results.json).' % (provenance.generated_by(meta),
                                                meta['load_before'][0], meta['load_after'][0]),
             '',
             '2 workers + 1 server on loopback; models: `mlp` 1,863,690 floats in 6 tensors, '
             '`big` one tensor of 16,777,216 floats; every step pushes all and pulls all, then '
             'waits. %d rounds of %d steps (`big`: %d) per store, alternating; the first %d '
             'steps of each job dropped. Server CPU: utime + stime of the server process over '
             'the kept steps, per round and per MB pushed (both workers\' bytes). Stock baseline '
             'verified in every process of every dist_sync job (no mxdelay import; MXNET_* of '
             'the workers: %s): **%s**.' % (
                 meta['rounds'], meta['steps'], meta['big_steps'], meta['dropped_per_job'],
                 ', '.join(sorted({e for r in runs if r['store'] == 'dist_sync'
                                   for e in r['worker_mxnet_env']})),
                 'yes' if result['stock_baseline_verified'] else 'NO'), '']
    lines += report.table(
        'model | server optimizer | store | median ms per push+pull | per-round medians | '
        'throughput vs stock dist_sync | server CPU ms per round (per job) | server CPU ms per '
        'MB | server CPU vs stock', [[
            row['model'], row['optimizer'], row['store'] + (
                ' (stock MXNet)' if row['store'] == 'dist_sync' else " (mxdelay's server)"),
            '%.1f' % row['median_ms'], ' '.join('%.1f' % v for v in row['round_medians_ms']),
            '%.2fx' % row['x_dist_sync'], '%.2f (%s)' % (row['server_cpu_ms_per_round'], ' '.join(
                '%.2f' % v for v in row['round_server_cpu_ms'])),
            '%.3f' % row['server_cpu_ms_per_mb'], '%.2fx' % row['server_cpu_x_dist_sync']]
            for row in result['summary']], 'lllrlrrrr')
    report.write_lines(os.path.join(out, 'results.md'), lines)
    return lines


if __name__ == '__main__':
    sys.exit(main())
