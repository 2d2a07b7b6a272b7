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
import provenance
import netns
import report as report_lib
import tta_real

_LOG = logging.getLogger('tta')
COMMAND = 'python benchmarks/tta.py'   # what the results files record as the command's start

REPO = harness.REPO
BATCH = harness.BATCH
TRAIN_IMAGES = 60000
METHODS = harness.methods('sync', 'k2', 'k4', 'k8', 'drift-k4', 'drift-k8')
#: What --methods runs unless told (the drift rule's runs are asked for by name).
DEFAULT_METHODS = ('sync', 'k2', 'k4', 'k8')
#: network -> (label, tc rate or None, phase-run warm-up steps, delayed steps, s/step bound)
NETWORKS = {name: harness.NETWORKS[name][:2] + steps for name, steps in (
    ('loopback', (100, 304, 1.0)), ('1gbit', (40, 80, 2.0)), ('100mbit', (12, 32, 10.0)))}
FULL_WARMUP = 200      # the default of DelayedTrainer and of the example
#: --optimizer -> (label, bench_worker arguments): the servers' optimizer of every method.
#: LAMB's rate: the best of 0.002, 0.005, 0.01, 0.02 in a 2-epoch single-process pilot of
#: gluon.Trainer at batch 256 (0.8715 after 2 epochs; 0.02 fell to 0.80).
OPTIMIZERS = {
    'sgd': ('SGD (lr 0.05, momentum 0.9)', []),
    'lamb': ('LAMB (lr 0.005, wd 0)', ['--optimizer', 'lamb', '--lr', '0.005', '--wd', '0']),
    'adam': ('Adam (lr 1e-3, wd 0)', ['--optimizer', 'adam', '--lr', '0.001', '--wd', '0']),
}


def steps_per_epoch(workers):
    """Steps of an epoch with `workers` workers (bench_worker's shards: whole batches)."""
    return TRAIN_IMAGES // (BATCH * workers)


def eval_every(workers):
    """Steps between worker 0's kept weights: a third of an epoch (78 with 2 workers)."""
    return steps_per_epoch(workers) // 3


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


def known_method(name):
    """Whether `name` is a method here; any method of harness.METHODS becomes one (report:
    a folder's runs name their methods again)."""
    if name not in METHODS and name in harness.METHODS:
        METHODS.update(harness.methods(name))
    return name in METHODS


def job_of(meta):
    """``(workers, servers, optimizer)`` that a part's meta file records (files from before
    ``--workers`` and ``--optimizer``: 2, 1, ``'sgd'``)."""
    settings = meta.get('settings', {})
    return (settings.get('workers', harness.NUM_WORKERS), settings.get('servers', 1),
            settings.get('optimizer', 'sgd'))


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
def is_stock(method):
    """Whether `method` is a stock baseline (bench_worker's ``--mode sync``: no mxdelay)."""
    return METHODS[method].stock


def warmup_of(method):
    """The warm-up steps of `method`'s full runs: its own (:attr:`harness.Method.warmup`), or
    FULL_WARMUP."""
    warmup = METHODS[method].warmup
    return FULL_WARMUP if warmup is None else warmup


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


# -- report --------------------------------------------------------------------------------
def derived_time(step, method, times):
    """Derived wall time of step `step` (1-based) from per-phase times (seconds)."""
    n_sync = step if is_stock(method) else min(step, warmup_of(method) + 1)
    n_delayed = step - n_sync
    return (times['first_step_s'] + (n_sync - 1) * times['sync_step_ms'] / 1000
            + n_delayed * times['delayed_step_ms'] / 1000)


