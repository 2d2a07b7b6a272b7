"""The benchmarks' shared report code, and the tables and plots of ``benchmarks/benchmark.py``.

Shared: the results files (:func:`write_csv`, :func:`read_csv`, :func:`write_json`,
:func:`read_json`, :func:`write_lines`), Markdown tables (:func:`table`, :func:`fmt`), plots
(:func:`pyplot`, :func:`save`), what a *noisy* run is (:data:`NOISE_CORES`) and the steady
rate of a window run (:func:`steady_ms_per_step`). The rest is ``benchmark.py``'s report
(issue 5's targets).
"""
import csv
import json
import os
import statistics

__all__ = ['write_csv', 'read_csv', 'write_json', 'read_json', 'write_lines', 'table', 'fmt',
           'pyplot', 'save', 'seconds', 'write_all', 'summarize', 'is_noisy', 'run_name',
           'steady_ms_per_step', 'NOISE_CORES']

#: A run during which processes outside the job used more than this many cores on average
#: (the machine is shared) is *noisy*: the benchmark repeats it, and the medians leave it
#: out whenever a quiet run of the same network and method exists.
NOISE_CORES = 0.25

#: Targets of issue 5 (k=4 unless said): (key, description, required, comparison)
TARGETS = [
    ('k4_vs_sync_loopback', 'k=4 throughput / dist_sync, loopback', 1.6, '>='),
    ('k4_vs_sync_1gbit', 'k=4 throughput / dist_sync, 1 Gbit/s', 1.6, '>='),
    ('k4_vs_compute_loopback', 'k=4 throughput / compute-only, loopback', 0.85, '>='),
    ('jitter_loss_ratio', "jitter: k=4's loss / dist_sync's loss (each vs its no-jitter run)",
     0.5, '<='),
    ('acc_k4', "test accuracy, k=4 'mirror' minus dist_sync (points)", -0.5, '>='),
    ('acc_k8', "test accuracy, k=8 'mirror' minus dist_sync (points)", -0.5, '>='),
]


def write_csv(path, rows):
    """Write `rows` (dicts) to `path`, columns in first-seen order."""
    columns = []
    for row in rows:
        columns += [key for key in row if key not in columns]
    with open(path, 'w', newline='', encoding='utf-8') as dst:
        writer = csv.DictWriter(dst, columns)
        writer.writeheader()
        writer.writerows(rows)


def read_csv(path):
    """Read rows written by :func:`write_csv`, numbers as numbers (for ``--report-only``)."""
    def convert(value):
        for kind in (int, float):
            try:
                return kind(value)
            except ValueError:
                pass
        return value
    with open(path, newline='', encoding='utf-8') as src:
        return [{key: convert(value) for key, value in row.items() if value != ''}
                for row in csv.DictReader(src)]


def write_json(path, data, indent=1):
    """Write `data` to `path` as JSON (`indent` None: one line)."""
    with open(path, 'w', encoding='utf-8') as dst:
        json.dump(data, dst, indent=indent)


def read_json(path):
    with open(path, encoding='utf-8') as src:
        return json.load(src)


def write_lines(path, lines):
    """Write `lines` to `path`, one a line (a Markdown file)."""
    with open(path, 'w', encoding='utf-8') as dst:
        dst.write('\n'.join(lines) + '\n')


def seconds(value):
    """`value` seconds as ``'42 s'``, from 10 minutes ``'12.5 min'``; ``'-'`` for None."""
    if value is None:
        return '-'
    return '%.0f s' % value if value < 600 else '%.1f min' % (value / 60)


def fmt(value, pattern='%.2f'):
    """`value` formatted by `pattern`; '' for None."""
    return '' if value is None else pattern % value


def table(header, rows, align=None):
    """The lines of a Markdown table: `header` (a list, or a string of cells separated by
    ``' | '``), its rule (`align`: one ``l`` or ``r`` a column; default: the first column
    left, the others right) and `rows` (lists of cells)."""
    if isinstance(header, str):
        header = header.split(' | ')
    align = align or 'l' + 'r' * (len(header) - 1)
    return ['| %s |' % ' | '.join(header),
            '|%s|' % '|'.join('---:' if a == 'r' else '---' for a in align)] + [
                '| %s |' % ' | '.join(str(cell) for cell in row) for row in rows]


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display)."""
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
    return plt


def save(fig, path, dpi):
    """Lay out `fig`, write it to `path` and close it."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)


def run_name(network, method, round_index, attempt=0):
    """The folder name of one throughput run under ``runs/``."""
    return '%s-%s-r%d%s' % (network, method, round_index, '-%d' % attempt if attempt else '')


