"""Gradient compression against stock MXNet, and the bytes of a sparse model (issue text).

Throughput and accuracy are ``benchmarks/tta.py``'s parts, run with methods of their own
(the same model, data, seeds, launcher, stock checks and interleaving; ``tta.py``'s
docstring has the procedure):

- ``sync``: stock ``gluon.Trainer`` on MXNet's native ``'dist_sync'``;
- ``sync-2bit``: stock MXNet's ``'dist_sync'`` with ``{'type': '2bit', 'threshold': 0.5}``;
  stock Gluon's ``pushpull`` refuses compression on ``'dist_sync'``, so the trainer is the
  tests' ``PushThenPullTrainer`` (a push, then a pull, as Gluon's own row_sparse branch);
  still MXNet only in every process (checked per process);
- ``k4``: ``mxdelay.DelayedTrainer`` k=4, rule ``'mirror'``;
- ``k4-fp16``: k=4 with ``{'type': 'fp16'}`` (float16 pushes summed in float32);
- ``k4-2bit``: k=4 with ``{'type': '2bit', 'threshold': 0.5}``.

Threshold 0.5 is MXNet's default (``GradientCompression``'s and its documentation's
example), so that ``sync-2bit`` is stock MXNet as its users meet it; it is the same in both
2bit methods. The gradients pushed are sums over the batch of 128 (the optimizer's
``rescale_grad`` is applied on the servers), so 0.5 is within their range.

Parts (``--part``):

``full``, ``phases``, ``report``
    ``tta.py``'s parts with the methods above, into ``docs/benchmarks/compress/``: 10-epoch
    loopback runs (seed 1) evaluated on the test set, short interleaved runs per link
    (``--networks 1gbit,100mbit``), and the report (``results.md``, ``tta.json``).
``sparse``
    Bytes on the wire per step and per worker of an ``Embedding(1,000,000 x 64)`` front-end
    (mean of the tokens' rows, then ``Dense(10)``) on synthetic token ids (``--tokens`` per
    sample, uniform over the vocabulary, seeded by rank and step), batch 128 per worker,
    ``gluon.Trainer`` (SGD) on ``'dist_delay'``; two workers, one server, each role in a
    network namespace of its own (unshaped links), counted as ``fp16_bytes.py`` counts them.
    Variants: ``dense`` (``sparse_grad=False``) and ``sparse_grad`` (``sparse_grad=True``:
    Gluon pushes the row_sparse gradient, and pulls the whole dense weight back, as MXNet
    1.9.1's Trainer does for a dense weight on a distributed store). Samples/s: worker 0's
    steps of the longer job after its first. Writes ``sparse-bytes.json`` and
    ``sparse-bytes.md``.
``plot``
    ``throughput.png`` from ``tta.json``: steady-state samples/s per link and method.

Usage (as root for the shaped links and the namespaces)::

    python benchmarks/compress.py --part full
    python benchmarks/compress.py --part phases --networks 1gbit,100mbit --rounds 3
    python benchmarks/compress.py --part sparse
    python benchmarks/compress.py --part report
    python benchmarks/compress.py --part plot
    python benchmarks/compress.py --part steady --out DIR   # a phases-only folder

``--methods`` (``full``, ``phases``) defaults to the methods above and may name any method of
``harness.METHODS`` (e.g. ``sync,k4-fp16,k4-fp16-pull-int8``: float16 pushes with int8
compressed pulls).
"""
import argparse
import json
import os
import statistics
import sys
import time

import fp16_bytes
import harness
import provenance
import report as report_lib
import tta

__all__ = ['METHODS', 'THRESHOLD', 'VARIANTS', 'main']

THRESHOLD = harness.TWO_BIT_THRESHOLD  # of the 2bit methods
METHODS = harness.methods('sync', 'sync-2bit', 'k4', 'k4-fp16', 'k4-2bit')
OUT = os.path.join('docs', 'benchmarks', 'compress')
SCRATCH = os.path.join('bench_out', 'compress')
VARIANTS = ('dense', 'sparse_grad')
VOCAB, DIM, CLASSES = 1000000, 64, 10


# -- the sparse model's worker (every role of its jobs) ------------------------------------
def sparse_worker(variant, steps, tokens, batch, out):
    """Train the embedding model `steps` steps; worker 0 writes its step ends to `out`."""
    import mxdelay  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    import numpy as np  # pylint: disable=import-outside-toplevel
    import mxnet as mx  # pylint: disable=import-outside-toplevel
    from mxnet import autograd, gluon, nd  # pylint: disable=import-outside-toplevel
    kv = mx.kv.create('dist_delay')
    mx.random.seed(1)
    head = gluon.nn.Dense(CLASSES, in_units=DIM)
    embed = gluon.nn.Embedding(VOCAB, DIM, sparse_grad=variant == 'sparse_grad')
    params = embed.collect_params()
    params.update(head.collect_params())
    params.initialize(mx.init.Uniform(0.1))
    trainer = gluon.Trainer(params, 'sgd', {'learning_rate': 0.1}, kvstore=kv)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    ends = []
    for step in range(steps):
        rng = np.random.RandomState(kv.rank * 100003 + step)
        ids = rng.randint(0, VOCAB, size=(batch, tokens))
        labels = nd.array(rng.randint(0, CLASSES, size=batch))
        with autograd.record():
            loss = loss_fn(head(embed(nd.array(ids)).mean(axis=1)), labels)
        loss.backward()
        trainer.step(batch)
        loss.wait_to_read()
        ends.append(time.time())
    nd.waitall()
    if kv.rank == 0:
        with open(out, 'w', encoding='utf-8') as dst:
            json.dump({'step_ends': ends, 'mxdelay': 'mxdelay' in sys.modules}, dst)


