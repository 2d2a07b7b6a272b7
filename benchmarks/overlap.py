"""Per-layer pushes during backward vs pushes after backward, side by side (issue 4).

Runs tests/scripts/timeline_job.py (6-layer MLP with one 2048x784 layer, 4.6M float32
parameters, batch 64, 2 workers + 1 server, ``OMP_NUM_THREADS=1``, ``DelayedTrainer`` with
k=2) in each *configuration*: a mode (``layerwise``: the trainer as it is; ``after_backward``:
the same trainer with ``mx.nd.waitall()`` before its pushes, the issue's baseline;
``after_grads``: the same waiting only for the gradients, since ``waitall`` also waits
for the previous round's pushes in the delayed phase) and a value of
``MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN_BWD`` (``--bulk``; mxdelay's default is 4, MXNet's
15), on each network of ``--network``:

- ``loopback``: every process on this machine's loopback (``mxdelay-launch`` local mode);
- ``1gbit``, ``100mbit``: scheduler, server and the two workers each in a network
  namespace of its own, linked to a bridge by a veth pair shaped with ``tc tbf`` to that
  rate in each direction (``benchmarks/netns.py``, ``mxdelay-launch --launcher netns``;
  root only). The namespaces are made once per run and deleted at its end, also on
  failure, SIGINT, SIGTERM or SIGHUP.

Every round runs every (network, configuration) once, in reverse order every other round,
so that the machine's drifts (other users) hit all alike. Per job: the mean step time of
the warm-up (synchronous: push, then wait for the pull) and of the delayed phase (k=2),
from each worker; and the timeline of 8 recorded steps (3 warm-up, the switch, 4 delayed;
``mxdelay.timeline``; the last one is left out of the tables, its span ends with the
recording): steps whose first push started during backward, communication time
hidden behind compute and behind backward, mean wait per step. The load average before and
after every job and the cores other processes used during it (``cpu_monitor.py``) are kept.

Output (``--out``, default ``bench_out/overlap``): ``runs.json`` (every job, every worker's
rows), ``results.md`` (tables: medians over rounds, paired ratios), ``overlap.png``;
``--report-only`` writes the last two again from ``runs.json``.

Examples::

    python benchmarks/overlap.py --rounds 2                      # loopback, about 1 minute
    python benchmarks/overlap.py --network loopback,1gbit --rounds 4   # as root
    python benchmarks/overlap.py --network 1gbit --bulk 1,4,15 --rounds 3
"""
import argparse
import contextlib
import datetime
import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

from cpu_monitor import CpuMonitor
import harness
import netns
import report

HERE, ROOT = harness.HERE, harness.REPO

MODES = ('layerwise', 'after_backward', 'after_grads')
DEFAULT_MODES = ('layerwise', 'after_backward')
MODE_LABELS = {'layerwise': 'per layer, during backward',
               'after_backward': 'after backward (waitall)',
               'after_grads': 'after backward (wait for the gradients)'}
#: name -> (tc rate or None, warm-up steps: the job's STEPS argument)
NETWORKS = {name: (harness.NETWORKS[name].rate, warmup)
            for name, warmup in (('loopback', 30), ('1gbit', 20), ('100mbit', 8))}
BULK = 'MXNET_EXEC_BULK_EXEC_MAX_NODE_TRAIN_BWD'
JOB = os.path.join(ROOT, 'tests', 'scripts', 'timeline_job.py')


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n', maxsplit=1)[0])
    parser.add_argument('--network', default='loopback', type=harness.names(NETWORKS),
                        help='comma-separated: %s (default: %%(default)s)' % ', '.join(NETWORKS))
    parser.add_argument('--modes', default=','.join(DEFAULT_MODES),
                        type=harness.names(MODES),
                        help='comma-separated, of %s (default: %%(default)s)' % ', '.join(MODES))
    parser.add_argument('--bulk', default='4', type=harness.ints,
                        help='comma-separated values of %s (default: %%(default)s)' % BULK)
    parser.add_argument('--rounds', type=int, default=2)
    parser.add_argument('--warmup', type=int,
                        help='warm-up steps per job (>= 8; default per network: %s)'
                             % ', '.join('%s %d' % (n, w) for n, (_, w) in NETWORKS.items()))
    parser.add_argument('--out', default=os.path.join(ROOT, 'bench_out', 'overlap'))
    parser.add_argument('--report-only', action='store_true',
                        help='only write results.md and overlap.png again from --out/runs.json')
    args = parser.parse_args(argv)
    if args.rounds < 1 or (args.warmup is not None and args.warmup < 8):
        parser.error('--rounds must be at least 1 and --warmup at least 8')
    return args


