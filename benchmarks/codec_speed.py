"""Codec speed: ns per element of each codec and direction, the numpy code (the job's before
the kernels were wired in; their reference and fallback) against the fused kernels
(kvstore_ext/codecs/kernels), beside a memory copy on the same core.

Procedure: docs/benchmarks/codec-speed/procedure.md. Usage (writes results.json, .csv, .md
and .png)::

    python benchmarks/codec_speed.py --threads 2 --out docs/benchmarks/codec-speed/results
"""
import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time

# One core for MXNet's operators too (the worker's pull decode and the old float16 cast):
# before MXNet is imported.
os.environ['OMP_NUM_THREADS'] = '1'

import numpy as np  # noqa: E402

import provenance  # noqa: E402

REPO = provenance.REPO
sys.path.insert(0, REPO)
PUSH = (('int8', 127), ('int4', 7), ('ternary', 1))
COLUMNS = ('old', 'new', 'new, threads', 'NDArray')


def methods(n, block, rows, threads):
    """[(codec, direction, implementation, elements, function)]: each function runs once."""
    # pylint: disable=import-outside-toplevel
    from mxnet import nd
    from kvstore_ext.codecs import pulls, quantize  # pylint: disable=import-outside-toplevel
    from kvstore_ext.worker.wires.pulls import Payload  # pylint: disable=import-outside-toplevel
    from kvstore_ext.codecs import kernels
    from kvstore_ext.codecs.kernels import _reference, ndarray
    kernels.require_compiled()
    rs = np.random.RandomState(0)
    grad = (rs.randn(n) * 1e-2).astype(np.float32)
    residuals = [(rs.randn(n) * 1e-3).astype(np.float32) for _ in range(3)]
    sent, copy = np.empty(n, np.float32), np.empty(n, np.float32)
    found = [('copy', '-', 'numpy', n, lambda: np.copyto(copy, grad))]

    def add(codec, direction, implementation, function, elements=n):
        found.append((codec, direction, implementation, elements, function))
    for name, h in PUSH:
        old_r, new_r = residuals[0].copy(), residuals[1].copy()
        add(name, 'encode', 'old', lambda h=h, r=old_r: _reference.encode_with_feedback(
            grad, r, h, block, [(0, n)], sent))
        add(name, 'encode', 'new', lambda h=h, r=new_r: kernels.encode_with_feedback(
            grad, r, h, block, out=sent))
        add(name, 'encode', 'new, threads', lambda h=h, r=new_r: kernels.encode_with_feedback(
            grad, r, h, block, out=sent, threads=threads))
        g_nd, r_nd = nd.array(grad), nd.array(residuals[2])
        add(name, 'encode', 'NDArray', lambda h=h, g=g_nd, r=r_nd: nd_wait(
            ndarray.encode_with_feedback_nd(g, r, h, block)[1]))
        payloads = np.stack([quantize.encode(grad * (1 + i), h, block)[0] for i in range(rows)])
        order = np.arange(rows)
        add(name, 'decode', 'old', lambda h=h, p=payloads[0]: quantize.decode(p, h, block, n))
        add(name, 'decode', 'new', lambda h=h, p=payloads[0]: kernels.decode(p, h, block, n))
        add(name, 'decode', 'new, threads', lambda h=h, p=payloads[0]: kernels.decode(
            p, h, block, n, threads))
        direction = 'sum of %d rows' % rows
        add(name, direction, 'old', lambda h=h, p=payloads: _reference.decode_sum(
            p, order, h, block, n), n * rows)
        add(name, direction, 'new', lambda h=h, p=payloads: kernels.decode_sum(
            p, order, h, block, n), n * rows)
        add(name, direction, 'new, threads', lambda h=h, p=payloads: kernels.decode_sum(
            p, order, h, block, n, threads=threads), n * rows)
    weight = (rs.randn(n)).astype(np.float32)
    for name, codec in (('int8 pull', pulls.Int8Pull(block)),
                        ('fp16 pull', pulls.Float16Pull())):
        kind = name.split()[0]
        old_x, new_x = weight - residuals[0], weight - residuals[1]
        old_broadcast = getattr(_reference, '%s_pull_broadcast' % kind)
        new_broadcast = getattr(kernels, '%s_pull_broadcast' % kind)
        extra = (block,) if kind == 'int8' else ()
        # The new encode writes into a payload kept from round to round (the model key's
        # memory, as the server can); the old one makes a fresh one.
        store = np.zeros(codec.payload_size(n), np.float32)
        add(name, 'encode', 'old', lambda b=old_broadcast, x=old_x, e=extra: b(weight, x, *e))
        add(name, 'encode', 'new', lambda b=new_broadcast, x=new_x, e=extra, s=store: b(
            weight, x, *e, payload=s))
        add(name, 'encode', 'new, threads', lambda b=new_broadcast, x=new_x, e=extra, s=store: b(
            weight, x, *e, payload=s, threads=threads))
        payload = Payload(codec, n)
        memory = payload._memory   # pylint: disable=protected-access
        memory[:] = old_broadcast(weight, weight - residuals[2], *extra).view(np.uint8)
        model_nd, model = nd.array(weight), weight.copy()
        decode_add = getattr(kernels, '%s_pull_decode_add' % kind)
        words = memory.view(np.float32)
        add(name, 'decode', 'old', lambda p=payload, m=model_nd: nd_wait(p.decode_into(m) or m))
        add(name, 'decode', 'new', lambda d=decode_add, w=words, m=model, e=extra: d(
            w, m, n, *e))
        add(name, 'decode', 'new, threads', lambda d=decode_add, w=words, m=model, e=extra: d(
            w, m, n, *e, threads=threads))
    half = np.empty(n, np.float16)
    grad_nd, half_nd = nd.array(grad), nd.zeros(n, dtype=np.float16)
    back_nd = nd.zeros(n)
    add('fp16 cast', 'encode', 'old', lambda: nd_wait(grad_nd.copyto(half_nd)))
    add('fp16 cast', 'encode', 'old (numpy)', lambda: grad.astype(np.float16))
    add('fp16 cast', 'encode', 'new', lambda: kernels.to_float16(grad, half))
    add('fp16 cast', 'encode', 'new, threads', lambda: kernels.to_float16(grad, half, threads))
    add('fp16 cast', 'decode', 'old', lambda: nd_wait(half_nd.copyto(back_nd)))
    add('fp16 cast', 'decode', 'old (numpy)', lambda: half.astype(np.float32))
    add('fp16 cast', 'decode', 'new', lambda: kernels.to_float32(half, copy))
    add('fp16 cast', 'decode', 'new, threads', lambda: kernels.to_float32(half, copy, threads))
    return found


