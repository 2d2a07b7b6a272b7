"""Why FrozenVarianceAdam needs Adam's bound: an in-process simulation of the delayed mirror.

One process simulates the algorithm of docs/design.md §1 (2 workers, warm-up 200, k=8, rule
``'mirror'``) on the Fashion-MNIST MLP 784-1024-1024-10 of the accuracy benchmarks (the
example's model, initialiser and shards, seeded alike; batch 128 per worker; Adam lr 1e-3,
wd 0), with the optimizer in numpy float32 on the servers' sum and on each worker's
``N * g``, and one of three second-moment rules after the freeze at update 200:

- ``adam``: plain Adam (no freeze);
- ``fill``: the first FrozenVarianceAdam: v kept, a coordinate still at v == 0 takes
  ``(1 - beta2) g^2`` (up to commit e30423a);
- ``bound``: today's FrozenVarianceAdam: ``v := max(v, (1 - beta2) g^2)``.

It is a diagnostic, not the library (tests/reference.py and the distributed tests check
that the library is the algorithm): it records, every 10 steps of the delayed phase, the
largest ``|g| / sqrt(v)`` per tensor (worker 0's ``N * g`` over the servers' v; Adam keeps
a gradient's own ratio below ``1 / sqrt(1 - beta2)``, 32), both workers' losses, and the
test accuracy of the servers' model after each epoch; a run stops at the first step where
a worker's mean loss is not finite or above 20 (chance: ln 10 = 2.3), reported as diverged.

Usage::

    python benchmarks/frozen_adam_sim.py --out docs/benchmarks/mlp-adam-bound/sim
    python benchmarks/frozen_adam_sim.py --out docs/benchmarks/mlp-adam-bound/sim --report-only
"""
import argparse
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, '..', 'examples'))
# The example's model and evaluation (the example imports mxdelay first, then mxnet).
from train_fashion_mnist import build_net, evaluate  # noqa: E402  pylint: disable=wrong-import-position
import fashion_mnist_data as data  # noqa: E402  pylint: disable=wrong-import-position
import mxnet as mx  # noqa: E402  pylint: disable=wrong-import-position
from mxnet import autograd, gluon, nd  # noqa: E402  pylint: disable=wrong-import-position

import harness  # noqa: E402  pylint: disable=wrong-import-position
import report  # noqa: E402  pylint: disable=wrong-import-position

B1, B2, EPS = np.float32(0.9), np.float32(0.999), np.float32(1e-8)
RULES = ('adam', 'fill', 'bound')
N, BATCH, WARMUP, LR = 2, 128, 200, 1e-3
DIVERGED = 20.0   # a worker's mean loss above it (chance is ln 10 = 2.3) ends the run


def adam_update(w, g, m, v, u, rule, rescale):
    """One update (number `u`) of weight `w` in place with raw gradient `g`."""
    g = g * np.float32(rescale)
    m[:] = B1 * m + (1 - B1) * g
    frozen = rule != 'adam' and u > WARMUP
    if not frozen:
        v[:] = B2 * v + (1 - B2) * g * g
    elif rule == 'fill':
        v[:] = np.where(v == 0, (1 - B2) * g * g, v)
    else:
        np.maximum(v, (1 - B2) * g * g, out=v)
    T = min(u, WARMUP) if frozen else u
    w -= np.float32(LR * np.sqrt(1 - 0.999 ** T) / (1 - 0.9 ** u)) * m / (np.sqrt(v) + EPS)


def build(seed):
    mx.random.seed(seed)
    net = build_net('mlp')
    net.initialize(mx.init.Xavier(magnitude=2.24))
    net(nd.zeros((1, 1, 28, 28)))
    net.hybridize()
    return net, list(net.collect_params().values())


def accuracy(net, params, weights, test):
    for p, w in zip(params, weights):
        p.set_data(nd.array(w))
    return evaluate(net, *test, mx.cpu())


