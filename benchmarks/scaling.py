"""How throughput scales with workers, servers and link rates: stock dist_sync, k=4, k=4 + fp16
(issue 13), k=4 + ternary + int8 pulls; issue 37's envelope (item 5).

Procedure (fixed before the run; the defaults below are the full run's):

- **Methods**, side by side in one invocation (``benchmarks/bench_worker.py``):
  ``sync``: stock ``gluon.Trainer`` on MXNet's native ``'dist_sync'``, no mxdelay in any
  process (every process checks and records it; ``stock_check`` column);
  ``k4``: ``mxdelay.DelayedTrainer`` on ``'dist_delay'``, k=4, rule ``'mirror'``;
  ``k4-fp16``: the same with ``compression_params={'type': 'fp16'}`` (float16 pushes);
  only when ``--methods`` names it, ``k4-ternary-pull-int8``: k=4 with ternary pushes and
  int8 pulls (issue 20's compressed configuration).
- **Models**: ``mlp``, the example's ``build_net('mlp')`` (784-1024-1024-10, 1.86M
  parameters), Fashion-MNIST shards, batch 128 per worker, SGD lr 0.05 momentum 0.9;
  ``resnet18``, Gluon's model zoo ``resnet18_v1(classes=10)`` (11.18M trained parameters)
  on *synthetic* data (8 fixed batches per worker of standard normal 3x32x32 images and
  uniform labels, seeded by seed and rank), batch 32 per worker, SGD lr 0.01 momentum 0.9
  (lr 0.05 makes the loss on random labels grow fast; throughput does not depend on it);
  only when ``--models`` names it, ``resnet50``, the model zoo's ``resnet50_v1(classes=10)``
  (23.55M trained parameters) on the same synthetic data, batch 8 per worker, SGD lr 0.01
  momentum 0.9 (issue 37's envelope). Seed 1, ``OMP_NUM_THREADS=1`` in every process.
- **Grid**: for each model, each link rate in ``--rate`` (1gbit; several comma-separated,
  e.g. ``10gbit,1gbit``), workers N in ``--workers`` (2,4,8) x servers S in ``--servers``
  (1,2,4). Every node (scheduler, each server, each worker) runs in a network namespace of
  its own with its own link to a bridge, shaped with ``tc tbf`` to the rate in each
  direction (``benchmarks/netns.py``: the bucket holds 2 ms at the rate, at least 64 KiB,
  so that it does not cap a fast link; ``mxdelay/launcher.py --launcher netns``); a fresh
  network of 1 + S + N nodes per configuration (model, rate, N, S). Right after it is
  built, one TCP stream from the first server to the first worker for 2 s measures what
  the link carries (``netns.measure_rate``: payload bits per second; on a busy machine also
  what its CPU lets through), recorded in every row (``link_gbit``).
- **Runs**: each run skips ``--warmup`` (3) synchronous steps and the switch step (the
  same for every method) and times the next ``--steps`` steps (mlp 40, resnet18 8,
  resnet50 20: whole k=4 periods; resnet50's 20 hold the 3 periods after the first that the
  steady rate needs). Within a configuration the methods run in ``--rounds`` (1) rounds; round r
  of the c-th configuration (0-based, in the order model, rate, N, S) takes the methods in the
  order of ``--methods`` rotated left by c, reversed when r is even, so that slow drifts
  of the shared machine hit all alike and no method is always first. No run is repeated
  or dropped; a run during which processes outside the job used more than 0.25 cores
  (``cpu_other``) is flagged *noisy* (on shaped links the bridge's packet work is charged to
  no process, so it counts as other too).
- **Measures**, per run:
  samples/s = N x steps x batch over the window from the first worker's window start to
  the last worker's end (after ``nd.waitall()``: pushes still queued at the end count);
  *steady* samples/s (where the window holds at least 3 periods of 4 steps after the
  first): the slowest worker's rate between the ends of the same step of the period,
  leaving out the first period and the final drain (``report.steady_ms_per_step``);
  ratio to ``sync`` of the same configuration (model, rate, N, S), job and steady;
  scaling efficiency = samples/s(N) / (N/2 x samples/s(N=2)), same model, S and method;
  bytes per step per link: each node's bridge port counters (the peer of its ``eth0``:
  port receives = node sends), sampled every 0.25 s during the job and interpolated at the
  window's start and end, divided by the steps; the worker links' mean and the server
  links' mean, sends and receives separately (headers included). Each node's own ``eth0``
  counters (``ip -j -s link``, ``monitor.eth0_counters``) are read before and after the whole
  job and compared with its port's (``eth0_check``: the largest relative difference);
  server CPU seconds per round = the servers' CPU time in the window (all servers
  together; ``benchmarks/monitor.py``) over the steps;
  *byte floor* (``byte_floor``): the bytes per step through the busiest direction of a
  worker's link and of a server's (the role's mean link) over the rate, in ms, and the
  samples/s the slower of the two allows (N x batch per that time): what the links alone
  would allow, to set beside the measured rate;
  *cores per role* (``cpu_shares``): the cores each worker and each server used on average
  in the window (the role's CPU time from ``monitor.CpuMonitor`` over its processes);
  the load average before and after, and ``cpu_other`` (cores used by other processes).
- **Reports**: medians over rounds (with the range). ``--out``: ``runs.csv`` (every run),
  ``results.md`` (every run), ``meta.json`` (commit at start and end, command, machine,
  load), ``throughput.png`` (samples/s against N per method, a panel per model, rate and S);
  ``--summary`` (``docs/benchmarks/scaling/scaling.md``): the tables (samples/s beside the
  byte floor and the cores per role, per configuration and method) and the verdicts on the
  issues' targets that the grid holds (issue 13, 1gbit: ResNet-18 N=4 S=2: k4 >= 1.6x
  sync, k4-fp16 >= 2.5x sync; scaling efficiency N=2 -> 8 of k4 >= sync's, per model, rate
  and S; issue 37, steady samples/s: ResNet-50 N=2 S=1, k4-ternary-pull-int8 >= 1.0x sync
  at 10gbit and >= 3.0x at 1gbit). Raw per-run files go to ``--scratch``.

Every namespace and process is cleaned up, also on failure, SIGINT, SIGTERM or SIGHUP
(``harness.handle_signals``). Needs root.

Usage (root; from a snapshot of one commit, docs/benchmarks/README.md rule 8)::

    git worktree add --detach /tmp/pin-scaling HEAD
    cd /tmp/pin-scaling && PYTHONPATH=/tmp/pin-scaling python benchmarks/scaling.py \\
        --out /path/to/repo/docs/benchmarks/scaling \\
        --summary /path/to/repo/docs/benchmarks/scaling/scaling.md
    python benchmarks/scaling.py --report-only       # tables and plot again from runs.csv
    python benchmarks/scaling.py --report-only --compare docs/benchmarks/scaling/run2
                                                     # ... beside a second invocation's
    python benchmarks/scaling.py --smoke             # 12 short runs into bench_out/

Issue 37's envelope (docs/benchmarks/scaling/envelope/; from a snapshot as above)::

    python benchmarks/scaling.py --models resnet50,mlp --rate 10gbit,1gbit --workers 2 \\
        --servers 1 --methods sync,k4,k4-fp16,k4-ternary-pull-int8 --rounds 2 \\
        --out docs/benchmarks/scaling/envelope \\
        --summary docs/benchmarks/scaling/envelope/summary.md
"""
import argparse
import logging
import os
import statistics
import subprocess
import sys

