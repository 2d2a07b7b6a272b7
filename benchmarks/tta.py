"""Time-to-accuracy, accuracy over seeds, and per-phase step times on shaped links (issue 14).

Every job: the Fashion-MNIST MLP 784-1024-1024-10, batch 128 per worker, ``--workers``
workers and ``--servers`` servers (default 2 and 1), ``--optimizer`` (:data:`OPTIMIZERS`;
default SGD lr 0.05 momentum 0.9) for every method, ``OMP_NUM_THREADS=1`` in every
process, launched by ``mxdelay/launcher.py`` run as a plain file (it imports neither
mxdelay's package nor MXNet) with an explicit environment: the driver's, minus every
``DMLC_*``, ``MXNET_*`` and ``MXDELAY_*`` variable. Methods: ``sync`` (stock
``gluon.Trainer`` on MXNet's native ``dist_sync``; no process of the job imports mxdelay,
which each process checks and records), and ``k2`` ``k4`` ``k8`` (``mxdelay.DelayedTrainer``,
rule ``'mirror'``, the default warm-up of 200 synchronous steps in full runs, unless the
method sets its own: :attr:`harness.Method.warmup`). The worker is ``benchmarks/bench_worker.py``.

Parts (``--part``), each one invocation, each writing its results and a ``meta-<part>.json``
(commit and dirty flag, command, machine, load before and after, date) into ``--out``:

``full``
    Real training runs on loopback: ``--epochs`` (10) epochs (``--method-epochs``: a
    method's own), every method, every seed of ``--seeds`` (1,2,3). The methods are
    interleaved (seed by seed, every other seed in the reverse order). Worker 0 keeps its weights every third of an epoch (78 steps of 234 with
    2 workers, 39 of 117 with 4) and at every epoch end, and evaluates them on the 10000
    test images after training: its own weights (in the delayed phase its last pull plus
    up to k local steps), or the global model for a method whose arguments include
    ``--global-model`` (every worker calls ``sync_weights()`` there). Wall time is that of
    training only, from the first worker's first step to each step's end on the
    slower worker. Files: ``full-evals.csv`` (one row per evaluation), ``full-runs.csv``.
``phases``
    Per-phase step times on each network of ``--networks`` (loopback, 1gbit, 100mbit):
    short runs of every method, interleaved over ``--rounds`` rounds (every other round
    reversed), with a shortened warm-up. The synchronous step time (``sync``: every step;
    delayed: the warm-up steps) is the mean step time after the first step; the delayed step
    time is the job's time over the ``--steps`` steps after the switch, divided by them
    (whole k=8 periods). The first step (it includes the kvstore's initial push) is timed
    on its own. Also the steady-state throughput of the delayed window (samples/s, as the
    earlier benchmark: workers x steps x 128 over the first worker's start to the last
    worker's end, drain included). File: ``phases-runs.csv``.
``real``
    The check of the derivation on shaped links: on each network of ``--networks``, in one
    set of namespaces per network (as ``phases``), the runs of ``full`` (``--epochs``, every
    method, every seed of ``--seeds``, interleaved as ``full``, worker 0's kept weights
    evaluated after training), with the real wall time of training to each evaluation.
    Files: ``real-evals.csv``, ``real-runs.csv`` (``full``'s columns and the network).
``report``
    From the files above: ``tta.json`` and ``results.md``. No run. With real runs, also the
    real wall time to ``--real-target`` (default ``epoch1``: dist_sync's mean accuracy at the
    end of epoch 1 over the ``full`` seeds; ``epochN``, or an accuracy such as ``0.85``) on
    each network and method beside the time derived for the same seed, target and link from
    ``full`` and ``phases``, and their ratio. A folder of ``real`` runs alone (no
    ``full-evals.csv``) is reported on them only (``benchmarks/tta_real.py``): there
    ``epochN`` is stock ``dist_sync``'s accuracy at the end of epoch N of the real run on each
    link; each run's real time to it, stock's time over each other method's, and
    ``accuracy-time.png`` (test accuracy against real wall time, a panel per link).

Derived time-to-accuracy: with 2 workers the trajectory does not depend on timing (exact
rounds, a sum of two is commutative, seeded data order), so step n has the same weights on
any link; a link changes only the time per step. With more workers the servers add the
pushes in the order they arrive, so the last bits of a sum, and from there the trajectory,
may differ from run to run (the report's loss digests show whether they did): the
derivation then rests on steps to accuracy being the same in distribution, which ``real``
checks. The time of step n on a link is
first_step + (n_sync - 1) * sync_step + n_delayed * delayed_step, with the per-phase times
(median over rounds) of ``phases`` and n_sync = min(n, W + 1) for the delayed methods (warm-up
plus the switch step; W is the method's warm-up, :func:`warmup_of`). On loopback this is
checked against the real wall time of ``full``; on a shaped link, against the real wall time
of ``real``. A method's warm-up length does not change its step times: a method without phase
runs of its own takes those of a method with the same job (:attr:`harness.Method.job`: the
same worker arguments and environment, another warm-up), and the report names which.

A stop signal (SIGINT, SIGTERM, SIGHUP) ends the running job (its launcher stops its roles)
and removes the part's namespaces; the part's meta file is still written; exit 128 + signal.

Usage (as root for the shaped networks)::

    python benchmarks/tta.py --part full
    python benchmarks/tta.py --part phases
    python benchmarks/tta.py --part real --networks 100mbit --epochs 1 --seeds 1
    python benchmarks/tta.py --part report
"""
import hashlib
import json
import logging
import os
import re
import statistics
import sys

