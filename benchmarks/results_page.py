"""Write docs/results.md (every figure of the tta, round-trip, memory, compression, scaling
and CNN benchmarks, one row each) from the committed results files:

- ``docs/benchmarks/tta/tta.json`` (``python benchmarks/tta.py --part report``): time to
  accuracy, accuracy over seeds, accuracy at a fixed wall time, steady-state throughput;
- ``docs/benchmarks/roundtrip-cpu-cost/after/results.json`` (``python benchmarks/kvstore_roundtrip.py``).
- ``docs/benchmarks/memory/memory.json`` (``python benchmarks/memory.py``).
- ``docs/benchmarks/compress/tta.json`` and ``sparse-bytes.json``, and
  ``docs/benchmarks/compress/after-cpu/phases-runs.csv``: compression against stock MXNet,
  sparse bytes (``benchmarks/compress.py``, which left the tree after commit cb88aae: the
  folders' procedures give its commands at the commit that ran them).
- ``docs/benchmarks/scaling/runs.csv`` and ``scaling/run2/runs.csv``
  (``python benchmarks/scaling.py``, twice): the issue's scaling targets.
- ``docs/benchmarks/cnn/accuracy.csv`` and the ``readme-rows.md`` of ``cnn/``, ``cnn-seeds/``,
  ``cnn-rules-3seeds/`` (SGD) and ``cnn-adam-bound/`` (Adam)
  (``python benchmarks/accuracy_cnn.py``): the BatchNorm CNN's accuracy.

Usage: ``python benchmarks/results_page.py [--check]`` (``--check``: exit 1 if docs/results.md
differs from what would be written, and write nothing). README.md's figures are written by
hand from the files they link; ``tests/test_docs.py`` checks that each appears there.
"""
import argparse
import os
import statistics
import sys
import textwrap

import harness
import report

REPO = harness.REPO
TTA = os.path.join('docs', 'benchmarks', 'tta')
# The server with W kept in the slots' stored values, as main's (docs/design.md §3.2); the
# earlier measurements are in git (docs/benchmarks/README.md, "Removed entries").
ROUNDTRIP = os.path.join('docs', 'benchmarks', 'roundtrip-cpu-cost', 'after')
COMPRESS = os.path.join('docs', 'benchmarks', 'compress')
#: The methods of compress/ (stock dist_sync with and without 2bit, k=4 without and with fp16
#: and 2bit), in the order of its tables.
COMPRESS_METHODS = ('sync', 'sync-2bit', 'k4', 'k4-fp16', 'k4-2bit')
#: The two invocations of benchmarks/scaling.py.
SCALING = (os.path.join('docs', 'benchmarks', 'scaling'),
           os.path.join('docs', 'benchmarks', 'scaling', 'run2'))
MEMORY = os.path.join('docs', 'benchmarks', 'memory')
NETWORKS = (('100mbit', '100 Mbit/s'), ('1gbit', '1 Gbit/s'), ('loopback', 'loopback'))
DELAYED = ('k2', 'k4', 'k8')
WIDTH = 95


def _load(*parts):
    return report.read_json(os.path.join(REPO, *parts))


def _quiet_seeds(tta, method):
    """Seeds whose full run of `method` had other processes use at most NOISE_CORES."""
    return [r['seed'] for r in tta['runs']
            if r['method'] == method and r['cpu_other'] <= report.NOISE_CORES]


def _tta_mean(tta, network, method, quiet=False):
    """Mean time to accuracy of `method` on `network` over its seeds (with `quiet`: its quiet
    seeds): derived on shaped links, the real wall time on loopback."""
    key = 'real_s' if network == 'loopback' else 'derived_s'
    seeds = _quiet_seeds(tta, method) if quiet else tta['seeds']
    return statistics.mean(p[key] for p, seed in zip(tta['tta']['%s/%s' % (network, method)],
                                                     tta['seeds']) if seed in seeds)


def _tta_cells(tta, network, quiet=False):
    """Time to accuracy per method on `network` (see `_tta_mean`), with speed-ups."""
    per = {m: tta['tta'].get('%s/%s' % (network, m)) for m in ('sync',) + DELAYED}
    if not per['sync'] or not all(per['sync']):
        return None

    def mean(method):
        return _tta_mean(tta, network, method, quiet)
    base = mean('sync')
    cells = ['`dist_sync` %s' % report.seconds(base)]
    for method in DELAYED:
        values = per[method]
        if not values:
            continue
        if not all(values):
            cells.append('k=%s not reached by every seed' % method[1:])
            continue
        cells.append('k=%s %s (**%.2fx**)' % (method[1:], report.seconds(mean(method)),
                                              base / mean(method)))
    return '; '.join(cells)