import harness
from monitor import PortCounters, eth0_counters
import netns
import provenance
import report

__all__ = ['METHODS', 'MODELS', 'main']

_LOG = logging.getLogger('scaling')
REPO = harness.REPO

METHODS = harness.methods('sync', 'k4=mirror-k4', 'k4-fp16=mirror-k4-fp16',
                          'k4-ternary-pull-int8')
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
    'resnet50': dict(label='resnet50_v1(classes=10) (23.55M trained parameters in 193 tensors; 299 '
                           'with the BatchNorm statistics), '
                           'synthetic 3x32x32, batch 8',
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
SMOKE = ['--workers', '2,4', '--servers', '2', '--warmup', '2', '--steps', 'mlp=8,resnet18=4',
         '--out', os.path.join(REPO, 'bench_out', 'scaling-smoke'),
         '--summary', os.path.join(REPO, 'bench_out', 'scaling-smoke', 'scaling.md'),
         '--scratch', os.path.join(REPO, 'bench_out', 'scaling-smoke', 'runs')]


def _steps(text):
    steps = {name: spec['steps'] for name, spec in MODELS.items()}
    for item in (v for v in text.split(',') if v):
        name, _, value = item.partition('=')
        if name not in MODELS or not value.isdigit() or int(value) < 1:
            raise argparse.ArgumentTypeError(
                'expected MODEL=STEPS items (models: %s), got %r' % (', '.join(MODELS), item))
        steps[name] = int(value)
    return steps


def _rates(text):
    rates = harness.names()(text)
    for rate in rates:
        try:
            netns.rate_bits(rate)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    if not rates:
        raise argparse.ArgumentTypeError("expected tc rates such as '10gbit,1gbit', got %r"
                                         % text)
    return rates


def parse_args(argv):
    parser = harness.parser(__doc__)
    parser.add_argument('--out', default=os.path.join(REPO, 'docs', 'benchmarks', 'scaling'),
                        help='results folder (default: %(default)s)')
    parser.add_argument('--summary', default=os.path.join(REPO, 'docs', 'benchmarks',
                                                          'scaling', 'scaling.md'),
                        help='the tables and verdicts (default: %(default)s)')
    parser.add_argument('--scratch', default=os.path.join(REPO, 'bench_out', 'scaling'),
                        help='raw per-run files and logs (default: %(default)s)')
    parser.add_argument('--models', default='mlp,resnet18',
                        type=harness.names(MODELS), help='(default: %(default)s)')
    parser.add_argument('--methods', default=DEFAULT_METHODS,
                        type=harness.names(METHODS), help='(default: %(default)s)')
    parser.add_argument('--workers', default='2,4,8', type=harness.ints,
                        help='(default: %(default)s)')
    parser.add_argument('--servers', default='1,2,4', type=harness.ints,
                        help='(default: %(default)s)')
    parser.add_argument('--rate', default='1gbit', type=_rates,
                        help='each link, in each direction; several, comma-separated: a '
                             'network of each per configuration (default: %(default)s)')
    parser.add_argument('--rounds', type=int, default=1, help='(default: %(default)s)')
    parser.add_argument('--warmup', type=int, default=3,
                        help='synchronous steps before the switch step (default: %(default)s)')
    parser.add_argument('--steps', default='', type=_steps, metavar='MODEL=STEPS,...',
                        help='timed steps per model (default: %s)' % ', '.join(
                            '%s=%d' % (n, s['steps']) for n, s in MODELS.items()))
    parser.add_argument('--data-dir', default='/usr/share/datasets/fashion-mnist')
    parser.add_argument('--report-only', action='store_true',
                        help='only write the reports again from --out/runs.csv')
    parser.add_argument('--compare', metavar='DIR',
                        help='--report-only: the results folder of a second invocation of the '
                             'same grid, shown beside --out in the summary and the plot')
    parser.add_argument('--smoke', action='store_true',
                        help='a quick check (12 short runs: 6 minutes at load 20 on 2 cores, '
                             'less on a quiet machine): %s' % ' '.join(SMOKE))
    args = parser.parse_args(argv)
    if args.smoke:
        args = parser.parse_args(SMOKE + [a for a in argv if a != '--smoke'])
    if args.rounds < 1 or args.warmup < 1:
        parser.error('--rounds and --warmup must be at least 1, got %d and %d'
                     % (args.rounds, args.warmup))
    if 'sync' not in args.methods:
        parser.error('--methods must include sync (the ratios are to it), got %s'
                     % ','.join(args.methods))
    return args


# -- link counters -------------------------------------------------------------------------
def _eth0_check(net, eth0_before, ports):
    """Largest relative difference between each node's eth0 and its port over the job."""
    after = eth0_counters(net)
    job = ports.between(ports.samples[0][0], ports.samples[-1][0])
    worst = 0.0
    for index, (name, _) in enumerate(net.nodes):
        eth0 = (after[name][0] - eth0_before[name][0], after[name][1] - eth0_before[name][1])
        for mine, theirs in zip(eth0, job[index]):
            if max(mine, theirs) > 10000:  # the scheduler's link carries almost nothing
                worst = max(worst, abs(mine - theirs) / max(mine, theirs))
    return worst


# -- one run -------------------------------------------------------------------------------
def run_one(args, net, hostfile, config, method, round_index):
    """Run one job of `method` in `config` (model, rate, N, S); return its row for runs.csv."""
    model, rate, workers, servers = config
    spec = MODELS[model]
    steps = args.steps[model]
    name = '%s-%s-n%d-s%d-%s-r%d' % (model, rate, workers, servers, method, round_index)
    folder = os.path.join(args.scratch, name)
    worker_args = spec['args'] + ['--warmup-steps', str(args.warmup), '--steps', str(steps),
                                  '--seed', '1', '--data-dir', args.data_dir]
    # A generous bound: 4x the synchronous step's bytes through the busiest link.
    busiest = 2 * spec['megabytes'] * max(1, workers / servers)
    step_bound = 2.0 + 4 * busiest * 8e6 / netns.rate_bits(rate)
    timeout = 180 + (args.warmup + 1 + steps) * step_bound
    row = dict(model=model, rate=rate, workers=workers, servers=servers, method=method,
               round=round_index, warmup=args.warmup, steps=steps, batch=spec['batch'])
    eth0_before = eth0_counters(net)
    ports = PortCounters(net)
    try:
        code, results, cpu, info = harness.run_method(folder, METHODS[method], worker_args,
                                                      timeout, hostfile, workers, servers, ports)
    except subprocess.TimeoutExpired:
        return dict(row, error='no exit 60 s after the launcher\'s timeout; see %s' % folder)
    info['wall_s'] = info.pop('job_s')
    row.update(info)
    if code != 0:
        return dict(row, error='exit %s; see %s' % (code, os.path.join(folder, 'log.txt')))
    row.update(harness.window(results, cpu, spec['batch']))
    row['noisy'] = int(report.is_noisy(row))
    steady = report.steady_ms_per_step(folder, PERIOD, workers)
    if steady:
        row['steady_samples_per_s'] = workers * spec['batch'] * 1000 / steady
    start = min(r['start'] for r in results)
    end = max(r['end'] for r in results)
    window = ports.between(start, end)
    server_nodes = range(1, 1 + servers)
    worker_nodes = range(1 + servers, 1 + servers + workers)
    for prefix, nodes in (('worker', worker_nodes), ('server', server_nodes)):
        row[prefix + '_tx_mb'] = statistics.mean(window[i][0] for i in nodes) / steps / 1e6
        row[prefix + '_rx_mb'] = statistics.mean(window[i][1] for i in nodes) / steps / 1e6
    row['eth0_check'] = _eth0_check(net, eth0_before, ports)
    row['server_cpu_s_per_round'] = row['cpu_server'] * row['window_s'] / steps
    row.update(byte_floor(row, netns.rate_bits(rate)))
    row.update(cpu_shares(row))
    row['trained_parameters'] = results[0]['trained_parameters']
    kernels = results[0]['codec_kernels']  # worker 0's: its backend and the calls it made
    row['codec_kernels'] = kernels and '%s, %d calls' % (kernels['backend'],
                                                         sum(kernels['calls'].values()))
    row['final_loss'] = results[0]['losses'][-1]
    return row


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


def _order(methods, config_index, round_index):
    rotation = config_index % len(methods)
    return harness.ordered(methods[rotation:] + methods[:rotation], round_index)


def run_all(args, rows, rows_path):
    """Run the grid, appending each row to `rows` and to runs.csv as it comes."""
    configs = [(m, r, n, s) for m in args.models for r in args.rate for n in args.workers
               for s in args.servers]
    total = len(configs) * len(args.methods) * args.rounds
    for index, config in enumerate(configs):
        with harness.shaped_network(1 + config[3] + config[2], config[1],
                                    'mxscaling-') as (net, hostfile):
            # What one TCP stream gets from the server's link to the first worker's, now.
            link = netns.measure_rate(net, 1, 1 + config[3]) / 1e9
            _LOG.info('%s %s N=%d S=%d: one TCP stream carries %.2f Gbit/s', *config, link)
            for round_index in range(1, args.rounds + 1):
                for method in _order(args.methods, index, round_index):
                    row = dict(run_one(args, net, hostfile, config, method, round_index),
                               link_gbit=link)
                    rows.append(row)
                    report.write_csv(rows_path, rows)
                    _log(row, '[%d/%d]' % (len(rows), total))


def _log(row, counter):
    what = '%s %s %s N=%d S=%d %s r%d' % (counter, row['model'], row['rate'], row['workers'],
                                          row['servers'], row['method'], row['round'])
    if 'error' in row:
        _LOG.error('%s FAILED: %s', what, row['error'])
        return
    _LOG.info('%s: %.1f samples/s (%.0f ms/step), steady %s; MB/step worker tx %.1f rx %.1f, '
              'server tx %.1f rx %.1f: byte floor %s samples/s; cores per worker %.2f, per '
              'server %.2f, other %.2f; load %.1f; %s', what, row['samples_per_s'],
              row['ms_per_step'], _fmt(row.get('steady_samples_per_s'), '%.1f'),
              row['worker_tx_mb'], row['worker_rx_mb'], row['server_tx_mb'],
              row['server_rx_mb'], _fmt(row['floor_samples_per_s'], '%.1f'),
              row['cores_per_worker'], row['cores_per_server'], row['cpu_other'],
              row['load_before'], row['stock_check'])


# -- report --------------------------------------------------------------------------------
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
                     'worker cores', 'server cores', 'floor samples/s', 'cpu_other', 'last loss', 'load before / after', 'job s',
                     'stock check'], body)
    envs = sorted({(r['method'], r.get('worker_env', '')) for r in rows})
    lines += ['', 'MXNET_* variables the workers saw at exit, per method: ' + '; '.join(
        '%s: %s' % env for env in envs) + '.']
    kernels = sorted({(r['method'], r['codec_kernels']) for r in rows
                      if r.get('codec_kernels')})
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
    pairs = _pairs(summary)
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
             'side by side in one run are the result.** With 8 workers, 4 servers and a '
             'scheduler on 2 cores the runs are partly CPU-bound, not only link-bound.', '']
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
    lines += _table(['model', 'link', 'S', 'N'] + ['%s samples/s' % METHODS[m].label for m in methods] + [
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
                                    second[2].get((model, rate, n, s, m)) or {}) for m in methods]]])
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
             'packet work). One TCP stream from the server to a '
             'worker right after each network was built carried: %s.' % (
                 '; '.join('%s %s N=%d S=%d: %.2f Gbit/s' % (key + (value,))
                           for key, value in links.items()) or 'not measured'), '']
    return lines + _table(
        ['model', 'link', 'N', 'S', 'method', 'samples/s', '/ sync', 'steady samples/s',
         'steady / sync', 'floor ms: worker link', 'server link', 'floor samples/s',
         'cores per worker', 'cores per server', 'CPU ms per step: worker', 'server',
         'other cores', 'noisy runs'],
        [[model, rate, str(n), str(s), METHODS[m].label, _fmt(it['samples_per_s'], '%.1f'),
          _fmt(it['x_sync'], '%.2fx'), _fmt(it['steady_samples_per_s'], '%.1f'),
          _fmt(it['x_sync_steady'], '%.2fx'), _fmt(it['worker_floor_ms'], '%.0f'),
          _fmt(it['server_floor_ms'], '%.0f'), _fmt(it['floor_samples_per_s'], '%.1f'),
          _fmt(it['cores_per_worker']), _fmt(it['cores_per_server']),
          _fmt(it['worker_cpu_ms'], '%.0f'), _fmt(it['server_cpu_ms'], '%.0f'),
          _fmt(it['cpu_other']),
          '%d of %d' % (it['noisy'], it['runs'])]
         for model, rate in pairs for n in workers for s in servers for m in methods
         for it in [summary.get((model, rate, n, s, m))] if it])


