"""One worker of a throughput run of ``benchmarks/benchmark.py``.

The model, data and seed are those of ``examples/train_fashion_mnist.py`` (its
``build_net`` and its per-worker shards), trained with a stock Gluon loop: forward,
backward, ``trainer.step``, read the loss (as a loop that logs its loss does; this is where
a worker waits for what the step left pending). The first ``--warmup-steps`` + 1 steps
(warm-up and switch of ``DelayedTrainer``; the same number for every mode) are not timed;
the next ``--steps`` are. Each worker writes one JSON file: its window's start and end
(``time.time()``, comparable across the processes of one machine), the end of every timed
step, and its own CPU seconds in the window.

Modes: ``compute`` trains with ``kvstore=None`` in a process of its own (no launcher; give
``--rank`` and ``--num-workers``); ``sync`` is stock ``gluon.Trainer`` on ``'dist_sync'``;
``delayed`` is ``mxdelay.DelayedTrainer`` on ``'dist_delay'``. The last two run under
``mxdelay-launch``. Only ``delayed`` imports mxdelay (before mxnet, so that its servers are
mxdelay's); the other modes are stock MXNet in every process, servers included, with
MXNet's defaults (``import mxdelay`` would also change the backward bulk size).
"""
import sys

# The servers of a job run what their `import` makes of them: mxdelay's server if mxdelay is
# imported before mxnet, else MXNet's stock one. The baseline is stock MXNet throughout.
if any(arg in ('--mode=delayed', 'delayed') for arg in sys.argv[1:]):
    import mxdelay  # noqa: F401  pylint: disable=unused-import

import argparse  # noqa: E402  pylint: disable=wrong-import-position,wrong-import-order
import json  # noqa: E402  pylint: disable=wrong-import-position,wrong-import-order
import os  # noqa: E402  pylint: disable=wrong-import-position,wrong-import-order
import random  # noqa: E402  pylint: disable=wrong-import-position,wrong-import-order
import time  # noqa: E402  pylint: disable=wrong-import-position,wrong-import-order

import mxnet as mx  # noqa: E402  pylint: disable=wrong-import-position
from mxnet import autograd, gluon, nd

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                'examples'))
import fashion_mnist_data as data  # noqa: E402  pylint: disable=wrong-import-position
from train_fashion_mnist import build_net  # noqa: E402  pylint: disable=wrong-import-position


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--mode', choices=('compute', 'sync', 'delayed'), required=True)
    parser.add_argument('--delay', type=int, default=4)
    parser.add_argument('--local-rule', default='mirror')
    parser.add_argument('--warmup-steps', type=int, default=200)
    parser.add_argument('--steps', type=int, default=300, help='timed steps')
    parser.add_argument('--batch-size', type=int, default=128)
    parser.add_argument('--lr', type=float, default=0.05)
    parser.add_argument('--momentum', type=float, default=0.9)
    parser.add_argument('--seed', type=int, default=1)
    parser.add_argument('--jitter', default='0,0', metavar='PROB,MAX_MS',
                        help='before each step, with probability PROB, sleep a uniformly random '
                             '0..MAX_MS milliseconds (seeded by seed and rank)')
    parser.add_argument('--rank', type=int, default=0, help='compute mode: this worker')
    parser.add_argument('--num-workers', type=int, default=1, help='compute mode: how many')
    parser.add_argument('--data-dir', default=data.DEFAULT_DATA_DIR)
    parser.add_argument('--out', required=True,
                        help='output JSON file; {rank} is replaced by the worker rank')
    args = parser.parse_args(argv)
    prob, max_ms = (float(value) for value in args.jitter.split(','))
    args.jitter = (prob, max_ms)
    return args


def main(argv=None):
    args = parse_args(argv)
    train_images, train_labels = data.load_split('train', args.data_dir)
    opt = {'learning_rate': args.lr, 'momentum': args.momentum}
    if args.mode == 'compute':
        kvstore, rank, num_workers = None, args.rank, args.num_workers
    else:
        kvstore = mx.kv.create('dist_delay' if args.mode == 'delayed' else 'dist_sync')
        rank, num_workers = kvstore.rank, kvstore.num_workers
    mx.random.seed(args.seed)
    net = build_net('mlp')
    net.initialize(mx.init.Xavier(magnitude=2.24))
    net(nd.zeros((1, 1, 28, 28)))
    net.hybridize()
    if args.mode == 'delayed':
        trainer = sys.modules['mxdelay'].DelayedTrainer(net.collect_params(), 'sgd', opt, kvstore=kvstore,
                                         delay=args.delay, warmup_steps=args.warmup_steps,
                                         local_rule=args.local_rule)
    else:
        trainer = gluon.Trainer(net.collect_params(), 'sgd', opt, kvstore=kvstore)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    shard = data.WorkerShard(train_images, train_labels, args.batch_size, rank, num_workers,
                             args.seed)
    jitter_rng = random.Random(args.seed * 1000 + rank)
    prob, max_ms = args.jitter

    skip = args.warmup_steps + 1  # warm-up and switch: not timed
    total = skip + args.steps
    step, ends, start, cpu_start, loss_sum = 0, [], None, None, 0.0
    epoch = 0
    while step < total:
        for x, y in shard.batches(epoch):
            if step == skip:
                start, cpu_start = time.time(), time.process_time()
            if prob and jitter_rng.random() < prob:
                time.sleep(jitter_rng.uniform(0, max_ms) / 1000)
            x, y = nd.array(x), nd.array(y)
            with autograd.record():
                loss = loss_fn(net(x), y)
            loss.backward()
            trainer.step(x.shape[0])
            loss_sum += float(loss.mean().asscalar())
            step += 1
            if step > skip:
                ends.append(time.time())
            if step == total:
                break
        epoch += 1
    nd.waitall()  # what the last step left pending belongs to the window
    end = time.time()
    with open(args.out.format(rank=rank), 'w', encoding='utf-8') as out:
        json.dump({'rank': rank, 'num_workers': num_workers, 'mode': args.mode,
                   'batch_size': args.batch_size, 'steps': args.steps, 'start': start,
                   'end': end, 'cpu_s': time.process_time() - cpu_start, 'step_ends': ends,
                   'mean_loss': loss_sum / total}, out)
    return 0


if __name__ == '__main__':
    try:
        sys.exit(main())
    except Exception:  # pylint: disable=broad-except
        if os.environ.get('DMLC_ROLE') != 'worker':
            raise
        # A raising worker would wait in ps-lite's exit barrier for the others: exit now.
        import traceback
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
