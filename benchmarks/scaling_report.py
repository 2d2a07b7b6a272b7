"""The scaling benchmark's grid and its reports (``benchmarks/scaling.py`` runs it).

The grid: the methods (:data:`METHODS`), the models (:data:`MODELS`) and the issues' targets
(:data:`TARGETS`). The arithmetic of a run's row: :func:`byte_floor` (the step time the links
alone allow) and :func:`cpu_shares` (the cores and CPU ms per step of each role). The
arithmetic over rows: :func:`summarize` (medians over rounds per configuration, ratios to
``dist_sync``, scaling efficiency) and :func:`verdicts`. The Markdown: every run
(:func:`results_markdown`) and the tables and verdicts (:func:`summary_markdown`).
"""
import statistics

import harness
import netns
import report

__all__ = ['METHODS', 'DEFAULT_METHODS', 'PERIOD', 'MODELS', 'TARGETS', 'KEY', 'byte_floor',
           'cpu_shares', 'period_profile', 'summarize', 'verdicts', 'model_rates',
           'results_markdown', 'summary_markdown']

METHODS = harness.methods('sync', 'k4=mirror-k4', 'k4-fp16=mirror-k4-fp16',
                          'k4-ternary-pull-int8', 'auto', 'auto-ternary-pull-int8',
                          'auto-auto')
DEFAULT_METHODS = 'sync,k4,k4-fp16'   # the issue-13 grid's; ternary on request (issue 20)
PERIOD = 4  # k of the delayed methods: the windows hold whole periods
_fmt, _table = report.fmt, report.table
#: name -> label, bench_worker arguments, batch per worker, float32 MB of the gradient,
#: timed steps of the full run
MODELS = {
    'mlp': dict(label='MLP 784-1024-1024-10 (1.86M parameters), Fashion-MNIST, batch 128',
                args=['--model', 'mlp', '--batch-size', '128', '--lr', '0.05'],
                batch=128, megabytes=7.46, steps=40),
    'resnet18': dict(label='resnet18_v1(classes=10) (11.18M parameters), synthetic 3x32x32, '
                           'batch 32', args=['--model', 'resnet18', '--batch-size', '32',
                                             '--lr', '0.01'],
                     batch=32, megabytes=44.7, steps=8),
    'resnet50': dict(label='resnet50_v1(classes=10) (23.55M trained parameters in 193 '
                           'tensors; 299 with the BatchNorm statistics), synthetic 3x32x32, '
                           'batch 8',
                     args=['--model', 'resnet50', '--batch-size', '8', '--lr', '0.01'],
                     batch=8, megabytes=94.2, steps=20),
}
#: (model, rate, N, S, method, at least this ratio to sync, of the steady samples/s?): issue
#: 13's (job samples/s) and issue 37's envelope targets (steady samples/s)
TARGETS = (('resnet18', '1gbit', 4, 2, 'k4', 1.6, False),
           ('resnet18', '1gbit', 4, 2, 'k4-fp16', 2.5, False),
           ('resnet50', '10gbit', 2, 1, 'k4-ternary-pull-int8', 1.0, True),
           ('resnet50', '1gbit', 2, 1, 'k4-ternary-pull-int8', 3.0, True))
#: what a configuration of the summary is
KEY = ('model', 'rate', 'workers', 'servers', 'method')


# -- one run's arithmetic ------------------------------------------------------------------
def byte_floor(row, rate_bits):
    """The step time the links alone allow: the bytes per step through the busiest direction
    of a worker's link and of a server's (``worker_tx_mb`` ... ``server_rx_mb``, the role's
    mean link; each direction of a full-duplex link carries `rate_bits` per second), in ms,
    and the samples/s of the slower of the two."""
    floors = {role + '_floor_ms': 1000 * 8e6 * max(row[role + '_tx_mb'], row[role + '_rx_mb'])
              / rate_bits for role in ('worker', 'server')}
    slowest = max(floors.values())
    return dict(floors, floor_samples_per_s=(row['workers'] * row['batch'] * 1000 / slowest
                                             if slowest > 0 else None))


