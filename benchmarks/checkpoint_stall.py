"""How long a periodic checkpoint stalls training: the example's MLP (1.86M parameters), 2
workers and 1 server on this machine, k=4, on loopback or on 1 Gbit/s links (``--network``).

One job (:mod:`checkpoint_stall_worker`) cycles through 3 kinds of windows of ``--window``
iterations: the trainer's own periodic checkpoint (``checkpoint_dir``, :mod:`mxdelay.autosave`:
the worker's file written by a thread) in the window's first iteration, an explicit
``trainer.save_states`` after its first iteration (everything written before it returns),
and no save (the control). Per kind and cycle: the excess of the window's first iteration
over the median iteration of the whole run (the save itself), and of the window's other
iterations (while the thread writes and training goes on, they share the CPU); the
synchronous parts of each periodic save; the writing thread's CPU and wall time. Reported:
medians over the cycles, with the range, in ms and in iterations. Also the excess of the
first two iterations together: a save falls where the worker waits for the servers anyway,
in the next iteration's forward pass, and takes that wait into its own iteration.

Usage: ``python benchmarks/checkpoint_stall.py [--network loopback|1gbit] [--cycles 20]
[--window 30] [--library DIR]`` (about 5 minutes; 1gbit needs root), writing ``--out``
(default docs/benchmarks/restarts/checkpoint-stall/<network>/): results.json and results.md.
``--library DIR`` runs the job on the mxdelay of DIR (a snapshot of another commit, e.g. the
code before a change, for a run beside this one's; the results name its commit);
``--beside RESULTS_JSON`` shows such a run's tables below this one's, under
``--beside-title`` (both may be repeated, in pairs, for several earlier runs).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import harness

__all__ = ['main', 'summarize']

WORKER = os.path.join(harness.HERE, 'checkpoint_stall_worker.py')
COMMAND = 'python benchmarks/checkpoint_stall.py'


def summarize(workers):
    """Per worker, per kind: the excess of a window's first iteration and of its other
    iterations over the run's median iteration, per cycle (seconds)."""
    rows = []
    for record in workers:
        # The window's iterations after its first, less the delay - 1 by which a periodic
        # save may fall late: the windows do not overlap.
        times, after = record['times'], record['window'] - record['delay']
        median = statistics.median(times)
        for kind, firsts in record['windows'].items():
            first = [times[f] - median for f in firsts]
            two = [times[f] + times[f + 1] - 2 * median for f in firsts]
            then = [sum(times[f + 1:f + 1 + after]) - after * median for f in firsts]
            writing = [sum(record['writing'][f:f + record['window']]) for f in firsts]
            rows.append({'rank': record['rank'], 'kind': kind, 'median_iteration': median,
                         'first': first, 'first_two': two, 'after': then,
                         'writing_iterations': writing})
    return rows


def parts(workers):
    """Per worker and part of a periodic save's synchronous half: seconds of each call."""
    found = {}
    for record in workers:
        saves = set(record['windows']['autosave'])
        for iteration, label, seconds in record['parts']:
            if iteration in saves:
                found.setdefault((record['rank'], label), []).append(seconds)
    return [{'rank': rank, 'part': label, 'seconds': values}
            for (rank, label), values in sorted(found.items())]


def _ms(values):
    return '%.0f (%.0f to %.0f)' % (1e3 * statistics.median(values), 1e3 * min(values),
                                    1e3 * max(values))


def markdown(meta, rows, breakdown):
    library = meta.get('library')
    lines = ['# Checkpoint stall: the MLP, 2 workers + 1 server, k=4, %s'
             % harness.NETWORKS[meta['network']].label, '',
             'Command: `%s`; commit %s%s; %s; load %s before, %s after.' % (
                 meta['command'], meta['code_start'].get('commit'),
                 '; the job ran the mxdelay of commit %s' % library['commit'] if library else '',
                 meta['started'], ' '.join('%.2f' % v for v in meta['load_before']),
                 ' '.join('%.2f' % v for v in meta['load_after'])), '',
             'Excess of a window\'s first iteration (the save), of its first two, and of the %d '
             'iterations after the first over the median iteration of the run, median over %d '
             'cycles (range); "iterations" = the median excess / the median iteration. The '
             '"none" rows are the control: their spread is the noise.'
             % (meta['after'], meta['cycles']), '',
             '| worker | kind | median iteration (ms) | save iteration: excess (ms) | in '
             'iterations | save and next iteration: excess (ms) | in iterations | the %d '
             'iterations after: excess (ms) | in iterations | iterations the thread wrote |'
             % meta['after'], '|---|---|---:|---:|---:|---:|---:|---:|---:|---:|']
    for row in rows:
        median = row['median_iteration']
        lines.append('| %d | %s | %.1f | %s | %.1f | %s | %.1f | %s | %.1f | %g |' % (
            row['rank'], row['kind'], 1e3 * median, _ms(row['first']),
            statistics.median(row['first']) / median, _ms(row['first_two']),
            statistics.median(row['first_two']) / median, _ms(row['after']),
            statistics.median(row['after']) / median,
            statistics.median(row['writing_iterations'])))
    lines += ['', 'The synchronous half of a periodic save, per part (ms: median, range):', '',
              '| worker | part | ms |', '|---|---|---:|']
    for row in breakdown:
        lines.append('| %d | %s | %s |' % (row['rank'], row['part'], _ms(row['seconds'])))
    lines += ['', 'The writing thread of a periodic save (ms: median, range):', '',
              '| worker | CPU | wall |', '|---|---:|---:|']
    for rank, writes in sorted(meta['writes'].items()):
        lines.append('| %s | %s | %s |' % (rank, _ms([cpu for cpu, _ in writes]),
                                         _ms([wall for _, wall in writes])))
    return '\n'.join(lines) + '\n'