def steady_ms_per_step(folder, period, num_workers=2):
    """Steady-state ms/step of a run, from its workers' step ends; None if too short.

    The job-level measure (from the first window start to the last worker's end, after
    ``nd.waitall()``) counts the start-up of the delayed phase and the drain of the pushes
    still queued at the end, up to ``slack`` rounds: a bias against the delayed runs on slow
    links, where a short window holds few steps. This one takes each worker's time between
    two ends of a pull period's last step (the same point of the cycle, so the same queue),
    leaving out the first period; the slower worker's rate is the job's.
    """
    worst = None
    for rank in range(num_workers):
        path = os.path.join(folder, 'worker-%d.json' % rank)
        if not os.path.exists(path):
            return None
        ends = read_json(path)['step_ends']
        first = 2 * period - 1
        last = first + (len(ends) - 1 - first) // period * period
        if last - first < 2 * period:
            return None
        value = 1000 * (ends[last] - ends[first]) / (last - first)
        worst = value if worst is None else max(worst, value)
    return worst


def is_noisy(row):
    """Whether other processes used more than :data:`NOISE_CORES` during the run."""
    return row.get('cpu_other', 0.0) > NOISE_CORES


def _median(values):
    return statistics.median(values) if values else None


def summarize(rows):
    """Return ``{(network, method): summary}`` over the successful runs."""
    groups = {}
    for row in rows:
        if 'error' not in row:
            groups.setdefault((row['network'], row['method']), []).append(row)
    summary = {}
    for key, all_runs in groups.items():
        runs = [run for run in all_runs if not is_noisy(run)] or all_runs
        rates = [run['samples_per_s'] for run in runs]
        summary[key] = dict(
            network=key[0], method=key[1], runs=len(runs), excluded=len(all_runs) - len(runs),
            noisy=all(is_noisy(run) for run in runs), samples_per_s=_median(rates),
            min=min(rates), max=max(rates), ms_per_step=_median([r['ms_per_step'] for r in runs]),
            cpu_workers=_median([r['cpu_workers'] for r in runs]),
            cpu_server=_median([r['cpu_server'] for r in runs]),
            cpu_other=_median([r['cpu_other'] for r in runs]),
            cpu_launcher=_median([r['cpu_launcher'] + r['cpu_scheduler'] for r in runs]),
            load=_median([r['load_before'] for r in runs]),
            values=sorted(rates),
            steady_ms=_median([r['steady_ms_per_step'] for r in runs
                               if r.get('steady_ms_per_step') is not None]))
    for (network, method), item in summary.items():
        for base in ('sync', 'compute'):
            ref = summary.get((network, base))
            item['x_' + base] = item['samples_per_s'] / ref['samples_per_s'] if ref else None
        ref = summary.get((network, 'sync'))
        item['steady_x_sync'] = (ref['steady_ms'] / item['steady_ms']
                                 if ref and ref['steady_ms'] and item['steady_ms'] else None)
    return summary


def _step_profile(rows, network, method, period):
    """Mean step time (ms) of worker 0 by position in the pull period, over all rounds."""
    sums, counts = [0.0] * period, [0] * period
    for row in rows:
        if row.get('network') == network and row.get('method') == method and 'error' not in row:
            for index, value in enumerate(row['step_ms'].split()):
                sums[index % period] += float(value)
                counts[index % period] += 1
    return [s / c if c else None for s, c in zip(sums, counts)]


def _accuracy_by_method(accuracy):
    by_method = {}
    for row in accuracy:
        if 'error' not in row:
            by_method.setdefault(row['method'], {})[row['epoch']] = row
    return by_method


def _table(header, rows):
    return '\n'.join(table(header, rows))


