"""Does mxdelay's k-step delayed update pay? Throughput and accuracy, side by side.

One invocation runs, on the same model, data and seed (Fashion-MNIST MLP 784-1024-1024-10,
batch 128 per worker, 2 workers + 1 server, ``OMP_NUM_THREADS=1`` in every process, SGD lr
0.05 momentum 0.9):

- ``compute``: the compute-only bound, the same 2 worker processes training at the same
  time with ``kvstore=None`` (no communication, no server);
- ``sync``: stock ``gluon.Trainer`` on MXNet's native ``dist_sync`` (stock server);
- ``k1`` ``k2`` ``k4`` ``k8``: ``mxdelay.DelayedTrainer`` on ``'dist_delay'`` with that
  delay (rule ``'mirror'``);

under these networks (``--networks``):

- ``loopback``: every process on this machine's loopback (``mxdelay-launch`` local mode);
- ``jitter``: the same, and before every step each worker sleeps, with probability 0.3,
  a random 0-40 ms (``--jitter``);
- ``1gbit`` and ``100mbit``: every node (scheduler, server, worker 0, worker 1) in a network
  namespace of its own, linked to a bridge by a veth pair shaped with ``tc tbf`` to that
  rate in each direction (``benchmarks/netns.py``; ``mxdelay-launch --launcher netns``).
  They need root; without it they are skipped, with a message;
- ``jitter-1gbit`` (only when asked for): ``1gbit`` with the jitter of ``jitter``.

Throughput runs (``benchmarks/bench_worker.py``): each run skips the warm-up and the switch
step (``--warmup`` steps + 1: 200 + 1 on loopback, fewer on the slow shaped links, where
only the delayed phase's throughput matters) and times the next ``--steps`` steps;
``sync`` skips and times the same steps, and so does ``compute`` on loopback (it does not
use the network: it takes loopback's steps on every network). Job throughput is 2 x steps x 128
samples over the time from the first worker's window start to the last one's end. The
methods run interleaved in ``--rounds`` rounds (every other round in reverse order, and the
two loopback networks interleaved with each other), so that slow drifts of the machine hit
all alike; tables report medians and each ratio to ``sync`` and to ``compute`` of the same
network. During every run the CPU time of each role and of the whole machine is sampled
(``benchmarks/cpu_monitor.py``), to show where the time goes.

Accuracy runs (``examples/train_fashion_mnist.py``, loopback, ``--epochs`` 10, warm-up 200):
stock ``--trainer sync``, delayed ``'mirror'`` with k=4 and k=8, and the patent's literal
``'sgd'`` rule with k=4; test accuracy after every epoch.

Output, in ``--out`` (default ``bench_out/``): ``results.md`` (every table, the target
verdicts), ``runs.csv`` (every run), ``throughput.csv``, ``accuracy.csv``, ``cpu.csv``,
``throughput.png``, ``accuracy.png``, and ``runs/`` with every run's logs and raw numbers.

Every namespace created is deleted at the end, also on failure, SIGINT, SIGTERM or SIGHUP
(a second signal during the clean-up is ignored); so is every process started.

Quick check (about 3 minutes)::

    python benchmarks/benchmark.py --networks loopback,1gbit --methods compute,sync,k4 \\
        --rounds 1 --steps 40 --warmup 10 --accuracy sync,mirror-k4 --epochs 1 \\
        --accuracy-steps 60 --out bench_out/quick

The full benchmark (about 40 minutes on 2 cores, more when noisy runs are repeated)::

    python benchmarks/benchmark.py
"""
import argparse
import contextlib
import datetime
import json
import logging
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time

import harness
import provenance
import netns
import report

_LOG = logging.getLogger('benchmark')

REPO = harness.REPO
NUM_WORKERS, BATCH = harness.NUM_WORKERS, harness.BATCH
WORKER = harness.WORKER
EXAMPLE = os.path.join(REPO, 'examples', 'train_fashion_mnist.py')

#: name -> (label, bench_worker arguments)
METHODS = {name: method.relabel('delayed ' + method.label) if method.delay else method
           for name, method in harness.methods('compute', 'sync', 'k1', 'k2', 'k4', 'k8').items()}

