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
    folder = os.path.join(args.out, 'runs', report.run_name(net_name, method, round_index,
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
        report.write_all(args.out, meta, rows, accuracy, METHODS, NETWORKS, ACCURACY,
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
        report.write_all(args.out, meta, rows, accuracy, METHODS, NETWORKS, ACCURACY, args)
        _LOG.info('wrote %s', os.path.join(args.out, 'results.md'))
    failed = [row for row in rows + accuracy if 'error' in row]
    return code or (1 if failed else 0)


if __name__ == '__main__':
    sys.exit(main())