def nd_wait(array):
    array.wait_to_read()


def build_cost():
    """Compile the kernels once from scratch, as a machine's first use does: the wall and
    CPU seconds of the compiler, and the library's size."""
    from kvstore_ext.codecs.kernels import _library  # pylint: disable=import-outside-toplevel
    with tempfile.TemporaryDirectory() as directory:
        target = os.path.join(directory, 'kernels.so')
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        _library.build(_library.compiler(), target)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        return {'compiler': _library.compiler(), 'wall_s': wall,
                'cpu_s': (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime),
                'library_bytes': os.path.getsize(target)}


def thread_scaling(threads, rounds):
    """The servers' sum of 2 int8 rows into a kept array, one thread against `threads`, by
    size: where a second thread starts to pay (kernels._dispatch._MIN_PART). The parts are
    forced down to 2**14 elements, so that every size is split."""
    # pylint: disable=import-outside-toplevel,protected-access
    from kvstore_ext.codecs import kernels
    from kvstore_ext.codecs.kernels import _dispatch
    kept, _dispatch._MIN_PART = _dispatch._MIN_PART, 1 << 14
    found = []
    try:
        for power in range(16, 24):
            n = 1 << power
            rows = np.stack([kernels.encode(np.random.RandomState(power).randn(n), 127,
                                            256)[0]] * 2)
            out = np.empty(n, np.float32)
            runs = [(None, None, None, None, lambda t=t: kernels.decode_sum(
                rows, [0, 1], 127, 256, n, out=out, threads=t)) for t in (1, threads)]
            times, other = measure(runs, rounds, 20)
            found.append({'elements': n, 'one_us': statistics.median(times[0]) * 1e6,
                          'threads_us': statistics.median(times[1]) * 1e6,
                          'cpu_other': max(other)})
    finally:
        _dispatch._MIN_PART = kept
    return found