#: name -> settings. `group`: networks of one group share their set-up and are interleaved.
#: warmup/steps: defaults chosen so that the full benchmark takes about 40 minutes; a
#: shaped run's step is communication-bound and steady, so fewer steps measure it as well.
#: The timed steps are a multiple of 8, so that every k's window holds whole pull periods.
NETWORKS = {name: dict(harness.NETWORKS[name]._asdict(), group=group, warmup=warmup,
                      steps=steps, step_bound=bound)
            for name, group, warmup, steps, bound in (
                ('loopback', 'loopback', 200, 304, 1.0), ('jitter', 'loopback', 200, 304, 1.0),
                ('1gbit', '1gbit', 20, 80, 2.0), ('100mbit', '100mbit', 3, 8, 10.0),
                # Not run by default: jitter where the CPU is not the bottleneck (README).
                ('jitter-1gbit', '1gbit', 20, 80, 2.0))}
DEFAULT_NETWORKS = ('loopback', 'jitter', '1gbit', '100mbit')

#: name -> (label, train_fashion_mnist arguments)
ACCURACY = {
    # The example imports mxdelay first: its sync job runs on mxdelay's servers (not stock).
    # The stock baseline's accuracy over seeds: benchmarks/tta.py --part full.
    'sync': ('dist_sync (example: mxdelay\'s servers)', ['--trainer', 'sync']),
    'mirror-k4': ("delayed k=4 'mirror'", ['--trainer', 'delayed', '--delay', '4',
                                          '--local-rule', 'mirror']),
    'mirror-k8': ("delayed k=8 'mirror'", ['--trainer', 'delayed', '--delay', '8',
                                          '--local-rule', 'mirror']),
    'sgd-k4': ("delayed k=4 'sgd' (literal)", ['--trainer', 'delayed', '--delay', '4',
                                              '--local-rule', 'sgd']),
}


def parse_args(argv=None):
    parser = harness.parser(__doc__, epilog='Networks: %s. Methods: %s. Accuracy runs: %s.' % (
            ', '.join(NETWORKS), ', '.join(METHODS), ', '.join(ACCURACY)))
    parser.add_argument('--out', default=os.path.join(REPO, 'bench_out'),
                        help='output folder (default: %(default)s)')
    parser.add_argument('--networks', default=','.join(DEFAULT_NETWORKS),
                        type=harness.names(NETWORKS),
                        help='comma-separated (default: %(default)s)')
    parser.add_argument('--methods', default=','.join(METHODS),
                        type=harness.names(METHODS),
                        help='comma-separated throughput methods (default: all)')
    parser.add_argument('--rounds', type=int, default=3,
                        help='rounds over all methods per network (default: %(default)s)')
    parser.add_argument('--steps', type=int,
                        help='timed steps of every throughput run (default: per network, %s)'
                             % ', '.join('%s %d' % (n, s['steps']) for n, s in NETWORKS.items()))
    parser.add_argument('--warmup', type=int,
                        help='warm-up steps of every throughput run (default: per network, %s)'
                             % ', '.join('%s %d' % (n, s['warmup']) for n, s in NETWORKS.items()))
    parser.add_argument('--retries', type=int, default=1,
                        help='repeat a noisy throughput run (other processes used more than '
                             '%g cores) up to this many times (default: %%(default)s)'
                             % report.NOISE_CORES)
    parser.add_argument('--report-only', action='store_true',
                        help='only write the report again from the files in --out')
    parser.add_argument('--jitter', default='0.3,40', metavar='PROB,MAX_MS',
                        help='the jitter network: per step and worker, sleep 0..MAX_MS ms with '
                             'probability PROB (default: %(default)s)')
    parser.add_argument('--accuracy', default=','.join(ACCURACY),
                        type=harness.names(ACCURACY),
                        help="comma-separated accuracy runs, '' for none (default: all)")
    parser.add_argument('--epochs', type=int, default=10,
                        help='epochs of every accuracy run (default: %(default)s)')
    parser.add_argument('--accuracy-warmup', type=int, default=200,
                        help='warm-up steps of the delayed accuracy runs (default: %(default)s)')
    parser.add_argument('--accuracy-steps', type=int,
                        help='accuracy runs: at most this many steps per epoch (quick checks)')
    parser.add_argument('--data-dir', default='/usr/share/datasets/fashion-mnist')
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.epochs < 1:
        parser.error('--rounds and --epochs must be at least 1')
    for name in ('steps', 'warmup'):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error('--%s must be at least 1' % name)
    return args


def _launcher(network, hostfile, timeout, num_workers=NUM_WORKERS, num_servers=1):
    """The launcher's argv up to and including ``--`` (harness.Job's)."""
    return harness.Job([], timeout, num_workers, num_servers,
                       hostfile if network['rate'] else None).argv


