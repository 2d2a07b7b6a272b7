"""Bytes on the wire per delayed step of the real training job, per worker link (root only).

The question (issue 20's target "bytes per delayed step per worker link <= 1/10 of
``dist_sync``'s in the headline configuration"): how many bytes does a worker's link carry
per step of training, stock ``dist_sync`` against the headline method, measured on the wire
rather than computed from the format?

The jobs are ``benchmarks/bench_worker.py`` window runs (the example's MLP, its Fashion-MNIST
shards, seed 1, batch 128, SGD-momentum), started by :class:`harness.Job` with its clean
environment, 2 workers and 1 server, every role in a network namespace of its own behind an
unshaped bridge (``benchmarks/netns.py``: loopback speed). The kernel's counters of each
node's ``eth0`` count what that node sent and received, TCP/IP headers included. Each method
runs twice per round, with ``--steps`` A and B window steps after the same ``--warmup``
synchronous steps and the switch step; the difference of the counters over B - A (a
multiple of every method's delay, so the same number of pull periods) is the traffic of
B - A steps of the delayed phase alone: start-up, hand-shake, init, warm-up, switch and
the end of the job cancel out. Rounds are interleaved (:func:`harness.ordered`).

Reported per method: bytes sent and received per step per worker (the mean of the 2
workers, median over rounds, with the range), the server's, the bytes the format gives
(:func:`expected`: values only, no ps-lite or TCP headers), and the ratio to the first
method (the stock baseline). Usage (root)::

    python benchmarks/wire_bytes.py --out docs/benchmarks/wire-bytes
"""
import os
import statistics
import sys
import time

import fp16_bytes
import harness
import provenance
import report

REPO = harness.REPO
#: The example's MLP (784-1024-1024-10): its trained parameters' sizes, in Gluon's order.
MLP_SIZES = (1024 * 784, 1024, 1024 * 1024, 1024, 10 * 1024, 10)
#: MXDELAY_CHUNK_SIZE's default (kvstore_ext/env.py): the largest chunk of a key.
CHUNK_SIZE = 524288
DEFAULT_METHODS = ('sync', 'k4-ternary-pull-int8')


def parse_args(argv=None):
    parser = harness.parser(__doc__)
    parser.add_argument('--out', default=os.path.join(REPO, 'docs', 'benchmarks', 'wire-bytes'),
                        help='results folder (default: %(default)s)')
    parser.add_argument('--scratch', default=os.path.join(REPO, 'bench_out', 'wire-bytes'),
                        help='raw per-run files and logs (default: %(default)s)')
    parser.add_argument('--methods', default=','.join(DEFAULT_METHODS),
                        type=harness.names(harness.METHODS),
                        help='the first is the baseline of the ratios (default: %(default)s)')
    parser.add_argument('--steps', default='16,48', type=harness.ints,
                        help='the two window lengths A,B (default: %(default)s)')
    parser.add_argument('--warmup', type=int, default=8,
                        help='synchronous steps before the switch step (default: %(default)s)')
    parser.add_argument('--rounds', type=int, default=2, help='(default: %(default)s)')
    parser.add_argument('--timeout', type=int, default=300,
                        help='seconds per job (default: %(default)s)')
    parser.add_argument('--data-dir', default='/usr/share/datasets/fashion-mnist')
    args = parser.parse_args(argv)
    if len(args.steps) != 2 or not 0 < args.steps[0] < args.steps[1]:
        parser.error('--steps must be two window lengths A,B with 0 < A < B, got %s'
                     % ','.join(map(str, args.steps)))
    delays = [harness.METHODS[m].delay or 1 for m in args.methods]
    span = args.steps[1] - args.steps[0]
    if any(span % d for d in delays):
        parser.error('--steps: B - A = %d must be a multiple of every method\'s delay (%s), so '
                     'that both windows end at the same point of the pull period'
                     % (span, ', '.join(map(str, delays))))
    if args.rounds < 1 or args.warmup < 1:
        parser.error('--rounds and --warmup must be at least 1, got %d and %d'
                     % (args.rounds, args.warmup))
    return args


def chunks(sizes=MLP_SIZES, chunk_size=CHUNK_SIZE):
    """The chunk sizes of tensors of `sizes` elements (kvstore_ext.worker.layout.Placement.place)."""
    return [min(size, start + chunk_size) - start
            for size in sizes for start in range(0, max(size, 1), chunk_size)]