def part_sparse(args):
    import netns  # pylint: disable=import-outside-toplevel
    reason = netns.netns_available()
    if reason:
        sys.exit('the sparse part needs network namespaces: %s' % reason)
    netns.remove_stale()
    command = 'python benchmarks/compress.py --part sparse --steps %d --tokens %d' % (
        args.steps, args.tokens)
    meta = harness.start_meta(command)
    scratch = os.path.join(args.scratch, 'sparse')
    os.makedirs(scratch, exist_ok=True)
    rows = []
    with netns.ShapedNetwork(1 + 1 + fp16_bytes.NUM_WORKERS) as net:
        hostfile = os.path.join(scratch, 'hosts')
        net.write_hostfile(hostfile)
        for variant in VARIANTS:
            timing = os.path.join(scratch, '%s.json' % variant)

            def command_of(steps, variant=variant, timing=timing):
                return [sys.executable, os.path.abspath(__file__), '--role', variant,
                        str(steps), str(args.tokens), timing]
            load = os.getloadavg()[0]
            row = fp16_bytes.traffic(net, hostfile, command_of, args.steps, timeout=900)
            ends = report_lib.read_json(timing)['step_ends']
            row.update(variant=variant, load_before=load, load_after=os.getloadavg()[0],
                       samples_per_s=fp16_bytes.NUM_WORKERS * 128 * (len(ends) - 1)
                       / (ends[-1] - ends[0]))
            rows.append(row)
            print('%s: sends %.0f, receives %.0f bytes/step/worker, %.0f samples/s' % (
                variant, row['worker_tx'], row['worker_rx'], row['samples_per_s']), flush=True)
    harness.finish_meta(meta)
    result = dict(meta=meta, vocab=VOCAB, dim=DIM, tokens=args.tokens, batch=128,
                  workers=fp16_bytes.NUM_WORKERS, steps=[args.steps, 3 * args.steps],
                  rows=rows)
    report_lib.write_json(os.path.join(args.out, 'sparse-bytes.json'), result)
    print('\n'.join(write_sparse(args.out, result)))


def write_sparse(out, result):
    """``sparse-bytes.md`` in `out` from `result` (``sparse-bytes.json``'s content)."""
    steps, rows = result['steps'][0], result['rows']
    dense = rows[0]
    lines = ['# Bytes per step of a sparse model (`%s`)' % result['meta']['command'], '',
             '- %s' % provenance.meta_line(result['meta']),
             '', 'Embedding(%d x %d) (mean of %d tokens per sample) + Dense(%d), batch 128 per '
             'worker, `gluon.Trainer` SGD on `dist_delay`, %d workers, 1 server, each role in its '
             'own network namespace (unshaped); bytes from the kernel counters of each node\'s '
             '`eth0` (headers included), per step = difference between a %d-step and a %d-step '
             'job / %d, mean of the workers. Samples/s: the %d-step job\'s steps after its '
             'first, worker 0\'s step ends, on this loaded machine.' % (
                 VOCAB, DIM, result['tokens'], CLASSES, fp16_bytes.NUM_WORKERS, 3 * steps,
                 steps, 2 * steps, 3 * steps), '']
    lines += report_lib.table(
        'variant | worker sends | worker receives | sends + receives | dense / this (sends) | '
        'dense / this (sends + receives) | samples/s | load before/after', [[
            row['variant'], '%.0f' % row['worker_tx'], '%.0f' % row['worker_rx'],
            '%.0f' % (row['worker_tx'] + row['worker_rx']),
            '%.1fx' % (dense['worker_tx'] / row['worker_tx']), '%.1fx' % (
                (dense['worker_tx'] + dense['worker_rx']) / (row['worker_tx'] + row['worker_rx'])),
            '%.1f' % row['samples_per_s'], '%.2f / %.2f' % (row['load_before'], row['load_after'])]
            for row in rows], 'lrrrrrrl')
    report_lib.write_lines(os.path.join(out, 'sparse-bytes.md'), lines)
    return lines


