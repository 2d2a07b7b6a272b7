"""Test accuracy per epoch of a BatchNorm CNN, SGD with momentum and Adam, stock vs delayed.

Every job: the Fashion-MNIST CNN ``build_net('cnn-bn')`` of ``examples/train_fashion_mnist.py``
(conv3x3-32, BatchNorm, ReLU, maxpool 2; conv3x3-64, BatchNorm, ReLU, maxpool 2; dense 128
ReLU; dense 10; hybridized; 225,226 trained parameters), batch 128 per worker, 2 workers + 1
server on loopback, ``--epochs`` (10) epochs of 234 steps, ``OMP_NUM_THREADS=1`` in every
process. Jobs are started as in ``benchmarks/tta.py``, by ``benchmarks/harness.py``:
``mxdelay/launcher.py`` run as a plain file with the explicit environment of ``harness.job_env``,
the worker ``benchmarks/bench_worker.py``, and every process's provenance records (stock
runs: no process imports mxdelay, checked per process).

Optimizers (on the servers; mirrored locally by ``DelayedTrainer``'s rule ``'mirror'``):
``sgd`` (lr 0.05, momentum 0.9, wd 1e-4) and ``adam`` (lr 1e-3, MXNet's default betas and
epsilon, wd 0). Methods: ``sync`` (stock ``gluon.Trainer`` on MXNet's ``dist_sync``),
``k4``, ``k8``, ``k16`` (``mxdelay.DelayedTrainer``, rule ``'mirror'``) and ``sgd-k4`` (the
literal rule ``local_rule='sgd'``, k=4); warm-up 200 synchronous steps. ``k4-aux`` and
``k8-aux``: ``k4`` and ``k8`` whose global model has the workers' mean BatchNorm statistics
(``sync_weights(aux_states=True)``, docs/design.md §2.13); ``k4-ternary-pull-int8``: k=4 with
ternary pushes and int8 pulls; the ``-fv`` methods (Adam only): ``mxdelay.FrozenVarianceAdam``
with its second moment frozen at the switch (docs/design.md §1.4); ``drift-k8`` and
``drift-k16``: the drift-corrected rule ``local_rule='drift'`` (§1.4); none of these in the
default runs.

Accuracy is that of the *global* model on the 10000 test images after every epoch: for the
delayed methods every worker calls ``trainer.sync_weights()`` at each epoch's end (it is part
of their trajectory: the next local steps start from the global weights), and worker 0 copies
the weights; for ``sync`` worker 0's weights are the global ones. BatchNorm's running mean and
variance are not trained parameters: each worker keeps its own, in both cases, and the
evaluated model has worker 0's (the ``-aux`` methods: the workers' mean). The copies are
evaluated after training.

With 2 workers the trajectory does not depend on timing (exact rounds, a sum of two is
commutative, seeded data order), so the runs need no shaped link, and a loaded machine
changes only their wall time. The runs go one after the other in the order of ``--runs``
(default: SGD's dist_sync, k=4, k=8, Adam's, then k=16 and the literal rule of both), once
per seed of ``--seeds`` (default: 1 only).

Files in ``--out`` (written after every run, so that a cut run keeps what is done):
``accuracy.csv`` (one row per run and epoch), ``runs.csv`` (one row per run),
``runs/<optimizer>-<method>-s<seed>.json`` (per run: the row, every worker's loss per epoch
and a digest of its per-step losses, every process's provenance records), ``meta.json``
(command, commit, machine, load, date), and from them ``results.md``, ``accuracy.png`` and
``readme-rows.md`` (the rows for README.md's results section). Logs and the workers' raw
outputs go to ``--scratch``.

``--include FOLDER:OPTIMIZER/METHOD,...`` (repeatable) adds runs of another results folder
to the report, e.g. the stock runs of an earlier invocation instead of making them again:
with 2 workers a run repeats bit for bit, and a run found in two folders must be identical
(else the report raises). The runs table names each run's folder.

A stop signal (SIGINT, SIGTERM, SIGHUP) ends the running job and writes the report of the
runs made so far; exit 128 + signal.

Usage::

    python benchmarks/accuracy_cnn.py                  # every run, then the report
    python benchmarks/accuracy_cnn.py --report-only    # the report from the files in --out
"""
import hashlib
import json
import logging
import os
import sys

import harness
import provenance
import report as report_lib

__all__ = ['main']