def simulate(rule, seed, delay, epochs, data_dir):
    """Yield a record every 10 delayed steps, at a non-finite loss, and after each epoch."""
    net, params = build(seed)
    W = [p.data().asnumpy() for p in params]
    M, V = [np.zeros_like(w) for w in W], [np.zeros_like(w) for w in W]
    workers = [dict(w=[x.copy() for x in W], m=None, v=None, pending=False) for _ in range(N)]
    train, test = data.load_split('train', data_dir), data.load_split('test', data_dir)
    shards = [data.WorkerShard(*train, BATCH, rank, N, seed) for rank in range(N)]
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    t, t0 = 0, WARMUP + 1
    for epoch in range(epochs):
        for batches in zip(*[shard.batches(epoch) for shard in shards]):
            grads, losses = [], []
            for worker, (x, y) in zip(workers, batches):
                for p, w in zip(params, worker['w']):
                    p.set_data(nd.array(w))
                with autograd.record():
                    loss = loss_fn(net(nd.array(x)), nd.array(y))
                loss.backward()
                losses.append(float(loss.mean().asscalar()))
                grads.append([p.grad().asnumpy() for p in params])
            u, W_t = t + 1, [w.copy() for w in W]            # round t = update t + 1
            for j, w in enumerate(W):
                adam_update(w, sum(g[j] for g in grads), M[j], V[j], u, rule, 1.0 / BATCH)
            for i, worker in enumerate(workers):
                if t <= WARMUP:                                  # synchronous; switch at W
                    worker['w'] = [w.copy() for w in W]
                    if t == WARMUP:
                        worker['m'], worker['v'] = [m.copy() for m in M], [v.copy() for v in V]
                    continue
                if worker['pending']:                            # the pull of t - 1: W_t
                    worker['w'] = [w.copy() for w in W_t]
                for j, w in enumerate(worker['w']):
                    adam_update(w, grads[i][j], worker['m'][j], worker['v'][j], u, rule,
                                float(N) / BATCH)
                worker['pending'] = (t - t0) % delay == delay - 1
            if not np.isfinite(losses).all() or max(losses) > DIVERGED:
                yield {'rule': rule, 'seed': seed, 'diverged_at': t, 'loss': losses}
                return
            if t > WARMUP and t % 10 == 0:
                ratio = [float(np.max(np.abs(g * np.float32(N / BATCH)) / (np.sqrt(v) + EPS)))
                         for g, v in zip(grads[0], V)]
                yield {'rule': rule, 'seed': seed, 'step': t, 'loss': losses,
                       'max_ratio': ratio}
            t += 1
        yield {'rule': rule, 'seed': seed, 'epoch': epoch + 1,
               'accuracy': accuracy(net, params, W, test)}


def summarize(records):
    """One row per (rule, seed)."""
    rows = {}
    for rec in records:
        row = rows.setdefault((rec['rule'], rec['seed']), {
            'rule': rec['rule'], 'seed': rec['seed'], 'diverged_at': None, 'accuracy': [],
            'max_ratio': 0.0})
        if 'diverged_at' in rec:
            row['diverged_at'] = rec['diverged_at']
        elif 'accuracy' in rec:
            row['accuracy'].append(rec['accuracy'])
        else:
            row['max_ratio'] = max(row['max_ratio'], max(rec['max_ratio']))
    return list(rows.values())


def write_report(out, records, command):
    rows = summarize(records)
    lines = ['# FrozenVarianceAdam with and without Adam\'s bound: simulated delayed mirror', '',
             'Generated by `%s`; do not edit. See the script\'s docstring for what it '
             'simulates; raw records in [records.jsonl](records.jsonl), provenance in '
             '[meta.json](meta.json).' % command, '',
             'Largest ratio: the largest `|N g| / sqrt(v)` (worker 0 over the servers\' v) '
             'seen every 10 delayed steps before a divergence.', '']
    lines += report.table(['rule', 'seed', 'diverged at step', 'largest ratio',
                           'test accuracy per epoch'],
                          [[r['rule'], str(r['seed']), str(r['diverged_at'] or '-'),
                            '%.3g' % r['max_ratio'],
                            ' '.join('%.4f' % a for a in r['accuracy']) or '-']
                           for r in rows], 'lrrrl')
    with open(os.path.join(out, 'results.md'), 'w', encoding='utf-8') as file:
        file.write('\n'.join(lines) + '\n')


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--out', required=True, help='results folder')
    parser.add_argument('--rules', default=','.join(RULES))
    parser.add_argument('--seeds', default='1,2,3')
    parser.add_argument('--delay', type=int, default=8)
    parser.add_argument('--epochs', type=int, default=2)
    parser.add_argument('--data-dir', default=data.DEFAULT_DATA_DIR)
    parser.add_argument('--report-only', action='store_true',
                        help='no simulation: results.md again from --out/records.jsonl')
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    out = os.path.abspath(args.out)                 # the command as run from the repository
    at = out.rfind(os.sep + 'docs' + os.sep)
    command = 'python benchmarks/frozen_adam_sim.py --out %s --rules %s --seeds %s --delay %d ' \
        '--epochs %d' % (out[at + 1:] if at >= 0 else args.out, args.rules, args.seeds,
                         args.delay, args.epochs)
    records_path = os.path.join(args.out, 'records.jsonl')
    if args.report_only:
        with open(records_path, encoding='utf-8') as file:
            write_report(args.out, [json.loads(line) for line in file], command)
        return
    meta, records, started = harness.start_meta(command), [], time.time()
    with open(records_path, 'w', encoding='utf-8') as file:
        for seed in (int(s) for s in args.seeds.split(',')):
            for rule in args.rules.split(','):
                for rec in simulate(rule, seed, args.delay, args.epochs, args.data_dir):
                    records.append(rec)
                    file.write(json.dumps(rec) + '\n')
                    if 'step' not in rec:
                        print('%5.0f s %s' % (time.time() - started, json.dumps(rec)), flush=True)
    with open(os.path.join(args.out, 'meta.json'), 'w', encoding='utf-8') as file:
        json.dump(harness.finish_meta(meta), file, indent=1)
    write_report(args.out, records, command)


if __name__ == '__main__':
    main()