def _loopback_tta_row(tta, link):
    """Loopback time to accuracy over the quiet full runs (each method's seeds listed); the
    mean of all seeds (runs beside busy cores included) is named as replaced."""
    loud = ['%s seed %d (%.2f cores)' % (_label(r['method']), r['seed'], r['cpu_other'])
            for r in tta['runs'] if r['cpu_other'] > report.NOISE_CORES]
    seeds = '; '.join('%s: %s' % (_label(m), ', '.join(str(s) for s in _quiet_seeds(tta, m)))
                      for m in ('sync',) + DELAYED)
    return ('| time to %.4f test accuracy, loopback | %s | whole training from step 1, the 200 '
            'warm-up steps included; evaluation excluded; real wall time of the full runs, mean '
            'of the quiet seeds (other processes used at most %g cores; %s). Replaced: the mean '
            'of all %d seeds, %s, because of the runs beside busy cores: %s | '
            '[tta/results.md](%s) |' % (
                tta['target'], _tta_cells(tta, 'loopback', quiet=True), report.NOISE_CORES,
                seeds, len(tta['seeds']), _tta_cells(tta, 'loopback').replace('**', ''),
                '; '.join(loud), link))


def scaling_rows():
    """The scaling targets (ResNet-18, N=4, S=2) of both invocations of scaling.py: the
    median samples/s over each method's successful rounds, and its ratio to dist_sync's."""
    cells = []
    for nth, folder in zip(('1st', '2nd'), SCALING):
        runs = report.groups(report.read_csv(os.path.join(REPO, folder, 'runs.csv')),
                             ('model', 'workers', 'servers', 'method'))
        rate = {m: statistics.median(r['samples_per_s'] for r in runs['resnet18', 4, 2, m])
                for m in ('sync', 'k4', 'k4-fp16')}
        cells.append('%s invocation: `dist_sync` %.1f, k=4 %.1f (%.2fx), k=4 + fp16 %.1f (%.2fx)'
                     % (nth, rate['sync'], rate['k4'], rate['k4'] / rate['sync'],
                        rate['k4-fp16'], rate['k4-fp16'] / rate['sync']))
    cells = '; '.join(cells)
    return ['| samples/s, ResNet-18 (11.2M parameters, batch 32), 4 workers, 2 servers, each '
            'node on its own 1 Gbit/s link | %s | targets 1.6x and 2.5x: missed; 8 timed steps, '
            '1 round per invocation, nearly every run noisy (the 2 cores were busy); N 2-8 x S 1-4 '
            'and the MLP in the file | [scaling.md](docs/benchmarks/scaling/scaling.md) |' % cells]


def _label(method):
    return '`dist_sync`' if method == 'sync' else 'k=%s' % method[1:]


def _throughput_rows(tta, methods, label, link, what, notes=None):
    """Steady-state samples/s and synchronous step rows of `methods` (the first is the
    baseline) on each network of a ``tta.py`` report; `what` qualifies the figure, `notes`
    (method -> text) goes next to a method's speed-up."""
    notes = notes or {}
    rows = []
    for network, net_label in NETWORKS:
        times = {m: tta['times'].get('%s/%s' % (network, m)) for m in methods}
        if not all(times.values()):
            continue
        base = times[methods[0]]['window_samples_per_s']
        cells = ['%s %.0f' % (label(methods[0]), base)] + [
            '%s %.0f (%.2fx%s)' % (label(m), times[m]['window_samples_per_s'],
                                   times[m]['window_samples_per_s'] / base, notes.get(m, ''))
            for m in methods[1:]]
        noisy = sum(t['noisy'] for t in times.values())
        runs = sum(t['rounds'] for t in times.values())
        rounds = sorted({t['rounds'] for t in times.values()})
        rows.append('| steady-state samples/s%s, %s | %s | delayed phase only (warm-up excluded); '
                    'median of %s interleaved rounds; %d of %d runs noisy (other processes used '
                    'more than 0.25 cores) | [%s](%s) |' % (
                        what, net_label, '; '.join(cells), '-'.join(str(r) for r in rounds),
                        noisy, runs, link[len('docs/benchmarks/'):], link))
        rows.append('| synchronous step (dist_sync; warm-up of the delayed methods)%s, %s | %s | '
                    'ms per step, median of %s interleaved rounds; the 200 warm-up steps run at '
                    'this speed | [%s](%s) |' % (what, net_label, '; '.join(
                        '%s %.0f ms' % (label(m), times[m]['sync_step_ms']) for m in methods),
                        '-'.join(str(r) for r in rounds), link[len('docs/benchmarks/'):], link))
    return rows