def expected(method, sizes=MLP_SIZES):
    """``(sent, received)``: the bytes of the values a worker sends and receives per step with
    `method` (a :class:`harness.Method`), from the format; no ps-lite or TCP/IP headers.

    A stock or delayed step without compression pushes and pulls every value as float32
    (the delayed phase pulls once per `delay` steps); the blockwise push codecs send each
    chunk's payload row and its row id (``Blockwise.push_bytes``); an int8 pull brings
    ``pulls.bytes_per_pull`` once per `delay` steps.
    """
    # kvstore_ext imports MXNet: only here, in the driver, never in a baseline's processes.
    from kvstore_ext import codecs
    from kvstore_ext.codecs import pulls  # pylint: disable=import-outside-toplevel
    pieces = chunks(sizes)
    codec = codecs.parse(_params(method.compression)) or codecs.NONE
    extra = list(method.extra)
    pull = (_params(extra[extra.index('--pull-compression') + 1])
            if '--pull-compression' in extra else None)
    received = pulls.bytes_per_pull(pulls.parse(pull), pieces)
    return sum(codec.push_bytes(n, 'float32') for n in pieces), received / (method.delay or 1)


def _params(text):
    """The settings of bench_worker's ``--compression``/``--pull-compression`` `text`
    (``TYPE``, ``TYPE:BLOCK`` or ``2bit:THRESHOLD``; None: none). bench_worker.py itself is
    not imported: it records its role's provenance on import."""
    if text is None:
        return None
    kind, _, value = text.partition(':')
    if kind == '2bit':
        return {'type': kind, 'threshold': float(value)}
    return dict({'type': kind}, **({'block_size': int(value)} if value else {}))


def worker_argv(args, method, steps):
    """bench_worker.py's argv (without ``--out``) of one window job of `method`."""
    return [sys.executable, harness.WORKER] + harness.METHODS[method].args + [
        '--warmup-steps', str(args.warmup), '--steps', str(steps), '--seed', '1',
        '--data-dir', args.data_dir]


def run_one(args, net, hostfile, method, steps, round_index):
    """Run one window job; its row with every node's eth0 bytes over the job."""
    folder = os.path.join(args.scratch, '%s-%d-r%d' % (method, steps, round_index))
    row = dict(method=method, steps=steps, round=round_index, warmup=args.warmup)
    before = fp16_bytes.counters(net)
    row, results = harness.run_window(row, folder, worker_argv(args, method, steps), hostfile,
                                      args.timeout)
    time.sleep(0.5)   # the last FINs
    after = fp16_bytes.counters(net)
    row['load_after'] = os.getloadavg()[0]
    roles = harness.read_roles(folder)
    row['stock_check'] = harness.stock_check(harness.METHODS[method].stock, roles)
    row['worker_env'] = harness.worker_env(roles)
    row['noisy'] = int(report.is_noisy(row))
    row['eth0'] = {name: [after[name][0] - before[name][0], after[name][1] - before[name][1]]
                   for name, _ in net.nodes}
    if results:
        row['trained_parameters'] = results[0]['trained_parameters']
        row['final_loss'] = results[0]['losses'][-1]
    return row


def per_step(short, long, nodes):
    """Bytes per step from the rows of a short and a long job of one method and round:
    ``worker_tx``, ``worker_rx`` (the mean of the workers), ``server_tx``, ``server_rx``,
    and each worker's ``workers``: [[tx, rx], ...]. `nodes`: the namespaces in the order
    scheduler, server, workers."""
    span = long['steps'] - short['steps']
    each = {name: [(long['eth0'][name][i] - short['eth0'][name][i]) / span for i in (0, 1)]
            for name in nodes}
    workers = [each[name] for name in nodes[2:]]
    return {'worker_tx': statistics.mean(w[0] for w in workers),
            'worker_rx': statistics.mean(w[1] for w in workers),
            'server_tx': each[nodes[1]][0], 'server_rx': each[nodes[1]][1],
            'workers': workers}


def summarize(rows, methods, nodes):
    """Per method: each round's per-step bytes, their medians and ranges, and the format's."""
    summary = []
    for method in methods:
        rounds = []
        for round_index in sorted({r['round'] for r in rows if r['method'] == method}):
            pair = sorted((r for r in rows if r['method'] == method and r['round'] == round_index
                           and 'error' not in r), key=lambda r: r['steps'])
            if len(pair) == 2:
                rounds.append(dict(round=round_index, **per_step(pair[0], pair[1], nodes)))
        entry = {'method': method, 'label': harness.METHODS[method].label, 'rounds': rounds}
        for key in ('worker_tx', 'worker_rx', 'server_tx', 'server_rx'):
            values = [r[key] for r in rounds]
            entry[key] = statistics.median(values) if values else None
            entry[key + '_range'] = [min(values), max(values)] if values else None
        entry['expected_tx'], entry['expected_rx'] = expected(harness.METHODS[method])
        summary.append(entry)
    base = summary[0]
    for entry in summary:
        for key in ('worker_tx', 'worker_rx'):
            entry[key + '_ratio'] = (base[key] / entry[key] if entry[key] and base[key]
                                     else None)
        both = [entry['worker_tx'], entry['worker_rx'], base['worker_tx'], base['worker_rx']]
        entry['worker_both_ratio'] = (None if None in both else
                                      (both[2] + both[3]) / (both[0] + both[1]))
    return summary