def real_check(out, evals, accuracy, times, real_target):
    """The check of the derivation on shaped links, from ``real``'s files in `out`.

    Per real run: the real wall time to the target (the first evaluation at or above it) and
    the time derived for the same link, method and target from the full run of the same seed
    (its first evaluation at or above the target) and ``phases``' step times; their ratio
    (derived / real); and whether the real run trained as the full run did (the largest
    difference of their test accuracies at the same steps). `real_target`:
    :func:`real_target`'s value.
    """
    real_runs = report_lib.read_csv(os.path.join(out, 'real-runs.csv'))
    evals_file = os.path.join(out, 'real-evals.csv')
    real_evals = report_lib.read_csv(evals_file) if os.path.exists(evals_file) else []
    kind, value = real_target
    if kind == 'epoch':
        row = next((a for a in accuracy.get('sync', []) if a['epoch'] == value), None)
        if row is None:
            raise ValueError('--real-target epoch%d: the full runs in %s have no dist_sync '
                             'accuracy at the end of epoch %d; give an epoch they have or an '
                             'accuracy' % (value, out, value))
        target = row['mean']
        definition = ("mean over seeds %s of dist_sync's test accuracy after epoch %d (full "
                      'runs)' % (', '.join(str(v) for v in sorted({
                          e['seed'] for e in evals if e['method'] == 'sync'})), value))
    else:
        target, definition = value, 'test accuracy %g (--real-target)' % value

    checks = []
    for run in real_runs:
        net_name, method, seed = run['network'], run['method'], run['seed']
        check = dict(network=net_name, method=method, seed=seed, exit=run['exit'],
                     cpu_other=run.get('cpu_other'), real_step=None, real_s=None,
                     full_step=None, derived_s=None, ratio=None, max_acc_diff=None, evals=[])
        checks.append(check)
        points = tta_real.run_points(real_evals, net_name, run)
        full = {e['step']: e for e in evals if e['method'] == method and e['seed'] == seed}
        phase_times = times.get((net_name, method))
        for point in points:
            derived = (derived_time(point['step'], method, phase_times) if phase_times
                       else None)
            same = full.get(point['step'])
            check['evals'].append(dict(step=point['step'], epoch=point['epoch'],
                                       test_acc=point['test_acc'], real_s=point['wall_s'],
                                       full_test_acc=same['test_acc'] if same else None,
                                       derived_s=derived))
        common = [e for e in check['evals'] if e['full_test_acc'] is not None]
        if common:
            check['max_acc_diff'] = max(abs(e['test_acc'] - e['full_test_acc']) for e in common)
        hit = tta_real.first_hit(points, target)
        full_hit = tta_real.first_hit(full.values(), target)
        if hit:
            check.update(real_step=hit['step'], real_s=hit['wall_s'])
        if full_hit:
            check['full_step'] = full_hit['step']
            if phase_times:
                check['derived_s'] = derived_time(full_hit['step'], method, phase_times)
        if hit and check['derived_s'] is not None:
            check['ratio'] = check['derived_s'] / hit['wall_s']
        if points:
            check.update(last_step=points[-1]['step'], last_acc=points[-1]['test_acc'])
    return dict(target=target, target_definition=definition, runs=checks,
                rows=real_runs)