def worker_copies_row():
    """The worker's floats per parameter at k=4 per configuration, before and after the
    arrays the delayed phase no longer keeps (memory/k4, issue 37 item 4)."""
    folder = os.path.join(MEMORY, 'k4')
    memory = _load(folder, 'memory.json')
    fits = {(f['config'], f['code']): f['measured_floats_per_param']
            for f in memory['per_parameter'] if f['role'] == 'worker' and f['k'] == 4}
    stock = next(f['measured_floats_per_param'] for f in memory['per_parameter']
                 if f['role'] == 'worker' and f['store'] == 'dist_sync')
    cells = ['%s %.2f (before %.2f)' % (label, fits[(config, 'after')], fits[(config, 'before')])
             for config, label in (('plain', 'k=4'), ('fp16', 'k=4 + fp16'),
                                   ('ternary-int8', 'k=4 + ternary + int8 pulls'))]
    return ('| worker memory at k=4 (float32 entries per parameter of the model), %d workers + '
            '%d servers | %s; `dist_sync` %.2f | steady RSS, the 1.9M- and 33.6M-parameter '
            'models\' slope, before and after in one run (%s) | [memory.md](%s/memory.md) |'
            % (memory['meta']['workers'], memory['meta']['servers'], '; '.join(cells), stock,
               ', '.join('%s: commit %s' % (name, code['commit'][:7])
                         for name, code in sorted(memory['meta']['codes'].items())), folder))


def compression_rows():
    """Rows of the compression results (fp16 and 2bit; sparse bytes)."""
    rows = []
    link = 'docs/benchmarks/compress/results.md'
    untrained = {}  # method -> the note beside its speed-ups
    if os.path.exists(os.path.join(REPO, COMPRESS, 'tta.json')):
        data = _load(COMPRESS, 'tta.json')
        methods = [m for m in COMPRESS_METHODS if m in data['accuracy']]

        def label(method):
            return harness.METHODS[method].label.replace('dist_sync', '`dist_sync`')
        last = {m: data['accuracy'][m][-1] for m in methods}
        base = last['sync']['mean']
        # A speed-up of a method that does not train is no speed-up: say so beside it.
        untrained = {m: '; **does not train** at this threshold: %.2f test accuracy after %d '
                        'epochs' % (last[m]['mean'], last[m]['epoch'])
                     for m in methods if last[m]['mean'] < base / 2}
        rows += _throughput_rows(data, methods, label, link, ' with compression (2bit '
                                 'threshold %g)' % harness.TWO_BIT_THRESHOLD, untrained)
        rows.append('| test accuracy after %d epochs with compression | %s | %d seed; '
                    'difference to `dist_sync` in points; worker 0\'s weights; loopback, real '
                    'runs '
                    '| [compress/results.md](%s) |' % (
                        last['sync']['epoch'], '; '.join(
                            '%s %.4f%s' % (label(m), last[m]['mean'], '' if m == 'sync' else
                                           ' (%+.2f)' % (100 * (last[m]['mean'] - base)))
                            for m in methods), len(data['seeds']), link))
    after = os.path.join(COMPRESS, 'after-cpu')
    if os.path.exists(os.path.join(REPO, after, 'phases-runs.csv')):
        runs = [r for r in report.read_csv(os.path.join(REPO, after, 'phases-runs.csv'))
                if r['network'] == '1gbit' and r['exit'] == 0]
        medians = {m: statistics.median(r['window_samples_per_s'] for r in runs
                                        if r['method'] == m)
                   for m in COMPRESS_METHODS if any(r['method'] == m for r in runs)}
        rows.append('| steady-state samples/s with compression (2bit threshold %g), 1 Gbit/s, '
                    'after the CPU work | %s | delayed phase only; median of 3 interleaved '
                    'rounds on a quiet machine (%d of %d runs noisy), not the machine of the '
                    'rows above (AMD EPYC at load 15 there, Intel Xeon here) | '
                    '[compress-after-cpu/steady.md](%s/steady.md) |' % (
                        harness.TWO_BIT_THRESHOLD, '; '.join(
                            '%s %.0f%s' % (harness.METHODS[m].label.replace(
                                'dist_sync', '`dist_sync`'), v, '' if m == 'sync' else
                                ' (%.2fx%s)' % (v / medians['sync'], untrained.get(m, '')))
                            for m, v in medians.items()),
                        sum(r.get('noisy') in (True, 'True') for r in runs), len(runs), after))
    if os.path.exists(os.path.join(REPO, COMPRESS, 'sparse-bytes.json')):
        sparse = _load(COMPRESS, 'sparse-bytes.json')
        by = {r['variant']: r for r in sparse['rows']}
        dense, thin = by['dense'], by['sparse_grad']
        rows.append('| bytes per step per worker, `Embedding(%d x %d)` + `Dense(10)`, '
                    '`gluon.Trainer` on `dist_delay` | dense gradient: sends %.1f MB, receives '
                    '%.1f MB, %.1f samples/s; `sparse_grad=True`: sends %.2f MB (**%.0fx '
                    'fewer**), receives %.1f MB (dense / this %.2fx: the dense weight is '
                    'pulled back), %.1f samples/s | kernel counters of each node\'s link (headers included); %d '
                    'token ids per sample, batch 128, 2 workers | '
                    '[compress/sparse-bytes.md](docs/benchmarks/compress/sparse-bytes.md) |' % (
                        sparse['vocab'], sparse['dim'], dense['worker_tx'] / 1e6,
                        dense['worker_rx'] / 1e6, dense['samples_per_s'], thin['worker_tx'] / 1e6,
                        dense['worker_tx'] / thin['worker_tx'], thin['worker_rx'] / 1e6,
                        dense['worker_rx'] / thin['worker_rx'], thin['samples_per_s'],
                        sparse['tokens']))
    return rows