import harness
import netns
import report as report_lib
import tta_real
from tta_report import build_report
from tta_setup import (COMMAND, DEFAULT_METHODS, FULL_WARMUP, METHODS, NETWORKS, OPTIMIZERS,
                       eval_every, is_stock, known_method, steps_per_epoch, warmup_of)

_LOG = logging.getLogger('tta')
REPO = harness.REPO
BATCH = harness.BATCH


def parse_args(argv=None):
    parser = harness.parser(__doc__)
    parser.add_argument('--part', choices=('full', 'phases', 'real', 'report'), required=True)
    parser.add_argument('--out', default=os.path.join(REPO, 'docs', 'benchmarks', 'tta'),
                        help='results folder (default: %(default)s)')
    parser.add_argument('--scratch', default=os.path.join(REPO, 'bench_out', 'tta'),
                        help='raw per-run files and logs (default: %(default)s)')
    parser.add_argument('--methods', default=','.join(DEFAULT_METHODS),
                        help='any of benchmarks/harness.py METHODS (default: %(default)s; '
                             'report: the runs\' methods outside the default)')
    parser.add_argument('--optimizer', choices=tuple(OPTIMIZERS), default='sgd',
                        help='full, phases, real: the servers\' optimizer of every method '
                             '(default: %(default)s)')
    parser.add_argument('--seeds', default='1,2,3',
                        help='full, real: seeds (default: %(default)s)')
    parser.add_argument('--epochs', type=int, default=10,
                        help='full, real (default: %(default)s)')
    parser.add_argument('--method-epochs', default='', metavar='METHOD=N[,METHOD=N]',
                        help='full, real: these methods train N epochs instead of --epochs '
                             '(e.g. sync=3,k4-ternary-pull-int8=5)')
    parser.add_argument('--networks', default=','.join(NETWORKS),
                        help='phases, real (default: %(default)s)')
    parser.add_argument('--rounds', type=int, default=3, help='phases (default: %(default)s)')
    parser.add_argument('--phase-steps', metavar='WARMUP,STEPS',
                        help='phases: these warm-up and delayed steps on every network instead '
                             'of the defaults (%s); for quick checks' % ', '.join(
                                 '%s %d,%d' % (n, v[2], v[3]) for n, v in NETWORKS.items()))
    parser.add_argument('--real-target', default='epoch1', metavar='epochN|ACCURACY',
                        help="report: the real runs' target, dist_sync's mean accuracy at the "
                             'end of epoch N of the full runs (a folder of real runs alone: of '
                             'its real runs on each link), or a test accuracy '
                             '(default: %(default)s)')
    parser.add_argument('--workers', type=int, default=harness.NUM_WORKERS,
                        help='full, phases, real: workers of every job (default: %(default)s)')
    parser.add_argument('--servers', type=int, default=1,
                        help='full, phases, real: servers of every job (default: %(default)s)')
    parser.add_argument('--data-dir', default='/usr/share/datasets/fashion-mnist')
    args = parser.parse_args(argv)
    for name in ('workers', 'servers'):
        if getattr(args, name) < 1:
            parser.error('--%s %d: give 1 or more' % (name, getattr(args, name)))
    try:
        args.real_target = real_target(args.real_target)
    except ValueError as err:
        parser.error(str(err))
    if args.phase_steps:
        warmup, steps = (int(v) for v in args.phase_steps.split(','))
        for name, value in list(NETWORKS.items()):
            NETWORKS[name] = value[:2] + (warmup, steps) + value[4:]
    args.methods = [m for m in args.methods.split(',') if m]
    try:
        args.method_epochs = method_epochs(args.method_epochs)
    except ValueError as err:
        parser.error(str(err))
    args.seeds = [int(s) for s in args.seeds.split(',') if s]
    args.networks = [n for n in args.networks.split(',') if n]
    for name in args.methods:
        if not known_method(name):
            parser.error('unknown method %s' % name)
    for name in args.networks:
        if name not in NETWORKS:
            parser.error('unknown network %s' % name)
    for name in args.method_epochs:
        if name not in args.methods:
            parser.error('--method-epochs names %s, which --methods (%s) does not run; name '
                         'a method of --methods' % (name, ','.join(args.methods)))
    return args