def build_report(out, real_target=('epoch', 1)):
    evals = report_lib.read_csv(os.path.join(out, 'full-evals.csv'))
    runs = report_lib.read_csv(os.path.join(out, 'full-runs.csv'))
    phases_file = os.path.join(out, 'phases-runs.csv')
    # A folder of accuracy runs alone (no phases part) reports accuracy only.
    phases = report_lib.read_csv(phases_file) if os.path.exists(phases_file) else []
    # Every method of the folder's runs, as --methods would name it (a folder combined from
    # several invocations may hold phase runs of methods without accuracy runs).
    for row in evals + phases:
        known_method(row['method'])
    metas = {part: report_lib.read_json(os.path.join(out, 'meta-%s.json' % part))
             for part in ('full', 'phases', 'real')
             if os.path.exists(os.path.join(out, 'meta-%s.json' % part))}
    seeds = sorted({e['seed'] for e in evals})
    # Methods whose full runs cover fewer seeds than the folder's are left out of the tables
    # over seeds (their means would not be comparable), and named in the report.
    seeds_of = {m: sorted({e['seed'] for e in evals if e['method'] == m}) for m in METHODS}
    methods = [m for m in METHODS if seeds_of[m] == seeds]
    partial = {m: seeds_of[m] for m in METHODS if seeds_of[m] and seeds_of[m] != seeds}
    epochs = sorted({int(e['epoch']) for e in evals if e['epoch_end'] in (True, 'True')})

    def acc(method, seed, step):
        return next(e['test_acc'] for e in evals
                    if e['method'] == method and e['seed'] == seed and e['step'] == step)

    steps_of = {e['step']: e['epoch'] for e in evals}
    per_epoch = min(e['step'] for e in evals if e['epoch_end'] in (True, 'True'))
    # 1. accuracy per epoch over seeds
    accuracy = {}
    for method in methods:
        accuracy[method] = []
        for epoch in epochs:
            values = [acc(method, seed, epoch * per_epoch) for seed in seeds]
            accuracy[method].append(dict(epoch=epoch, mean=statistics.mean(values),
                                         min=min(values), max=max(values),
                                         sd=statistics.stdev(values) if len(values) > 1 else 0.0,
                                         values=values))
    target = next(a['mean'] for a in accuracy['sync'] if a['epoch'] == 5)
    # steps to the target, per seed (no link involved): the first evaluation at or above it
    steps_to_target = {}
    for method in methods:
        steps_to_target[method] = []
        for seed in seeds:
            hit = min((e for e in evals if e['method'] == method and e['seed'] == seed
                       and e['test_acc'] >= target), key=lambda e: e['step'], default=None)
            steps_to_target[method].append(None if hit is None else dict(
                step=hit['step'], epoch=hit['epoch'], test_acc=hit['test_acc']))
    # 2. per-phase times: median over rounds
    networks = [n for n in NETWORKS if any(p['network'] == n for p in phases)]
    times = {}
    for net_name in networks:
        for method in METHODS:  # every method timed, with or without full runs
            rows = [p for p in phases if p['network'] == net_name and p['method'] == method
                    and p['exit'] == 0]
            if not rows:
                continue
            times[net_name, method] = {
                key: statistics.median(r[key] for r in rows)
                for key in ('first_step_s', 'sync_step_ms', 'delayed_step_ms',
                            'window_samples_per_s')}
            times[net_name, method].update(
                rounds=len(rows), noisy=sum(1 for r in rows if r.get('noisy') in (True, 'True')),
                window_min=min(r['window_samples_per_s'] for r in rows),
                window_max=max(r['window_samples_per_s'] for r in rows))
        # A method without phase runs takes those of a timed method with the same job (the
        # warm-up's length changes how many steps are synchronous, not how long each takes).
        for method in methods:
            if (net_name, method) in times:
                continue
            source = next((m for m in METHODS if (net_name, m) in times
                           and 'phases_of' not in times[net_name, m]
                           and METHODS[m].job == METHODS[method].job), None)
            if source:
                times[net_name, method] = dict(times[net_name, source], phases_of=source)
    # 3. time to accuracy, per seed: the first evaluation at or above the target
    tta = {}
    for net_name in networks:
        for method in methods:
            if (net_name, method) not in times:
                continue
            per_seed = []
            for seed in seeds:
                points = sorted((e for e in evals if e['method'] == method and e['seed'] == seed),
                                key=lambda e: e['step'])
                hit = next((e for e in points if e['test_acc'] >= target), None)
                per_seed.append(None if hit is None else dict(
                    step=hit['step'], epoch=hit['epoch'],
                    derived_s=derived_time(hit['step'], method, times[net_name, method]),
                    real_s=hit['wall_s'] if net_name == 'loopback' else None))
            tta[net_name, method] = per_seed
    # 4. accuracy at a fixed wall time: dist_sync's derived time of epoch 5 on that link
    fixed = {}
    for net_name in networks:
        if (net_name, 'sync') not in times:
            continue
        budget = derived_time(5 * per_epoch, 'sync', times[net_name, 'sync'])
        for method in methods:
            if (net_name, method) not in times:
                continue
            values = []
            for seed in seeds:
                points = [e for e in evals if e['method'] == method and e['seed'] == seed
                          and derived_time(e['step'], method, times[net_name, method]) <= budget]
                best = max(points, key=lambda e: e['step']) if points else None
                values.append(dict(step=best['step'], epoch=best['epoch'],
                                   test_acc=best['test_acc']) if best else None)
            fixed[net_name, method] = dict(budget_s=budget, per_seed=values)
    # 5. validation on loopback: derived vs real time of every epoch end
    validation = []
    if any(n == 'loopback' for n in networks):
        for method in methods:
            if ('loopback', method) not in times:
                continue
            for epoch in (1, 5, 10):
                real = [e['wall_s'] for e in evals if e['method'] == method
                        and e['step'] == epoch * per_epoch]
                if not real:
                    continue
                derived = derived_time(epoch * per_epoch, method, times['loopback', method])
                quiet_seeds = {r['seed'] for r in runs if r['method'] == method
                               and r.get('cpu_other', 1.0) <= report_lib.NOISE_CORES}
                quiet = [e['wall_s'] for e in evals if e['method'] == method
                         and e['step'] == epoch * per_epoch and e['seed'] in quiet_seeds]
                validation.append(dict(method=method, epoch=epoch,
                                       real_mean_s=statistics.mean(real),
                                       real_min_s=min(real), real_max_s=max(real),
                                       derived_s=derived,
                                       ratio=derived / statistics.mean(real),
                                       quiet_seeds=sorted(quiet_seeds),
                                       quiet_ratio=derived / statistics.mean(quiet)
                                       if quiet else None))
    # 6. timing independence: the losses of runs with the same method and steps
    same = {}
    for p in phases:
        if p['exit'] == 0:
            same.setdefault((p['method'], p['warmup'], p['steps']), []).append(p)
    determinism = [dict(method=m, warmup=w, steps=n,
                        runs=['%s r%s' % (p['network'], p['round']) for p in rows],
                        digests=sorted({str(p['loss_digest']) for p in rows}))
                   for (m, w, n), rows in same.items()]
    result = dict(target=target, determinism=determinism,
                  target_definition="mean over seeds of dist_sync's test accuracy after epoch 5",
                  seeds=seeds, per_epoch=per_epoch, partial=partial,
                  eval_every=min(e['step'] for e in evals), job=_job_shape(metas),
                  accuracy=accuracy, steps_to_target=steps_to_target,
                  warmups={m: warmup_of(m) for m in methods if not is_stock(m)},
                  times={'%s/%s' % k: v for k, v in times.items()},
                  tta={'%s/%s' % k: v for k, v in tta.items()},
                  fixed_time={'%s/%s' % k: v for k, v in fixed.items()},
                  validation=validation, runs=runs, metas=metas, steps_of=len(steps_of))
    # 7. the check on shaped links: real runs of `real`, derived beside real
    if os.path.exists(os.path.join(out, 'real-runs.csv')):
        result['real'] = real_check(out, evals, accuracy, times, real_target)
    report_lib.write_json(os.path.join(out, 'tta.json'), result)
    write_markdown(out, result, methods, networks, phases)
    return result


