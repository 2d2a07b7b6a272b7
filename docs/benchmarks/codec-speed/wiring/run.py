"""Steady-state samples/s of the MLP before and after the codec kernels were wired in, and of
float16 pushes cast by MXNet's engine against the kernel (issue 37, item 1).

Procedure: window runs of ``benchmarks/bench_worker.py`` (the example's MLP, 2 workers, 1
server, batch 128, seed 1; ``harness.run_method``), each variant's job importing the
library of its own snapshot (``PYTHONPATH``, rule 8):

- ``before``: k=4 + ternary pushes + int8 pulls (``k4-ternary-pull-int8``), snapshot
  ``--pins before=DIR`` (main before the wiring: numpy codecs);
- ``after``: the same method, snapshot ``after=DIR`` (the kernels wired in);
- ``fp16-engine``: k=4 + float16 pushes (``k4-fp16``), snapshot ``after``, MXNet's cast in
  its engine (``fp16_cast_worker.py --fp16-cast engine``);
- ``fp16-kernel``: the same, the cast by ``kernels.to_float16`` on the worker's Python
  thread, after waiting for the gradient (``--fp16-cast kernel``).

(The first run, ``fp16/`` here at commit fa1f0a7, had the engine's cast in the library and
the kernel's in ``fp16_kernel_worker.py``; the library now casts with the kernel, and both
variants name their cast.)

Per network (loopback: 100 warm-up steps then 304 timed; 1 Gbit/s per-node links: 40 then
80, as ``benchmarks/tta.py --part phases``), ``--rounds`` rounds, the variants in one order
and every other round in the reverse order (``harness.ordered``). The figure: the job's
samples/s over the timed window (``harness.window``), its median over the rounds with the
range, the medians of ms per step and of the servers' CPU per step (their cores in the window
times ms per step: one round of every tensor a step), and the ratios of medians (after /
before, kernel / engine). Each run also records the cores of each role and of other
processes in the window (noisy above 0.25) and the servers' last log line (the compiled
kernels they called).

Usage (root for the shaped links)::

    python docs/benchmarks/codec-speed/wiring/run.py \\
        --pins before=/tmp/pin-main,after=/tmp/pin-wire --variants before,after \\
        --networks loopback,1gbit --rounds 5 --out docs/benchmarks/codec-speed/wiring
"""
import argparse
import dataclasses
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, *[os.pardir] * 4, 'benchmarks'))
import harness  # noqa: E402  pylint: disable=wrong-import-position
import provenance  # noqa: E402  pylint: disable=wrong-import-position
import report  # noqa: E402  pylint: disable=wrong-import-position

CAST_WORKER = os.path.join(HERE, 'fp16_cast_worker.py')
#: variant -> (snapshot name, method of benchmarks/methods.py, worker script, its arguments)
VARIANTS = {
    'before': ('before', 'k4-ternary-pull-int8', harness.WORKER, ()),
    'after': ('after', 'k4-ternary-pull-int8', harness.WORKER, ()),
    'fp16-engine': ('after', 'k4-fp16', CAST_WORKER, ('--fp16-cast', 'engine')),
    'fp16-kernel': ('after', 'k4-fp16', CAST_WORKER, ('--fp16-cast', 'kernel')),
}
#: network -> (tc rate or None, warm-up steps, timed steps, seconds a step at most)
NETWORKS = {'loopback': (None, 100, 304, 1.0), '1gbit': ('1gbit', 40, 80, 2.0)}
#: Pairs whose ratio is reported: (numerator, denominator).
RATIOS = (('after', 'before'), ('fp16-kernel', 'fp16-engine'))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--pins', required=True,
                        help='before=DIR,after=DIR: snapshots of the library (git archive)')
    parser.add_argument('--variants', default='before,after,fp16-engine,fp16-kernel')
    parser.add_argument('--networks', default='loopback,1gbit')
    parser.add_argument('--rounds', type=int, default=5)
    parser.add_argument('--out', default=HERE)
    parser.add_argument('--scratch', default=os.path.join(harness.REPO, 'bench_out',
                                                          'codec-wiring'))
    parser.add_argument('--data-dir', default='/usr/share/datasets/fashion-mnist')
    args = parser.parse_args(argv)
    args.pins = dict(item.split('=', 1) for item in args.pins.split(','))
    args.variants = args.variants.split(',')
    args.networks = args.networks.split(',')
    for name in args.variants:
        if name not in VARIANTS or VARIANTS[name][0] not in args.pins:
            parser.error('variant %r: unknown, or its snapshot is not in --pins' % name)
    for name in args.networks:
        if name not in NETWORKS:
            parser.error('unknown network %r; known: %s' % (name, ', '.join(NETWORKS)))
    return args