def method_epochs(text):
    """``--method-epochs``: ``{method: epochs}`` from ``'sync=3,k4=5'`` (``{}`` for ``''``)."""
    epochs = {}
    for item in (i for i in text.split(',') if i):
        match = re.fullmatch(r'([\w-]+)=([1-9][0-9]*)', item)
        if not match:
            raise ValueError('--method-epochs: %r is not METHOD=N with N >= 1 (e.g. sync=3)'
                             % item)
        epochs[match.group(1)] = int(match.group(2))
    return epochs


def epochs_of(args, method):
    """The epochs `method` trains: its ``--method-epochs`` entry, else ``--epochs``."""
    return args.method_epochs.get(method, args.epochs)


def real_target(text):
    """``--real-target``: ``('epoch', N)`` for ``epochN``, or ``('accuracy', value)``."""
    match = re.fullmatch(r'epoch([1-9][0-9]*)', text)
    if match:
        return ('epoch', int(match.group(1)))
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not 0 < value <= 1:
        raise ValueError('--real-target must be epochN (dist_sync\'s mean accuracy at the end '
                         'of epoch N, e.g. epoch1) or a test accuracy in (0, 1], got %r' % text)
    return ('accuracy', value)


# -- one job -------------------------------------------------------------------------------
def _step_ends(results):
    """The first worker's first step start, and each step's end on the slower worker after it."""
    t0 = min(r['first'] for r in results)
    return t0, [max(pair) - t0 for pair in zip(*(r['all_step_ends'] for r in results))]


def _meta(args, argv):
    return harness.start_meta(harness.command_line(COMMAND, argv), settings={
        'methods': args.methods, 'seeds': args.seeds, 'epochs': args.epochs,
        'method_epochs': args.method_epochs,
        'optimizer': args.optimizer,
        'networks': {n: NETWORKS[n] for n in args.networks}, 'rounds': args.rounds,
        'full_warmup': FULL_WARMUP, 'eval_every': eval_every(args.workers),
        'workers': args.workers, 'servers': args.servers,
        'warmups': {m: warmup_of(m) for m in args.methods if not is_stock(m)}})