_LOG = logging.getLogger('accuracy_cnn')
REPO = harness.REPO

MODEL = 'cnn-bn'
WARMUP = 200
STEPS_PER_EPOCH = 60000 // harness.NUM_WORKERS // harness.BATCH  # 234
#: optimizer -> (label, bench_worker arguments)
OPTIMIZERS = {
    'sgd': ('SGD (lr 0.05, momentum 0.9, wd 1e-4)',
            ['--optimizer', 'sgd', '--lr', '0.05', '--momentum', '0.9', '--wd', '1e-4']),
    'adam': ('Adam (lr 1e-3)', ['--optimizer', 'adam', '--lr', '0.001', '--wd', '0']),
}
METHODS = harness.methods('sync', 'k4', 'k8', 'k16', 'sgd-k4', 'k4-aux', 'k8-aux',
                          'k4-ternary-pull-int8', 'k4-fv', 'k8-fv', 'k16-fv',
                          'k4-ternary-pull-int8-fv', 'drift-k4', 'drift-k8', 'drift-k16',
                          'k4-int8-pull-int8', 'k4-int4-pull-int8', 'k8-ternary-pull-int8')
#: method -> (matplotlib colour, line style) of accuracy.png; one for every method
PLOT_STYLES = {'sync': ('C3', '--'), 'k4': ('C0', '-'), 'k8': ('C1', '-'), 'k16': ('C2', '-'),
               'sgd-k4': ('C7', '-.'), 'k4-aux': ('C0', ':'), 'k8-aux': ('C1', ':'),
               'k4-ternary-pull-int8': ('C4', '-'), 'k4-fv': ('C0', '--'),
               'k8-fv': ('C1', '--'), 'k16-fv': ('C2', '--'),
               'k4-ternary-pull-int8-fv': ('C4', '--'), 'drift-k4': ('C0', '-.'),
               'drift-k8': ('C1', '-.'), 'drift-k16': ('C2', '-.'),
               'k4-int8-pull-int8': ('C5', '-'), 'k4-int4-pull-int8': ('C6', '-'),
               'k8-ternary-pull-int8': ('C4', ':')}
TARGETS = ('k4', 'k8')  # within TARGET_POINTS of dist_sync
TARGET_POINTS = 0.5
DEFAULT_RUNS = ('sgd/sync,sgd/k4,sgd/k8,adam/sync,adam/k4,adam/k8,'
                'sgd/k16,sgd/sgd-k4,adam/k16,adam/sgd-k4')


def parse_args(argv=None):
    parser = harness.parser(__doc__)
    parser.add_argument('--out', default=os.path.join(REPO, 'docs', 'benchmarks', 'cnn'),
                        help='results folder (default: %(default)s)')
    parser.add_argument('--scratch', default=os.path.join(REPO, 'bench_out', 'cnn'),
                        help='logs and raw worker outputs (default: %(default)s)')
    parser.add_argument('--runs', default=DEFAULT_RUNS,
                        help='OPTIMIZER/METHOD pairs, in this order (default: %(default)s)')
    parser.add_argument('--seeds', default='1', help='(default: %(default)s)')
    parser.add_argument('--epochs', type=int, default=10, help='(default: %(default)s)')
    parser.add_argument('--data-dir', default='/usr/share/datasets/fashion-mnist')
    parser.add_argument('--include', action='append', default=[], metavar='FOLDER:RUNS',
                        help='also report the runs RUNS (OPTIMIZER/METHOD pairs, comma '
                        'separated) of the results folder FOLDER (relative to the repository); '
                        'repeatable; recorded in meta.json, so --report-only repeats it')
    parser.add_argument('--report-only', action='store_true',
                        help='no run: the report from the files in --out')
    args = parser.parse_args(argv)
    args.runs = [tuple(pair.split('/')) for pair in args.runs.split(',') if pair]
    for pair in args.runs:
        if len(pair) != 2 or pair[0] not in OPTIMIZERS or pair[1] not in METHODS:
            parser.error('--runs: %r is not OPTIMIZER/METHOD with OPTIMIZER one of %s and '
                         'METHOD one of %s' % ('/'.join(pair), ', '.join(OPTIMIZERS),
                                               ', '.join(METHODS)))
    args.seeds = [int(s) for s in args.seeds.split(',') if s]
    try:
        args.include = [parse_include(spec) for spec in args.include]
    except ValueError as err:
        parser.error(str(err))
    if args.epochs < 1:
        parser.error('--epochs must be at least 1, got %d' % args.epochs)
    return args


