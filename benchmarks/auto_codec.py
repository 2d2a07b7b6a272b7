"""What ``compression_params='auto'`` measures and chooses for the MLP on shaped links
(docs/design.md §2.16; results: docs/benchmarks/auto-codec/).

Procedure (fixed before the run): for each link rate of ``--rates`` (100mbit, 1gbit,
10gbit) and each of ``--rounds`` rounds, a fresh network of 4 nodes (scheduler, 1 server,
2 workers), each in its own network namespace with its own link shaped to the rate in
both directions (``benchmarks/netns.py``); right after it is built one TCP stream from the
server to a worker for 2 s measures what the link carries (``netns.measure_rate``). Then
one job under ``mxdelay-launch --launcher netns``: each worker builds the example's MLP
(``build_net('mlp')``, 784-1024-1024-10, 1.86M parameters), creates
``DelayedTrainer(..., 'sgd', {'learning_rate': 0.05, 'momentum': 0.9},
compression_params='auto', delay=4, warmup_steps=50)`` and runs 2 steps on random batches of
128 (the choice is made at the first step and depends on the tensors' sizes, not their
values). Worker 0's INFO lines of ``kvstore_ext.worker.autocodec`` are its probe's rate,
each candidate's estimate (wire, codec CPU, step) and the choice; the report tabulates
them beside the TCP stream's rate. ``OMP_NUM_THREADS=1`` in every process.

Usage (root; from a snapshot of one commit)::

    git worktree add --detach /tmp/pin-auto HEAD
    cd /tmp/pin-auto && PYTHONPATH=/tmp/pin-auto python benchmarks/auto_codec.py \\
        --out /path/to/repo/docs/benchmarks/auto-codec
"""
import json
import os
import re
import sys

_WORKER = '--worker'


def worker():
    """One role of the job: a worker trains 2 steps with 'auto'; the others serve."""
    import logging  # pylint: disable=import-outside-toplevel
    import mxdelay  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    from mxnet import autograd, gluon, nd  # pylint: disable=import-outside-toplevel
    from bench_worker import build_net  # pylint: disable=import-outside-toplevel
    logging.basicConfig(level=logging.INFO, format='%(name)s: %(message)s')
    net = build_net('mlp')
    net.initialize()
    trainer = mxdelay.DelayedTrainer(net.collect_params(), 'sgd',
                                     {'learning_rate': 0.05, 'momentum': 0.9},
                                     compression_params='auto', delay=4, warmup_steps=50)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    rs = np.random.RandomState(1)
    for _ in range(2):
        x = nd.array(rs.standard_normal((128, 1, 28, 28)).astype(np.float32))
        y = nd.array(rs.randint(0, 10, 128).astype(np.float32))
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(128)
    loss.asnumpy()


_RATE = re.compile(r'link (\S+) Gbit/s \((\w+)\)')
_ROW = re.compile(r'auto codec: (\S+)\s+wire\s+(\S+) ms \+ (\S+) x codec CPU\s+(\S+) ms =\s+(\S+) ms')
_CHOSE = re.compile(r'chose (\S+) .*to repeat it pass (.*)$')


def parse_log(text):
    """The rank-0 worker's 'auto codec' lines of a job log: probed Gbit/s, {candidate:
    (wire, cpu, estimate) ms}, the choice and its pinning arguments."""
    found = {'estimates': {}}
    for line in text.splitlines():
        if 'auto codec' not in line:
            continue
        match = _RATE.search(line) or _ROW.search(line) or _CHOSE.search(line)
        if match is None:
            continue
        if match.re is _RATE:
            found['probed_gbit'] = float(match.group(1))
        elif match.re is _ROW:
            found['estimates'][match.group(1)] = [float(v) for v in match.group(2, 4, 5)]
            found['cpu_weight'] = float(match.group(3))
        else:
            found['chosen'], found['arguments'] = match.group(1), match.group(2)
    return found