# -- throughput ------------------------------------------------------------------------
def run_throughput(args, net_name, network, method, round_index, hostfile, attempt=0):
    """Run one throughput job; return its row for runs.csv."""
    # Compute-only does not depend on the network: it takes loopback's (longer) window
    # everywhere, which a slow network's few steps would measure poorly.
    steps_of = NETWORKS['loopback'] if method == 'compute' else network
    warmup = args.warmup or steps_of['warmup']
    steps = args.steps or steps_of['steps']
    folder = os.path.join(args.out, 'runs', run_name(net_name, method, round_index,
                                                           attempt))
    worker = [sys.executable, WORKER] + METHODS[method].args + [
        '--warmup-steps', str(warmup), '--steps', str(steps),
        '--data-dir', args.data_dir, '--jitter', args.jitter if network['jitter'] else '0,0']
    row = dict(network=net_name, method=method, round=round_index, attempt=attempt,
               warmup=warmup, steps=steps)
    row, _ = harness.run_window(row, folder, worker, hostfile if network['rate'] else None,
                                timeout=120 + (warmup + 1 + steps) * network['step_bound'],
                                compute=method == 'compute')
    return row


@contextlib.contextmanager
def _network(net_name, network):
    """Context: the set-up of a network; yields the hostfile (None for loopback)."""
    with harness.shaped_network(1 + 1 + NUM_WORKERS, network['rate']) as (net, hostfile):
        if net:
            _LOG.info('%s: namespaces %s, each link shaped to %s in both directions',
                      net_name, ', '.join(name for name, _ in net.nodes), network['rate'])
        yield hostfile


def run_all_throughput(args, rows, rows_path):
    """Run every throughput job, appending its row to `rows` (kept if interrupted)."""
    networks = list(args.networks)
    reason = netns.netns_available() if any(NETWORKS[n]['rate'] for n in networks) else None
    if reason:
        skipped = [n for n in networks if NETWORKS[n]['rate']]
        _LOG.warning('skipping the shaped networks %s: %s', ', '.join(skipped), reason)
        networks = [n for n in networks if not NETWORKS[n]['rate']]
    groups = {}  # networks of one group share a set-up and are interleaved
    for name in networks:
        groups.setdefault(NETWORKS[name]['group'], []).append(name)
    total = len(networks) * len(args.methods) * args.rounds
    done = 0
    for names in groups.values():
        with _network(names[0], NETWORKS[names[0]]) as hostfile:
            order = [(n, m) for m in args.methods for n in names]
            for round_index in range(1, args.rounds + 1):
                for net_name, method in harness.ordered(order, round_index):
                    done += 1
                    attempt = 0
                    while True:
                        row = run_throughput(args, net_name, NETWORKS[net_name], method,
                                             round_index, hostfile, attempt)
                        rows.append(row)
                        report.write_csv(rows_path, rows)
                        _log_run(row, '[%d/%d]' % (done, total))
                        if 'error' in row or not report.is_noisy(row) or attempt == args.retries:
                            break
                        attempt += 1
                        _LOG.warning('other processes used %.2f cores during that run: '
                                     'repeating it (attempt %d) in 10 s', row['cpu_other'],
                                     attempt + 1)
                        time.sleep(10)


def _log_run(row, counter):
    what = '%s %s %s round %d%s' % (counter, row['network'], row['method'], row['round'],
                                    ' attempt %d' % (row['attempt'] + 1) if row['attempt'] else '')
    if 'error' in row:
        _LOG.error('%s FAILED: %s', what, row['error'])
    else:
        _LOG.info('%s: %.0f samples/s (%.1f ms/step); cores: workers %.2f server %.2f other '
                  '%.2f; load %.2f', what, row['samples_per_s'], row['ms_per_step'],
                  row['cpu_workers'], row['cpu_server'], row['cpu_other'], row['load_before'])