def markdown(meta, args, rows, summary):
    """The lines of results.md."""
    nodes = '2 workers, 1 server and the scheduler'
    lines = ['# Bytes per delayed step per worker link, on the wire', '',
             provenance.meta_line(meta), '',
             'The real training job (`benchmarks/bench_worker.py`: the example\'s MLP, %d '
             'trained parameters, batch 128, SGD-momentum, seed 1), %s, each in its own '
             'network namespace behind an unshaped bridge; bytes from the kernel counters of '
             'each node\'s `eth0` (TCP/IP and ps-lite headers included). Per step = the '
             'difference between a %d-step and a %d-step window job (the same %d warm-up '
             'steps and switch step before) / %d: delayed steps only. Worker columns: the '
             'mean of the 2 workers, median over %d rounds (range). "format": the values\' '
             'bytes from the wire format (no headers). Ratio: the baseline\'s bytes over the '
             'method\'s.' % (
                 sum(MLP_SIZES), nodes, args.steps[1], args.steps[0], args.warmup,
                 args.steps[1] - args.steps[0], args.rounds), '']

    def cell(entry, key):
        low, high = entry[key + '_range']
        return '%.0f (%.0f-%.0f)' % (entry[key], low, high)
    lines += report.table(
        'method | worker sends / step | format | worker receives / step | format | '
        'sends + receives | ratio sends | ratio receives | ratio both',
        [[e['label'], cell(e, 'worker_tx'), '%.0f' % e['expected_tx'], cell(e, 'worker_rx'),
          '%.0f' % e['expected_rx'], '%.0f' % (e['worker_tx'] + e['worker_rx']),
          '%.2f' % e['worker_tx_ratio'], '%.2f' % e['worker_rx_ratio'],
          '%.2f' % e['worker_both_ratio']] for e in summary if e['worker_tx'] is not None])
    lines += ['', 'Server per step (median): ' + '; '.join(
        '%s sends %.0f, receives %.0f' % (e['label'], e['server_tx'], e['server_rx'])
        for e in summary if e['server_tx'] is not None) + '.', '', '## Every round', '']
    lines += report.table(
        'method | round | worker 0 sends / step | worker 0 receives / step | '
        'worker 1 sends / step | worker 1 receives / step',
        [[e['method'], r['round']] + ['%.0f' % v for w in r['workers'] for v in w]
         for e in summary for r in e['rounds']])
    lines += ['', '## Every job (bytes over the whole job)', '']
    lines += report.table(
        'method | round | window steps | worker 0 tx | worker 0 rx | worker 1 tx | '
        'worker 1 rx | ms/step | cpu_other | stock check | workers\' MXNET_*',
        [[r['method'], r['round'], r['steps']] + [
            '%d' % r['eth0'][name][i] for name in meta['nodes'][2:] for i in (0, 1)] + [
            report.fmt(r.get('ms_per_step'), '%.1f'),
            report.fmt(r.get('cpu_other'), '%.2f') + (' noisy' if r.get('noisy') else ''),
            r.get('error', r['stock_check']), r['worker_env']] for r in rows])
    return lines


def main(argv=None):
    args = parse_args(argv)
    import netns  # pylint: disable=import-outside-toplevel
    reason = netns.netns_available()
    if reason:
        sys.exit('wire_bytes needs network namespaces: %s' % reason)
    meta = harness.start_meta(harness.command_line('python benchmarks/wire_bytes.py', argv),
                              methods=args.methods, steps=args.steps, warmup=args.warmup,
                              rounds=args.rounds)
    rows = []
    os.makedirs(args.out, exist_ok=True)
    with harness.interruptible(), netns.ShapedNetwork(1 + 1 + harness.NUM_WORKERS) as net:
        hostfile = os.path.join(args.scratch, 'hosts')
        os.makedirs(args.scratch, exist_ok=True)
        net.write_hostfile(hostfile)
        meta['nodes'] = [name for name, _ in net.nodes]
        for round_index in range(1, args.rounds + 1):
            for method in harness.ordered(args.methods, round_index):
                for steps in harness.ordered(args.steps, round_index):
                    row = run_one(args, net, hostfile, method, steps, round_index)
                    rows.append(row)
                    report.write_json(os.path.join(args.out, 'runs.json'), rows)
                    print('%s r%d %d steps: %s' % (method, round_index, steps, row.get(
                        'error', row['eth0'])), flush=True)
    harness.finish_meta(meta)
    summary = summarize(rows, args.methods, meta['nodes'])
    report.write_json(os.path.join(args.out, 'results.json'),
                      dict(meta, rows=rows, summary=summary))
    lines = markdown(meta, args, rows, summary)
    report.write_lines(os.path.join(args.out, 'results.md'), lines)
    print('\n'.join(lines))
    return 0 if all('error' not in r for r in rows) else 1


if __name__ == '__main__':
    sys.exit(main())
