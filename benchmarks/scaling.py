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
  in the window (the role's CPU time from ``monitor.CpuMonitor`` over its processes), and
  the CPU ms each spent per step (cores x ms per step);
  ``codec_kernels``: what ran worker 0's codecs (``kvstore_ext.codecs.kernels``: compiled
  or numpy, and the calls it made); the load average before and after, and ``cpu_other``
  (cores used by other processes).
- **Reports** (``benchmarks/scaling_report.py``; the plots here): medians over rounds (with
  the range). ``--out``: ``runs.csv`` (every run), ``results.md`` (every run),
  ``meta.json`` (commit at start and end, command, machine, load), ``throughput.png``
  (samples/s against N per method, a panel per model, rate and S; for a grid of one N and
  one S, each method's steady samples/s beside what its byte floor allows);
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
from scaling_report import (DEFAULT_METHODS, METHODS, MODELS, PERIOD, byte_floor, cpu_shares,
                            model_rates, results_markdown, summarize, summary_markdown)

__all__ = ['METHODS', 'MODELS', 'main']

_LOG = logging.getLogger('scaling')
REPO = harness.REPO
_fmt = report.fmt

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
    row['decided'] = results[0].get('decided')   # delay='auto''s decisions, else None
    return row


def _order(methods, config_index, round_index):
    rotation = config_index % len(methods)
    return harness.ordered(methods[rotation:] + methods[:rotation], round_index)


def run_all(args, rows, rows_path):
    """Run the grid, appending each row to `rows` and to runs.csv as it comes."""
    configs = [(m, r, n, s) for m in args.models for r in args.rate for n in args.workers
               for s in args.servers]
    total = len(configs) * len(args.methods) * args.rounds
    for index, config in enumerate(configs):
        _, rate, workers, servers = config
        with harness.shaped_network(1 + servers + workers, rate,
                                    'mxscaling-') as (net, hostfile):
            # What one TCP stream carries from the first server to the first worker, now.
            link = netns.measure_rate(net, 1, 1 + servers) / 1e9
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


# -- reports -------------------------------------------------------------------------------
def plot(path, summary, methods, second=None):
    """samples/s against N per method, one panel per model, rate and S; `second`: the
    summary of a second invocation, dashed. A grid of one N and one S: :func:`plot_floor`."""
    if len({k[2:4] for k in summary}) == 1 and not second:
        plot_floor(path, summary, methods)
        return
    plt = report.pyplot()
    pairs = model_rates(summary)
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
    pairs = model_rates(summary)
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