# -- accuracy --------------------------------------------------------------------------
def run_accuracy(args, name):
    folder = os.path.join(args.out, 'runs', 'accuracy-%s' % name)
    os.makedirs(folder, exist_ok=True)
    metrics = os.path.join(folder, 'metrics.jsonl')
    if os.path.exists(metrics):
        os.remove(metrics)
    steps_per_epoch = args.accuracy_steps or 60000 // NUM_WORKERS // BATCH
    timeout = 300 + args.epochs * steps_per_epoch * 1.0
    argv = _launcher(NETWORKS['loopback'], None, timeout) + [
        sys.executable, EXAMPLE, '--epochs', str(args.epochs), '--seed', '1',
        '--warmup-steps', str(args.accuracy_warmup), '--metrics-file', metrics, '--no-progress',
        '--data-dir', args.data_dir] + ACCURACY[name][1]
    if args.accuracy_steps:
        argv += ['--max-steps-per-epoch', str(args.accuracy_steps)]
    started = time.time()
    with harness.started([argv], os.path.join(folder, 'log.txt')) as popens:
        codes = harness.wait_all(popens, timeout + 30)
    records = []
    if os.path.exists(metrics):
        with open(metrics, encoding='utf-8') as src:
            records = [json.loads(line) for line in src if line.strip()]
    rows = [dict(method=name, epoch=r['epoch'], test_acc=r['test_acc'], loss=r['loss'],
                 train_acc=r['train_acc'], samples_per_s=r['samples_per_s'],
                 time_s=r['time']) for r in records]
    if codes != [0]:
        _LOG.error('accuracy %s FAILED (exit %s); see %s', name, codes[0],
                   os.path.join(folder, 'log.txt'))
        rows.append(dict(method=name, error='exit %s' % codes[0]))
    else:
        _LOG.info('accuracy %s: test accuracy %s (%.0f s)', name,
                  ' '.join('%.4f' % r['test_acc'] for r in records), time.time() - started)
    return rows


# -- report ------------------------------------------------------------------------------
_fmt = report.fmt

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


