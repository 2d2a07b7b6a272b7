"""Memory of workers and servers: 'dist_delay' against stock 'dist_sync', per configuration.

Runs ``benchmarks/memory_worker.py`` with 2 workers and 2 servers on loopback, launched by
``mxdelay/launcher.py`` run as a plain file with an explicit environment (this one minus every
``DMLC_*``, ``MXNET_*`` and ``MXDELAY_*`` variable, plus ``OMP_NUM_THREADS=1``). The
``dist_sync`` jobs are stock MXNet in every process (each process checks and records it).

While a job runs, this driver reads ``/proc/<pid>/status`` of every process of the job
(every descendant of the launcher, labelled by its ``DMLC_ROLE`` and ``MXDELAY_RANK``) every
0.2 s: ``VmHWM`` (peak resident memory) and ``VmRSS``. *Steady* is ``VmRSS`` at the first
sample after every worker has finished its steps and its queued work and given its heap's
free memory back (``malloc_trim(0)``; the servers do not), then holds still for 3 s before
exiting; *peak* is the last ``VmHWM`` seen of the process.

Jobs: for each model of ``--models`` (``mlp``: 1,863,690 float32 parameters, ``mid``:
33,554,432, ``big``: 100,663,296; the tensors of the last two, 64 MiB each, are above glibc's
largest mmap threshold, so that temporaries freed leave the RSS), ``dist_sync`` and
``dist_delay`` at each k of ``--ks`` (slack k, R = k + 1 slots) with each configuration of ``--configs`` (``plain``: float32
pushes and pulls; ``fp16``: float16 pushes; ``ternary-int8``: ternary pushes and int8
pulls), one job at a time; with ``--code NAME=PATH,...`` each ``dist_delay`` job once per
snapshot of the code (``PYTHONPATH=PATH`` in its processes, e.g. a ``git worktree`` of
another commit), so that two versions are measured side by side in one invocation. A job
is skipped, and says so, when the formula below predicts more memory than ``MemAvailable``
minus 2 GiB (the machine is shared).

The formulas (float32 entries per parameter, SGD with momentum, rule ``'mirror'``, one CPU
device, the delayed phase; docs/design.md §2.3 and §3.5), for the code since issue 37 item 4
(``before``: the code before it):

- stock worker: 2 (weights, gradients; MXNet pushes a one-device CPU gradient without a copy
  and receives the pull into it);
- mxdelay worker, ``plain``: R + 3 (weights, gradients, the mirror's momentum, R slot
  buffers, where the period's pull lands too); before R + 5 (``pre_weight``, a pull buffer).
  Not counted: the warm-up's pushpull buffers of a split tensor's chunks 1.. (up to one
  more);
- ``fp16``: R/2 + 5 (weights, gradients, momentum, R float16 slot buffers, one float32
  receive buffer, the float32 values sent that the rule reads); before 3R/2 + 6 (R receive
  buffers, ``pre_weight``, a pull buffer);
- ``ternary-int8``: 8 + R p_t + p_8 (weights, gradients, momentum, residual, one buffer of
  the values sent, x̂, one receive buffer for exact pulls, the int8 decode's scratch; the
  pushed payloads, p_t = 0.054 per slot, and the pulled one, p_8 = 0.254); before 2R + 9 + ...
  (R buffers of the values sent, R receive buffers, ``pre_weight``, a pull buffer, a second
  decode scratch);
- stock servers, all together: 3 (stored value, merge buffer, momentum);
- mxdelay servers, all together, ``plain``: 2R + 2 (R stored values, R merge buffers, ``W``,
  momentum); with a codec no formula here (§2.11, §2.12, §2.14), 2R + 4 for the skip check.

Writes ``memory.json`` (every sample of every process, the commit, command, machine),
``memory.csv`` (one row per process), ``memory.md`` and ``memory.png`` into ``--out``.

Usage: ``python benchmarks/memory.py [--models mlp,big] [--ks 1,4,8] [--configs plain]
[--code NAME=PATH,...]`` (``--report``: only rewrite the Markdown and the plot from the JSON)
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
PARAMETERS = {'mlp': 1863690, 'mid': 2 * 4096 * 4096, 'big': 6 * 4096 * 4096}
CONFIGS = ('plain', 'fp16', 'ternary-int8')
MIB = 1 << 20
MARGIN = 2 << 30
WARMUP = 3   # memory_worker.WARMUP
#: Payload floats per value: a ternary push's (one slot) and an int8 pull's, blocks of 256.
TERNARY, INT8 = 0.0539, 0.2539


def formula(mode, k, config='plain', code=None):
    """Predicted float32 entries per parameter: (each worker, all servers together or None).
    `code` ``'before'``: the code before issue 37 item 4; any other: this code."""
    if mode == 'sync':
        return 2, 3
    slots = k + 1
    before = code == 'before'
    servers = 2 * slots + 2 if config == 'plain' else None
    if config == 'fp16':
        return (1.5 * slots + 6 if before else 0.5 * slots + 5), servers
    if config == 'ternary-int8':
        payloads = slots * TERNARY + INT8
        return (2 * slots + 9 if before else 8) + payloads, servers
    return (slots + 5 if before else slots + 3), servers


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


def run(model, mode, k, folder, config='plain', path=None):
    """Run one job of `config` (`path`: PYTHONPATH of its processes, or None); return
    {label: {'peak', 'steady', 'samples'}} and its provenance."""
    steps = steps_of(mode, k)
    job = harness.Job([sys.executable, os.path.join(HERE, 'memory_worker.py'), mode, str(k),
                       model, str(steps), folder] + ([config] if config != 'plain' else []),
                      1500, NUM_WORKERS, NUM_SERVERS, env={'PYTHONPATH': path} if path else None)
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
            raise RuntimeError('%s %s k=%d %s failed (%d):\n%s' % (
                model, mode, k, config, popen.returncode, src.read()[-3000:]))
    for label, record in processes.items():
        record['steady'] = (steady or {}).get(label)
    _, imported = provenance.read_records(folder)
    return processes, dict(steps=steps, mxdelay_imported_in=imported)


def predicted_bytes(model, mode, k, config, code):
    worker, servers = formula(mode, k, config, code)
    if servers is None:
        servers = 2 * (k + 1) + 4
    return 4 * PARAMETERS[model] * worker, 4 * PARAMETERS[model] * servers


def available():
    with open('/proc/meminfo', encoding='ascii') as src:
        for line in src:
            if line.startswith('MemAvailable:'):
                return int(line.split()[1]) * 1024
    return 0


def _config_of(run_):
    """A job's (store, k, configuration, code) as the tables show it."""
    return (run_['store'], run_['k'], run_.get('config') or '-', run_.get('code') or '-')