def _in_repo(folder):
    """`folder` relative to its repository's root (a results folder under docs/, also when
    it is written from a snapshot's checkout into another: rule 8)."""
    folder = os.path.abspath(folder)
    at = folder.rfind(os.sep + 'docs' + os.sep)
    return folder[at + 1:] if at >= 0 else os.path.relpath(folder, REPO)


def parse_include(spec):
    """'FOLDER:OPT/METHOD,...' -> [FOLDER, [[OPT, METHOD], ...]], checked."""
    folder, sep, pairs = spec.rpartition(':')
    pairs = [pair.split('/') for pair in pairs.split(',') if pair]
    if not sep or not pairs or any(len(p) != 2 or p[0] not in OPTIMIZERS or p[1] not in METHODS
                                   for p in pairs):
        raise ValueError('--include: %r is not FOLDER:OPTIMIZER/METHOD[,...]' % spec)
    if not os.path.isfile(os.path.join(REPO, folder, 'accuracy.csv')):
        raise ValueError('--include: %r has no accuracy.csv (FOLDER is relative to %s)'
                         % (folder, REPO))
    return [folder, pairs]


# -- runs ----------------------------------------------------------------------------------
def worker_args(optimizer, seed, args):
    """bench_worker's arguments after the method's."""
    return OPTIMIZERS[optimizer][1] + [
        '--model', MODEL, '--epochs', str(args.epochs), '--seed', str(seed), '--warmup-steps',
        str(WARMUP), '--eval-every', str(STEPS_PER_EPOCH), '--global-model', '--data-dir',
        args.data_dir]


def _per_epoch_loss(losses):
    return [sum(losses[i:i + STEPS_PER_EPOCH]) / len(losses[i:i + STEPS_PER_EPOCH])
            for i in range(0, len(losses), STEPS_PER_EPOCH)]


def run_one(optimizer, method, seed, args):
    """One job; returns (its row, its accuracy rows) and writes its per-run file."""
    name = '%s-%s-s%d' % (optimizer, method, seed)
    folder = os.path.join(args.scratch, name)
    extra = worker_args(optimizer, seed, args)
    # A 'sync' job is stock: none of its processes may have imported mxdelay (stock_check).
    code, results, monitor, info = harness.run_method(
        folder, METHODS[method], extra, 600 + args.epochs * STEPS_PER_EPOCH * 3.0)
    info['job_s'] = round(info['job_s'], 1)
    row = dict(optimizer=optimizer, method=method, seed=seed, exit=code, **info)
    evals, workers = [], []
    if code == 0:
        t0 = min(r['first'] for r in results)
        end = max(r['end'] for r in results) - t0
        if results[0]['steps_per_epoch'] != STEPS_PER_EPOCH:
            raise RuntimeError('%s: %d steps per epoch, expected %d' % (
                name, results[0]['steps_per_epoch'], STEPS_PER_EPOCH))
        row.update(train_s=round(end, 1), cpu_other=round(monitor.usage(t0, t0 + end)['other'], 3),
                   eval_s=round(results[0]['eval_s'], 1),
                   trained_parameters=results[0]['trained_parameters'])
        for record in results[0]['evals']:
            evals.append(dict(optimizer=optimizer, method=method, seed=seed,
                              epoch=record['step'] // STEPS_PER_EPOCH, step=record['step'],
                              test_acc=record['test_acc']))
        for r in results:
            workers.append({key: r[key] for key in (
                'rank', 'mode', 'model', 'optimizer', 'optimizer_params', 'local_rule', 'delay',
                'warmup_steps', 'global_model', 'aux_states', 'trained_parameters', 'seed',
                'batch_size', 'steps', 'steps_per_epoch', 'cpu_s')})
            workers[-1].update(loss_per_epoch=_per_epoch_loss(r['losses']),
                               loss_digest=hashlib.sha1(json.dumps(r['losses']).encode())
                               .hexdigest()[:12])
        _LOG.info('%s: %.0f s training (%.2f other cores); test acc per epoch %s; %s', name,
                  end, row['cpu_other'], ' '.join('%.4f' % e['test_acc'] for e in evals),
                  row['stock_check'])
    else:
        _LOG.error('%s FAILED (exit %s): see %s', name, code, folder)
    os.makedirs(os.path.join(args.out, 'runs'), exist_ok=True)
    report_lib.write_json(os.path.join(args.out, 'runs', name + '.json'), dict(
        row, worker_args=METHODS[method].args + extra, evals=evals, workers=workers,
        roles=harness.read_roles(folder)))
    return row, evals