def _cell(row, key, pattern):
    """`row`'s `key` by `pattern`, '-' where the run has none (a failed run)."""
    return pattern % row[key] if key in row else '-'


def _spread(values, text=lambda v: '%.4f' % v):
    return '%s (%s-%s)' % (text(statistics.mean(values)), text(min(values)), text(max(values)))


def _warmup_text(methods, steps='steps'):
    """The delayed methods' warm-ups in words: one number if all have the same."""
    warmups = {m: warmup_of(m) for m in methods if not is_stock(m)}
    if len(set(warmups.values())) <= 1:
        return '%d %s' % (next(iter(warmups.values()), FULL_WARMUP), steps)
    return ', '.join('%d %s (%s)' % (w, steps, METHODS[m].label) for m, w in warmups.items())


def _job_shape(metas):
    """``(workers, servers)`` of the folder's runs (meta files before ``--workers``: 2, 1)."""
    shapes = {job_of(m)[:2] for m in metas.values() if 'settings' in m}
    if len(shapes) > 1:
        raise ValueError('the parts of this folder ran different jobs (workers, servers): %s; '
                         'give each job its own --out' % sorted(shapes))
    return list(shapes.pop()) if shapes else [harness.NUM_WORKERS, 1]


def _optimizer_label(result):
    """The full runs' optimizer (runs from before --optimizer: SGD)."""
    return OPTIMIZERS[job_of(result['metas'].get('full', {}))[2]][0]