def summarize(runs):
    rows = []
    for run_ in runs:
        if run_.get('skipped'):
            continue
        worker_f, server_f = formula(run_['mode'], run_['k'], run_.get('config', 'plain'),
                                     run_.get('code'))
        n = PARAMETERS[run_['model']]
        store, k, config, code = _config_of(run_)
        for role, share in (('worker', worker_f),
                            ('server', None if server_f is None else server_f / NUM_SERVERS)):
            for label, record in sorted(run_['processes'].items()):
                if label.startswith(role):
                    rows.append(dict(model=run_['model'], store=store, k=k, config=config,
                                     code=code, process=label, parameters=n,
                                     steady_mib=record['steady'] / MIB,
                                     peak_mib=record['peak'] / MIB,
                                     formula_floats_per_param=share,
                                     formula_mib=None if share is None else 4 * n * share / MIB))
    return rows


def _key(row):
    return (row['store'], row['k'], row.get('config', '-'), row.get('code', '-'))


def fixed_and_slope(rows):
    """Per job configuration and role: the measured floats per parameter, from the difference
    of the largest and the smallest model's mean steady RSS, and the fixed amount (the
    smallest model's measured minus its formula)."""
    out = []
    for key in sorted({_key(r) for r in rows}, key=str):
        for role in ('worker', 'server'):
            mean = {}
            for model in PARAMETERS:
                sel = [r for r in rows if _key(r) == key and r['model'] == model
                       and r['process'].startswith(role)]
                if sel:
                    mean[model] = (sum(r['steady_mib'] for r in sel) / len(sel),
                                   sel[0]['formula_floats_per_param'], sel[0]['formula_mib'])
            if len(mean) >= 2:
                small, large = min(mean, key=PARAMETERS.get), max(mean, key=PARAMETERS.get)
                span = PARAMETERS[large] - PARAMETERS[small]
                slope = (mean[large][0] - mean[small][0]) * MIB / 4 / span
                out.append(dict(store=key[0], k=key[1], config=key[2], code=key[3], role=role,
                                models=(small, large), measured_floats_per_param=slope,
                                formula_floats_per_param=mean[large][1],
                                fixed_mib=None if mean[small][2] is None
                                else mean[small][0] - mean[small][2]))
    return out