def run_all(args, meta):
    rows, evals = [], []
    for seed in args.seeds:
        for optimizer, method in args.runs:
            row, run_evals = run_one(optimizer, method, seed, args)
            rows.append(row)
            evals += run_evals
            report_lib.write_csv(os.path.join(args.out, 'runs.csv'), rows)
            report_lib.write_csv(os.path.join(args.out, 'accuracy.csv'), evals)
            write_meta(args.out, meta)  # finished and load_after: as of the last run
    return rows


def write_meta(out, meta):
    report_lib.write_json(os.path.join(out, 'meta.json'), harness.finish_meta(meta))


# -- report --------------------------------------------------------------------------------
def _mean_acc(rows):
    """{epoch: mean test accuracy of `rows`}."""
    epochs = sorted({e['epoch'] for e in rows})
    return {ep: sum(e['test_acc'] for e in rows if e['epoch'] == ep)
            / sum(1 for e in rows if e['epoch'] == ep) for ep in epochs}


def summarize(evals):
    """{(optimizer, method): {'acc': {epoch: mean over seeds}, 'seeds': [...], ...}} and the
    gaps to dist_sync's mean over the same seeds (a method run on fewer seeds than dist_sync
    is compared with dist_sync's runs of those seeds only)."""
    summary = {}
    for optimizer in OPTIMIZERS:
        for method in METHODS:
            rows = [e for e in evals if e['optimizer'] == optimizer and e['method'] == method]
            if rows:
                summary[optimizer, method] = dict(acc=_mean_acc(rows),
                                                  seeds=sorted({e['seed'] for e in rows}))
    for (optimizer, method), entry in summary.items():
        base = summary.get((optimizer, 'sync'))
        if method == 'sync' or not base or not set(entry['seeds']) <= set(base['seeds']):
            continue
        base_acc = _mean_acc([e for e in evals if e['optimizer'] == optimizer and
                              e['method'] == 'sync' and e['seed'] in entry['seeds']])
        gaps = {ep: 100 * (entry['acc'][ep] - base_acc[ep])
                for ep in entry['acc'] if ep in base_acc}
        if gaps:
            worst = min(gaps, key=lambda ep: (gaps[ep], ep))
            entry.update(gaps=gaps, worst_epoch=worst, worst_points=gaps[worst],
                         base_acc=base_acc)
    return summary


def _acc(entry, epoch):
    value = entry['acc'].get(epoch)
    return '-' if value is None else '%.4f' % value


def _method_label(method, entry, seeds):
    """The method's label, with its seeds where they are not all of the folder's (its gaps
    are then to dist_sync's runs of those seeds)."""
    label = METHODS[method].label
    if entry['seeds'] != seeds:
        label += ' (seed%s %s)' % ('s' if len(entry['seeds']) > 1 else '',
                                   ', '.join(str(s) for s in entry['seeds']))
    return label


