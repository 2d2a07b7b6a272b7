"""The report of ``benchmarks/tta.py`` (``--part report``): time to accuracy derived from the
full runs and the per-phase step times, the accuracy over seeds, and the check of the
derivation against real runs on shaped links; written as ``tta.json`` and, by
``tta_page.py``, ``results.md``. No run."""
import os
import statistics

import report as report_lib
import tta_real
from tta_page import write_markdown
from tta_setup import METHODS, NETWORKS, is_stock, job_shape, known_method, warmup_of

__all__ = ['derived_time', 'real_check', 'build_report']


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
                  eval_every=min(e['step'] for e in evals), job=job_shape(metas),
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