def _pairs(summary):
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


def plot(path, summary, methods, second=None):
    """samples/s against N per method, one panel per model, rate and S; `second`: the
    summary of a second invocation, dashed. A grid of one N and one S: :func:`plot_floor`."""
    if len({k[2:4] for k in summary}) == 1 and not second:
        plot_floor(path, summary, methods)
        return
    plt = report.pyplot()
    pairs = _pairs(summary)
    servers = sorted({k[3] for k in summary})
    fig, axes = plt.subplots(len(pairs), len(servers), squeeze=False,
                             figsize=(max(7, 4 * len(servers)), 3.4 * len(pairs)))
    for row, (model, rate) in enumerate(pairs):
        for col, s in enumerate(servers):
            axis = axes[row][col]
            for color, method in enumerate(methods):
                for style, which in (('-', summary), ('--', second or {})):
                    points = sorted((k[2], v['samples_per_s']) for k, v in which.items()
                                    if k[:2] == (model, rate) and k[3] == s and k[4] == method)
                    if points:
                        axis.plot(*zip(*points), style, marker='o', label='%s%s' % (
                            METHODS[method].label, ' (2nd)' if style == '--' else ''),
                                  color='0.5' if method == 'sync' else 'C%d' % (color - 1))
            axis.set_xticks(sorted({k[2] for k in summary}))
            axis.set_title('%s, %s, S=%d' % (model, rate, s), fontsize=9)
            axis.set_xlabel('workers N')
            axis.set_ylabel('samples/s')
            axis.set_ylim(bottom=0)
            axis.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle('Throughput against workers, each node on its own link (grey: stock%s)'
                 % ('; dashed: second invocation' if second else ''), fontsize=10)
    report.save(fig, path, 100)