def write_markdown(out, summary, runs, meta):
    seeds = sorted({r['seed'] for r in runs})
    params = sorted({r['trained_parameters'] for r in runs if 'trained_parameters' in r})
    done = {(r['optimizer'], r['method'], r['seed']) for r in runs if r['folder'] == '.'}
    borrowed = {}
    for r in runs:
        if r['folder'] != '.':
            borrowed.setdefault(r['folder'], []).append('%s/%s seed %d' % (
                r['optimizer'], r['method'], r['seed']))
    planned = meta['settings'].get('seeds') or seeds  # older meta files: what ran
    missing = ['%s/%s seed %d' % (o, m, seed) for seed in planned
               for o, m in meta['settings']['runs'] if (o, m, seed) not in done]
    lines = ['# Accuracy of a BatchNorm CNN: SGD with momentum and Adam, dist_sync vs delayed',
             '', 'Generated by `python benchmarks/accuracy_cnn.py` from the files in this folder; '
             'do not edit. How the runs are made: the docstring of `benchmarks/accuracy_cnn.py`; '
             'the rules: %s.' % report_lib.rules_link(out), '',
             '- %s' % provenance.meta_line(meta),
             '- Procedure, fixed before the run: Fashion-MNIST, CNN `cnn-bn` of the example '
             '(conv3x3-32 + BN + ReLU + maxpool, conv3x3-64 + BN + ReLU + maxpool, dense 128 + '
             'ReLU, dense 10; hybridized; %s trained parameters), 2 workers + 1 server on '
             'loopback, batch 128 per worker, %d epochs of %d steps, seed%s %s%s, warm-up %d '
             'steps, run order `%s`.' % (
                 ', '.join('{:,}'.format(p) for p in params) or '?', meta['settings']['epochs'],
                 STEPS_PER_EPOCH, 's' if len(seeds) > 1 else '',
                 ', '.join(str(s) for s in seeds), '' if len(seeds) > 1 else (
                     ' (one seed: a difference of a few tenths of a point between two methods '
                     'is within what another seed would change)'), WARMUP,
                 ','.join('/'.join(p) for p in meta['settings']['runs'])),
             '- Planned but not run (the invocation was stopped before them): %s.' % (
                 ', '.join(missing) or 'none'),
             '- Runs of other results folders reported here (`--include`; with 2 workers a run '
             'repeats bit for bit, so a run made again would give the same figures): %s.' % (
                 '; '.join('[%s](%s): %s' % (f, os.path.relpath(f, _in_repo(out)),
                                             ', '.join(names))
                           for f, names in borrowed.items()) or 'none'),
             '- Test accuracy of the global model on the 10000 test images after every epoch: '
             'delayed methods call `trainer.sync_weights()` on every worker at each epoch end '
             '(so their next local steps start from the global weights), then worker 0 copies '
             "its weights; dist_sync: worker 0's weights, which are the global ones. BatchNorm's "
             'running mean and variance are not trained parameters: each worker keeps its own, '
             "with dist_sync as with the delayed methods; the evaluated model has worker 0's.",
             '- Optimizers on the servers: %s. Delayed methods: rule `mirror` (a local copy of '
             "the servers' optimizer, docs/design.md §1.4) unless said; the literal rule "
             "`local_rule='sgd'` steps `w' := w' - lr*(g + wd*w')` locally with the optimizer's "
             'lr (0.05 for SGD, 1e-3 for Adam).' % '; '.join(v[0] for v in OPTIMIZERS.values()),
             '', '## Summary', '',
             'Accuracy after epochs 5 and 10; minus dist_sync in points; the largest shortfall '
             'against dist_sync at any epoch (negative: below dist_sync), with its epoch. '
             'Targets: k=4 and k=8 within %.1f points of dist_sync.' % TARGET_POINTS, '',
             '| optimizer | method | epoch 5 | epoch 10 | epoch 10 minus dist_sync | largest '
             'shortfall, any epoch | within %.1f at epoch 10 | within %.1f at every epoch |'
             % (TARGET_POINTS, TARGET_POINTS), '|---|---|---:|---:|---:|---:|---|---|']
    for optimizer, (label, _) in OPTIMIZERS.items():
        for method in METHODS:
            entry = summary.get((optimizer, method))
            if not entry:
                continue
            last = max(entry['acc'])
            if method == 'sync':
                gap_cells = ['-', '-', '-', '-']
            elif 'gaps' in entry:
                gap_cells = ['%+.2f' % entry['gaps'].get(last, float('nan')),
                             '%+.2f (epoch %d)' % (entry['worst_points'], entry['worst_epoch']),
                             'yes' if entry['gaps'].get(last, -1e9) >= -TARGET_POINTS else 'no',
                             'yes' if entry['worst_points'] >= -TARGET_POINTS else 'no']
            else:
                gap_cells = ['-'] * 4
            lines.append('| %s | %s | %s | %s | %s |' % (
                label, _method_label(method, entry, seeds), _acc(entry, 5), _acc(entry, last),
                ' | '.join(gap_cells)))
    for optimizer, (label, _) in OPTIMIZERS.items():
        methods = [m for m in METHODS if (optimizer, m) in summary]
        if not methods:
            continue
        lines += ['', '## %s: test accuracy per epoch' % label, ''] + report_lib.table(
            ['epoch'] + [_method_label(m, summary[optimizer, m], seeds) for m in methods], [
                [epoch] + [
                _acc(summary[optimizer, m], epoch) + ('' if gap is None else ' (%+.2f)' % gap)
                for m in methods
                for gap in [summary[optimizer, m].get('gaps', {}).get(epoch)]]
                for epoch in sorted(summary[optimizer, methods[0]]['acc'])],
            'r' * (len(methods) + 1))
    lines += ['', '## Runs', '',
              'Training wall time (evaluation excluded; the machine is shared, so wall times are '
              'not a speed comparison: see the time-to-accuracy benchmark), the CPU other '
              'processes used during the run (cores; *noisy* above %g: it changes wall time, '
              'not accuracy), and the stock check.' % report_lib.NOISE_CORES, '']
    lines += report_lib.table(
        'optimizer | method | seed | folder | exit | training s | other cores | load before/after '
        '| stock check | MXNET_* seen by the workers', [[
            r['optimizer'], METHODS[r['method']].label, r['seed'],
            'this' if r['folder'] == '.' else r['folder'], r['exit'],
            r.get('train_s', '-'), '%s%s' % (r.get('cpu_other', '-'), ' (noisy)' if r.get(
                'cpu_other', 0) > report_lib.NOISE_CORES else ''),
            '%.2f / %.2f' % (r['load_before'], r['load_after']), r['stock_check'],
            r.get('worker_env', '')] for r in runs], 'llrlrrrlll')
    report_lib.write_lines(os.path.join(out, 'results.md'), lines)