def full_table():
    """docs/results.md's text from its intro to its closing note (links from the repository's
    root)."""
    tta = _load(TTA, 'tta.json')
    link = 'docs/benchmarks/tta/results.md'
    seeds = len(tta['seeds'])
    rows = []
    for network, label in NETWORKS:
        cells = _tta_cells(tta, network)
        if cells is None:
            continue
        if network == 'loopback':
            rows.append(_loopback_tta_row(tta, link))
            continue
        rows.append('| time to %.4f test accuracy, %s | %s | whole training from step 1, the '
                    '200 warm-up steps included; evaluation excluded; mean of %d seeds; '
                    '*derived*: the real loopback runs\' steps timed with per-phase step times '
                    'measured on this link (median of 3 interleaved rounds) | '
                    '[tta/results.md](%s) |' % (tta['target'], label, cells, seeds, link))
    for network, label in NETWORKS:
        fixed = {m: tta['fixed_time'].get('%s/%s' % (network, m)) for m in ('sync',) + DELAYED}
        if not fixed['sync'] or network == 'loopback':
            continue
        cells = []
        for method in ('sync',) + DELAYED:
            values = [v['test_acc'] for v in fixed[method]['per_seed'] if v] if fixed[method] \
                else []
            if values:
                cells.append('%s %.4f' % ('`dist_sync`' if method == 'sync' else
                                          'k=%s' % method[1:], statistics.mean(values)))
        rows.append('| test accuracy after %s of training, %s | %s | the budget is `dist_sync`\'s '
                    'time to epoch 5 there; warm-up included; mean of %d seeds; derived as above '
                    '| [tta/results.md](%s) |' % (report.seconds(fixed['sync']['budget_s']), label,
                                                   '; '.join(cells), seeds, link))
    accuracy = tta['accuracy']
    for epoch in (5, 10):
        cells = []
        for method in ('sync',) + DELAYED:
            row = next(a for a in accuracy[method] if a['epoch'] == epoch)
            cells.append('%s %.4f (%.4f-%.4f)' % ('`dist_sync`' if method == 'sync'
                                                   else 'k=%s' % method[1:],
                                                   row['mean'], row['min'], row['max']))
        rows.append('| test accuracy after %d epochs | %s | mean (min-max) of %d seeds; rule '
                    '`mirror`, warm-up 200; loopback, real runs | [tta/results.md](%s) |'
                    % (epoch, '; '.join(cells), seeds, link))
    gaps = []
    for method in DELAYED:
        worst = _mean_shortfall(accuracy, method)
        gaps.append('k=%s %+.2f (epoch %d)' % (method[1:], worst[0], worst[1]))
    rows.append('| largest shortfall of the mean accuracy against `dist_sync`\'s, any epoch, in '
                'points | %s | epochs 1-10, %d seeds; the target is 0.5 | [tta/results.md](%s) |'
                % ('; '.join(gaps), seeds, link))
    rows += _throughput_rows(tta, ('sync',) + DELAYED, _label, link, '')
    roundtrip = _load(ROUNDTRIP, 'results.json')
    link = '[%s/results.md](%s/results.md)' % (
        ROUNDTRIP[len('docs/benchmarks/'):], ROUNDTRIP)
    cells, cpu_cells = [], []
    for model, optimizer in (('mlp', 'none'), ('mlp', 'sgd'), ('big', 'sgd')):
        delay, sync = (next((r for r in roundtrip['summary']
                             if (r.get('model', 'mlp'), r['optimizer'], r['store'])
                             == (model, optimizer, store)), None)
                       for store in ('dist_delay', 'dist_sync'))
        if not (delay and sync):
            continue
        what = '%s, %s' % ('1.86M floats in 6 tensors' if model == 'mlp' else
                           'one 16.8M-float tensor',
                           'no server optimizer' if optimizer == 'none' else 'SGD on the servers')
        if model == 'mlp':
            cells.append('%s: %.2fx (%.1f vs %.1f ms; per round %s vs %s)' % (
                what, delay['x_dist_sync'], delay['median_ms'], sync['median_ms'],
                ', '.join('%.1f' % m for m in delay['round_medians_ms']),
                ', '.join('%.1f' % m for m in sync['round_medians_ms'])))
        if 'server_cpu_ms_per_round' in delay:
            cpu_cells.append('%s: %.2fx (%.1f vs %.1f ms, %.2f vs %.2f ms per MB)' % (
                what, delay['server_cpu_x_dist_sync'], delay['server_cpu_ms_per_round'],
                sync['server_cpu_ms_per_round'], delay['server_cpu_ms_per_mb'],
                sync['server_cpu_ms_per_mb']))
    load = (roundtrip['meta']['load_before'][0], roundtrip['meta']['load_after'][0])
    rows.append('| push+pull round trip of 1.86M floats, `dist_delay` vs stock `dist_sync` | %s | '
                'throughput ratio of median step times; loopback; %d alternating rounds of %d '
                'steps; load average %.1f before, %.1f after (2 cores): one store\'s round '
                'medians differ by up to %.1fx, so the ratio is this loaded machine\'s; library '
                'of commit %s | %s |' % (
                    '; '.join(cells), roundtrip['meta']['rounds'], roundtrip['meta']['steps'],
                    load[0], load[1], max(max(r['round_medians_ms']) / min(r['round_medians_ms'])
                                          for r in roundtrip['summary']),
                    roundtrip['meta']['code']['commit'][:7], link))
    if cpu_cells:
        rows.append('| server CPU time per round, `dist_delay` vs stock `dist_sync` | %s | '
                    'utime + stime of the server over the kept steps of the same jobs; 2 '
                    'workers, 1 server, loopback | %s |' % ('; '.join(cpu_cells), link))
    memory = _load(MEMORY, 'memory.json')
    fits = {(f['store'], f['k'], f['role']): f for f in memory['per_parameter']}
    servers = memory['meta']['servers']
    cells = []
    # memory.py's slope is per parameter of the whole model for every process; a server holds
    # 1/servers of the model, so per parameter of its share it holds `servers` times that.
    for role, what, scale in (('worker', 'worker, per parameter of the model', 1),
                              ('server', 'server, per parameter of its share', servers)):
        cells.append('%s: %s' % (what, '; '.join(
            '%s %.2f' % ('`dist_sync`' if store == 'dist_sync' else 'k=%d' % k,
                         scale * fits[(store, k, role)]['measured_floats_per_param'])
            for store, k in (('dist_sync', 0), ('dist_delay', 1), ('dist_delay', 4),
                             ('dist_delay', 8)) if (store, k, role) in fits)))
    rows.append('| memory (float32 entries), %d workers + %d servers | %s | steady RSS, big model '
                'minus MLP, per process; a server\'s share is 1/%d of the model, so its figures '
                'are %d x memory.md\'s per-model-parameter slope; SGD momentum, rule `mirror`; '
                'library of commit %s | [memory.md](%s/memory.md) |'
                % (memory['meta']['workers'], servers, '; '.join(cells), servers, servers,
                   memory['meta']['code']['commit'][:7], MEMORY))
    rows.append(worker_copies_row())
    rows += compression_rows()
    rows += scaling_rows()
    # The CNN accuracy rows are made by benchmarks/accuracy_cnn.py from its results files
    # (seed 1: cnn/; Adam's dist_sync and k=8 again with seed 2: cnn-seeds/; 3 seeds of every
    # configuration of issue 21: cnn-rules-3seeds/, whose Adam rows cnn-adam-bound/ replaces:
    # FrozenVarianceAdam with Adam's bound, docs/benchmarks/README.md "Replaced figures").
    for folder, prefix in (('cnn', '| '), ('cnn-seeds', '| '),
                           ('cnn-rules-3seeds', '| CNN with BatchNorm, SGD'),
                           ('cnn-adam-bound', '| CNN with BatchNorm, Adam')):
        with open(os.path.join(REPO, 'docs', 'benchmarks', folder, 'readme-rows.md'),
                  encoding='utf-8') as rows_file:
            rows.extend(line.rstrip('\n') for line in rows_file if line.startswith(prefix))
    intro = textwrap.fill(
        'Generated by `python benchmarks/results_page.py` from the results files; every '
        'figure links its file, which names the command that reproduces it. Setup: the '
        'Fashion-MNIST MLP (1.86M parameters, batch 128 per worker), 2 workers and 1 server on '
        'one shared 2-core machine; shaped links are network namespaces with `tc tbf`. The '
        'baseline `dist_sync` is stock MXNet in every process of its jobs (checked and recorded '
        'per process), run interleaved with the delayed methods (rule `mirror`). Rules: '
        '[docs/benchmarks/README.md](docs/benchmarks/README.md).', WIDTH)
    outro = textwrap.fill(
        'Replaced figures stay visible with the reason: issue 5\'s throughput and one-seed '
        'accuracy (their baseline was not stock, and the 100 Mbit/s row was a rerun chosen '
        'after the first), and the figures corrected by issue 23 (loopback time to accuracy, '
        'round trip, server memory, 2bit), in '
        '[docs/benchmarks/README.md](docs/benchmarks/README.md#replaced-figures). '
        'Per-layer pushes against pushes after backward: [overlap.md](docs/benchmarks/overlap/overlap.md) '
        '(Markdown only: its raw runs are not committed).', WIDTH)
    lines = [intro, '', '| figure | result | what it includes | file |', '|---|---|---|---|'
             ] + rows + ['', outro]
    return '\n'.join(lines)