def part_plot(out):
    plt = report_lib.pyplot()
    times = report_lib.read_json(os.path.join(out, 'tta.json'))['times']
    networks = [n for n in tta.NETWORKS if any(k.startswith(n + '/') for k in times)]
    fig, axes = plt.subplots(1, len(networks), figsize=(5 * len(networks), 4), squeeze=False)
    for axis, net_name in zip(axes[0], networks):
        methods = [m for m in METHODS if '%s/%s' % (net_name, m) in times]
        values = [times['%s/%s' % (net_name, m)] for m in methods]
        medians = [v['window_samples_per_s'] for v in values]
        errors = [[v['window_samples_per_s'] - v['window_min'] for v in values],
                  [v['window_max'] - v['window_samples_per_s'] for v in values]]
        axis.bar(range(len(methods)), medians, yerr=errors, capsize=4,
                 color=['0.6' if METHODS[m].stock else 'C0' for m in methods])
        base = times['%s/sync' % net_name]['window_samples_per_s']
        for index, (value, top) in enumerate(zip(medians, (v['window_max'] for v in values))):
            axis.text(index, top, '%.2fx' % (value / base), ha='center', va='bottom')
        axis.set_xticks(range(len(methods)))
        axis.set_xticklabels([METHODS[m].label.replace(' (stock)', '\n(stock)') for m in methods],
                             fontsize=8)
        axis.set_title(tta.NETWORKS[net_name][0])
        axis.set_ylabel('steady-state samples/s (median, min-max)')
    fig.suptitle('Compression vs stock dist_sync (grey: stock MXNet)', fontsize=10)
    report_lib.save(fig, os.path.join(out, 'throughput.png'), 100)


def part_steady(out):
    """``steady.md`` from ``phases-runs.csv`` alone (a phases run without full runs): the
    steady-state samples/s per link and method, median and range over rounds, and the ratio
    of the medians to stock ``dist_sync``'s."""
    rows = report_lib.read_csv(os.path.join(out, 'phases-runs.csv'))
    meta = report_lib.read_json(os.path.join(out, 'meta-phases.json'))
    lines = ['# Steady-state samples/s with compression (phases runs only)', '',
             'Generated by `python benchmarks/compress.py --part steady --out %s` from '
             '[phases-runs.csv](phases-runs.csv) (do not edit). Runs: `%s`, %s to %s, commit '
             '`%s`; load average (1 min) %.2f before, %.2f after.' % (
                 os.path.relpath(out, harness.REPO), meta['command'], meta['started'],
                 meta['finished'], meta['code_start']['commit'][:10], meta['load_before'][0],
                 meta['load_after'][0]), '']
    body = []
    for net_name in [n for n in tta.NETWORKS if any(r['network'] == n for r in rows)]:
        medians = {}
        for method in harness.METHODS:   # every method the runs have, in the registry's order
            runs = [r for r in rows if r['network'] == net_name and r['method'] == method
                    and r['exit'] == 0]
            if runs:
                medians[method] = (statistics.median(r['window_samples_per_s'] for r in runs),
                                   runs)
        base = medians.get('sync', (None,))[0]
        body += [[tta.NETWORKS[net_name][0], harness.METHODS[method].label, '%.0f (%s)' % (
            median, ' '.join('%.0f' % r['window_samples_per_s'] for r in runs)),
                  '%.2fx' % (median / base) if base else '-', '%d of %d' % (
                      sum(r.get('noisy') in (True, 'True') for r in runs), len(runs))]
                 for method, (median, runs) in medians.items()]
    report_lib.write_lines(os.path.join(out, 'steady.md'), lines + report_lib.table(
        'link | method | samples/s, median (runs) | / `dist_sync` | noisy runs', body, 'llrrr'))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n', maxsplit=1)[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--part', required=True,
                        choices=('full', 'phases', 'report', 'steady', 'sparse', 'plot'))
    parser.add_argument('--steps', type=int, default=4,
                        help='sparse: steps of the shorter job (the longer: 3x)')
    parser.add_argument('--tokens', type=int, default=20, help='sparse: token ids per sample')
    parser.add_argument('--out', default=os.path.join(harness.REPO, OUT))
    parser.add_argument('--scratch', default=os.path.join(harness.REPO, SCRATCH))
    parser.add_argument('--methods', default=','.join(METHODS),
                        help="full, phases: the methods, any of harness.METHODS (default: "
                             "this file's)")
    if argv[:1] == ['--role']:  # a process of a sparse job: --role VARIANT STEPS TOKENS OUT
        sparse_worker(argv[1], int(argv[2]), int(argv[3]), 128, argv[4])
        return 0
    args, rest = parser.parse_known_args(argv)
    # tta.py's parts, labels and stock checks run on this file's methods and, added by tta.py's
    # --methods, those asked for (an unknown name is tta.py's error).
    tta.METHODS.clear()
    tta.METHODS.update(METHODS)
    os.makedirs(args.out, exist_ok=True)
    if args.part == 'sparse':
        part_sparse(args)
        return 0
    if args.part == 'plot':
        part_plot(args.out)
        return 0
    if args.part == 'steady':
        part_steady(args.out)
        return 0
    forwarded = ['--part', args.part, '--out', os.path.relpath(args.out, harness.REPO),
                 '--scratch', os.path.relpath(args.scratch, harness.REPO)]
    if args.part == 'full' and '--seeds' not in rest:
        forwarded += ['--seeds', '1']
    forwarded += ['--methods', args.methods]
    return tta.main(forwarded + rest, command='python benchmarks/compress.py')


if __name__ == '__main__':
    sys.exit(main())