def targets(summary, accuracy):
    """Return ``[(description, value text, required text, verdict)]`` for issue 5's targets."""
    values = {}
    for network in ('loopback', '1gbit'):
        item = summary.get((network, 'k4'))
        if item and item['x_sync'] is not None:
            values['k4_vs_sync_' + network] = (item['x_sync'], '%.2fx' % item['x_sync'])
    item = summary.get(('loopback', 'k4'))
    if item and item['x_compute'] is not None:
        values['k4_vs_compute_loopback'] = (item['x_compute'], '%.2fx' % item['x_compute'])
    losses = {}
    for method in ('k4', 'sync'):
        plain, jitter = summary.get(('loopback', method)), summary.get(('jitter', method))
        if plain and jitter:
            losses[method] = 1 - jitter['samples_per_s'] / plain['samples_per_s']
    if len(losses) == 2 and losses['sync'] > 0:
        ratio = losses['k4'] / losses['sync']
        values['jitter_loss_ratio'] = (ratio, '%.2f (k=4 loses %.1f%%, dist_sync %.1f%%)' % (
            ratio, 100 * losses['k4'], 100 * losses['sync']))
    by_method = _accuracy_by_method(accuracy)
    if 'sync' in by_method:
        last = max(by_method['sync'])
        base = by_method['sync'][last]['test_acc']
        for key, method in (('acc_k4', 'mirror-k4'), ('acc_k8', 'mirror-k8')):
            row = by_method.get(method, {}).get(last)
            if row:
                diff = 100 * (row['test_acc'] - base)
                values[key] = (diff, '%+.2f (%.4f vs %.4f, epoch %d)' % (
                    diff, row['test_acc'], base, last))
    result = []
    for key, description, required, comparison in TARGETS:
        if key not in values:
            result.append((description, 'not run', '%s %g' % (comparison, required), ''))
            continue
        value, text = values[key]
        met = value >= required if comparison == '>=' else value <= required
        result.append((description, text, '%s %g' % (comparison, required),
                       'met' if met else 'missed'))
    return result


#: network with jitter -> the same network without (as benchmark.JITTER_PAIRS)
JITTER_PAIRS = {'jitter': 'loopback', 'jitter-1gbit': '1gbit'}


def jitter_losses(summary, methods):
    """Return ``[(jitter network, base network, method, loss)]``: 1 - jittered/plain."""
    losses = []
    for jittered, plain in JITTER_PAIRS.items():
        for method in methods:
            a, b = summary.get((plain, method)), summary.get((jittered, method))
            if a and b:
                losses.append((jittered, plain, method,
                               1 - b['samples_per_s'] / a['samples_per_s']))
    return losses