def main(argv=None):
    import harness  # pylint: disable=import-outside-toplevel
    import netns  # pylint: disable=import-outside-toplevel
    import provenance  # pylint: disable=import-outside-toplevel
    parser = harness.parser(__doc__)
    parser.add_argument('--rates', type=harness.names(), default='100mbit,1gbit,10gbit')
    parser.add_argument('--rounds', type=int, default=2)
    parser.add_argument('--out', required=True)
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    meta = {'command': 'python benchmarks/auto_codec.py ' + ' '.join(argv or sys.argv[1:]),
            'start': provenance.now(), 'code': provenance.code_version(),
            'machine': provenance.machine(), 'load_start': os.getloadavg()}
    runs = []
    for rate in args.rates:
        for round_index in range(1, args.rounds + 1):
            with harness.shaped_network(4, rate) as (net, hostfile):
                tcp = netns.measure_rate(net, 1, 2) / 1e9
                log = os.path.join(args.out, 'log-%s-r%d.txt' % (rate, round_index))
                job = harness.Job([sys.executable, os.path.abspath(__file__), _WORKER], 300,
                                  2, 1, hostfile=hostfile)
                code = job.run(log)
            with open(log, encoding='utf-8') as src:
                row = dict(parse_log(src.read()), rate=rate, round=round_index,
                           tcp_gbit=tcp, exit=code)
            runs.append(row)
            print(json.dumps(row), flush=True)
    meta.update(end=provenance.now(), load_end=os.getloadavg())
    with open(os.path.join(args.out, 'runs.json'), 'w', encoding='utf-8') as out:
        json.dump({'meta': meta, 'runs': runs}, out, indent=1)
    with open(os.path.join(args.out, 'results.md'), 'w', encoding='utf-8') as out:
        out.write(report(meta, runs))


def report(meta, runs):
    """results.md: per run, the links' rates, each candidate's estimate and the choice."""
    names = ('none', 'fp16', 'fp16+int8', 'ternary+int8')
    lines = ['# What compression_params=\'auto\' measures and chooses: the MLP, 2 workers, 1 '
             'server, k=4', '',
             '- Command: `%s` (procedure: the docstring of `benchmarks/auto_codec.py`)'
             % meta['command'],
             '- Commit %s%s; %s to %s (UTC); load average %s at the start, %s at the end'
             % (meta['code']['commit'], ' (dirty)' if meta['code']['dirty'] else '',
                meta['start'], meta['end'], ', '.join('%.2f' % v for v in meta['load_start']),
                ', '.join('%.2f' % v for v in meta['load_end'])),
             '- Machine: %(cores)s cores (%(cpu)s), Python %(python)s; shared' % meta['machine'],
             '- Each cell: wire ms + (%s x the kernels\' CPU ms) = estimated step ms (docs/design.md §2.16); '
             'the job logs: `log-<rate>-r<round>.txt`' % runs[0].get('cpu_weight'), '',
             '| link (tbf) | round | TCP stream Gbit/s | probed Gbit/s | %s | chosen |'
             % ' | '.join(names), '|---|---:|---:|---:|%s---|' % ('---:|' * len(names))]
    for row in runs:
        cells = []
        for name in names:
            wire, cpu, total = row['estimates'].get(name, (None, None, None))
            cells.append('-' if total is None else '%.1f + %.1f = **%.1f**'
                         % (wire, row['cpu_weight'] * cpu, total))
        lines.append('| %s | %d | %.2f | %s | %s | %s |' % (
            row['rate'], row['round'], row['tcp_gbit'],
            '%.2f' % row['probed_gbit'] if 'probed_gbit' in row else 'exit %s' % row['exit'],
            ' | '.join(cells), row.get('chosen', '-')))
    return '\n'.join(lines) + '\n'


if __name__ == '__main__':
    if _WORKER in sys.argv:
        worker()
    else:
        main()