def cpu_shares(row):
    """Cores each worker and each server used on average in the window (the role's cores,
    ``cpu_workers`` and ``cpu_server``, over its processes), and the CPU ms each one spent
    per step (cores x ms per step): a step cannot be shorter than the job's CPU ms per step
    over the cores the machine leaves it."""
    shares = dict(cores_per_worker=row['cpu_workers'] / row['workers'],
                  cores_per_server=row['cpu_server'] / row['servers'])
    return dict(shares, worker_cpu_ms=shares['cores_per_worker'] * row['ms_per_step'],
                server_cpu_ms=shares['cores_per_server'] * row['ms_per_step'])


def period_profile(step_ms, period=PERIOD):
    """Worker 0's median step time (ms) at each position of the period: `step_ms` is its
    timed steps' times (the ``step_ms`` column, space-separated), position i the steps i,
    i + period, ... of the window: a delayed method's pull falls at one position."""
    times = [float(value) for value in str(step_ms).split()]
    return [statistics.median(times[i::period]) for i in range(min(period, len(times)))]


# -- over the runs --------------------------------------------------------------------------
def _median(rows, key):
    values = [r[key] for r in rows if r.get(key) not in (None, '')]
    return statistics.median(values) if values else None


def _busy(row):
    """Cores the whole machine used in the row's window (the job's roles and the rest)."""
    return sum(row[k] for k in ('cpu_workers', 'cpu_server', 'cpu_scheduler', 'cpu_launcher',
                                'cpu_other'))


def summarize(rows):
    """{(model, rate, N, S, method): medians over the successful rounds, and ratios (job
    and steady samples/s to sync's)}."""
    summary = {}
    for key, runs in report.groups(rows, KEY).items():
        rates = [r['samples_per_s'] for r in runs]
        item = dict(runs=len(runs), samples_per_s=statistics.median(rates), min=min(rates),
                    max=max(rates), noisy=sum(bool(r.get('noisy')) for r in runs))
        for name in ('worker_tx_mb', 'worker_rx_mb', 'server_tx_mb', 'server_rx_mb',
                     'server_cpu_s_per_round', 'cpu_workers', 'cpu_server', 'cpu_other',
                     'steady_samples_per_s', 'cores_per_worker', 'cores_per_server',
                     'worker_cpu_ms', 'server_cpu_ms',
                     'worker_floor_ms', 'server_floor_ms', 'floor_samples_per_s'):
            item[name] = _median(runs, name)
        item['busy_cores'] = statistics.median(_busy(r) for r in runs)
        profiles = [period_profile(r['step_ms']) for r in runs if r.get('step_ms')]
        item['period_ms'] = [statistics.median(p[i] for p in profiles)
                             for i in range(PERIOD)] if profiles else None
        summary[key] = item
    for (model, rate, workers, servers, method), item in summary.items():
        sync = summary.get((model, rate, workers, servers, 'sync'))
        item['x_sync'] = item['samples_per_s'] / sync['samples_per_s'] if sync else None
        item['x_sync_steady'] = (item['steady_samples_per_s'] / sync['steady_samples_per_s']
                                 if sync and sync['steady_samples_per_s']
                                 and item['steady_samples_per_s'] else None)
        base = summary.get((model, rate, 2, servers, method))
        item['efficiency'] = (item['samples_per_s'] / (workers / 2 * base['samples_per_s'])
                              if base else None)
    return summary


def verdicts(summary):
    """[(target text, measured text, 'met'/'missed'/'not run')] of the issues' targets
    (:data:`TARGETS`) that the summary's models and links hold."""
    out = []
    for model, rate, workers, servers, method, required, steady in TARGETS:
        if not any(k[:2] == (model, rate) for k in summary):
            continue
        item = summary.get((model, rate, workers, servers, method))
        ratio = item and item['x_sync_steady' if steady else 'x_sync']
        out.append(('%s %s N=%d S=%d: %s >= %.1fx dist_sync%s' % (
            model, rate, workers, servers, METHODS[method].label, required,
            ' (steady samples/s)' if steady else ''), _fmt(ratio, '%.2fx'),
                    'not run' if ratio is None else 'met' if ratio >= required else 'missed'))
    for model, rate, servers in sorted({(k[0], k[1], k[3]) for k in summary}):
        k4 = summary.get((model, rate, 8, servers, 'k4'))
        sync = summary.get((model, rate, 8, servers, 'sync'))
        if k4 and sync and k4['efficiency'] and sync['efficiency']:
            out.append(('%s %s S=%d: scaling efficiency N=2 -> 8 of k=4 >= dist_sync\'s'
                        % (model, rate, servers),
                        '%.3f vs %.3f' % (k4['efficiency'], sync['efficiency']),
                        'met' if k4['efficiency'] >= sync['efficiency'] else 'missed'))
    return out