def _job_env(bulk):
    env = {name: value for name, value in os.environ.items()
           if not name.startswith('DMLC_') and name not in ('MXNET_CPU_WORKER_NTHREADS',
                                                            'MXDELAY_RANK')}
    env.update(OMP_NUM_THREADS='1', PYTHONUNBUFFERED='1')
    env[BULK] = str(bulk)
    return env


def run_job(network, mode, bulk, warmup, hostfile, log_path):
    """Run one job; return its record (workers' results, load, other processes' cores)."""
    rate = NETWORKS[network][0]
    timeout = 120 + (warmup + 20) * (6.0 if rate == '100mbit' else 1.5)
    record = dict(network=network, mode=mode, bulk=bulk, warmup=warmup,
                  load_before=os.getloadavg()[0])
    with tempfile.TemporaryDirectory(prefix='mxoverlap-') as folder:
        job = harness.Job([sys.executable, JOB, mode, folder, str(warmup)], timeout,
                          hostfile=hostfile if rate else None, environ=_job_env(bulk))
        argv = job.argv
        started = time.time()
        with open(log_path, 'ab') as log:
            log.write(('$ %s=%d %s\n' % (BULK, bulk, ' '.join(argv))).encode())
            log.flush()
            popen = job.start(stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
            try:
                with CpuMonitor({os.getpid(): 'driver'}) as monitor:
                    code = popen.wait(timeout + 30)
            finally:
                harness.stop(popen)
        record.update(wall_s=time.time() - started, load_after=os.getloadavg()[0],
                      other_cores=monitor.usage(started, time.time())['other'])
        if code != 0:
            raise RuntimeError('%s %s bulk %d: exit %s; see %s' % (network, mode, bulk, code,
                                                                    log_path))
        record['workers'] = [report.read_json(os.path.join(folder, 'timeline%d.json' % rank))
                             for rank in (0, 1)]
    return record


@contextlib.contextmanager
def networks(names):
    """Yield {network: hostfile or None}; shaped networks exist for the block only."""
    with contextlib.ExitStack() as stack:
        hostfiles = {}
        for name in names:
            rate = NETWORKS[name][0]
            if rate is None:
                hostfiles[name] = None
                continue
            reason = netns.netns_available()
            if reason:
                raise SystemExit('--network %s needs network namespaces: %s' % (name, reason))
            net, hostfiles[name] = stack.enter_context(
                harness.shaped_network(4, rate, 'mxoverlap-net-'))
            print('%s: namespaces %s, every link shaped to %s each way'
                  % (name, ', '.join(n for n, _ in net.nodes), rate), flush=True)
        yield hostfiles


# -- report ---------------------------------------------------------------------------------
def _timeline(records, phases):
    """Totals of mxdelay.timeline over the rows of `phases` of every worker of `records`."""
    from mxdelay import timeline  # pylint: disable=import-outside-toplevel
    # The last recorded step is left out: its span is cut short by the end of the recording.
    rows = [row for rec in records for worker in rec['workers'] for row in worker['rows'][:-1]
            if row['phase'] in phases]
    total = timeline.totals(rows)
    total['overlapping'] = sum(1 for row in rows if row['overlap'])
    return total


def _fmt_spread(values):
    return '%.1f (%.1f-%.1f)' % (np.median(values), min(values), max(values))


def summary(runs):
    """{(network, mode, bulk): stats} over the rounds."""
    groups = {}
    for rec in runs:
        groups.setdefault((rec['network'], rec['mode'], rec['bulk']), []).append(rec)
    out = {}
    for key, records in groups.items():
        sync = _timeline(records, ('warm-up', 'switch'))
        delayed = _timeline(records, ('delayed',))
        out[key] = dict(
            rounds=len(records),
            warmup_ms=[1000 * np.mean([w['warmup_step_s'] for w in r['workers']])
                       for r in records],
            delayed_ms=[1000 * np.mean([w['delayed_step_s'] for w in r['workers']])
                        for r in records],
            sync=sync, delayed=delayed,
            overlap='%d of %d' % (sync['overlapping'] + delayed['overlapping'],
                                  sync['steps'] + delayed['steps']),
            load=[r['load_before'] for r in records] + [r['load_after'] for r in records],
            other=[r['other_cores'] for r in records])
    return out


def _paired_ratio(runs, network, bulk, field, baseline):
    """layerwise / `baseline` step time of each round (same network and bulk)."""
    pairs = {}
    for rec in runs:
        if rec['network'] == network and rec['bulk'] == bulk:
            value = 1000 * np.mean([w[field] for w in rec['workers']])
            pairs.setdefault(rec['round'], {})[rec['mode']] = value
    return [p['layerwise'] / p[baseline] for p in pairs.values()
            if 'layerwise' in p and baseline in p]


def _network_tables(runs, network, bulks):
    stats = summary(runs)
    lines = ['| pushes | bulk | rounds | warm-up ms/step | delayed (k=2) ms/step | steps with a '
             'push during backward | comm hidden behind compute (sync / delayed) | behind '
             'backward (sync / delayed) | mean wait per step, ms (sync / delayed) |',
             '|---|---:|---:|---:|---:|---:|---:|---:|---:|']
    for (net, mode, bulk), st in sorted(stats.items(),
                                        key=lambda kv: (kv[0][2], MODES.index(kv[0][1]))):
        if net != network:
            continue
        lines.append('| %s | %d | %d | %s | %s | %s | %.0f%% / %.0f%% | %.0f%% / %.0f%% | '
                     '%.1f / %.1f |' % (
                         MODE_LABELS[mode], bulk, st['rounds'], _fmt_spread(st['warmup_ms']),
                         _fmt_spread(st['delayed_ms']), st['overlap'],
                         100 * st['sync']['hidden'], 100 * st['delayed']['hidden'],
                         100 * st['sync']['hidden_backward'],
                         100 * st['delayed']['hidden_backward'],
                         st['sync']['wait_ms'], st['delayed']['wait_ms']))
    lines.append('')
    for bulk in bulks:
        for baseline in ('after_backward', 'after_grads'):
            warm = _paired_ratio(runs, network, bulk, 'warmup_step_s', baseline)
            dela = _paired_ratio(runs, network, bulk, 'delayed_step_s', baseline)
            if warm:
                lines.append('- bulk %d: per-layer / %s step time, paired by round: warm-up %s '
                             '(median %.3f), delayed %s (median %.3f).' % (
                                 bulk, baseline, ' '.join('%.3f' % r for r in warm),
                                 np.median(warm), ' '.join('%.3f' % r for r in dela),
                                 np.median(dela)))
    return lines + ['']


def markdown(runs, meta):
    quiet = [r for r in runs if r['other_cores'] <= report.NOISE_CORES]
    lines = ['# Overlap benchmark: per-layer pushes during backward vs after backward', '',
             'Command: `%s`' % meta['command'], '',
             '- Started %s, ended %s; %d jobs.' % (meta['start'], meta['end'], len(runs)),
             '- `uptime` before: `%s`' % meta['uptime_before'],
             '- `uptime` after: `%s`' % meta['uptime_after'],
             '- Load average (1 min) before/after the jobs: %.2f-%.2f; cores used by other '
             'processes during a job: median %.2f, max %.2f; %d of %d jobs quiet (at most %.2f).'
             % (min(r['load_before'] for r in runs), max(r['load_after'] for r in runs),
                np.median([r['other_cores'] for r in runs]),
                max(r['other_cores'] for r in runs), len(quiet), len(runs), report.NOISE_CORES),
             '', 'ms/step: median over rounds (min-max), each the mean of both workers. '
             'bulk: %s. Timeline columns: 7 of the 8 recorded steps per worker and round '
             '(sync: 3 warm-up + the switch; delayed: the first 3; the 8th is cut short by the '
             'end of the recording), communication time = wall time with a push or pull '
             'outstanding (`mxdelay.timeline`).' % BULK, '']
    for network in meta['networks']:
        lines += ['## %s: all jobs' % network, ''] + _network_tables(runs, network, meta['bulk'])
        if quiet and len(quiet) < len(runs):
            lines += ['## %s: quiet jobs only (other processes used at most %.2f cores)'
                      % (network, report.NOISE_CORES), '']
            lines += _network_tables(quiet, network, meta['bulk'])
    lines += ['## Every job', ''] + report.table(
        'round | network | mode | bulk | warm-up ms/step | delayed ms/step | load before-after | '
        'other cores', [['%d' % rec['round'], rec['network'], rec['mode'], '%d' % rec['bulk']] + [
            '%.1f' % (1000 * np.mean([w[key] for w in rec['workers']]))
            for key in ('warmup_step_s', 'delayed_step_s')] + [
                '%.2f-%.2f' % (rec['load_before'], rec['load_after']), '%.2f' % rec['other_cores']]
            for rec in runs], 'rllrrrlr')
    return '\n'.join(lines) + '\n'


def plot(path, runs, meta):
    plt = report.pyplot()
    stats = summary(runs)
    configs = sorted({(mode, bulk) for _, mode, bulk in stats},
                     key=lambda c: (c[1], MODES.index(c[0])))
    fig, axes = plt.subplots(1, len(meta['networks']), figsize=(5.5 * len(meta['networks']), 4.2),
                             squeeze=False)
    width = 0.8 / len(configs)
    for ax, network in zip(axes[0], meta['networks']):
        for index, (mode, bulk) in enumerate(configs):
            st = stats.get((network, mode, bulk))
            if st is None:
                continue
            for x, field in enumerate(('warmup_ms', 'delayed_ms')):
                values = st[field]
                pos = x + (index - (len(configs) - 1) / 2) * width
                bar = ax.bar(pos, np.median(values), width,
                             yerr=[[np.median(values) - min(values)],
                                   [max(values) - np.median(values)]],
                             color='C%d' % index, capsize=3,
                             label='%s, bulk %d' % (MODE_LABELS[mode], bulk) if x == 0 else None)
                hidden = st['sync' if x == 0 else 'delayed']['hidden_backward']
                ax.annotate('%.0f%%' % (100 * hidden), (pos, bar[0].get_height()),
                            ha='center', va='bottom', fontsize=7, xytext=(0, 3),
                            textcoords='offset points')
        ax.set_xticks([0, 1])
        ax.set_xticklabels(['warm-up (synchronous)', 'delayed (k=2)'])
        ax.set_ylabel('ms per step (median, min-max over rounds)')
        ax.set_title(network)
    axes[0][0].legend(fontsize=7, loc='lower left')
    fig.suptitle('6-layer MLP, 2 workers + 1 server, every job; bars: median over rounds, '
                 'whiskers: min-max; labels: communication hidden behind backward', fontsize=9)
    report.save(fig, path, 110)


def main():
    args = parse_args()
    harness.handle_signals((signal.SIGTERM, signal.SIGHUP))
    os.makedirs(args.out, exist_ok=True)
    if args.report_only:
        saved = report.read_json(os.path.join(args.out, 'runs.json'))
        write_report(args.out, saved.pop('runs'), saved)
        return
    log_path = os.path.join(args.out, 'jobs.log')
    configs = [(network, mode, bulk) for network in args.network for bulk in args.bulk
               for mode in args.modes]
    meta = dict(command='python benchmarks/overlap.py ' + ' '.join(sys.argv[1:]),
                start=datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC'),
                uptime_before=subprocess.run(['uptime'], capture_output=True, text=True,
                                             check=False).stdout.strip(),
                networks=args.network, bulk=args.bulk)
    print('uptime before:', meta['uptime_before'], flush=True)
    runs = []
    with networks(args.network) as hostfiles:
        for round_index in range(1, args.rounds + 1):
            for network, mode, bulk in (configs if round_index % 2 else configs[::-1]):
                warmup = args.warmup or NETWORKS[network][1]
                record = run_job(network, mode, bulk, warmup, hostfiles[network], log_path)
                record['round'] = round_index
                runs.append(record)
                report.write_json(os.path.join(args.out, 'runs.json'), dict(meta, runs=runs), None)
                print('round %d %s %s bulk %d: warm-up %.1f ms/step, delayed %.1f ms/step; '
                      'load %.2f-%.2f, other cores %.2f' % (
                          round_index, network, mode, bulk,
                          1000 * np.mean([w['warmup_step_s'] for w in record['workers']]),
                          1000 * np.mean([w['delayed_step_s'] for w in record['workers']]),
                          record['load_before'], record['load_after'], record['other_cores']),
                      flush=True)
    meta['end'] = datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')
    meta['uptime_after'] = subprocess.run(['uptime'], capture_output=True, text=True,
                                          check=False).stdout.strip()
    print('uptime after:', meta['uptime_after'], flush=True)
    report.write_json(os.path.join(args.out, 'runs.json'), dict(meta, runs=runs), None)
    write_report(args.out, runs, meta)


def write_report(out, runs, meta):
    """Write results.md and overlap.png into `out`; print the tables."""
    text = markdown(runs, meta)
    with open(os.path.join(out, 'results.md'), 'w', encoding='utf-8') as dst:
        dst.write(text)
    plot(os.path.join(out, 'overlap.png'), runs, meta)
    print(text)


if __name__ == '__main__':
    main()