def write_markdown(out, result, methods, networks, phases):
    label = {m: METHODS[m].label for m in METHODS}
    table = report_lib.table
    lines = ['# Time to accuracy, accuracy over seeds, per-phase step times',
             '', 'Generated by `%s --part report` from the CSV files in this ' % COMMAND +
             'folder; do not edit. How they were made: `benchmarks/tta.py` (docstring) and '
             '%s (rules).' % report_lib.rules_link(out), '']
    for part in ('full', 'phases', 'real'):
        meta = result['metas'].get(part)
        # A folder combined from several (by benchmarks/tta_combine.py, up to commit cb88aae).
        if meta and 'sources' in meta:
            lines.append('- %s: the runs of %d folder%s (`benchmarks/tta_combine.py`):' % (
                part, len(meta['sources']), '' if len(meta['sources']) == 1 else 's'))
            lines += ['  - `%s`%s: %s' % (source['folder'], ' (%s)' % ', '.join(
                source['methods']) if source['methods'] else '', source['line'])
                for source in meta['sources']]
        elif meta:
            lines.append('- %s: %s' % (part, provenance.meta_line(meta)))
    accuracy = result['accuracy']
    lines += ['', '## Test accuracy over %d seeds (loopback, real runs, %d epochs)' % (
        len(result['seeds']), len(accuracy['sync'])), '',
        "Worker 0's weights after each epoch, on the 10000 test images; mean (min-max) over "
        'seeds %s. Every job: %d workers, %d server%s. Optimizer: %s. Delayed methods: rule '
        '`mirror`, warm-up %s.' % (', '.join(str(s) for s in result['seeds']), result['job'][0],
                                   result['job'][1], '' if result['job'][1] == 1 else 's',
                                   _optimizer_label(result), _warmup_text(methods)),
        '']
    if result.get('partial'):
        lines += ['Left out of every table over seeds (full runs of fewer seeds): %s.' % '; '.join(
            '%s (seed %s)' % (label[m], ', '.join(str(s) for s in seeds))
            for m, seeds in result['partial'].items()), '']
    lines += table(['epoch'] + [label[m] for m in methods], [
        [row['epoch']] + ['%.4f (%.4f-%.4f)' % (accuracy[m][index]['mean'], accuracy[m][index][
            'min'], accuracy[m][index]['max']) for m in methods]
        for index, row in enumerate(accuracy['sync'])], 'r' * (len(methods) + 1))
    lines += ['', 'Mean minus dist_sync\'s mean, in points (the targets: within 0.5):', '']
    lines += table(['epoch'] + [label[m] for m in methods[1:]], [
        [row['epoch']] + ['%+.2f' % (100 * (accuracy[m][index]['mean'] - row['mean']))
                          for m in methods[1:]]
        for index, row in enumerate(accuracy['sync'])]
        + [['lowest'] + ['%+.2f' % (min(
            100 * (a['mean'] - s['mean']) for a, s in zip(accuracy[m], accuracy['sync'])))
            for m in methods[1:]]], 'r' * len(methods))
    lines += ['', '## Steps to %.4f (dist_sync\'s mean epoch-5 accuracy)' % result['target'], '',
              'The first evaluation (every %d steps, a third of an epoch; %d steps an epoch) '
              'at or above the target, per seed (%s): step (epoch); the same steps on any '
              'link.' % (result['eval_every'], result['per_epoch'],
                         ', '.join(str(s) for s in result['seeds'])), '']
    lines += table(['method', 'warm-up'] + ['seed %d' % s for s in result['seeds']] + [
        'mean step, seeds reaching it'], [
            [label[m], '-' if is_stock(m) else warmup_of(m)] + [
                '%d (%.2g)' % (p['step'], p['epoch']) if p else 'not reached'
                for p in result['steps_to_target'][m]] + [
                '%.0f, %d of %d' % (statistics.mean(p['step'] for p in reached), len(reached),
                                    len(result['seeds'])) if reached else '-']
            for m in methods for reached in [[p for p in result['steps_to_target'][m] if p]]],
        'lr' + 'r' * (len(result['seeds']) + 1))
    lines += ['', '## Per-phase step times (median over rounds)', '',
              'Short runs with seed 1, interleaved; synchronous = stock steps of dist_sync or '
              'the warm-up steps of a delayed method; first step includes the kvstore\'s '
              'initial push.', '']
    times = [(n, m, result['times'].get('%s/%s' % (n, m))) for n in networks for m in METHODS]
    lines += table('network | method | rounds | first step | synchronous ms/step | delayed '
                   'ms/step | steady-state samples/s (delayed window; min-max)', [[
                       NETWORKS[n][0], label[m], '%d%s%s' % (t['rounds'], ' (%d noisy)' % t[
                           'noisy'] if t['noisy'] else '', ', those of %s (same job)' % label[
                               t['phases_of']] if 'phases_of' in t else ''),
                       '%.2f s' % t['first_step_s'],
                       '%.1f' % t['sync_step_ms'],
                       '-' if is_stock(m) else '%.1f' % t['delayed_step_ms'],
                       '%.0f (%.0f-%.0f)' % (t['window_samples_per_s'], t['window_min'],
                                             t['window_max'])] for n, m, t in times if t],
                   'llrrrrr')
    lines += ['', '## Time to accuracy %.4f (dist_sync\'s mean epoch-5 accuracy)' % result[
        'target'], '',
        'Wall time of training (evaluation excluded) until the first evaluation (every %d '
        'steps, a third of an epoch) at or above the target; mean (min-max) over seeds; '
        '*derived* from the real runs\' steps and the per-phase step times, the warm-up of '
        '%s included. Loopback also gives the real time of the full runs.'
        % (result['eval_every'], _warmup_text(methods, 'synchronous steps')), '']
    body = []
    for net_name in networks:
        cells = []
        for method in methods:
            per_seed = result['tta'].get('%s/%s' % (net_name, method))
            reached = [p for p in per_seed or [] if p]
            if per_seed is None or not reached:
                cells.append('-' if per_seed is None else 'not reached')
                continue
            text = '%s, %s epochs' % (_spread([p['derived_s'] for p in reached],
                                              report_lib.seconds),
                                      '/'.join('%.2g' % p['epoch'] for p in reached))
            if len(reached) < len(per_seed):
                text += ', %d of %d seeds' % (len(reached), len(per_seed))
            cells.append(text)
        body.append([NETWORKS[net_name][0]] + cells)
        if net_name == 'loopback':
            real = {m: [p['real_s'] for p in result['tta'].get('loopback/%s' % m) or [] if p]
                    for m in methods}
            body.append(['loopback, real wall time of the full runs'] + [
                _spread(real[m], report_lib.seconds) if real[m] else '-' for m in methods])
    lines += table(['network'] + [label[m] for m in methods], body)
    lines += ['', 'Speed-up of time to accuracy over dist_sync (ratio of the means):', '']
    body = []
    for net_name in networks:
        base = result['tta'].get('%s/sync' % net_name)
        if not base or not all(base):
            continue
        base_mean = statistics.mean(p['derived_s'] for p in base)
        cells = []
        for method in methods[1:]:
            per_seed = result['tta'].get('%s/%s' % (net_name, method))
            cells.append('%.2fx' % (base_mean / statistics.mean(p['derived_s'] for p in per_seed))
                         if per_seed and all(per_seed) else '-')
        body.append([NETWORKS[net_name][0]] + cells)
        if net_name == 'loopback':
            real = {m: [p['real_s'] for p in result['tta'].get('loopback/%s' % m) or [] if p]
                    for m in methods}
            if real['sync'] and all(len(real[m]) == len(real['sync']) for m in methods):
                body.append(['loopback, real wall time of the full runs'] + [
                    '%.2fx' % (statistics.mean(real['sync']) / statistics.mean(real[m]))
                    for m in methods[1:]])
    lines += table(['network'] + [label[m] for m in methods[1:]], body)
    lines += ['', '## Accuracy at a fixed wall time', '',
              "The budget on each network is dist_sync's derived time to the end of epoch 5; "
              'accuracy of the last evaluation within it, mean (min-max) over seeds.', '']
    body = []
    for net_name in networks:
        sync = result['fixed_time'].get('%s/sync' % net_name)
        if not sync:
            continue
        cells = []
        for method in methods:
            f = result['fixed_time'].get('%s/%s' % (net_name, method))
            reached = [v for v in f['per_seed'] if v] if f else []
            cells.append('%s at epoch %s' % (_spread([v['test_acc'] for v in reached]), '/'.join(
                '%.2g' % v['epoch'] for v in reached)) if reached else '-')
        body.append([NETWORKS[net_name][0], report_lib.seconds(sync['budget_s'])] + cells)
    lines += table(['network', 'budget'] + [label[m] for m in methods], body)
    if result['validation']:
        lines += ['', '## Check of the derivation on loopback', '',
                  'Derived time (from the loopback per-phase times) against the real training '
                  'wall time of the full runs (mean and min-max over seeds), and against the '
                  'quiet full runs only (other processes used at most %g cores during the run; '
                  'all runs are in the tables).' % report_lib.NOISE_CORES, '']
        lines += table('method | epoch | real, all seeds | derived | derived / real | quiet '
                       'seeds | derived / real, quiet seeds', [[
                           label[v['method']], v['epoch'], '%.1f s (%.1f-%.1f)' % (
                               v['real_mean_s'], v['real_min_s'], v['real_max_s']),
                           '%.1f s' % v['derived_s'], '%.2f' % v['ratio'],
                           ', '.join(str(s) for s in v['quiet_seeds']) or 'none',
                           '%.2f' % v['quiet_ratio'] if v['quiet_ratio'] else '-']
                           for v in result['validation']], 'lrrrrlr')
    if 'real' in result:
        lines += _real_markdown(result['real'], label)
    lines += ['', '## Does timing change training?', '',
              'Per-step losses of worker 0 (a SHA-1 of the list) of the phase runs with the same '
              'method and steps, on different links, rounds, and loopback runs with the shaped '
              "links' steps (`loopback-as-...`). One digest for a group: bit-identical training "
              'whatever the link and timing.', '']
    lines += table('method | warm-up | delayed steps | runs | distinct loss digests', [
        [label[d['method']], d['warmup'], d['steps'], ', '.join(d['runs']),
         ' '.join(d['digests'])] for d in result['determinism']], 'lrrll')
    lines += ['', '## Runs', '', '### Full runs (loopback)', '']
    lines += table('method | seed | exit | training s | first step s | other cores | load '
                   'before/after | stock check | MXNET_* seen by the workers', [[
                       label[r['method']], r['seed'], r['exit'], _cell(r, 'train_s', '%.1f'),
                       _cell(r, 'first_step_s', '%.2f'), _cell(r, 'cpu_other', '%.2f'),
                       '%.2f / %.2f' % (r['load_before'], r['load_after']), r['stock_check'],
                       r['worker_env']] for r in result['runs']], 'lrrrrrlll')
    lines += ['', '### Phase runs', '']
    lines += table('network | method | round | exit | first s | sync ms | delayed ms | window '
                   'samples/s | other cores | load before/after | stock check | MXNET_* seen by '
                   'the workers | loss sum (seed 1)', [[
                       r['network'], label[r['method']], r['round'], r['exit'],
                       _cell(r, 'first_step_s', '%.2f'), _cell(r, 'sync_step_ms', '%.1f'),
                       _cell(r, 'delayed_step_ms', '%.1f'),
                       _cell(r, 'window_samples_per_s', '%.0f'),
                       _cell(r, 'cpu_other', '%.2f') + (
                           ' (noisy)' if r.get('noisy') in (True, 'True') else ''),
                       '%.2f / %.2f' % (r['load_before'], r['load_after']), r['stock_check'],
                       r['worker_env'], r.get('loss_digest', '-')] for r in phases],
                   'llrrrrrrrllll')
    if 'real' in result:
        lines += ['', '### Real runs (shaped links)', '']
        lines += table('network | method | seed | exit | training s | first step s | other '
                       'cores | load before/after | stock check | MXNET_* seen by the workers', [[
                           NETWORKS[r['network']][0], label[r['method']], r['seed'], r['exit'],
                           _cell(r, 'train_s', '%.1f'), _cell(r, 'first_step_s', '%.2f'),
                           _cell(r, 'cpu_other', '%.2f'),
                           '%.2f / %.2f' % (r['load_before'], r['load_after']), r['stock_check'],
                           r['worker_env']] for r in result['real']['rows']], 'llrrrrrlll')
    report_lib.write_lines(os.path.join(out, 'results.md'), lines)