def plot_floor(path, summary, methods):
    """Steady samples/s per method (job samples/s where a run had none), one panel per
    model and rate, each bar beside the samples/s its byte floor allows (log scale)."""
    plt = report.pyplot()
    pairs = _pairs(summary)
    fig, axes = plt.subplots(1, len(pairs), squeeze=False,
                             figsize=(max(6.0, 3.6 * len(pairs)), 3.8))
    for axis, (model, rate) in zip(axes[0], pairs):
        items = [(m, summary[k]) for m in methods for k in summary
                 if k[:2] == (model, rate) and k[4] == m]
        spots = range(len(items))
        axis.bar([x - 0.2 for x in spots], [it['steady_samples_per_s'] or it['samples_per_s']
                                            for _, it in items], 0.4, label='measured',
                 color=['0.5' if m == 'sync' else 'C0' for m, _ in items])
        axis.bar([x + 0.2 for x in spots], [it['floor_samples_per_s'] or 0 for _, it in items],
                 0.4, label='byte floor allows', color='C1', alpha=0.5)
        axis.set_xticks(list(spots))
        axis.set_xticklabels([METHODS[m].label.replace(' + ', '\n+ ') for m, _ in items],
                             fontsize=7)
        axis.set_yscale('log')
        axis.set_title('%s, %s, N=%d S=%d' % ((model, rate) + next(
            k[2:4] for k in summary if k[:2] == (model, rate))), fontsize=9)
        axis.set_ylabel('samples/s')
        axis.grid(alpha=0.3, axis='y')
    axes[0][0].legend(fontsize=7)
    fig.suptitle('Steady samples/s (grey: stock) beside what the links alone allow',
                 fontsize=10)
    report.save(fig, path, 100)