def run_variant(args, name, network, round_index, hostfile):
    """One window run of variant `name`; its row."""
    pin, method_name, worker, extra = VARIANTS[name]
    rate, warmup, steps, bound = NETWORKS[network]
    method = dataclasses.replace(harness.METHODS[method_name],
                                 env=(('PYTHONPATH', args.pins[pin]),))
    folder = os.path.join(args.scratch, '%s-%s-r%d' % (network, name, round_index))
    worker_args = ['--warmup-steps', str(warmup), '--steps', str(steps), '--seed', '1',
                   '--data-dir', args.data_dir] + list(extra)
    saved, harness.WORKER = harness.WORKER, worker   # run_worker starts harness.WORKER
    try:
        code, results, cpu, info = harness.run_method(folder, method, worker_args,
                                                      120 + (warmup + 1 + steps) * bound,
                                                      hostfile)
    finally:
        harness.WORKER = saved
    row = dict(network=network, variant=name, method=method_name, pin=args.pins[pin],
               worker=os.path.basename(worker), round=round_index, exit=code, **info)
    with open(os.path.join(folder, 'log.txt'), encoding='utf-8', errors='replace') as log:
        row['server_kernels'] = ' | '.join(line.split('compiled codec kernels: ')[1].strip()
                                           for line in log if 'compiled codec kernels: ' in line)
    if code == 0:
        row.update(harness.window(results, cpu))
        row['noisy'] = row['cpu_other'] > report.NOISE_CORES
    return row


def summary(rows, variants, networks):
    """Per network and variant: median samples/s over the rounds, min, max; the ratios."""
    out = []
    for network in networks:
        medians = {}
        for name in variants:
            values = [r['samples_per_s'] for r in rows
                      if r['network'] == network and r['variant'] == name and r['exit'] == 0]
            if values:
                medians[name] = statistics.median(values)
                ok = [r for r in rows
                      if r['network'] == network and r['variant'] == name and r['exit'] == 0]
                out.append(dict(network=network, variant=name, runs=len(values),
                                samples_per_s=medians[name], min=min(values), max=max(values),
                                ms_per_step=statistics.median(r['ms_per_step'] for r in ok),
                                server_ms=statistics.median(r['cpu_server'] * r['ms_per_step']
                                                            for r in ok),
                                noisy=sum(r.get('noisy', False) for r in rows
                                          if r['network'] == network and r['variant'] == name)))
        for top, bottom in RATIOS:
            if top in medians and bottom in medians:
                out.append(dict(network=network, variant='%s / %s' % (top, bottom),
                                ratio=medians[top] / medians[bottom]))
    return out


def write_markdown(path, meta, rows, table):
    medians = report.table(
        'network | variant | runs | samples/s (median) | min | max | ms/step (median) | '
        'servers\' CPU ms/step (median) | noisy runs | ratio of medians',
        [[t['network'], t['variant'], t.get('runs', ''),
          report.fmt(t.get('samples_per_s'), '%.0f'), report.fmt(t.get('min'), '%.0f'),
          report.fmt(t.get('max'), '%.0f'), report.fmt(t.get('ms_per_step'), '%.1f'),
          report.fmt(t.get('server_ms'), '%.1f'), t.get('noisy', ''),
          report.fmt(t.get('ratio'), '%.3f')] for t in table])
    runs = report.table(
        'network | variant | round | exit | samples/s | ms/step | cores: workers | server | '
        'other | noisy | servers\' compiled kernels',
        [[r['network'], r['variant'], r['round'], r['exit'],
          report.fmt(r.get('samples_per_s'), '%.0f'), report.fmt(r.get('ms_per_step'), '%.1f'),
          report.fmt(r.get('cpu_workers')), report.fmt(r.get('cpu_server')),
          report.fmt(r.get('cpu_other')), r.get('noisy', ''), r['server_kernels'] or '-']
         for r in rows])
    pins = ', '.join('%s = `%s`, commit `%s`' % (k, v, meta['pin_commits'].get(k, '?')[:10])
                     for k, v in meta['pins'].items())
    report.write_lines(path, ['# Codec kernels wired in: steady-state samples/s', '',
                              'Run: %s.' % provenance.meta_line(meta), '',
                              'Snapshots (each variant\'s `PYTHONPATH`): %s.' % pins, '',
                              '## Medians over the rounds', ''] + medians
                       + ['', '## Every run', ''] + runs + [''])


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    meta = harness.start_meta(harness.command_line(
        'python docs/benchmarks/codec-speed/wiring/run.py', argv), pins=args.pins)
    meta['pin_commits'] = {}
    for pin, folder in args.pins.items():
        stamp = os.path.join(folder, 'COMMIT')
        if os.path.exists(stamp):
            with open(stamp, encoding='ascii') as src:
                meta['pin_commits'][pin] = src.read().strip()
    rows = []
    with harness.interruptible():
        for network in args.networks:
            with harness.shaped_network(2 + harness.NUM_WORKERS, NETWORKS[network][0],
                                        'mxwire-') as (_, hostfile):
                for round_index in range(1, args.rounds + 1):
                    for name in harness.ordered(args.variants, round_index):
                        row = run_variant(args, name, network, round_index, hostfile)
                        print('%s %s r%d: exit %s, %s samples/s, other %s cores' % (
                            network, name, round_index, row['exit'],
                            report.fmt(row.get('samples_per_s'), '%.0f'),
                            report.fmt(row.get('cpu_other'))), flush=True)
                        rows.append(row)
                        report.write_csv(os.path.join(args.out, 'runs.csv'), rows)
    harness.finish_meta(meta)
    table = summary(rows, args.variants, args.networks)
    report.write_json(os.path.join(args.out, 'results.json'),
                      dict(meta=meta, summary=table, runs=rows))
    write_markdown(os.path.join(args.out, 'results.md'), meta, rows, table)
    return 0


if __name__ == '__main__':
    sys.exit(main())
