"""The report of a folder of ``tta.py --part real`` runs alone: real time to a target (issue 38).

A folder without ``full`` runs (nothing to derive from) but with ``real-runs.csv`` and
``real-evals.csv`` is reported on its real runs only: on each link, the target (``epochN``:
stock ``dist_sync``'s test accuracy at the end of epoch N of the folder's real runs on that
link, the mean over their seeds; or a test accuracy), each run's real wall time of training to
its first evaluation at or above the target, the stock run's time over each other method's
time (the same link and seed), and ``accuracy-time.png``: test accuracy against real wall
time, a panel per link, every method, the target as a horizontal line. Files written:
``results.md``, ``headline.json``, ``accuracy-time.png``. ``tta.py --part report`` calls
:func:`build_report` for such a folder.
"""
import os
import statistics

import report as report_lib

__all__ = ['link_target', 'first_hit', 'run_points', 'time_to_target', 'build_report', 'plot']

STOCK = 'sync'   # the stock baseline's method name in tta.py's runs


def link_target(evals, network, real_target):
    """``(target, definition)`` on `network` for `real_target` (``tta.real_target``'s value):
    ``('epoch', N)``: stock's mean test accuracy at the end of epoch N of `evals` on the link.
    """
    kind, value = real_target
    if kind == 'accuracy':
        return value, 'test accuracy %g (--real-target)' % value
    rows = [e for e in evals if e['network'] == network and e['method'] == STOCK
            and e['epoch_end'] in (True, 'True') and round(e['epoch']) == value]
    if not rows:
        raise ValueError('--real-target epoch%d: the real runs have no %s evaluation at the end '
                         'of epoch %d on %s; give an epoch they have or an accuracy'
                         % (value, STOCK, value, network))
    seeds = ', '.join(str(e['seed']) for e in rows)
    return (statistics.mean(e['test_acc'] for e in rows),
            "dist_sync's test accuracy at the end of epoch %d of its real run on the link "
            '(seed%s %s%s)' % (value, 's' if len(rows) > 1 else '', seeds,
                               ', the mean' if len(rows) > 1 else ''))


def first_hit(points, target):
    """The evaluation of `points` with the fewest steps at or above `target`, else None."""
    return min((p for p in points if p['test_acc'] >= target), key=lambda p: p['step'],
               default=None)


def run_points(evals, network, run):
    """The evaluations of `run` (its method and seed) on `network`, by step."""
    return sorted((e for e in evals if e['network'] == network and e['method'] == run['method']
                   and e['seed'] == run['seed']), key=lambda e: e['step'])


def time_to_target(evals, runs, real_target):
    """Per link (in the runs' order): the target and, per run, its time to it.

    Returns a list of ``{'network', 'target', 'definition', 'runs': [...]}``; each run has
    ``method``, ``seed``, ``exit``, ``cpu_other``, ``hit`` (the first evaluation at or above
    the target: ``step``, ``epoch``, ``test_acc``, ``wall_s``; None if never), ``last`` (its
    last evaluation), and for a method other than stock ``ratio``: the stock run's time to
    the target (same link and seed) over this run's (None if either never reached it).
    """
    result = []
    for network in dict.fromkeys(r['network'] for r in runs):
        target, definition = link_target(evals, network, real_target)
        checks = []
        for run in (r for r in runs if r['network'] == network):
            points = run_points(evals, network, run)
            hit = first_hit(points, target)
            checks.append(dict(method=run['method'], seed=run['seed'], exit=run['exit'],
                               cpu_other=run.get('cpu_other'), hit=hit,
                               last=points[-1] if points else None))
        for check in checks:
            if check['method'] == STOCK:
                continue
            stock = next((c for c in checks if c['method'] == STOCK
                          and c['seed'] == check['seed']), None)
            check['ratio'] = (stock['hit']['wall_s'] / check['hit']['wall_s']
                              if stock and stock['hit'] and check['hit'] else None)
        result.append(dict(network=network, target=target, definition=definition,
                           runs=checks))
    return result


def plot(path, evals, links, labels, networks):
    """``accuracy-time.png``: a panel per link of `links` (:func:`time_to_target`), test
    accuracy against real wall time of every method, the target as a horizontal line."""
    plt = report_lib.pyplot()
    fig, axes = plt.subplots(1, len(links), figsize=(5.2 * len(links), 4.2), squeeze=False)
    for ax, link in zip(axes[0], links):
        for index, run in enumerate(link['runs']):
            points = run_points(evals, link['network'], run)
            color = '0.35' if run['method'] == STOCK else 'C%d' % (2 + index)
            ax.plot([p['wall_s'] for p in points], [p['test_acc'] for p in points],
                    marker='o', ms=3, color=color,
                    label='%s, seed %s' % (labels[run['method']], run['seed']))
            if run['hit']:
                ax.plot([run['hit']['wall_s']], [run['hit']['test_acc']], marker='o', ms=8,
                        mfc='none', color=color)
                # stock's time below right of its point, the others' above left: apart
                # when both reach the target at about the same time
                stock = run['method'] == STOCK
                ax.annotate('%.0f s' % run['hit']['wall_s'],
                            (run['hit']['wall_s'], run['hit']['test_acc']),
                            textcoords='offset points', xytext=(6, -14) if stock else (-6, 6),
                            ha='left' if stock else 'right', color=color)
        ax.axhline(link['target'], color='k', ls='--', lw=0.8,
                   label='target %.4f' % link['target'])
        ratios = [r['ratio'] for r in link['runs'] if r.get('ratio')]
        ax.set_title('%s%s' % (networks[link['network']],
                               ': %.2fx to the target' % ratios[0] if len(ratios) == 1 else ''))
        ax.set_xlabel('real wall time of training (s)')
        ax.set_ylabel('test accuracy')
        ax.set_xlim(left=0)
        ax.grid(alpha=0.3)
        ax.legend(loc='lower right', fontsize=8)
    report_lib.save(fig, path, 110)


