"""What the first training step sends, and how long it takes (issues 20 and 37).

Each job trains the example's MLP (``bench_worker.build_model('mlp')``, 1.86M parameters)
for ``STEPS`` steps of one fixed random batch (``--batch-size``, seeded), 2 workers and 1
server, each step waited for (``nd.waitall()``), and records every step's end. Methods:

- ``stock``: ``gluon.Trainer`` on ``'dist_sync'`` (SGD with momentum), stock MXNet in every
  process (nothing imports mxdelay);
- ``k4``: ``mxdelay.DelayedTrainer``, delay 4, 200 warm-up steps, no compression;
- ``fp16-int8``: the same with ``compression_params={'type': 'fp16'}`` and
  ``pull_compression={'type': 'int8'}``;
- ``ternary-int8``: the same with ``{'type': 'ternary'}`` pushes and int8 pulls.

Networks: ``netns`` (each role in a network namespace of its own, unshaped links,
``benchmarks/netns.py``: the kernel's counters of each node's ``eth0`` count what each role
sent and received, TCP/IP headers included), ``100mbit`` (the same, links shaped to 100
Mbit/s) and ``loopback`` (local processes, no counters). Per network, round and method, three
jobs of 0, 1 and 2 steps (0: the store and trainer are made, nothing trained): the first
step's bytes are the 1-step job's minus the 0-step job's, a synchronous step's the 2-step
job's minus the 1-step job's. The first step's time is each worker's first step end minus
its loop's start; the job's is the slower worker's.

Every worker also logs, on the worker side, every call to MXNet's native store (``init``,
``push``, ``pull``, ``pushpull``, ``row_sparse_pull``, ``broadcast``): the calling function,
the native keys' kinds (mxdelay's slot, pull, model and finish keys) and the payload bytes (a
dense value's elements times its item size; a row_sparse value's data plus 8 bytes a row id).
MXNet's ``init`` sends only from rank 0, so its bytes are counted on rank 0 only.

Snapshots (``--snapshots before=DIR,after=DIR``): the jobs of mxdelay's methods run once
per snapshot, each with ``PYTHONPATH=DIR`` (a pinned worktree: its ``mxdelay`` and
``kvstore_ext`` are what the job imports; each worker records which), the snapshots
alternating within every round and network, so that one invocation measures them side by
side; ``stock`` runs once per round (no mxdelay in its processes). Without ``--snapshots``
every job runs this script's own checkout (one snapshot, ``here``).

Usage (writes ``OUT.json`` and ``OUT.md``; the raw per-job files go under ``OUT-raw/``)::

    python benchmarks/first_step.py --networks 100mbit,loopback --rounds 2 \
        --snapshots before=/tmp/pin-before,after=/tmp/pin-after \
        --out docs/benchmarks/first-step/runs
    python benchmarks/first_step.py --summary --out docs/benchmarks/first-step
"""
import collections
import contextlib
import json
import os
import sys
import time

__all__ = ['main', 'role', 'summary', 'markdown']

BATCH = 128
METHODS = ('stock', 'k4', 'fp16-int8', 'ternary-int8')
NETWORKS = {'netns': None, '100mbit': '100mbit', 'loopback': False}
NUM_WORKERS = 2
KIND_OF_TRAINER = {'k4': (None, None), 'fp16-int8': ({'type': 'fp16'}, {'type': 'int8'}),
                   'ternary-int8': ({'type': 'ternary'}, {'type': 'int8'})}