def readme_rows(summary, runs, out):
    """The rows of README.md's results table for the results in `out` (results_page.py
    reads them)."""
    seeds = sorted({str(r['seed']) for r in runs})
    seeds = 'seed%s %s' % ('s' if len(seeds) > 1 else '', ', '.join(seeds))
    path = os.path.join(_in_repo(out), 'results.md')
    link = '[%s](%s)' % (os.path.relpath(path, os.path.join('docs', 'benchmarks')), path)
    rows = []
    for optimizer, (label, _) in OPTIMIZERS.items():
        methods = [m for m in METHODS if (optimizer, m) in summary]
        if 'sync' not in methods:
            continue
        for epoch in (5, 10):
            cells = ['%s %s' % ('`dist_sync`' if m == 'sync' else METHODS[m].label,
                                _acc(summary[optimizer, m], epoch)) for m in methods]
            rows.append('| CNN with BatchNorm, %s: test accuracy after %d epochs | %s | global '
                        'model; %s; rule `mirror` unless said, warm-up 200; loopback, '
                        'real runs | %s |' % (label, epoch, '; '.join(cells), seeds, link))
        gaps = ['%s %+.2f (epoch %d)' % (METHODS[m].label, summary[optimizer, m]['worst_points'],
                                         summary[optimizer, m]['worst_epoch'])
                for m in methods if 'worst_points' in summary[optimizer, m]]
        rows.append('| CNN with BatchNorm, %s: largest shortfall against `dist_sync`, any epoch, '
                    'in points | %s | epochs 1-10; the target for k=4 and k=8 is %.1f | %s |'
                    % (label, '; '.join(gaps), TARGET_POINTS, link))
    return rows


def plot(path, summary):
    plt = report_lib.pyplot()
    optimizers = [o for o in OPTIMIZERS if any(key[0] == o for key in summary)]
    fig, axes = plt.subplots(1, len(optimizers), figsize=(max(8.0, 6.4 * len(optimizers)), 4.8),
                             squeeze=False)
    for ax, optimizer in zip(axes[0], optimizers):
        label = OPTIMIZERS[optimizer][0]
        shown, literal = [], []
        seeds = sorted({s for key, entry in summary.items() if key[0] == optimizer
                        for s in entry['seeds']})
        subsets = set()
        for method in METHODS:
            entry = summary.get((optimizer, method))
            if not entry:
                continue
            epochs = sorted(entry['acc'])
            acc = [entry['acc'][e] for e in epochs]
            color, style = PLOT_STYLES[method]
            ax.plot(epochs, acc, marker='o', ms=4, color=color, ls=style,
                    label='%s: %.4f' % (_method_label(method, entry, seeds), acc[-1]))
            (literal if method == 'sgd-k4' else shown).extend(acc)
            if entry['seeds'] != seeds and 'base_acc' in entry:
                subsets.add((tuple(entry['seeds']), tuple(sorted(entry['base_acc'].items()))))
        # dist_sync over the seeds of a method run on fewer seeds: what its gaps compare with
        for subset, base in sorted(subsets):
            ax.plot([e for e, _ in base], [a for _, a in base], color='0.55', ls=':', lw=1,
                    label='dist_sync, seed%s %s: %.4f' % ('s' if len(subset) > 1 else '',
                                                          ', '.join(map(str, subset)), base[-1][1]))
            shown.extend(a for _, a in base)
        title = label
        if shown:
            # The literal rule may fall far below: the scale is set by the others.
            ax.set_ylim(min(shown) - 0.01, max(shown) + 0.005)
            if literal and min(literal) < min(shown) - 0.01:
                title += " (the literal rule is partly below the scale)"
        ax.set_title(title, fontsize=10)
        ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
        ax.set_xlabel('epoch')
        ax.set_ylabel('test accuracy, global model')
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc='lower right', title='epoch-10 accuracy', title_fontsize=8)
    fig.suptitle('Fashion-MNIST CNN with BatchNorm, 2 workers, batch 128 each, warm-up 200')
    report_lib.save(fig, path, 110)