def results_page():
    """docs/results.md: every figure of the results files, one row each."""
    # The page lives in docs/: its links drop the leading 'docs/' of the root-relative ones.
    return ('# Results: every figure, with its conditions and file\n\n'
            '<!-- generated by benchmarks/results_page.py: do not edit -->\n\n'
            + full_table().replace('](docs/', '](') + '\n')


def _mean_shortfall(accuracy, method):
    """(points, epoch) of `method`'s largest shortfall of the mean against `dist_sync`'s."""
    return min(((a['mean'] - s['mean']) * 100, a['epoch'])
               for a, s in zip(accuracy[method], accuracy['sync']))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n', maxsplit=1)[0])
    parser.add_argument('--check', action='store_true')
    parser.add_argument('--page', default=os.path.join(REPO, 'docs', 'results.md'))
    args = parser.parse_args(argv)
    new = results_page()
    old = None
    if os.path.exists(args.page):
        with open(args.page, encoding='utf-8') as src:
            old = src.read()
    if old == new:
        return 0
    if args.check:
        sys.stderr.write('out of date (run python benchmarks/results_page.py): %s\n' % args.page)
        return 1
    with open(args.page, 'w', encoding='utf-8') as dst:
        dst.write(new)
    return 0


if __name__ == '__main__':
    sys.exit(main())