def run_name(network, method, round_index, attempt=0):
    """The folder name of one throughput run under ``runs/``."""
    return '%s-%s-r%d%s' % (network, method, round_index, '-%d' % attempt if attempt else '')


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
        runs = [run for run in all_runs if not report.is_noisy(run)] or all_runs
        rates = [run['samples_per_s'] for run in runs]
        summary[key] = dict(
            network=key[0], method=key[1], runs=len(runs), excluded=len(all_runs) - len(runs),
            noisy=all(report.is_noisy(run) for run in runs), samples_per_s=_median(rates),
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
    return '\n'.join(report.table(header, rows))


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


#: network with jitter -> the same network without
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
                'too short.' % (args.rounds, settings, report.NOISE_CORES), '']
        for network in present_networks:
            items = [(m, summary[network, m]) for m in present_methods if (network, m) in summary]
            out += ['### %s' % networks[network]['label'], '', _table(
                ['method', 'samples/s', 'ms/step', 'x dist_sync', 'x compute-only',
                 'steady ms/step', 'steady x dist_sync'],
                [[methods[m].label, '%.0f%s [%s%s]' % (
                    item['samples_per_s'], ' (noisy)' if item['noisy'] else '',
                    ', '.join('%.0f' % v for v in item['values']),
                    '; %d noisy left out' % item['excluded'] if item['excluded'] else ''),
                  '%.1f' % item['ms_per_step'], _fmt(item['x_sync'], '%.2fx'),
                  _fmt(item['x_compute'], '%.2fx'), _fmt(item['steady_ms'], '%.1f'),
                  _fmt(item['steady_x_sync'], '%.2fx')] for m, item in items]), '']
        out += ['### Where the CPU goes', '',
                'Cores used on average during the timed window (medians over rounds): the two '
                'workers together, the server, the scheduler + launcher + benchmark driver, and '
                "everything else on the machine ('other': other users' processes, and kernel "
                'work not charged to a process of the job, such as bridged packets). '
                'The machine has %d cores.' % meta['nproc'], '']
        out += [_table(['network', 'method', 'workers', 'server', 'sched+launcher', 'other',
                        'idle', 'load before'], [
            [networks[network]['label'], methods[method].label] + ['%.2f' % item[k] for k in (
                'cpu_workers', 'cpu_server', 'cpu_launcher', 'cpu_other')] + [
                    '%.2f' % max(0.0, meta['nproc'] - (item['cpu_workers'] + item['cpu_server']
                                                       + item['cpu_other'] + item['cpu_launcher'])),
                    '%.2f' % item['load']]
            for network in present_networks for method in present_methods
            for item in [summary.get((network, method))] if item]), '']
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
                       [[epoch] + [_fmt(by_method[name].get(epoch, {}).get('test_acc'), '%.4f')
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
    plt = report.pyplot()
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
    report.save(fig, path, 110)
    return True


def plot_accuracy(path, accuracy, accuracy_runs):
    plt = report.pyplot()
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
    report.save(fig, path, 110)
    return True


def write_all(out, meta, rows, accuracy, methods, networks, accuracy_runs, args):
    """Write results.md, the CSV files and the plots into `out`."""
    for row in rows:
        if 'error' not in row and 'steady_ms_per_step' not in row:
            method = row['method']
            row['steady_ms_per_step'] = report.steady_ms_per_step(
                os.path.join(out, 'runs', run_name(row['network'], method, row['round'],
                                                   row.get('attempt', 0))),
                int(method[1:]) if method.startswith('k') else 1)
    if rows:
        report.write_csv(os.path.join(out, 'runs.csv'), rows)
        summary = summarize(rows)
        report.write_csv(os.path.join(out, 'throughput.csv'),
                  [{k: v for k, v in item.items() if k != 'values'} for item in summary.values()])
        plot_throughput(os.path.join(out, 'throughput.png'), rows, methods, networks)
    if accuracy:
        report.write_csv(os.path.join(out, 'accuracy.csv'), accuracy)
        plot_accuracy(os.path.join(out, 'accuracy.png'), accuracy, accuracy_runs)
    with open(os.path.join(out, 'results.md'), 'w', encoding='utf-8') as dst:
        dst.write(markdown(meta, rows, accuracy, methods, networks, accuracy_runs, args))


# -- main ------------------------------------------------------------------------------
def _machine():
    return dict(nproc=os.cpu_count(), cpu=platform.processor() or provenance.cpu_model(),
                kernel=platform.release(), python=platform.python_version())


def _code_version():
    """The commit, and the library files that differ from it (the runs import them anew)."""
    return '%s%s' % (provenance.git('rev-parse', '--short', 'HEAD') or 'unknown', ''.join(
        ' +modified ' + line[3:] for line in provenance.git(
            'status', '--porcelain', '--', 'mxdelay', 'kvstore_ext', 'examples').splitlines()))


def main(argv=None):
    logging.basicConfig(level=logging.INFO, format='%(asctime)s %(message)s', datefmt='%H:%M:%S')
    args = parse_args(argv)
    args.out = os.path.abspath(args.out)
    os.makedirs(args.out, exist_ok=True)
    meta_path = os.path.join(args.out, 'meta.json')
    if args.report_only:
        meta = report.read_json(meta_path)
        rows, accuracy = [], []
        for name, target in (('runs.csv', rows), ('accuracy.csv', accuracy)):
            if os.path.exists(os.path.join(args.out, name)):
                target += report.read_csv(os.path.join(args.out, name))
        write_all(args.out, meta, rows, accuracy, METHODS, NETWORKS, ACCURACY,
                         argparse.Namespace(**meta['settings']))
        _LOG.info('wrote %s', os.path.join(args.out, 'results.md'))
        return 0
    harness.handle_signals()
    if os.geteuid() == 0 and netns.netns_available() is None:
        stale = netns.remove_stale()
        if stale:
            _LOG.warning('deleted namespaces left by a killed benchmark: %s', ', '.join(stale))
    meta = dict(command=('python benchmarks/benchmark.py ' + shlex.join(
                    sys.argv[1:] if argv is None else argv)).strip(),
                started=datetime.datetime.now().astimezone().isoformat(timespec='seconds'),
                load_start=os.getloadavg(), code_start=_code_version(), **_machine(),
                settings={name: getattr(args, name) for name in (
                    'rounds', 'warmup', 'steps', 'jitter', 'epochs', 'accuracy_warmup',
                    'accuracy_steps', 'retries')})
    _LOG.info('benchmark: %s; output in %s', meta['command'], args.out)
    rows, accuracy, code = [], [], 0
    try:
        run_all_throughput(args, rows, os.path.join(args.out, 'runs.csv'))
        for name in args.accuracy:
            accuracy += run_accuracy(args, name)
            report.write_csv(os.path.join(args.out, 'accuracy.csv'), accuracy)
    except harness.Interrupted as stop:
        _LOG.error('stopped by %s; namespaces and processes cleaned up', stop)
        code = 128 + stop.signum
    finally:
        meta.update(finished=datetime.datetime.now().astimezone().isoformat(timespec='seconds'),
                    load_end=os.getloadavg(), code_end=_code_version())
        listed = subprocess.run(['ip', 'netns', 'list'], capture_output=True, text=True,
                                check=False).stdout.splitlines()
        left = [line.split()[0] for line in listed
                if line.startswith('%s%d-' % (netns.PREFIX, os.getpid()))]
        if left:
            _LOG.error('namespaces left behind: %s', left)
    report.write_json(meta_path, meta)
    if rows or accuracy:
        write_all(args.out, meta, rows, accuracy, METHODS, NETWORKS, ACCURACY, args)
        _LOG.info('wrote %s', os.path.join(args.out, 'results.md'))
    failed = [row for row in rows + accuracy if 'error' in row]
    return code or (1 if failed else 0)


if __name__ == '__main__':
    sys.exit(main())