def read_results(out, include):
    """The accuracy rows and run rows of `out` and of the runs `include` names in other
    folders (rows with a 'folder' key: '.' for `out`). A run (optimizer, method, seed) found
    in two folders must have the same accuracies in both (with 2 workers a run repeats bit
    for bit); it is reported once, from the first."""
    evals, runs, seen = [], [], {}
    for folder, pairs in [['.', None]] + [list(i) for i in include]:
        path = out if folder == '.' else os.path.join(REPO, folder)
        wanted = None if pairs is None else {tuple(p) for p in pairs}
        folder_evals = report_lib.read_csv(os.path.join(path, 'accuracy.csv'))
        for run in report_lib.read_csv(os.path.join(path, 'runs.csv')):
            key = (run['optimizer'], run['method'], run['seed'])
            if wanted is not None and (key[:2] not in wanted or run['exit'] != 0):
                continue
            acc = [e['test_acc'] for e in folder_evals
                   if (e['optimizer'], e['method'], e['seed']) == key]
            if key in seen:
                if seen[key][1] != acc:
                    raise RuntimeError('%s/%s seed %d differs between %s and %s: %s vs %s' % (
                        key + (seen[key][0], folder, seen[key][1], acc)))
                continue
            seen[key] = (folder, acc)
            runs.append(dict(run, folder=folder))
            evals += [e for e in folder_evals
                      if (e['optimizer'], e['method'], e['seed']) == key]
    return evals, runs


def build_report(out):
    meta = report_lib.read_json(os.path.join(out, 'meta.json'))
    evals, runs = read_results(out, meta['settings'].get('include', []))
    summary = summarize(evals)
    write_markdown(out, summary, runs, meta)
    plot(os.path.join(out, 'accuracy.png'), summary)
    report_lib.write_lines(os.path.join(out, 'readme-rows.md'), [
        'Rows for the table of README.md\'s results section (generated by '
        '`python benchmarks/accuracy_cnn.py --report-only`):', ''] + (
            readme_rows(summary, runs, out) or ['']))


def main(argv=None):
    logging.basicConfig(level=logging.INFO, format='%(asctime)s %(message)s', datefmt='%H:%M:%S')
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if not args.report_only:
        os.makedirs(args.scratch, exist_ok=True)
        meta = harness.start_meta(
            harness.command_line('python benchmarks/accuracy_cnn.py', argv), settings={
                'runs': args.runs, 'seeds': args.seeds, 'epochs': args.epochs, 'model': MODEL,
                'include': args.include,
                'warmup': WARMUP, 'optimizers': {k: v[1] for k, v in OPTIMIZERS.items()},
                'methods': {k: v.args for k, v in METHODS.items()}})
        _LOG.info('%s', meta['command'])
        write_meta(args.out, meta)
        # A stop signal ends the running job (Job.run stops its launcher, which stops its
        # roles); the files of the runs made so far stay, and the report is written from them.
        with harness.interruptible():
            try:
                rows = run_all(args, meta)
            except harness.Interrupted as stop:
                _LOG.error('stopped by %s; the running job is stopped', stop)
                if os.path.exists(os.path.join(args.out, 'runs.csv')):
                    build_report(args.out)
                return 128 + stop.signum
        if any(row['exit'] != 0 for row in rows):
            build_report(args.out)
            return 1
    build_report(args.out)
    _LOG.info('wrote %s', os.path.join(args.out, 'results.md'))
    return 0


if __name__ == '__main__':
    sys.exit(main())