def _complete(meta, rows):
    """`rows` with their link's rate, byte floor and cores per role (a runs.csv of one link
    written before they were columns has the rate in the meta only)."""
    for row in rows:
        row.setdefault('rate', meta['settings']['rate'])
        if 'error' not in row:  # derived from the counters: the same for a new row
            row.update(byte_floor(row, netns.rate_bits(row['rate'])))
            row.update(cpu_shares(row))
    return rows


def write_reports(args, meta, rows):
    _complete(meta, rows)
    methods = [m for m in METHODS if any(r['method'] == m for r in rows)]
    summary = summarize(rows)
    code = provenance.code_version()  # before this report's own files change
    here = os.path.dirname(os.path.abspath(args.summary))
    second = None
    if args.compare:
        meta2 = report.read_json(os.path.join(args.compare, 'meta.json'))
        rows2 = _complete(meta2, report.read_csv(os.path.join(args.compare, 'runs.csv')))
        second = (meta2, rows2, summarize(rows2), os.path.relpath(args.compare, here))
    with open(os.path.join(args.out, 'results.md'), 'w', encoding='utf-8') as dst:
        dst.write(results_markdown(meta, rows, os.path.relpath(args.summary, args.out)))
    with open(args.summary, 'w', encoding='utf-8') as dst:
        dst.write(summary_markdown(meta, rows, summary, methods, os.path.relpath(args.out, here),
                                   code, args.report_only, second))
    if summary:
        plot(os.path.join(args.out, 'throughput.png'), summary, methods,
             second and second[2])
    _LOG.info('wrote %s, %s', os.path.join(args.out, 'results.md'), args.summary)