def _meta_lines(meta):
    code = meta['code_start']
    end = meta.get('code_end') or {}
    changed = '' if end.get('commit') == code['commit'] and end.get('dirty_files') == code[
        'dirty_files'] else ' (at the end: %s, modified: %s)' % (
            end.get('commit', '?'), ', '.join(end.get('dirty_files') or ['none']))
    machine = meta['machine']
    return ['- Command: `%s`' % meta['command'],
            '- Commit %s%s%s; library imported from `%s`' % (
                code['commit'], ' with modified %s' % ', '.join(code['dirty_files'])
                if code['dirty'] else '', changed, meta['pythonpath'] or meta['repo']),
            '- %s to %s (UTC); load average (1, 5, 15 min) %s at the start, %s at the end' % (
                meta['started'], meta.get('finished', '?'),
                ', '.join('%.2f' % v for v in meta['load_before']),
                ', '.join('%.2f' % v for v in meta.get('load_after', ()))),
            '- Machine: %d cores (%s), Linux %s, Python %s; shared with other sessions' % (
                machine['cores'], machine['cpu'], machine['kernel'], machine['python'])]


def results_markdown(meta, rows, summary_link):
    """results.md: every run; `summary_link`: the summary's path relative to it."""
    lines = ['# Scaling benchmark: every run', ''] + _meta_lines(meta) + [
        '', 'Procedure: the docstring of `benchmarks/scaling.py`; summary and verdicts: '
        '[%s](%s). MB: 10^6 bytes per step per link (window). '
        'cpu_other: cores used by processes outside the job (and kernel work charged to no '
        'process, such as the bridge\'s); noisy: more than %.2f.' % (
            summary_link, summary_link, report.NOISE_CORES), '']
    body = []
    for r in rows:
        if 'error' in r:
            body.append([r['model'], r['rate'], str(r['workers']), str(r['servers']),
                         r['method'], str(r['round'])] + ['FAILED: %s' % r['error']] + [''] * 13
                        + [_fmt(r.get('load_before')), '', r.get('stock_check', '')])
            continue
        body.append([r['model'], r['rate'], str(r['workers']), str(r['servers']), r['method'],
                     str(r['round']), _fmt(r['samples_per_s'], '%.1f'),
                     _fmt(r.get('steady_samples_per_s'), '%.1f'),
                     _fmt(r['ms_per_step'], '%.0f'), _fmt(r['worker_tx_mb'], '%.1f'),
                     _fmt(r['worker_rx_mb'], '%.1f'), _fmt(r['server_tx_mb'], '%.1f'),
                     _fmt(r['server_rx_mb'], '%.1f'), _fmt(r['eth0_check'], '%.3f'),
                     _fmt(r['server_cpu_s_per_round'], '%.3f'), _fmt(r['cpu_workers']),
                     _fmt(r['cpu_server']), _fmt(r.get('floor_samples_per_s'), '%.1f'),
                     _fmt(r['cpu_other']) + (' noisy' if r.get('noisy') else ''),
                     '%.3g' % r['final_loss'], '%.1f / %.1f' % (r['load_before'],
                                                                 r['load_after']),
                     _fmt(r['wall_s'], '%.0f'), r['stock_check']])
    lines += _table(['model', 'link', 'N', 'S', 'method', 'round', 'samples/s',
                     'steady samples/s', 'ms/step', 'worker tx MB', 'worker rx MB',
                     'server tx MB', 'server rx MB', 'eth0 check', 'server CPU s/round',
                     'worker cores', 'server cores', 'floor samples/s', 'cpu_other',
                     'last loss', 'load before / after', 'job s', 'stock check'], body)
    envs = sorted({(r['method'], r.get('worker_env', '')) for r in rows})
    lines += ['', 'MXNET_* variables the workers saw at exit, per method: ' + '; '.join(
        '%s: %s' % env for env in envs) + '.']
    kernels = sorted({(r['method'], r['codec_kernels']) for r in rows
                      if r.get('codec_kernels')})
    choices = [(r['model'], r['rate'], r['method'], r['round'], r['decided']) for r in rows
               if r.get('decided')]
    if choices:
        lines += ['', "What `delay='auto'` decided (worker 0's schedule at the end; "
                  'steps counted from 0): ' + '; '.join('%s %s %s r%d: %s' % item
                                                         for item in choices) + '.']
    if kernels:
        lines += ['', 'The codec kernels of worker 0 (`kvstore_ext.codecs.kernels`: their '
                  'backend and the calls it made), per method and run: ' + '; '.join(
                      '%s: %s' % item for item in kernels) + '.']
    return '\n'.join(lines) + '\n'