def _name(key):
    store, k, config, code = key
    if store == 'dist_sync':
        return 'stock dist_sync'
    return 'k=%d %s%s' % (k, config, '' if code == '-' else ' (%s)' % code)


def plot(rows, path):
    plt = report.pyplot()
    models = [m for m in PARAMETERS if any(r['model'] == m for r in rows)]
    fig, axes = plt.subplots(1, len(models), figsize=(2 + 1.3 * len({_key(r) for r in rows})
                                                      * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models):
        configs = sorted({_key(r) for r in rows if r['model'] == model},
                         key=lambda c: (c[0] != 'dist_sync', str(c)))
        for offset, role, color in ((-0.2, 'worker', 'tab:blue'), (0.2, 'server', 'tab:orange')):
            steady, peak, pred = [], [], []
            for config in configs:
                sel = [r for r in rows if r['model'] == model and _key(r) == config
                       and r['process'].startswith(role)]
                steady.append(sum(r['steady_mib'] for r in sel) / len(sel) / 1024)
                peak.append(sum(r['peak_mib'] for r in sel) / len(sel) / 1024)
                pred.append(float('nan') if sel[0]['formula_mib'] is None
                            else sel[0]['formula_mib'] / 1024)
            xs = [i + offset for i in range(len(configs))]
            ax.bar(xs, peak, 0.38, color=color, alpha=0.35, label='%s peak (VmHWM)' % role)
            ax.bar(xs, steady, 0.38, color=color, label='%s steady (VmRSS)' % role)
            ax.plot(xs, pred, 'k_', markersize=18, mew=2)
        ax.plot([], [], 'k_', markersize=12, mew=2, label='formula (parameters only)')
        ax.set_xticks(range(len(configs)))
        ax.set_xticklabels([_name(c) for c in configs], fontsize=7, rotation=20, ha='right')
        ax.set_ylabel('GiB per process (mean of 2)')
        ax.set_title('%s: %s parameters' % (model, format(PARAMETERS[model], ',')))
        ax.legend(fontsize=7)
    fig.suptitle('Memory per process, 2 workers + 2 servers, SGD momentum')
    fig.tight_layout()
    report.save(fig, path, 110)


def _formula_cell(mib, share):
    return '-' if share is None else '%.0f (%.3g)' % (mib, share)


def write_markdown(meta, runs, rows, fits, path):
    codes = meta.get('codes') or {}
    lines = [
        '# Memory of workers and servers: dist_delay vs stock dist_sync', '',
        '%s, %.1f GiB memory. Raw samples: [memory.json](memory.json); rows: '
        '[memory.csv](memory.csv); plot: [memory.png](memory.png).' % (
            provenance.generated_by(meta), meta['memory_total'] / (1 << 30)),
        '',
        '2 workers + 2 servers on loopback, one job at a time; SGD momentum 0.9; rule '
        '`mirror`; float32. Steady: VmRSS once every worker finished its steps and queued work '
        '(warm-up of %d steps, the switch and two whole periods, so every slot buffer was '
        'used) and gave its heap\'s free memory back (glibc\'s `malloc_trim(0)`; not the '
        'servers); peak: VmHWM. Formula: the model\'s arrays only (docs/design.md §2.3, '
        '§3.5), no process overhead. Stock baseline verified in every process of every dist_sync job '
        '(no mxdelay import): **%s**.' % (WARMUP, 'yes' if meta['stock_ok'] else 'NO'), '']
    if codes:
        lines += ['Code of the dist_delay jobs (`PYTHONPATH`, one job after the other in this '
                  'invocation): ' + '; '.join('**%s**: commit `%s`' % (name, code['commit'][:10])
                                             for name, code in sorted(codes.items())) + '.', '']
    lines += report.table(
        'model | store | k | config | code | process | steady MiB | peak MiB | '
        'formula MiB (floats/param)', [
            [r['model'], r['store'], r['k'] or '-', r.get('config', '-'), r.get('code', '-'),
             r['process'],
             '%.0f' % r['steady_mib'], '%.0f' % r['peak_mib'],
             _formula_cell(r['formula_mib'], r['formula_floats_per_param'])]
            for r in rows] + [[run_['model'], run_['store'], run_['k'] or '-',
                               run_.get('config') or '-', run_.get('code') or '-',
                               'skipped: %s' % run_['skipped'], '', '', '']
                              for run_ in runs if run_.get('skipped')], 'llrlllrrr')
    if fits:
        lines += ['', '## Per parameter, measured', '',
                  'Slope: (the larger model\'s mean steady RSS - the smaller\'s) / (the '
                  'difference of their parameters) / 4 bytes, per process; for servers per '
                  'server (each holds half the parameters, so the formula column is per server '
                  'too). Fixed: the smaller model\'s steady RSS minus its formula (interpreter, '
                  'MXNet, thread pools).', '']
        lines += report.table(
            'store | k | config | code | role | measured floats per parameter | formula | '
            'fixed MiB', [[f['store'], f['k'] or '-', f.get('config', '-'), f.get('code', '-'),
                           f['role'],
                           '%.2f' % f['measured_floats_per_param'],
                           '-' if f['formula_floats_per_param'] is None
                           else '%.3g' % f['formula_floats_per_param'],
                           '-' if f['fixed_mib'] is None else '%.0f' % f['fixed_mib']]
                          for f in fits], 'lrlllrrr')
    report.write_lines(path, lines)


def _codes(text):
    """``--code``'s ``NAME=PATH,...`` as [(name, path)] ([(None, None)] if empty)."""
    pairs = [item.split('=', 1) for item in text.split(',') if item]
    if any(len(p) != 2 or not p[0] or not os.path.isdir(p[1]) for p in pairs):
        raise SystemExit('--code %r: give NAME=PATH,... with PATH a directory holding '
                         'mxdelay and kvstore_ext (e.g. a git worktree)' % (text,))
    return [tuple(p) for p in pairs] or [(None, None)]


def _commit(path):
    return subprocess.run(['git', '-C', path, 'rev-parse', 'HEAD'], capture_output=True,
                          text=True, check=False).stdout.strip()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--models', default='mlp,big')
    parser.add_argument('--ks', default='1,4,8')
    parser.add_argument('--configs', default='plain',
                        help='comma-separated, of %s' % ', '.join(CONFIGS))
    parser.add_argument('--code', default='',
                        help='NAME=PATH,...: run each dist_delay job with PYTHONPATH=PATH')
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
    configs = [c for c in args.configs.split(',') if c]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        raise SystemExit('--configs: unknown %s; use some of %s' % (unknown, ', '.join(CONFIGS)))
    codes = _codes(args.code)
    with open('/proc/meminfo', encoding='ascii') as src:
        total = int(src.readline().split()[1]) * 1024
    meta = dict(command='python benchmarks/memory.py ' + shlex.join(
                    sys.argv[1:] if argv is None else argv),
                started=provenance.now(),
                code=provenance.code_version(), machine=provenance.machine(), memory_total=total,
                workers=NUM_WORKERS, servers=NUM_SERVERS,
                codes={name: {'path': path, 'commit': _commit(path)}
                       for name, path in codes if name})
    jobs = [('dist_sync', 'sync', 0, None, None, None)] + [
        ('dist_delay', 'delay', int(k), config, name, path)
        for k in args.ks.split(',') if k for config in configs for name, path in codes]
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in [m for m in args.models.split(',') if m]:
            for store, mode, k, config, name, path in jobs:
                worker_b, servers_b = predicted_bytes(model, mode, k, config, name)
                need = NUM_WORKERS * worker_b + servers_b
                entry = dict(model=model, store=store, mode=mode, k=k, config=config, code=name,
                             predicted_bytes=need, available_before=available())
                if need > entry['available_before'] - MARGIN:
                    entry['skipped'] = ('the formula predicts %.1f GiB, %.1f GiB available'
                                        % (need / (1 << 30), entry['available_before'] / (1 << 30)))
                    print(model, store, k, config, name, entry['skipped'], flush=True)
                    runs.append(entry)
                    continue
                folder = os.path.join(tmp, '%s-%s-%d-%s-%s' % (model, store, k, config, name))
                os.makedirs(folder)
                processes, check = run(model, mode, k, folder, config or 'plain', path)
                entry.update(processes=processes, **check)
                runs.append(entry)
                print('%s %s k=%d %s %s: %s' % (model, store, k, config, name, ', '.join(
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