# -- one role of a job ------------------------------------------------------------------------
def _nbytes(value):
    """Payload bytes of an NDArray (row_sparse: its data and its int64 row ids)."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    if getattr(value, 'stype', 'default') == 'row_sparse':
        return int(value.data.size) * np.dtype(value.dtype).itemsize + 8 * int(value.indices.size)
    return int(value.size) * np.dtype(value.dtype).itemsize


def _flat(values):
    for value in values if isinstance(values, (list, tuple)) else [values]:
        if isinstance(value, (list, tuple)):
            yield from _flat(value)
        elif value is not None:
            yield value


class CallLog:
    """Counts the payload bytes of every native store call by (operation, caller, key kind)."""

    def __init__(self):
        self.bytes = collections.Counter()
        self.calls = collections.Counter()
        self.store = None   # the DistDelay whose keys are classified

    def kinds(self):
        kinds = {}
        session = getattr(self.store, '_session', None)
        if session is None:
            return kinds
        tensors = list(session.tensors.values())
        counter = getattr(session.finish, 'tensor', None)
        for tensor in tensors + ([counter] if counter is not None else []):
            name = 'finish ' if tensor is counter else ''
            for chunk in tensor.chunks:
                for key in chunk.keys:
                    kinds[key] = name + 'slot'
                if chunk.pull_keys is not chunk.keys:
                    for key in chunk.pull_keys:
                        kinds[key] = name + 'pull'
                if getattr(chunk, 'model_key', None) is not None:
                    kinds[chunk.model_key] = name + 'model'
        return kinds

    def wrap(self, cls, op, rank_of):
        original = getattr(cls, op)
        log = self

        def wrapper(native, key, *args, **kwargs):
            frame = sys._getframe(1)  # pylint: disable=protected-access
            owner = frame.f_locals.get('self')
            caller = '%s.%s' % (type(owner).__name__, frame.f_code.co_name) if owner is not None \
                else frame.f_code.co_name
            if op == 'init' and rank_of(native) != 0:
                sent = 0    # MXNet's init pushes from rank 0 only
            else:
                sent = None
            if op == 'broadcast':   # stock Gluon's init: rank 0 sends, every worker pulls
                for k, v, o in zip(*[x if isinstance(x, (list, tuple)) else [x]
                                     for x in (key, args[0], kwargs.get('out', args[1:2]))]):
                    for part, size in (('broadcast (init)',
                                        _nbytes(v) if rank_of(native) == 0 else 0),
                                       ('broadcast (pull)', sum(_nbytes(x) for x in _flat(o)))):
                        log.bytes[(part, caller, 'stock')] += size
                        log.calls[(part, caller, 'stock')] += 1
                return original(native, key, *args, **kwargs)
            if op in ('init', 'push'):
                values = args[0] if args else kwargs.get('value')
            else:
                values = kwargs.get('out', args[0] if args else None)
                if op == 'pushpull':
                    values = args[0] if args else kwargs.get('value')
            keys = key if isinstance(key, (list, tuple)) else [key]
            vals = values if isinstance(values, (list, tuple)) else [values]
            kinds = log.kinds()
            for k, v in zip(keys, vals):
                kind = kinds.get(k, 'status/other') if log.store is not None else 'stock'
                if op == 'row_sparse_pull':
                    size = 0   # mxdelay's ordering pulls ask for no rows
                else:
                    size = sum(_nbytes(x) for x in _flat(v))
                if sent is not None:
                    size = sent
                tag = (op, caller, kind)
                log.bytes[tag] += size * (2 if op == 'pushpull' else 1)
                log.calls[tag] += 1
            return original(native, key, *args, **kwargs)
        setattr(cls, op, wrapper)

    def rows(self):
        return [{'op': op, 'caller': caller, 'kind': kind, 'calls': self.calls[(op, caller, kind)],
                 'bytes': self.bytes[(op, caller, kind)]}
                for (op, caller, kind) in sorted(self.bytes)]


def role(method, steps, out):
    """Every role of one job: a scheduler or server returns from the imports."""
    if method != 'stock':
        import mxdelay  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    import mxnet as mx  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    from mxnet import autograd, gluon, nd  # pylint: disable=import-outside-toplevel
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_worker  # pylint: disable=import-outside-toplevel
    log = CallLog()
    for op in ('init', 'push', 'pull', 'pushpull', 'row_sparse_pull', 'broadcast'):
        log.wrap(mx.kvstore.KVStore, op, lambda native: native.rank)
    kv = mx.kv.create('dist_sync' if method == 'stock' else 'dist_delay')
    if method == 'stock':
        assert 'mxdelay' not in sys.modules and 'kvstore_ext' not in sys.modules
    else:
        log.store = kv
    rank = kv.rank
    mx.random.seed(1)
    net = bench_worker.build_model('mlp')
    net.initialize(mx.init.Xavier(magnitude=2.24))
    net(nd.zeros((1,) + bench_worker.INPUT_SHAPE['mlp']))
    net.hybridize()
    opt = {'learning_rate': 0.05, 'momentum': 0.9, 'wd': 0.0}
    if method == 'stock':
        trainer = gluon.Trainer(net.collect_params(), 'sgd', opt, kvstore=kv)
    else:
        push, pull = KIND_OF_TRAINER[method]
        trainer = sys.modules['mxdelay'].DelayedTrainer(
            net.collect_params(), 'sgd', opt, kvstore=kv, delay=4, warmup_steps=200,
            compression_params=push, pull_compression=pull)
    rng = np.random.default_rng([1, rank])
    x = nd.array(rng.standard_normal((BATCH,) + bench_worker.INPUT_SHAPE['mlp'], dtype=np.float32))
    y = nd.array(rng.integers(0, 10, BATCH).astype(np.float32))
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    nd.waitall()
    start, ends = time.time(), []
    for _ in range(steps):
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(BATCH)
        nd.waitall()
        ends.append(time.time())
    imported = sys.modules.get('kvstore_ext')
    result = {'rank': rank, 'method': method, 'steps': steps, 'start': start, 'ends': ends,
              'kvstore_ext': os.path.dirname(os.path.dirname(imported.__file__))
              if imported else None,
              'calls': log.rows(),
              'parameters': sum(p.data().size for p in net.collect_params().values())}
    with open('%s.rank%d.json' % (out, rank), 'w', encoding='utf-8') as dst:
        json.dump(result, dst)


# -- the driver -------------------------------------------------------------------------------
def run_job(harness, net, hostfile, method, steps, raw, timeout, snapshot):
    """One job with ``PYTHONPATH`` the directory `snapshot`; returns {'exit', 'roles':
    {role: [tx, rx]} or None, 'workers': [...]}."""
    from monitor import eth0_counters  # pylint: disable=import-outside-toplevel  (driver only)
    tag = os.path.join(raw, '%s-%dsteps-%d' % (method, steps, int(time.time() * 1000)))
    command = [sys.executable, os.path.abspath(__file__), '--role', method, str(steps), tag]
    before = eth0_counters(net) if net else None
    job = harness.Job(command, timeout, NUM_WORKERS, hostfile=hostfile,
                      env={'PYTHONPATH': snapshot})
    code = job.run(tag + '.log')
    time.sleep(0.5)   # the last FINs
    roles = None
    if net:
        after = eth0_counters(net)
        names = ['scheduler', 'server'] + ['worker%d' % i for i in range(NUM_WORKERS)]
        roles = {label: [after[n][0] - before[n][0], after[n][1] - before[n][1]]
                 for label, (n, _) in zip(names, net.nodes)}
    workers = []
    for rank in range(NUM_WORKERS):
        path = '%s.rank%d.json' % (tag, rank)
        if os.path.exists(path):
            with open(path, encoding='utf-8') as src:
                workers.append(json.load(src))
    return {'method': method, 'steps': steps, 'exit': code, 'roles': roles, 'workers': workers,
            'log': os.path.relpath(tag + '.log', harness.REPO)}


def _snapshots(text):
    """``NAME=DIR,...`` -> [(name, absolute dir)], each dir a checkout holding kvstore_ext."""
    pairs = []
    for item in text.split(','):
        name, sep, path = item.partition('=')
        path = os.path.abspath(path)
        if not sep or not name or not os.path.isdir(os.path.join(path, 'kvstore_ext')):
            raise ValueError('--snapshots %r: each item must be NAME=DIR with DIR a checkout '
                             'of this repository (e.g. a `git worktree add --detach DIR '
                             'COMMIT`), got %r' % (text, item))
        pairs.append((name, path))
    return pairs


def main():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import harness  # pylint: disable=import-outside-toplevel
    import netns  # pylint: disable=import-outside-toplevel
    import report  # pylint: disable=import-outside-toplevel
    parser = harness.parser(__doc__)
    parser.add_argument('--networks', type=harness.names(tuple(NETWORKS)),
                        default=['netns', '100mbit', 'loopback'])
    parser.add_argument('--methods', type=harness.names(METHODS), default=list(METHODS))
    parser.add_argument('--rounds', type=int, default=1)
    parser.add_argument('--snapshots', type=_snapshots, default=None,
                        help='NAME=DIR,... : run mxdelay\'s methods once per snapshot '
                             '(PYTHONPATH=DIR), alternating; default: this checkout')
    parser.add_argument('--timeout', type=int, default=300)
    parser.add_argument('--out', required=True)
    parser.add_argument('--report-only', action='store_true',
                        help='rewrite OUT.md from OUT.json, running nothing')
    parser.add_argument('--summary', action='store_true',
                        help='write OUT/results.md from OUT/runs*.json and the earlier '
                             'page\'s OUT/after-r*.json (OUT a folder), running nothing')
    args = parser.parse_args()
    if args.summary:
        report.write_lines(os.path.join(args.out, 'results.md'), summary(args.out, report))
        return
    if args.report_only:
        report.write_lines(args.out + '.md', markdown(report.read_json(args.out + '.json'),
                                                      report))
        return
    raw = args.out + '-raw'
    os.makedirs(raw, exist_ok=True)
    snapshots = args.snapshots or [('here', harness.REPO)]
    meta = harness.start_meta(harness.command_line('python benchmarks/first_step.py'),
                              snapshots={name: [path, _commit(path)] for name, path in snapshots})
    jobs = []
    with harness.interruptible():
        for network in args.networks:
            rate = NETWORKS[network]
            with contextlib.ExitStack() as stack:
                net = hostfile = None
                if rate is not False:   # a namespace per role; rate None: unshaped links
                    net = stack.enter_context(netns.ShapedNetwork(1 + 1 + NUM_WORKERS, rate))
                    hostfile = os.path.join(raw, 'hosts-%s' % network)
                    net.write_hostfile(hostfile)
                for round_index in range(1, args.rounds + 1):
                    for method in harness.ordered(args.methods, round_index):
                        runs = snapshots[:1] if method == 'stock' else \
                            harness.ordered(snapshots, round_index)
                        for snapshot, path in runs:
                            for steps in (0, 1, 2):
                                row = run_job(harness, net, hostfile, method, steps, raw,
                                              args.timeout, path)
                                row.update(network=network, round=round_index,
                                           snapshot='stock' if method == 'stock' else snapshot)
                                jobs.append(row)
                                print(json.dumps({k: row[k] for k in (
                                    'network', 'method', 'snapshot', 'steps', 'exit',
                                    'roles')}), flush=True)
    harness.finish_meta(meta)
    result = {'meta': meta, 'jobs': jobs}
    report.write_json(args.out + '.json', result)
    report.write_lines(args.out + '.md', markdown(result, report))


def _median(values):
    values = sorted(values)
    middle = len(values) // 2
    return values[middle] if len(values) % 2 else (values[middle - 1] + values[middle]) / 2


def summary(folder, report):
    """results.md: the snapshots of every ``runs*.json`` of `folder` side by side (stock's
    ratio per snapshot), beside the earlier page's figures (``after-r*.json``: issue 20's
    fix, the first step as it was measured before these runs)."""
    import glob  # pylint: disable=import-outside-toplevel
    import provenance  # pylint: disable=import-outside-toplevel
    earlier = [(os.path.basename(p), report.read_json(p))
               for p in sorted(glob.glob(os.path.join(folder, 'after-r*.json')))]
    runs = [(os.path.basename(p), report.read_json(p))
            for p in sorted(glob.glob(os.path.join(folder, 'runs*.json')))]
    names = []
    for _, result in runs:
        for name in result['meta'].get('snapshots', {}):
            if name not in names:
                names.append(name)
    lines = ['Generated by `python benchmarks/first_step.py --summary --out %s` (do not edit) '
             'from %s.' % (os.path.relpath(folder, os.path.dirname(os.path.dirname(
                 os.path.abspath(__file__)))), ', '.join('`%s`' % f for f, _ in runs + earlier)),
             '']
    for path, result in runs:
        snapshots = ', '.join('%s = `%s`' % (name, commit[1][:10])
                              for name, commit in result['meta']['snapshots'].items())
        lines.append('- %s: %s; snapshots %s' % (path, provenance.meta_line(result['meta']),
                                                 snapshots))
    for path, result in earlier:
        lines.append('- earlier page (%s): %s' % (path, provenance.meta_line(result['meta'])))
    lines += ['', 'First step: the slower worker\'s, per job; median (min-max) over the 1-step and '
              '2-step jobs of every round. MB: first-step bytes (1-step job minus 0-step job) on '
              'the server\'s eth0, median over rounds; rx received, tx sent. x stock: the median '
              'first step over stock\'s in the same runs (stock runs once per round, no mxdelay '
              'in its processes; its row holds those figures in every column). The procedure: '
              '[procedure.md](procedure.md).', '']
    rows = []
    networks = sorted({j['network'] for _, r in runs for j in r['jobs']})
    for network in networks:
        stock = _stats([r for _, r in runs], network, 'stock', 'stock')
        for method in METHODS:
            old = _stats([r for _, r in earlier], network, method, None)
            cells = [network, method, old[0], old[1]]
            for name in names:
                stats = _stats([r for _, r in runs], network, method,
                               'stock' if method == 'stock' else name)
                cells += list(stats[:3])
                cells.append('%.2f' % (stats[3] / stock[3]) if stats[3] and stock[3] else '-')
            rows.append(cells)
    header = 'network | method | earlier page: first s | earlier page: server rx MB'
    for name in names:
        header += (' | %s: first s | %s: server rx MB | %s: server tx MB | %s: x stock'
                   % (name, name, name, name))
    lines += report.table(header, rows, 'll' + 'r' * (2 + 4 * len(names)))
    return lines


def _stats(results, network, method, snapshot):
    """``(first s cell, server rx MB cell, server tx MB cell, median first s or None)`` of
    the jobs of `results` of `network`, `method` and `snapshot` (None: any)."""
    def chosen(job, steps=None):
        return (job['network'] == network and job['method'] == method
                and (snapshot is None or job.get('snapshot') == snapshot)
                and (steps is None or job['steps'] == steps))
    jobs = [j for r in results for j in r['jobs'] if chosen(j)]
    firsts = [_first(j) for j in jobs if j['steps'] in (1, 2) and _first(j)]
    cells = ['%.2f (%.2f-%.2f)' % (_median(firsts), min(firsts), max(firsts))
             if firsts else '-']
    for index in (1, 0):
        values = []
        for result in results:
            for rnd in sorted({j['round'] for j in result['jobs']}):
                one = [j for j in result['jobs'] if chosen(j, 1) and j['round'] == rnd
                       and j['roles']]
                zero = [j for j in result['jobs'] if chosen(j, 0) and j['round'] == rnd
                        and j['roles']]
                if one and zero:
                    values.append((one[0]['roles']['server'][index]
                                   - zero[0]['roles']['server'][index]) / 1e6)
        cells.append('%.1f' % _median(values) if values else '-')
    return cells[0], cells[1], cells[2], _median(firsts) if firsts else None


def _commit(path):
    """The commit checked out at `path` (a snapshot)."""
    import subprocess  # pylint: disable=import-outside-toplevel
    return subprocess.run(['git', '-C', path, 'rev-parse', 'HEAD'], capture_output=True,
                          text=True, check=True).stdout.strip()


def _first(job):
    """The job's first step in seconds: the slower worker's first end minus its start."""
    times = [w['ends'][0] - w['start'] for w in job['workers'] if w['ends']]
    return max(times) if len(times) == NUM_WORKERS else None


def markdown(result, report):
    """The results' Markdown: per network and method, bytes by role and the first step."""
    import provenance  # pylint: disable=import-outside-toplevel
    meta = result['meta']
    lines = ['Generated by `%s` (do not edit).' % meta['command'], '',
             provenance.meta_line(meta), '']
    jobs = result['jobs']
    by = collections.defaultdict(list)
    for job in jobs:
        by[(job['network'], job['method'], job.get('snapshot'), job['round'],
            job['steps'])].append(job)
    keys = sorted({(j['network'], j['method'], j.get('snapshot'), j['round']) for j in jobs},
                  key=lambda k: (k[0], METHODS.index(k[1]), str(k[2]), k[3]))
    rows = []
    for network, method, snapshot, rnd in keys:
        one = by.get((network, method, snapshot, rnd, 1), [None])[0]
        two = by.get((network, method, snapshot, rnd, 2), [None])[0]
        zero = by.get((network, method, snapshot, rnd, 0), [None])[0]
        exits = '/'.join(str(j['exit']) for j in (zero, one, two) if j)
        cells = [network, method, snapshot or '-', rnd, exits,
                 report.fmt(_first(one)) if one and _first(one) else '-',
                 report.fmt(_first(two)) if two and _first(two) else '-']
        if one and zero and two and one['roles']:
            def diff(a, b, role, index):
                return a['roles'][role][index] - b['roles'][role][index]
            for role, index in (('server', 1), ('server', 0)):
                cells.append('%.2f' % (diff(one, zero, role, index) / 1e6))
            # the worker that sent more is rank 0 (it alone sends the init); node order is
            # not rank order
            sent = sorted((diff(one, zero, w, 0) for w in ('worker0', 'worker1')), reverse=True)
            cells += ['%.2f' % (b / 1e6) for b in sent]
            cells.append('%.2f' % (diff(two, one, 'server', 1) / 1e6))
            cells.append('%.2f' % (diff(two, one, 'server', 0) / 1e6))
        else:
            cells += ['-'] * 6
        rows.append(cells)
    lines += ['## First step: time and bytes', '',
              'first s: the slower worker\'s first step (1-step job; 2-step job). MB = 10^6 '
              'bytes on each node\'s eth0, headers included: "first" = 1-step job minus '
              '0-step job (the store\'s initialisation and step 0), "step" = 2-step job minus '
              '1-step job (one synchronous step). rx = received, tx = sent.', '']
    lines += report.table('network | method | snapshot | round | exit (0/1/2 steps) | '
                          'first s (1-step) | '
                          'first s (2-step) | server rx first MB | server tx first MB | '
                          'rank-0 worker tx first MB | other worker tx first MB | '
                          'server rx step MB | '
                          'server tx step MB', rows, 'llllrrrrrrrrr')
    lines += ['', '## Worker-side calls to the native store in the first step', '',
              'From the 1-step jobs of the first network and round: payload bytes (MB) '
              'by operation, calling function and kind of native key, per worker rank. '
              'init bytes count on rank 0 only (MXNet\'s init pushes from rank 0).', '']
    first_net = jobs[0]['network'] if jobs else None
    for method, snapshot in sorted({(j['method'], j.get('snapshot')) for j in jobs},
                                   key=lambda k: (METHODS.index(k[0]), str(k[1]))):
        job = next((j for j in jobs if j['network'] == first_net and j['method'] == method
                    and j.get('snapshot') == snapshot and j['steps'] == 1
                    and j['round'] == 1), None)
        if not job or len(job['workers']) < NUM_WORKERS:
            continue
        table = collections.OrderedDict()
        for worker in sorted(job['workers'], key=lambda w: w['rank']):
            for call in worker['calls']:
                key = (call['op'], call['caller'], call['kind'])
                table.setdefault(key, [0, 0, 0, 0])
                table[key][worker['rank']] += call['bytes']
                table[key][2 + worker['rank']] += call['calls']
        lines += ['### %s%s' % (method, ' (%s)' % snapshot if snapshot else ''), '']
        lines += report.table('op | caller | key kind | calls (rank 0, 1) | MB rank 0 | MB rank 1',
                              [[op, caller, kind, '%d, %d' % (v[2], v[3]),
                                '%.2f' % (v[0] / 1e6), '%.2f' % (v[1] / 1e6)]
                               for (op, caller, kind), v in table.items()], 'lllrrr')
        lines.append('')
    return lines


if __name__ == '__main__':
    if len(sys.argv) > 1 and sys.argv[1] == '--role':
        role(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    else:
        main()