def markdown(meta, rows, accuracy, methods, networks, accuracy_runs, args):
    """Return results.md's text."""
    summary = summarize(rows)
    present_networks = [n for n in networks if any(k[0] == n for k in summary)]
    present_methods = [m for m in methods if any(k[1] == m for k in summary)]
    out = ['# mxdelay benchmark results', '',
           'Command: `%s`  ' % meta['command'],
           'Started %s, finished %s.  ' % (meta['started'], meta.get('finished', '?')),
           'Machine: %d CPU cores (%s), Linux %s, Python %s; load average (1, 5, 15 min) '
           'at the start %s, at the end %s.' % (
               meta['nproc'], meta['cpu'], meta['kernel'], meta['python'],
               ', '.join('%.2f' % v for v in meta['load_start']),
               ', '.join('%.2f' % v for v in meta.get('load_end', ()))),
           '', 'Code: %s at the start, %s at the end.' % (meta.get('code_start', '?'),
                                                        meta.get('code_end', '?')), '']
    if summary:
        settings = ', '.join('%s: warm-up %d + 1, %d timed steps' % (
            n, args.warmup or networks[n]['warmup'], args.steps or networks[n]['steps'])
            for n in present_networks) + ' (compute-only: as loopback, on every network)'
        out += ['## Throughput', '',
                'Job samples/s (2 workers x batch 128), median of %d round(s) (the values in '
                'brackets); ratios of medians to dist_sync and to compute-only of the same '
                'network. Steps: %s. A run during which processes outside the job used more '
                'than %.2f cores on average (the machine is shared) is noisy: it was repeated, '
                'and it is left out of the median if the same network and method has a quiet '
                'run (every run is in runs.csv). *Steady* columns: the rate within the run, '
                'between the same points of the pull cycle after the first period, without '
                'the start-up of the delayed phase and without the drain of the pushes still '
                'queued when the window ends (the main measure counts both, which costs the '
                'delayed runs up to slack rounds on a slow link); blank where the window is '
                'too short.' % (args.rounds, settings, NOISE_CORES), '']
        for network in present_networks:
            out += ['### %s' % networks[network]['label'], '']
            table = []
            for method in present_methods:
                item = summary.get((network, method))
                if not item:
                    continue
                table.append([methods[method].label, '%.0f%s [%s%s]' % (
                    item['samples_per_s'], ' (noisy)' if item['noisy'] else '',
                    ', '.join('%.0f' % v for v in item['values']),
                    '; %d noisy left out' % item['excluded'] if item['excluded'] else ''),
                    '%.1f' % item['ms_per_step'], fmt(item['x_sync'], '%.2fx'),
                    fmt(item['x_compute'], '%.2fx'), fmt(item['steady_ms'], '%.1f'),
                    fmt(item['steady_x_sync'], '%.2fx')])
            out += [_table(['method', 'samples/s', 'ms/step', 'x dist_sync', 'x compute-only',
                            'steady ms/step', 'steady x dist_sync'], table), '']
        out += ['### Where the CPU goes', '',
                'Cores used on average during the timed window (medians over rounds): the two '
                'workers together, the server, the scheduler + launcher + benchmark driver, and '
                "everything else on the machine ('other': other users' processes, and kernel "
                'work not charged to a process of the job, such as bridged packets). '
                'The machine has %d cores.' % meta['nproc'], '']
        table = []
        for network in present_networks:
            for method in present_methods:
                item = summary.get((network, method))
                if item:
                    used = (item['cpu_workers'] + item['cpu_server'] + item['cpu_other']
                            + item['cpu_launcher'])
                    table.append([networks[network]['label'], methods[method].label,
                                  '%.2f' % item['cpu_workers'], '%.2f' % item['cpu_server'],
                                  '%.2f' % item['cpu_launcher'], '%.2f' % item['cpu_other'],
                                  '%.2f' % max(0.0, meta['nproc'] - used),
                                  '%.2f' % item['load']])
        out += [_table(['network', 'method', 'workers', 'server', 'sched+launcher', 'other',
                        'idle', 'load before'], table), '']
        losses = jitter_losses(summary, present_methods)
        if losses:
            out += ['### What the jitter costs', '',
                    'Throughput lost to the jitter (1 - jittered / plain, medians), each method '
                    'against its own run without jitter on the same network. Each worker '
                    'sleeps 6.0 ms per step on average; a job that waited at every step for '
                    'the slower worker would lose 10.8 ms per step (the mean of the larger of '
                    'two sleeps).', '',
                    _table(['network', 'method', 'plain ms/step', 'jittered ms/step', 'loss'],
                           [[networks[j]['label'], methods[m].label,
                             '%.1f' % summary[(p, m)]['ms_per_step'],
                             '%.1f' % summary[(j, m)]['ms_per_step'], '%.1f%%' % (100 * loss)]
                            for j, p, m, loss in losses]), '']
        profile_rows = []
        for network in present_networks:
            for method, period in (('k4', 4), ('k8', 8)):
                if (network, method) in summary:
                    profile = _step_profile(rows, network, method, period)
                    profile_rows.append([networks[network]['label'], methods[method].label]
                                        + ['%.1f' % v for v in profile[:4]]
                                        + ([''] if period == 4 else
                                           ['%.1f' % max(profile[4:])]))
        if profile_rows:
            out += ['### Step time by position in the pull period', '',
                    "Worker 0's mean step time (ms), all rounds. Position k-1 issues the pull "
                    'of the global weights; position 0 of the next period applies it (and '
                    'waits for it if it has not arrived); positions 4-7 of k=8 are summarised '
                    'by their maximum.', '',
                    _table(['network', 'method', 'pos 0', 'pos 1', 'pos 2', 'pos 3',
                            'max pos 4-7'], profile_rows), '']
    by_method = _accuracy_by_method(accuracy)
    if by_method:
        epochs = sorted({epoch for rows_ in by_method.values() for epoch in rows_})
        names = [name for name in accuracy_runs if name in by_method]
        out += ['## Accuracy', '',
                'Test accuracy of worker 0 (10000 test images) after each epoch, '
                'examples/train_fashion_mnist.py on loopback, seed 1, warm-up %d steps for '
                'the delayed runs.' % args.accuracy_warmup, '',
                _table(['epoch'] + [accuracy_runs[name][0] for name in names],
                       [[epoch] + [fmt(by_method[name].get(epoch, {}).get('test_acc'), '%.4f')
                                   for name in names] for epoch in epochs]), '']
    verdicts = targets(summary, accuracy)
    out += ['## Targets (issue 5)', '',
            _table(['target', 'measured', 'required', 'verdict'], verdicts), '']
    failed = [row for row in rows + accuracy if 'error' in row]
    if failed:
        out += ['## Failed runs', ''] + ['- %s' % ', '.join('%s=%s' % item for item in row.items())
                                         for row in failed] + ['']
    out += ['Plots: [throughput](throughput.png), [accuracy](accuracy.png).', '']
    return '\n'.join(out)


