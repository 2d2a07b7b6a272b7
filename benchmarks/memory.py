"""Memory of workers and servers: 'dist_delay' at k = 1, 4, 8 against stock 'dist_sync'.

Runs ``benchmarks/memory_worker.py`` with 2 workers and 2 servers on loopback, launched by
``mxdelay/launcher.py`` run as a plain file with an explicit environment (this one minus every
``DMLC_*``, ``MXNET_*`` and ``MXDELAY_*`` variable, plus ``OMP_NUM_THREADS=1``). The
``dist_sync`` jobs are stock MXNet in every process (each process checks and records it).

While a job runs, this driver reads ``/proc/<pid>/status`` of every process of the job
(every descendant of the launcher, labelled by its ``DMLC_ROLE`` and ``MXDELAY_RANK``) every
0.2 s: ``VmHWM`` (peak resident memory) and ``VmRSS``. *Steady* is ``VmRSS`` at the first
sample after every worker has finished its steps and its queued work (it then holds still
for 3 s before exiting); *peak* is the last ``VmHWM`` seen of the process.

Configurations, fixed here: models ``mlp`` (1,863,690 float32 parameters) and ``big``
(100,663,296), each with ``dist_sync`` and ``dist_delay`` k = 1, 4, 8 (slack k, R = k + 1
slots), one job at a time. A job is skipped, and says so, when the formula below predicts
more memory than ``MemAvailable`` minus 2 GiB (the machine is shared).

The formulas (float32 entries per parameter, SGD with momentum, rule ``'mirror'``, one
device), docs/design.md §3.5:

- stock worker: 2 (weights, gradients; MXNet pushes a one-device CPU gradient without a copy
  and receives the pull into it);
- mxdelay worker: R + 5 (weights, gradients, R slot buffers, ``pre_weight``, the mirror's
  momentum, the pull buffer); R + 2 in the warm-up;
- stock servers, all together: 3 (stored value, merge buffer, momentum);
- mxdelay servers, all together: 2R + 2 (R stored values, R merge buffers, ``W``, momentum).

Writes ``memory.json`` (every sample of every process, the commit, command, machine),
``memory.csv`` (one row per process), ``memory.md`` and ``memory.png`` into ``--out``.

Usage: ``python benchmarks/memory.py [--models mlp,big] [--ks 1,4,8]`` (``--report``: only rewrite
the Markdown and the plot from the JSON)
"""
import argparse
import os
import shlex
import subprocess
import sys
import tempfile
import time

import harness
from monitor import job_tree
import provenance
import report

HERE, REPO = harness.HERE, harness.REPO

NUM_WORKERS, NUM_SERVERS = 2, 2
PARAMETERS = {'mlp': 1863690, 'big': 6 * 4096 * 4096}
MIB = 1 << 20
MARGIN = 2 << 30
WARMUP = 3   # memory_worker.WARMUP


def formula(model, mode, k):
    """Predicted float32 entries per parameter: (each worker, all servers together)."""
    if mode == 'sync':
        return 2, 3
    slots = k + 1
    return slots + 5, 2 * slots + 2


def steps_of(mode, k):
    """Steps of a job: the warm-up, the switch and two whole periods (every slot used)."""
    return WARMUP + 1 + 2 * (k if mode == 'delay' else 8) + 1


def _status(pid):
    """(VmRSS, VmHWM) of `pid` in bytes, or None if it is gone."""
    values = {}
    try:
        with open('/proc/%d/status' % pid, encoding='ascii', errors='replace') as src:
            for line in src:
                if line.startswith(('VmRSS:', 'VmHWM:')):
                    name, value = line.split(':', 1)
                    values[name] = int(value.split()[0]) * 1024
    except OSError:
        return None
    return (values['VmRSS'], values['VmHWM']) if len(values) == 2 else None


def run(model, mode, k, folder):
    """Run one job; return {label: {'peak', 'steady', 'samples'}} and its provenance."""
    steps = steps_of(mode, k)
    job = harness.Job([sys.executable, os.path.join(HERE, 'memory_worker.py'), mode, str(k),
                       model, str(steps), folder], 1500, NUM_WORKERS, NUM_SERVERS)
    with open(os.path.join(folder, 'job.log'), 'w', encoding='utf-8') as log:
        popen = job.start(stdout=log, stderr=subprocess.STDOUT, start_new_session=False)
        labels, processes, steady = {}, {}, None
        start = time.time()
        while popen.poll() is None:
            for pid in job_tree({popen.pid: 'launcher'}, labels):
                status = _status(pid)
                if status is not None and labels[pid] not in ('launcher', 'unknown'):
                    record = processes.setdefault(labels[pid], {'samples': []})
                    record['samples'].append((round(time.time() - start, 2),) + status)
                    record['peak'] = max(record.get('peak', 0), status[1])
            done = [n for n in os.listdir(folder) if n.startswith('steady-')]
            if steady is None and len(done) == NUM_WORKERS:
                steady = {label: record['samples'][-1][1] for label, record in processes.items()}
            time.sleep(0.2)
    if popen.returncode != 0:
        with open(os.path.join(folder, 'job.log'), encoding='utf-8') as src:
            raise RuntimeError('%s %s k=%d failed (%d):\n%s' % (model, mode, k, popen.returncode,
                                                              src.read()[-3000:]))
    for label, record in processes.items():
        record['steady'] = (steady or {}).get(label)
    _, imported = provenance.read_records(folder)
    return processes, dict(steps=steps, mxdelay_imported_in=imported)