def _minutes(seconds):
    return '%.1f s (%.1f min)' % (seconds, seconds / 60)


def _when(hit):
    return '%.1f s (step %d, epoch %.2f, %.4f)' % (
        hit['wall_s'], hit['step'], hit['epoch'], hit['test_acc'])


def _agreement(evals, method, label):
    """Whether `method`'s runs on different links had the same test accuracy at the same
    step and seed (with 2 workers the trajectory does not depend on timing)."""
    same = {}
    for e in evals:
        if e['method'] == method:
            same.setdefault((e['seed'], e['step']), []).append(e['test_acc'])
    shared = [v for v in same.values() if len(v) > 1]
    if not shared:
        return '%s: no step evaluated on more than one link.' % label
    spread = max(max(v) - min(v) for v in shared)
    return '%s on the links, at the same %d steps: %s.' % (
        label, len(shared), 'the same test accuracy at every one' if spread == 0
        else 'test accuracies up to %.4f apart' % spread)


def _markdown(links, evals, rows, meta, labels, networks):
    table = report_lib.table
    lines = ['# Real wall-clock time to a target on shaped links', '',
             'Real runs of `tta.py --part real` (no derivation). Procedure: '
             '[notes.md](notes.md). Command: `%s`; commit %s%s; %s to %s; load average '
             '(1 min) %.2f before, %.2f after.' % (
                 meta['command'], meta['code_start']['commit'][:7],
                 ' (dirty)' if meta['code_start']['dirty'] else '', meta['started'],
                 meta.get('finished', '?'), meta['load_before'][0],
                 meta.get('load_after', [float('nan')])[0]), '',
             'Time: the real wall time of training, from the first worker\'s first step to the '
             'evaluated step\'s end on the slower worker (start-up before it and evaluation '
             'after training not counted). Time to the target: the first evaluation at or '
             'above it. Other cores: what other processes of the shared machine used during '
             'the run (noisy above %g).' % report_lib.NOISE_CORES, '']
    body = []
    for link in links:
        for run in link['runs']:
            reached = _when(run['hit']) if run['hit'] else (
                'run failed (exit %s)' % run['exit'] if run['exit'] != 0 else
                'not reached (%.4f at step %d, %.1f s)' % (
                    run['last']['test_acc'], run['last']['step'], run['last']['wall_s'])
                if run['last'] else 'not reached')
            body.append([networks[link['network']], '%.4f' % link['target'], labels[
                run['method']], run['seed'], reached,
                '%.2fx' % run['ratio'] if run.get('ratio') else '-',
                '-' if run['cpu_other'] is None else '%.2f%s' % (run['cpu_other'], (
                    ' (noisy)' if run['cpu_other'] > report_lib.NOISE_CORES else ''))])
    lines += ['## Headline', '']
    for link in links:
        stock = {r['seed']: r for r in link['runs'] if r['method'] == STOCK}
        for run in (r for r in link['runs'] if r.get('ratio')):
            lines.append('- %s, seed %s, to %.4f: %s %s, %s %s: **%.2fx**.' % (
                networks[link['network']], run['seed'], link['target'], labels[run['method']],
                _minutes(run['hit']['wall_s']), labels[STOCK],
                _minutes(stock[run['seed']]['hit']['wall_s']), run['ratio']))
    lines += ['', '## Time to the target', '']
    lines += ['Targets: %s.' % '; '.join('%s: %s' % (networks[link['network']],
                                                      link['definition']) for link in links), '']
    lines += table('link | target | method | seed | real time to the target | stock / this '
                   '| other cores', body, 'lrllrrr')
    for method in dict.fromkeys(e['method'] for e in evals):
        lines += ['', _agreement(evals, method, labels[method])]
    lines += ['', '![test accuracy against real wall time](accuracy-time.png)', '',
              '## Every evaluation', '']
    lines += table('link | method | seed | step | epoch | test accuracy | real wall time', [
        [networks[e['network']], labels[e['method']], e['seed'], e['step'], '%.2f' % e['epoch'],
         '%.4f' % e['test_acc'], '%.1f s' % e['wall_s']] for e in evals], 'lllrrrr')
    lines += ['', '## Runs', '']
    lines += table('link | method | seed | exit | steps | training | first step | other cores '
                   '| load before / after | stock check', [
                       [networks[r['network']], labels[r['method']], r['seed'], r['exit'],
                        r.get('steps', '-'), report_lib.fmt(r.get('train_s'), '%.1f s'),
                        report_lib.fmt(r.get('first_step_s'), '%.2f s'),
                        report_lib.fmt(r.get('cpu_other')),
                        '%.2f / %.2f' % (r['load_before'], r['load_after']),
                        r.get('stock_check', '-')] for r in rows], 'lllrrrrrrl')
    return lines


def build_report(out, real_target, labels, networks):
    """Write ``results.md``, ``headline.json`` and ``accuracy-time.png`` into `out` from its
    real runs. `labels`: method -> label; `networks`: network -> label."""
    rows = report_lib.read_csv(os.path.join(out, 'real-runs.csv'))
    evals = report_lib.read_csv(os.path.join(out, 'real-evals.csv'))
    meta = report_lib.read_json(os.path.join(out, 'meta-real.json'))
    links = time_to_target(evals, rows, real_target)
    report_lib.write_json(os.path.join(out, 'headline.json'), links)
    plot(os.path.join(out, 'accuracy-time.png'), evals, links, labels, networks)
    report_lib.write_lines(os.path.join(out, 'results.md'),
                           _markdown(links, evals, rows, meta, labels, networks))