# -- full runs -----------------------------------------------------------------------------
def train_run(args, part, method, seed, folder, timeout, hostfile=None, key=None):
    """One training run of ``full`` (``--epochs``, evaluation after training) under `part`'s
    name in the log; `key` (e.g. the network) starts its row and its evaluations.

    Returns (run row, evaluation rows): the evaluations have the wall time of training to
    each (from the first worker's first step to that step's end on the slower worker).
    """
    key = dict(key or {})
    worker_args = ['--epochs', str(epochs_of(args, method)), '--seed', str(seed),
                   '--warmup-steps', str(warmup_of(method)),
                   '--eval-every', str(eval_every(args.workers)),
                   '--data-dir', args.data_dir] + OPTIMIZERS[args.optimizer][1]
    code, results, monitor, info = harness.run_method(folder, METHODS[method], worker_args,
                                                      timeout, hostfile, args.workers,
                                                      args.servers)
    row = dict(key, method=method, seed=seed, exit=code, **info)
    name = ' '.join([part] + [str(v) for v in key.values()] + [method])
    if code != 0:
        _LOG.error('%s seed %d FAILED (exit %s): see %s', name, seed, code, folder)
        return row, []
    t0, ends = _step_ends(results)
    end = max(r['end'] for r in results) - t0
    per_epoch = results[0]['steps_per_epoch']
    row.update(steps=len(ends), train_s=end, first_step_s=ends[0],
               eval_s=results[0]['eval_s'], cpu_other=monitor.usage(t0, t0 + end)['other'],
               mean_loss=results[0]['mean_loss'])
    evals = [dict(key, method=method, seed=seed, step=record['step'],
                  epoch=round(record['epoch'], 4), test_acc=record['test_acc'],
                  wall_s=ends[record['step'] - 1], epoch_end=record['step'] % per_epoch == 0)
             for record in results[0]['evals']]
    _LOG.info('%s seed %d: %.1f s training; test acc per epoch %s; %s', name,
              seed, end, ' '.join('%.4f' % r['test_acc'] for r in results[0]['evals']
                                  if r['step'] % per_epoch == 0), row['stock_check'])
    return row, evals


def part_full(args, meta):
    evals, runs = [], []
    for index, seed in enumerate(args.seeds):
        for method in harness.ordered(args.methods, index + 1):
            folder = os.path.join(args.scratch, 'full', '%s-s%d' % (method, seed))
            row, run_evals = train_run(args, 'full', method, seed, folder,
                                       300 + epochs_of(args, method)
                                       * steps_per_epoch(args.workers)
                                       * 0.5 * args.workers)
            runs.append(row)
            if row['exit'] != 0:
                continue
            evals += run_evals
            report_lib.write_csv(os.path.join(args.out, 'full-evals.csv'), evals)
            report_lib.write_csv(os.path.join(args.out, 'full-runs.csv'), runs)
    return runs


# -- real runs on shaped links -------------------------------------------------------------
def part_real(args, meta):
    """``full``'s runs on each network of ``--networks``, one set of namespaces per network."""
    evals, runs = [], []
    for net_name in args.networks:
        _, rate, _, _, bound = NETWORKS[net_name]
        with harness.shaped_network(1 + args.servers + args.workers, rate,
                                    'mxtta-') as (_, hostfile):
            for index, seed in enumerate(args.seeds):
                for method in harness.ordered(args.methods, index + 1):
                    folder = os.path.join(args.scratch, 'real',
                                          '%s-%s-s%d' % (net_name, method, seed))
                    row, run_evals = train_run(args, 'real', method, seed, folder,
                                               300 + epochs_of(args, method)
                                               * steps_per_epoch(args.workers) * bound,
                                               hostfile,
                                               {'network': net_name})
                    runs.append(row)
                    evals += run_evals
                    report_lib.write_csv(os.path.join(args.out, 'real-runs.csv'), runs)
                    if evals:
                        report_lib.write_csv(os.path.join(args.out, 'real-evals.csv'), evals)
    return runs


# -- phase runs ----------------------------------------------------------------------------
def phase_row(results, warmup, steps):
    """Per-phase step times of one short run, from both workers' step ends."""
    t0, ends = _step_ends(results)
    durations = [b - a for a, b in zip(ends, ends[1:])]
    switch = warmup + 1  # steps 1..switch are synchronous (the switch step included)
    start = min(r['start'] for r in results)
    end = max(r['end'] for r in results)
    return dict(first_step_s=ends[0], sync_steps=switch - 1,
                sync_step_ms=1000 * statistics.mean(durations[:switch - 1]),
                delayed_steps=steps,
                delayed_step_ms=1000 * (ends[switch + steps - 1] - ends[switch - 1]) / steps,
                drain_s=end - t0 - ends[-1],
                window_samples_per_s=len(results) * steps * BATCH / (end - start),
                losses=results[0]['losses'], window=(start - t0, end - t0))