def predicted_bytes(model, mode, k):
    worker, servers = formula(model, mode, k)
    return 4 * PARAMETERS[model] * worker, 4 * PARAMETERS[model] * servers


def available():
    with open('/proc/meminfo', encoding='ascii') as src:
        for line in src:
            if line.startswith('MemAvailable:'):
                return int(line.split()[1]) * 1024
    return 0


def summarize(runs):
    rows = []
    for run_ in runs:
        if run_.get('skipped'):
            continue
        worker_f, server_f = formula(run_['model'], run_['mode'], run_['k'])
        n = PARAMETERS[run_['model']]
        for role, share in (('worker', worker_f), ('server', server_f / NUM_SERVERS)):
            for label, record in sorted(run_['processes'].items()):
                if label.startswith(role):
                    rows.append(dict(model=run_['model'], store=run_['store'], k=run_['k'],
                                     process=label, parameters=n,
                                     steady_mib=record['steady'] / MIB,
                                     peak_mib=record['peak'] / MIB,
                                     formula_floats_per_param=share,
                                     formula_mib=4 * n * share / MIB))
    return rows


def fixed_and_slope(rows):
    """Per store and role: the measured floats per parameter, from the difference of the big
    and the small model's mean steady RSS, and the fixed amount (mlp's measured minus its
    formula)."""
    out = []
    keys = sorted({(r['store'], r['k']) for r in rows})
    for store, k in keys:
        for role in ('worker', 'server'):
            mean = {}
            for model in PARAMETERS:
                sel = [r for r in rows if (r['store'], r['k'], r['model']) == (store, k, model)
                       and r['process'].startswith(role)]
                if sel:
                    mean[model] = (sum(r['steady_mib'] for r in sel) / len(sel),
                                   sum(r['peak_mib'] for r in sel) / len(sel),
                                   sel[0]['formula_floats_per_param'], sel[0]['formula_mib'])
            if len(mean) == 2:
                span = PARAMETERS['big'] - PARAMETERS['mlp']
                slope = (mean['big'][0] - mean['mlp'][0]) * MIB / 4 / span
                out.append(dict(store=store, k=k, role=role,
                                measured_floats_per_param=slope,
                                formula_floats_per_param=mean['big'][2],
                                fixed_mib=mean['mlp'][0] - mean['mlp'][3]))
    return out


def plot(rows, path):
    plt = report.pyplot()
    models = [m for m in PARAMETERS if any(r['model'] == m for r in rows)]
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models):
        configs = sorted({(r['store'], r['k']) for r in rows if r['model'] == model},
                         key=lambda c: (c[0] != 'dist_sync', c[1]))
        names = ['stock dist_sync' if s == 'dist_sync' else 'dist_delay k=%d' % k
                 for s, k in configs]
        for offset, role, color in ((-0.2, 'worker', 'tab:blue'), (0.2, 'server', 'tab:orange')):
            steady, peak, pred = [], [], []
            for config in configs:
                sel = [r for r in rows if r['model'] == model and (r['store'], r['k']) == config
                       and r['process'].startswith(role)]
                steady.append(sum(r['steady_mib'] for r in sel) / len(sel) / 1024)
                peak.append(sum(r['peak_mib'] for r in sel) / len(sel) / 1024)
                pred.append(sel[0]['formula_mib'] / 1024)
            xs = [i + offset for i in range(len(configs))]
            ax.bar(xs, peak, 0.38, color=color, alpha=0.35, label='%s peak (VmHWM)' % role)
            ax.bar(xs, steady, 0.38, color=color, label='%s steady (VmRSS)' % role)
            ax.plot(xs, pred, 'k_', markersize=18, mew=2)
        ax.plot([], [], 'k_', markersize=12, mew=2, label='formula (parameters only)')
        ax.set_xticks(range(len(configs)))
        ax.set_xticklabels(names, fontsize=8)
        ax.set_ylabel('GiB per process (mean of 2)')
        ax.set_title('%s: %s parameters' % (model, format(PARAMETERS[model], ',')))
        ax.legend(fontsize=7)
    fig.suptitle('Memory per process, 2 workers + 2 servers, SGD momentum')
    report.save(fig, path, 110)