def _seconds(value):
    return '-' if value is None else '%.1f s' % value


def _real_markdown(real, label):
    """The section of the real runs on shaped links (:func:`real_check`'s result)."""
    table = report_lib.table
    lines = ['', '## Check of the derivation on shaped links: real runs to %.4f' % real[
        'target'], '',
        'Target: %s. Real: the wall time of training (evaluation excluded) of a real run on the '
        'link (part `real`) to its first evaluation at or above the target. Derived: the time '
        'to the same target of the loopback full run of the same seed, from its steps and the '
        "link's per-phase step times (median over rounds), the warm-up included. Other cores: "
        'what other processes used during the real run (noisy above %g).'
        % (real['target_definition'], report_lib.NOISE_CORES), '']

    def at(step, seconds):
        return '-' if step is None else '%s (step %d)' % (_seconds(seconds), step)
    body = []
    for c in real['runs']:
        if c['exit'] != 0:
            real_cell = 'run failed (exit %s)' % c['exit']
        elif c['real_step'] is None:
            real_cell = 'not reached (%.4f at step %s)' % (c['last_acc'], c['last_step']) \
                if 'last_step' in c else 'not reached'
        else:
            real_cell = at(c['real_step'], c['real_s'])
        derived_cell = at(c['full_step'], c['derived_s']) if c['derived_s'] is not None else (
            'not reached in the full run' if c['full_step'] is None else 'no phases on the link')
        body.append([NETWORKS[c['network']][0], label[c['method']], c['seed'], real_cell,
                     derived_cell, '-' if c['ratio'] is None else '%.2f' % c['ratio'],
                     '-' if c['cpu_other'] is None else '%.2f%s' % (c['cpu_other'], (
                         ' (noisy)' if c['cpu_other'] > report_lib.NOISE_CORES else '')),
                     '-' if c['max_acc_diff'] is None else (
                         'yes' if c['max_acc_diff'] == 0 else 'no: up to %.4f apart'
                         % c['max_acc_diff'])])
    lines += table('network | method | seed | real time to target | derived time to target | '
                   'derived / real | other cores | test accuracies equal to the full run\'s',
                   body, 'llrrrrrl')
    lines += ['', 'Every evaluation of the real runs: real and derived wall time of training '
              'to that step.', '']
    lines += table('network | method | seed | step | epoch | test accuracy (full run) | real '
                   '| derived | derived / real', [[
                       NETWORKS[c['network']][0], label[c['method']], c['seed'], e['step'],
                       '%.2f' % e['epoch'], '%.4f (%s)' % (e['test_acc'], '-' if e[
                           'full_test_acc'] is None else '%.4f' % e['full_test_acc']),
                       _seconds(e['real_s']), _seconds(e['derived_s']),
                       '-' if e['derived_s'] is None else '%.2f' % (e['derived_s'] / e[
                           'real_s'])] for c in real['runs'] for e in c['evals']],
                   'llrrrrrrr')
    return lines


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