# -- main ----------------------------------------------------------------------------------
def main(argv=None):
    logging.basicConfig(level=logging.INFO, format='%(asctime)s %(message)s', datefmt='%H:%M:%S')
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    meta_path = os.path.join(args.out, 'meta.json')
    rows_path = os.path.join(args.out, 'runs.csv')
    if args.report_only:
        write_reports(args, report.read_json(meta_path), report.read_csv(rows_path))
        return 0
    reason = netns.netns_available()
    if reason:
        sys.exit('scaling.py needs network namespaces: %s' % reason)
    harness.handle_signals()
    stale = netns.remove_stale()
    if stale:
        _LOG.warning('deleted namespaces left by a killed benchmark: %s', ', '.join(stale))
    meta = harness.start_meta(
        harness.command_line('python benchmarks/scaling.py', argv), settings=dict(
            models=args.models, methods=args.methods, workers=args.workers,
            servers=args.servers, rate=','.join(args.rate), rounds=args.rounds, warmup=args.warmup,
            steps=args.steps))
    _LOG.info('%s; output in %s', meta['command'], args.out)
    rows, code = [], 0
    try:
        run_all(args, rows, rows_path)
    except harness.Interrupted as stop:
        _LOG.error('stopped by %s; namespaces and processes cleaned up', stop)
        code = 128 + stop.signum
    finally:
        report.write_json(meta_path, harness.finish_meta(meta))
    if rows:
        write_reports(args, meta, rows)
    return code or (1 if any('error' in r for r in rows) else 0)


if __name__ == '__main__':
    sys.exit(main())