def summary_markdown(meta, rows, summary, methods, out_link, code, report_only=False,
                     second=None):
    """scaling.md: the tables and the verdicts.

    `out_link`: the results folder relative to the summary; `code`: the commit writing the
    report (``provenance.code_version()``); `second`: ``(meta, rows, summary, link)`` of a second
    invocation of the same grid, shown beside the first.
    """
    pairs = model_rates(summary)
    models = [m for m in MODELS if any(p[0] == m for p in pairs)]
    workers = sorted({k[2] for k in summary})
    servers = sorted({k[3] for k in summary})
    runs = len(rows)
    failed = [r for r in rows if 'error' in r]
    noisy = [r for r in rows if r.get('noisy')]
    busy = [_busy(r) for r in rows if 'error' not in r]
    lines = ['# How throughput scales with workers and servers (issue 13 item 1, issue 37 '
             'item 5)', '',
             'Stock `dist_sync` against `DelayedTrainer` (%s), N workers x S servers, every '
             'node in its own network namespace with its own link (tbf: %s) to a bridge. '
             'Procedure: the docstring of `benchmarks/scaling.py`, fixed before the run; every '
             'run: [{0}/results.md]({0}/results.md), [{0}/runs.csv]({0}/runs.csv); meta: '
             '[{0}/meta.json]({0}/meta.json).'.format(out_link) % (
                 ', '.join(METHODS[m].label for m in methods if m != 'sync'),
                 ', '.join(dict.fromkeys(p[1] for p in pairs))),
             ''] + _meta_lines(meta) + [
             '- Settings: %s' % ', '.join('%s %s' % item for item in sorted(
                 meta['settings'].items())),
             '- Models: %s' % '; '.join('`%s`: %s' % (m, MODELS[m]['label']) for m in models),
             '- Report written by `python benchmarks/scaling.py%s` at commit %s%s' % (
                 ' --report-only' if report_only else '', code['commit'],
                 ' (modified: %s)' % ', '.join(code['dirty_files']) if code['dirty'] else ''),
             '- %d runs, %d failed, %d noisy (other processes used more than %.2f cores; '
             'on the shaped links the bridge\'s packet work counts as other too).' % (
                 runs, len(failed), len(noisy), report.NOISE_CORES),
             '- The whole machine was busy during the timed windows: %s cores of %d used '
             '(median over the runs; min %s), of which other processes and the bridge %s.' % (
                 _fmt(statistics.median(busy) if busy else None), meta['machine']['cores'],
                 _fmt(min(busy, default=None)), _fmt(_median(rows, 'cpu_other'))),
             '', '**On 2 shared cores the absolute numbers mean little; the ratios measured '
             'side by side in one run are the result.** With up to %d processes a job '
             '(scheduler, servers, workers) on %d cores the runs are partly CPU-bound, not '
             'only link-bound.' % (1 + max(servers, default=0) + max(workers, default=0),
                                   meta['machine']['cores']), '']
    if second:
        meta2, rows2, _, link2 = second
        lines += ['Second invocation of the same command (every run: [%s/results.md](%s/'
                  'results.md)):' % (link2, link2), ''] + _meta_lines(meta2) + [
                  '- %d runs, %d failed, %d noisy.' % (
                      len(rows2), sum('error' in r for r in rows2),
                      sum(bool(r.get('noisy')) for r in rows2)), '']
    lines += ['## Verdicts on the issue\'s targets', '']
    if second:
        again = {target: (measured, verdict) for target, measured, verdict
                 in verdicts(second[2])}
        lines += _table(['target', 'measured (1st)', 'verdict (1st)', 'measured (2nd)',
                         'verdict (2nd)'],
                        [[t, m, v] + list(again.get(t, ('', 'not run')))
                         for t, m, v in verdicts(summary)])
    else:
        lines += _table(['target', 'measured', 'verdict'],
                        [list(v) for v in verdicts(summary)])
    lines += _envelope_lines(rows, summary, pairs, workers, servers, methods)
    lines += ['', '## Throughput (samples/s) and ratio to dist_sync', '',
              'Job samples/s over the timed window (median over rounds; the range in brackets '
              'when there are several), and each method\'s ratio to `dist_sync` of the same '
              'model, N and S.', '']
    lines += _table(['model', 'link', 'S', 'N'] + [
        '%s samples/s' % METHODS[m].label for m in methods] + [
        '%s / sync' % METHODS[m].label for m in methods if m != 'sync'], [
            [model, rate, str(s), str(n)] + [
                '' if not it else '%.1f%s%s' % (
                    it['samples_per_s'], ' [%.1f-%.1f]' % (it['min'], it['max'])
                    if it['runs'] > 1 else '', ' (noisy)' if it['noisy'] else '')
                for it in items] + [_fmt(it and it['x_sync'], '%.2fx')
                                    for m, it in zip(methods, items) if m != 'sync']
            for model, rate in pairs for s in servers for n in workers
            for items in [[summary.get((model, rate, n, s, m)) for m in methods]] if any(items)])
    if second:
        lines += ['', 'The ratios to `dist_sync` in both invocations (1st / 2nd), and the '
                  'scaling efficiency N=2 -> 8 (1st / 2nd):', '']
        lines += _table(['model', 'link', 'S', 'N'] + [
            '%s / sync' % METHODS[m].label for m in methods if m != 'sync'] + [
                '%s efficiency' % METHODS[m].label for m in methods], [
                    [model, rate, str(s), str(n)] + [
                        '%s / %s' % (_fmt(a.get('x_sync'), '%.2fx'),
                                     _fmt(b.get('x_sync'), '%.2fx'))
                        for m, (a, b) in zip(methods, pairs) if m != 'sync'] + [
                        '%s / %s' % (_fmt(a.get('efficiency')), _fmt(b.get('efficiency')))
                        if n == max(workers) else '' for a, b in pairs]
                    for model, rate in pairs for s in servers for n in workers
                    for pairs in [[(summary.get((model, rate, n, s, m)) or {},
                                    second[2].get((model, rate, n, s, m)) or {})
                                   for m in methods]]])
    lines += ['', '![samples/s against N](%s/throughput.png)' % out_link, '',
              '## Scaling efficiency relative to N=2', '',
              'samples/s(N) / (N/2 x samples/s(N=2)), same model, S and method (1.00: '
              'linear).', '']
    lines += _table(['model', 'link', 'S'] + ['%s N=%d' % (METHODS[m].label, n) for m in methods
                                      for n in workers if n != 2], [
        [model, rate, str(s)] + [_fmt((summary.get((model, rate, n, s, m)) or {}).get('efficiency'))
                           for m in methods for n in workers if n != 2]
        for model, rate in pairs for s in servers])
    lines += ['', '## Bytes per step per link', '',
              'MB (10^6 bytes) per timed step, from the bridge ports\' counters interpolated '
              'at the window\'s start and end (headers included): the mean over the worker '
              'links and over the server links; tx: what the node sends, rx: what it '
              'receives. k=4 pulls the weights once per period of 4 steps; in a short window '
              'a pull at the window\'s edge weighs more. Each node\'s eth0 counters agree '
              'with its port\'s over every job within %s (largest relative difference, '
              'results.md).' % _fmt(max((r['eth0_check'] for r in rows if 'eth0_check' in r),
                                        default=None), '%.3f'), '']
    lines += _table(['model', 'link', 'N', 'S', 'method', 'worker tx', 'worker rx', 'server tx',
                     'server rx'], _method_rows(summary, pairs, workers, servers, methods, (
        'worker_tx_mb', 'worker_rx_mb', 'server_tx_mb', 'server_rx_mb')))
    lines += ['', '## Server CPU seconds per round', '',
              'CPU time of all servers together in the timed window, divided by the timed '
              'steps (one round of every key per step).', '']
    lines += _table(['model', 'link', 'N', 'S'] + [METHODS[m].label for m in methods], [
        [model, rate, str(n), str(s)] + [_fmt(it and it['server_cpu_s_per_round'], '%.3f')
                                   for it in items]
        for model, rate in pairs for n in workers for s in servers
        for items in [[summary.get((model, rate, n, s, m)) for m in methods]] if any(items)])
    lines += ['', '## Where the CPU went', '',
              'Cores used on average in the timed window (median over rounds): the job\'s '
              'workers, its servers, and everything else (other sessions, and the kernel\'s '
              'packet work on the bridge, which is charged to no process); *busy*: the whole '
              'machine (%d cores), scheduler and launcher included. A busy machine means a '
              'run bound by the CPU, not only by its links.' % meta['machine']['cores'], '']
    lines += _table(['model', 'link', 'N', 'S', 'method', 'workers', 'servers', 'other', 'busy'],
                    _method_rows(summary, pairs, workers, servers, methods, (
        'cpu_workers', 'cpu_server', 'cpu_other', 'busy_cores')))
    if failed:
        lines += ['', '## Failed runs', ''] + ['- %s N=%d S=%d %s round %d: %s' % (
            r['model'], r['workers'], r['servers'], r['method'], r['round'], r['error'])
            for r in failed]
    return '\n'.join(lines) + '\n'