def plot_throughput(path, rows, methods, networks):
    plt = pyplot()
    summary = summarize(rows)
    present = [n for n in networks if any(k[0] == n for k in summary)]
    if not present:
        return False
    cols = min(2, len(present))
    nrows = (len(present) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(6.4 * cols, 4.4 * nrows), squeeze=False)
    for ax, network in zip(axes.flat, present):
        ks = [k for k in (1, 2, 4, 8) if (network, 'k%d' % k) in summary]
        if ks:
            items = [summary[(network, 'k%d' % k)] for k in ks]
            med = [item['samples_per_s'] for item in items]
            err = [[m - item['min'] for m, item in zip(med, items)],
                   [item['max'] - m for m, item in zip(med, items)]]
            ax.errorbar(ks, med, yerr=err, marker='o', capsize=4, color='C0', lw=2,
                        label='DelayedTrainer (mxdelay)')
            for k, value, item in zip(ks, med, items):
                ax.annotate('%.0f' % value + (' (%.2fx)' % item['x_sync'] if item['x_sync']
                                              else ''), (k, value), textcoords='offset points',
                            xytext=(0, 9), ha='center', fontsize=8, color='C0')
        shown = [summary[(network, m)]['samples_per_s'] for m in methods
                 if m != 'compute' and (network, m) in summary]
        top = 1.3 * max(shown) if shown else None
        for method, style, color in (('sync', '--', 'C3'), ('compute', ':', 'C2')):
            item = summary.get((network, method))
            if not item:
                continue
            label = '%s: %.0f' % (methods[method].label, item['samples_per_s'])
            if top is not None and item['samples_per_s'] > 2 * top:
                # Far above the rest (a slow network): a line there would flatten the others.
                ax.plot([], [], ls=style, color=color, lw=2, label=label + ' (off scale)')
            else:
                ax.axhline(item['samples_per_s'], ls=style, color=color, lw=2, label=label)
        ax.set_xscale('log', base=2)
        ax.set_xticks([1, 2, 4, 8])
        ax.set_xticklabels(['1', '2', '4', '8'])
        ax.set_xlim(0.8, 10)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.1)  # room for the labels
        ax.set_xlabel('k (pull every k steps)')
        ax.set_ylabel('samples/s (2 workers)')
        ax.set_title(networks[network]['label'])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc='best')
    for ax in list(axes.flat)[len(present):]:
        ax.set_visible(False)
    fig.suptitle('Throughput vs k (median over rounds; bars: min-max; in brackets: x dist_sync)')
    save(fig, path, 110)
    return True


def plot_accuracy(path, accuracy, accuracy_runs):
    plt = pyplot()
    by_method = _accuracy_by_method(accuracy)
    if not by_method:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(12.8, 4.6))
    styles = {'sync': ('C3', '--'), 'mirror-k4': ('C0', '-'), 'mirror-k8': ('C1', '-'),
              'sgd-k4': ('C7', '-.')}
    finals = []
    for name in accuracy_runs:
        if name not in by_method:
            continue
        epochs = sorted(by_method[name])
        acc = [by_method[name][e]['test_acc'] for e in epochs]
        color, style = styles.get(name, (None, '-'))
        for ax in axes:
            ax.plot(epochs, acc, marker='o', ms=4, color=color, ls=style,
                    label='%s: %.4f' % (accuracy_runs[name][0], acc[-1]))
        if name != 'sgd-k4':
            finals += acc
    axes[0].set_ylim(0, 1)
    axes[0].set_title('test accuracy per epoch')
    if finals:
        axes[1].set_ylim(min(finals) - 0.01, max(finals) + 0.005)
    axes[1].set_title('zoom (the literal rule may be off the scale)')
    for ax in axes:
        ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
        ax.set_xlabel('epoch')
        ax.set_ylabel('test accuracy')
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc='lower right')
    save(fig, path, 110)
    return True


def write_all(out, meta, rows, accuracy, methods, networks, accuracy_runs, args):
    """Write results.md, the CSV files and the plots into `out`."""
    for row in rows:
        if 'error' not in row and 'steady_ms_per_step' not in row:
            method = row['method']
            row['steady_ms_per_step'] = steady_ms_per_step(
                os.path.join(out, 'runs', run_name(row['network'], method, row['round'],
                                                   row.get('attempt', 0))),
                int(method[1:]) if method.startswith('k') else 1)
    if rows:
        write_csv(os.path.join(out, 'runs.csv'), rows)
        summary = summarize(rows)
        write_csv(os.path.join(out, 'throughput.csv'),
                  [{k: v for k, v in item.items() if k != 'values'} for item in summary.values()])
        plot_throughput(os.path.join(out, 'throughput.png'), rows, methods, networks)
    if accuracy:
        write_csv(os.path.join(out, 'accuracy.csv'), accuracy)
        plot_accuracy(os.path.join(out, 'accuracy.png'), accuracy, accuracy_runs)
    with open(os.path.join(out, 'results.md'), 'w', encoding='utf-8') as dst:
        dst.write(markdown(meta, rows, accuracy, methods, networks, accuracy_runs, args))