def beside(path, title, out):
    """The tables of the run whose results.json is `path`, under the heading `title`, for
    the page in folder `out`."""
    with open(path, encoding='utf-8') as src:
        earlier = json.load(src)
    tables = markdown(earlier['meta'], earlier['rows'], earlier['parts']).split('\n', 2)[2]
    return '\n## %s ([results.json](%s))\n\n%s' % (title, os.path.relpath(path, out), tables)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--cycles', type=int, default=20)
    parser.add_argument('--window', type=int, default=30)
    parser.add_argument('--network', choices=('loopback', '1gbit'), default='loopback')
    parser.add_argument('--out', help='default: docs/benchmarks/restarts/checkpoint-stall/NETWORK')
    parser.add_argument('--library', help='run the job on the mxdelay of this folder (a '
                        'snapshot of another commit)')
    parser.add_argument('--beside', metavar='RESULTS_JSON', action='append', default=[],
                        help="an earlier run's results (e.g. of the code before a change, with "
                        "--library, just before this run), shown below this run's tables "
                        'under its --beside-title; repeat both for several')
    parser.add_argument('--beside-title', action='append', default=[])
    args = parser.parse_args(argv)
    if len(args.beside_title) > len(args.beside):
        parser.error('--beside-title given %d times, --beside %d: one title per --beside'
                     % (len(args.beside_title), len(args.beside)))
    args.out = args.out or os.path.join(harness.REPO, 'docs', 'benchmarks', 'restarts',
                                        'checkpoint-stall', args.network)
    meta = harness.start_meta(harness.command_line(COMMAND, argv), cycles=args.cycles,
                              window=args.window, network=args.network)
    env = None
    if args.library:
        args.library = os.path.abspath(args.library)
        env = {'PYTHONPATH': args.library}
        meta['library'] = {'path': args.library, 'commit': subprocess.run(
            ['git', '-C', args.library, 'rev-parse', 'HEAD'], capture_output=True, text=True,
            check=True).stdout.strip()}
    rate = harness.NETWORKS[args.network].rate
    with harness.shaped_network(4, rate) as (_, hostfile), \
            tempfile.TemporaryDirectory(prefix='checkpoint-stall-') as folder:
        ckpt = os.path.join(folder, 'ckpt')
        os.makedirs(ckpt)
        out = os.path.join(folder, 'worker-{rank}.json')
        job = harness.Job([sys.executable, WORKER, '--out', out, '--checkpoint-dir', ckpt,
                           '--cycles', str(args.cycles), '--window', str(args.window)],
                          timeout=1800, hostfile=hostfile, env=env)
        code = job.run(os.path.join(folder, 'job.log'))
        if code != 0:
            with open(os.path.join(folder, 'job.log'), encoding='utf-8') as log:
                sys.exit('the job failed (exit %d):\n%s' % (code, log.read()[-5000:]))
        workers = []
        for rank in range(harness.NUM_WORKERS):
            with open(out.format(rank=rank), encoding='utf-8') as src:
                workers.append(json.load(src))
    harness.finish_meta(meta)
    meta['checkpoint_bytes'] = workers[0]['sizes']
    meta['writes'] = {w['rank']: w['writes'] for w in workers}
    meta['after'] = workers[0]['window'] - workers[0]['delay']
    rows, breakdown = summarize(workers), parts(workers)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, 'results.json'), 'w', encoding='utf-8') as dst:
        json.dump({'meta': meta, 'rows': rows, 'parts': breakdown,
                   'times': {w['rank']: w['times'] for w in workers}}, dst, indent=1)
    page = markdown(meta, rows, breakdown)
    titles = args.beside_title + ['An earlier run'] * (len(args.beside) - len(args.beside_title))
    for path, title in zip(args.beside, titles):
        page += beside(path, title, args.out)
    with open(os.path.join(args.out, 'results.md'), 'w', encoding='utf-8') as dst:
        dst.write(page)
    print(page)


if __name__ == '__main__':
    sys.exit(harness.run_stoppable(main))