def _busy():
    """The machine's busy CPU seconds (all cores, /proc/stat) and this process's."""
    with open('/proc/stat', encoding='ascii') as stat:
        fields = [int(v) for v in stat.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / os.sysconf('SC_CLK_TCK'), time.process_time()


def measure(runs, rounds, repeats):
    """Interleaved rounds (every other one in reverse order); per method and round the mean
    seconds of `repeats` calls after one untimed call; per round the cores others used."""
    times = [[] for _ in runs]
    other = []
    for index in range(rounds):
        order = list(range(len(runs)))
        if index % 2:
            order.reverse()
        start, (busy, own) = time.perf_counter(), _busy()
        for position in order:
            function = runs[position][4]
            function()
            begin = time.perf_counter()
            for _ in range(repeats):
                function()
            times[position].append((time.perf_counter() - begin) / repeats)
        wall = time.perf_counter() - start
        busy_end, own_end = _busy()
        other.append(max(0.0, (busy_end - busy) - (own_end - own)) / wall)
    return times, other


def table(rows):
    """Markdown lines: one row per codec and direction, a column per implementation."""
    lines = ['| codec | direction | elements | old (today) | new, 1 thread | new, threads | '
             'NDArray (CPU) | old / new | copy |', '|---|---|---:|---:|---:|---:|---:|---:|---:|']
    copy = {r['elements']: r for r in rows if r['codec'] == 'copy'}
    keys = []
    for row in rows:
        if row['codec'] != 'copy' and (row['codec'], row['direction'], row['size']) not in keys:
            keys.append((row['codec'], row['direction'], row['size']))
    for codec, direction, size in keys:
        found = {r['implementation']: r for r in rows
                 if (r['codec'], r['direction'], r['size']) == (codec, direction, size)}
        cells = []
        for column in COLUMNS:
            row = found.get(column)
            cells.append('%.2f (%.2f..%.2f)' % (row['ns'], row['ns_min'], row['ns_max'])
                         if row else '-')
        if 'old (numpy)' in found:
            cells[0] += '; numpy %.2f' % found['old (numpy)']['ns']
        ratio = found['old']['ns'] / found['new']['ns']
        lines.append('| %s | %s | %d | %s | %.1fx | %.2f |' % (
            codec, direction, size, ' | '.join(cells), ratio, copy[size]['ns']))
    return lines


def plot(rows, path):
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
    sizes = sorted({r['size'] for r in rows}, reverse=True)
    figure, axes = plt.subplots(len(sizes), 1, figsize=(13, 4.5 * len(sizes)), squeeze=False)
    for axis, size in zip(axes[:, 0], sizes):
        here = [r for r in rows if r['size'] == size]
        keys = []
        for row in here:
            key = (row['codec'], row['direction'])
            if row['codec'] != 'copy' and key not in keys:
                keys.append(key)
        width = 0.2
        for offset, column in enumerate(COLUMNS):
            values = [next((r['ns'] for r in here if (r['codec'], r['direction']) == key
                            and r['implementation'] == column), np.nan) for key in keys]
            axis.bar(np.arange(len(keys)) + (offset - 1.5) * width, values, width, label=column)
        copy = next(r['ns'] for r in here if r['codec'] == 'copy')
        axis.axhline(copy, color='k', linestyle='--', label='numpy copy (%.2f)' % copy)
        axis.axhline(2.0, color='r', linestyle=':', label='target: 2 ns (2 GB/s of float32)')
        axis.set_yscale('log')
        axis.set_ylabel('ns per element (median)')
        axis.set_xticks(np.arange(len(keys)))
        axis.set_xticklabels(['%s\n%s' % key for key in keys], fontsize=8)
        axis.set_title('%d elements; one thread, "new, threads": %d'
                       % (size, max(r['threads'] for r in here)))
        axis.legend(fontsize=8, ncol=3)
    figure.tight_layout()
    figure.savefig(path, dpi=90)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--out', default=os.path.join(REPO, 'docs', 'benchmarks', 'codec-speed',
                                                      'results'))
    parser.add_argument('--sizes', default='25600000,4194304,524288',
                        help='elements per array, comma-separated (default: ResNet-50\'s '
                             'gradient, 2**22, and one chunk of MXDELAY_CHUNK_SIZE)')
    parser.add_argument('--block', type=int, default=256)
    parser.add_argument('--rows', type=int, default=2, help='workers of the servers\' sum')
    parser.add_argument('--threads', type=int, default=2, help='threads of "new, threads"')
    parser.add_argument('--rounds', type=int, default=5)
    parser.add_argument('--repeats', type=int, default=2)
    args = parser.parse_args()
    meta = {'command': 'python benchmarks/codec_speed.py ' + ' '.join(sys.argv[1:]),
            'started': provenance.now(), 'code_start': provenance.code_version(),
            'machine': provenance.machine(), 'load_before': list(os.getloadavg())}
    build = build_cost()
    scaling = thread_scaling(args.threads, args.rounds)
    rows, raw = [], {}
    for size in [int(s) for s in args.sizes.split(',')]:
        runs = methods(size, args.block, args.rows, args.threads)
        times, other = measure(runs, args.rounds, args.repeats)
        raw[size] = {'cpu_other': other, 'seconds': {
            '%s | %s | %s' % run[:3]: t for run, t in zip(runs, times)}}
        for (codec, direction, implementation, elements, _), seconds in zip(runs, times):
            ns = [s / elements * 1e9 for s in seconds]
            rows.append(dict(size=size, codec=codec, direction=direction,
                             implementation=implementation, elements=elements,
                             threads=args.threads if 'threads' in implementation else 1,
                             ns=statistics.median(ns), ns_min=min(ns), ns_max=max(ns)))
        del runs
    meta.update(finished=provenance.now(), code_end=provenance.code_version(),
                load_after=list(os.getloadavg()))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + '.json', 'w', encoding='utf-8') as out:
        json.dump(dict(meta, settings=vars(args), build=build, thread_scaling=scaling, rows=rows,
                       raw=raw), out, indent=1)
    with open(args.out + '.csv', 'w', encoding='utf-8') as out:
        fields = list(rows[0])
        out.write(','.join(fields) + '\n')
        out.writelines(','.join('"%s"' % r[f] if isinstance(r[f], str) else '%.4g' % r[f]
                                for f in fields) + '\n' for r in rows)
    plot(rows, args.out + '.png')
    noisy = {size: max(raw[size]['cpu_other']) for size in raw}
    lines = ['# Codec speed (`%s`)' % meta['command'], '', provenance.meta_line(meta), '',
             'ns per element (per value decoded for the sums), median over %d interleaved '
             'rounds of the mean of %d calls, (min..max); "new, threads": %d threads. Other '
             'processes used up to %s cores during the rounds. Procedure: '
             '[procedure.md](procedure.md).' % (
                 args.rounds, args.repeats, args.threads,
                 ', '.join('%.2f (%d elements)' % (v, k) for k, v in noisy.items())), ''
             ] + table(rows) + [
                 '', 'Threads: the servers\' sum of 2 int8 rows into a kept array, median µs of '
                 '%d rounds of 20 calls, every size split into %d parts:' % (
                     args.rounds, args.threads), '',
                 '| elements | 1 thread | %d threads | speed-up | other processes (cores) |'
                 % args.threads, '|---:|---:|---:|---:|---:|'] + [
                 '| %d | %.0f | %.0f | %.2fx | %.2f |' % (
                     r['elements'], r['one_us'], r['threads_us'], r['one_us'] / r['threads_us'],
                     r['cpu_other']) for r in scaling] + [
                 '', 'Building the kernels from scratch (%s, a machine\'s first use): %.1f s of '
                 'wall time, %.1f s of CPU; the library is %d KB.' % (
                     build['compiler'], build['wall_s'], build['cpu_s'],
                     build['library_bytes'] // 1024)]
    with open(args.out + '.md', 'w', encoding='utf-8') as out:
        out.write('\n'.join(lines) + '\n')
    print('\n'.join(lines))


if __name__ == '__main__':
    main()