def part_phases(args, meta):
    rows = []
    plan = []
    for net_name in args.networks:
        plan.append((net_name, NETWORKS[net_name], args.rounds))
        if net_name == 'loopback':
            # One run per method on loopback with each shaped network's steps: the same
            # losses there and on the shaped links show that timing does not change training.
            for other in args.networks:
                if NETWORKS[other][1]:
                    plan.append(('loopback-as-%s' % other, ('loopback',  None)
                                 + NETWORKS[other][2:4] + (1.0,), 1))
    for net_name, (label, rate, warmup, steps, bound), rounds in plan:
        with harness.shaped_network(1 + args.servers + args.workers, rate,
                                    'mxtta-') as (_, hostfile):
            for round_index in range(1, rounds + 1):
                for method in harness.ordered(args.methods, round_index):
                    folder = os.path.join(args.scratch, 'phases',
                                          '%s-%s-r%d' % (net_name, method, round_index))
                    worker_args = ['--warmup-steps', str(warmup), '--steps', str(steps),
                                   '--seed', '1', '--data-dir', args.data_dir
                                   ] + OPTIMIZERS[args.optimizer][1]
                    code, results, monitor, info = harness.run_method(
                        folder, METHODS[method], worker_args,
                        120 + (warmup + 1 + steps) * bound, hostfile, args.workers,
                        args.servers)
                    info.pop('job_s')
                    row = dict(network=net_name, method=method, round=round_index, exit=code,
                               warmup=warmup, steps=steps, **info)
                    if code == 0:
                        detail = phase_row(results, warmup, steps)
                        losses = detail.pop('losses')
                        start, end = detail.pop('window')
                        t0 = min(r['first'] for r in results)
                        other = monitor.usage(t0 + start, t0 + end)['other']
                        row.update(detail, cpu_other=other, noisy=other > report_lib.NOISE_CORES,
                                   loss_digest=hashlib.sha1(json.dumps(losses).encode())
                                   .hexdigest()[:12])
                        _LOG.info('%s %s r%d: first %.2f s, sync %.1f ms, delayed %.1f ms, '
                                  '%.0f samples/s; other %.2f cores; %s', net_name, method,
                                  round_index, row['first_step_s'], row['sync_step_ms'],
                                  row['delayed_step_ms'], row['window_samples_per_s'],
                                  row['cpu_other'], row['stock_check'])
                    else:
                        _LOG.error('%s %s r%d FAILED (exit %s): see %s', net_name, method,
                                   round_index, code, folder)
                    rows.append(row)
                    report_lib.write_csv(os.path.join(args.out, 'phases-runs.csv'), rows)
    return rows



def main(argv=None):
    """Run the part ``--part`` of `argv` (default: this process's arguments)."""
    logging.basicConfig(level=logging.INFO, format='%(asctime)s %(message)s', datefmt='%H:%M:%S')
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.scratch, exist_ok=True)
    if args.part == 'report':
        if (not os.path.exists(os.path.join(args.out, 'full-evals.csv'))
                and os.path.exists(os.path.join(args.out, 'real-runs.csv'))):
            for row in report_lib.read_csv(os.path.join(args.out, 'real-runs.csv')):
                known_method(row['method'])
            tta_real.build_report(args.out, args.real_target,
                                  {name: method.label for name, method in METHODS.items()},
                                  {name: value[0] for name, value in NETWORKS.items()})
        else:
            build_report(args.out, args.real_target)
        _LOG.info('wrote %s', os.path.join(args.out, 'results.md'))
        return 0
    if args.part in ('phases', 'real') and any(NETWORKS[n][1] for n in args.networks):
        reason = netns.netns_available()
        if reason:
            _LOG.error('shaped networks unavailable: %s', reason)
            return 2
        stale = netns.remove_stale()
        if stale:
            _LOG.warning('deleted namespaces left by a killed benchmark: %s', ', '.join(stale))
    meta = _meta(args, argv)
    _LOG.info('%s', meta['command'])
    part = {'full': part_full, 'phases': part_phases, 'real': part_real}[args.part]
    # A stop signal unwinds the part: Job.run stops the launcher (which stops its roles), the
    # `with` of the namespaces deletes them, and the meta file is written.
    with harness.interruptible():
        try:
            rows = part(args, meta)
        except harness.Interrupted as stop:
            _LOG.error('stopped by %s; the job and the namespaces are cleaned up', stop)
            return 128 + stop.signum
        finally:
            report_lib.write_json(os.path.join(args.out, 'meta-%s.json' % args.part),
                                  harness.finish_meta(meta))
    failed = [row for row in rows if row['exit'] != 0]
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