def write_markdown(meta, runs, rows, fits, path):
    lines = [
        '# Memory of workers and servers: dist_delay vs stock dist_sync', '',
        '%s, %.1f GiB memory. Raw samples: [memory.json](memory.json); rows: '
        '[memory.csv](memory.csv); plot: [memory.png](memory.png).' % (
            provenance.generated_by(meta), meta['memory_total'] / (1 << 30)),
        '',
        '2 workers + 2 servers on loopback, one job at a time; SGD momentum 0.9; rule '
        '`mirror`; float32. Steady: VmRSS once every worker finished its steps and queued work '
        '(warm-up of %d steps, the switch and two whole periods, so every slot buffer was '
        'used); peak: VmHWM. Formula: the model\'s arrays only (docs/design.md §3.5), no '
        'process overhead. Stock baseline verified in every process of every dist_sync job '
        '(no mxdelay import): **%s**.' % (WARMUP, 'yes' if meta['stock_ok'] else 'NO'), '']
    lines += report.table(
        'model | store | k | process | steady MiB | peak MiB | formula MiB (floats/param)', [
            [r['model'], r['store'], r['k'] or '-', r['process'], '%.0f' % r['steady_mib'],
             '%.0f' % r['peak_mib'], '%.0f (%g)' % (r['formula_mib'],
                                                   r['formula_floats_per_param'])]
            for r in rows] + [[run_['model'], run_['store'], run_['k'] or '-', 'skipped: %s' % (
                run_['skipped']), '', '', ''] for run_ in runs if run_.get('skipped')], 'llrlrrr')
    if fits:
        lines += ['', '## Per parameter, measured', '',
                  'Slope: (big model\'s mean steady RSS - MLP\'s) / (100,663,296 - 1,863,690) '
                  '/ 4 bytes, per process; for servers per server (each holds half the '
                  'parameters, so the formula column is per server too). Fixed: the MLP\'s '
                  'steady RSS minus its formula (interpreter, MXNet, thread pools).', '']
        lines += report.table('store | k | role | measured floats per parameter | formula | '
                              'fixed MiB', [[f['store'], f['k'] or '-', f['role'], '%.2f' % f[
                                  'measured_floats_per_param'], '%g' % f[
                                      'formula_floats_per_param'], '%.0f' % f['fixed_mib']]
                                            for f in fits], 'lrlrrr')
    report.write_lines(path, lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--models', default='mlp,big')
    parser.add_argument('--ks', default='1,4,8')
    parser.add_argument('--out', default=os.path.join(REPO, 'docs', 'benchmarks', 'memory'))
    parser.add_argument('--report', action='store_true',
                        help='only rewrite memory.md and memory.png from --out\'s memory.json')
    args = parser.parse_args(argv)
    if args.report:
        saved = report.read_json(os.path.join(args.out, 'memory.json'))
        plot(saved['rows'], os.path.join(args.out, 'memory.png'))
        write_markdown(saved['meta'], saved['runs'], saved['rows'], saved['per_parameter'],
                       os.path.join(args.out, 'memory.md'))
        return 0
    with open('/proc/meminfo', encoding='ascii') as src:
        total = int(src.readline().split()[1]) * 1024
    meta = dict(command='python benchmarks/memory.py ' + shlex.join(
                    sys.argv[1:] if argv is None else argv),
                started=provenance.now(),
                code=provenance.code_version(), machine=provenance.machine(), memory_total=total,
                workers=NUM_WORKERS, servers=NUM_SERVERS)
    configs = [('dist_sync', 'sync', 0)] + [('dist_delay', 'delay', int(k))
                                            for k in args.ks.split(',') if k]
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in [m for m in args.models.split(',') if m]:
            for store, mode, k in configs:
                worker_b, servers_b = predicted_bytes(model, mode, k)
                need = NUM_WORKERS * worker_b + servers_b
                entry = dict(model=model, store=store, mode=mode, k=k, predicted_bytes=need,
                             available_before=available())
                if need > entry['available_before'] - MARGIN:
                    entry['skipped'] = ('the formula predicts %.1f GiB, %.1f GiB available'
                                        % (need / (1 << 30), entry['available_before'] / (1 << 30)))
                    print(model, store, k, entry['skipped'], flush=True)
                    runs.append(entry)
                    continue
                folder = os.path.join(tmp, '%s-%s-%d' % (model, store, k))
                os.makedirs(folder)
                processes, check = run(model, mode, k, folder)
                entry.update(processes=processes, **check)
                runs.append(entry)
                print('%s %s k=%d: %s' % (model, store, k, ', '.join(
                    '%s %.0f/%.0f MiB' % (label, (r['steady'] or 0) / MIB, r['peak'] / MIB)
                    for label, r in sorted(processes.items()))), flush=True)
    meta.update(finished=provenance.now())
    meta['stock_ok'] = all(not r['mxdelay_imported_in'] for r in runs
                           if r['store'] == 'dist_sync' and not r.get('skipped'))
    rows = summarize(runs)
    fits = fixed_and_slope(rows)
    os.makedirs(args.out, exist_ok=True)
    report.write_json(os.path.join(args.out, 'memory.json'),
                      dict(meta=meta, rows=rows, per_parameter=fits, runs=runs))
    report.write_csv(os.path.join(args.out, 'memory.csv'), rows)
    plot(rows, os.path.join(args.out, 'memory.png'))
    write_markdown(meta, runs, rows, fits, os.path.join(args.out, 'memory.md'))
    return 0 if meta['stock_ok'] else 1


if __name__ == '__main__':
    sys.exit(main())