def _envelope_lines(rows, summary, pairs, workers, servers, methods):
    """The section of every configuration and method: samples/s, the byte floor and the
    cores per role (issue 37 item 5)."""
    links = {(r['model'], r['rate'], r['workers'], r['servers']): r['link_gbit']
             for r in rows if 'link_gbit' in r}
    lines = ['', '## Samples/s beside the byte floor and the CPU of each role', '',
             'Per configuration and method (medians over rounds): the job\'s samples/s and the '
             'steady samples/s (the slowest worker\'s rate over whole periods, leaving out the '
             'first period and the drain), each with its ratio to `dist_sync`; the byte floor: '
             'the bytes per step through the busiest direction of a worker\'s link and of a '
             'server\'s (headers included, from the ports\' counters) over the link\'s rate, in '
             'ms, and the samples/s the slower of the two allows; the cores each worker and '
             'each server used in the window, the CPU ms each spent per step (cores x job '
             'ms/step), and the rest of the machine (*other*: other sessions and the bridge\'s '
             'packet work); worker 0\'s step times at each position of the k=4 period (the '
             'median over the window\'s steps there, then over rounds: a delayed method\'s '
             'pull shows at one position). One TCP stream from the server to a '
             'worker right after each network was built carried: %s.' % (
                 '; '.join('%s %s N=%d S=%d: %.2f Gbit/s' % (key + (value,))
                           for key, value in links.items()) or 'not measured'), '']
    return lines + _table(
        ['model', 'link', 'N', 'S', 'method', 'samples/s', '/ sync', 'steady samples/s',
         'steady / sync', 'floor ms: worker link', 'server link', 'floor samples/s',
         'cores per worker', 'cores per server', 'CPU ms per step: worker', 'server',
         'other cores', 'noisy runs', 'worker 0 step ms by position in the period'],
        [[model, rate, str(n), str(s), METHODS[m].label, _fmt(it['samples_per_s'], '%.1f'),
          _fmt(it['x_sync'], '%.2fx'), _fmt(it['steady_samples_per_s'], '%.1f'),
          _fmt(it['x_sync_steady'], '%.2fx'), _fmt(it['worker_floor_ms'], '%.0f'),
          _fmt(it['server_floor_ms'], '%.0f'), _fmt(it['floor_samples_per_s'], '%.1f'),
          _fmt(it['cores_per_worker']), _fmt(it['cores_per_server']),
          _fmt(it['worker_cpu_ms'], '%.0f'), _fmt(it['server_cpu_ms'], '%.0f'),
          _fmt(it['cpu_other']),
          '%d of %d' % (it['noisy'], it['runs']),
          ' / '.join('%.0f' % v for v in it['period_ms'] or ())]
         for model, rate in pairs for n in workers for s in servers for m in methods
         for it in [summary.get((model, rate, n, s, m))] if it])


def model_rates(summary):
    """The (model, rate) pairs of `summary`, models in :data:`MODELS`' order, rates fastest
    first."""
    return sorted({k[:2] for k in summary}, key=lambda p: (list(MODELS).index(p[0]),
                                                           -netns.rate_bits(p[1])))


def _method_rows(summary, pairs, workers, servers, methods, keys):
    """Table rows (model, link, N, S, method, then `keys` of its summary) of every run
    configuration."""
    return [[model, rate, str(n), str(s), METHODS[m].label] + [_fmt(it[k]) for k in keys]
            for model, rate in pairs for n in workers for s in servers for m in methods
            for it in [summary.get((model, rate, n, s, m))] if it]
