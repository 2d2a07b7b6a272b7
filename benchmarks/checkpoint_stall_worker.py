"""A worker of benchmarks/checkpoint_stall.py: the example's MLP on its Fashion-MNIST shard,
timing every iteration while saving checkpoints in a fixed cycle of windows.

Each cycle is 3 windows of ``--window`` iterations (forward, backward, ``trainer.step``,
``loss.asscalar()``): one where the trainer's periodic checkpoint (``checkpoint_every`` =
3 windows, :mod:`mxdelay.autosave`) falls in its first step, one that starts with an
explicit ``trainer.save_states`` (what a script did before), and one without a save. Each
worker writes ``--out`` (``{rank}`` replaced): every iteration's wall time and the windows.
"""
import mxdelay  # before mxnet: the scheduler and servers become mxdelay's

import argparse
import json
import os
import sys
import time

import mxnet as mx
from mxnet import autograd, gluon, nd

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'examples')
sys.path.insert(0, EXAMPLES)
import fashion_mnist_data as data  # noqa: E402  pylint: disable=wrong-import-position
from train_fashion_mnist import build_net  # noqa: E402  pylint: disable=wrong-import-position


#: (iteration, part, seconds) of every call of the parts of a save (:func:`time_parts`).
PARTS = []
_ITERATION = [None]
#: (CPU seconds, wall seconds) of the writing thread of every periodic save.
WRITES = []


def time_parts():
    """Time each part of a save's synchronous half (the functions autosave calls)."""
    from kvstore_ext.checkpoint import files  # pylint: disable=import-outside-toplevel
    from kvstore_ext.worker import channel  # pylint: disable=import-outside-toplevel
    from kvstore_ext.worker.store_checkpoint import StoreCheckpoint  # pylint: disable=C0415
    from mxdelay import autosave, delayed, worker_state  # pylint: disable=C0415

    def timed(owner, name, label):
        original = getattr(owner, name, None)
        if original is None:
            return   # not in the library this job runs (--library: another commit's)

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                PARTS.append((_ITERATION[0], label, time.perf_counter() - start))
        setattr(owner, name, wrapper)

    timed(mxdelay.DelayedTrainer, 'join', 'join')
    timed(delayed.DelayedUpdate, 'snapshot', 'snapshot (its waits, copy to host)')
    timed(files, 'encode', 'encode (copy of the fields)')
    timed(worker_state, 'collect', 'copy to host (in the snapshot)')
    timed(channel, 'wait_for_issued_work', 'wait for issued work (before SAVE)')
    timed(channel.CommandChannel, 'command', 'SAVE command (send, reply)')
    write = autosave.AutoSave._write

    def timed_write(self, *args):
        # The writing thread's own CPU time and wall time, for each periodic save.
        cpu, wall = time.thread_time(), time.perf_counter()
        write(self, *args)
        WRITES.append((time.thread_time() - cpu, time.perf_counter() - wall))
    autosave.AutoSave._write = timed_write
    timed(StoreCheckpoint, 'save', "servers' files (barrier, SAVE, barrier)")
    timed(StoreCheckpoint, 'save_in_background', "servers' copy (SAVE in the background)")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--out', required=True)
    parser.add_argument('--checkpoint-dir', required=True)
    parser.add_argument('--window', type=int, default=50)
    parser.add_argument('--cycles', type=int, default=5)
    parser.add_argument('--warmup-steps', type=int, default=20)
    parser.add_argument('--delay', type=int, default=4)
    parser.add_argument('--seed', type=int, default=1)
    parser.add_argument('--batch-size', type=int, default=128)
    args = parser.parse_args()
    images, labels = data.load_split('train', data.DEFAULT_DATA_DIR)
    kv = mx.kv.create('dist_delay')
    rank = kv.rank
    mx.random.seed(args.seed)
    net = build_net('mlp')
    net.initialize(mx.init.Xavier(magnitude=2.24))
    net(nd.zeros((1, 1, 28, 28)))
    net.hybridize()
    period = 3 * args.window
    trainer = mxdelay.DelayedTrainer(
        net.collect_params(), 'sgd', {'learning_rate': 0.05, 'momentum': 0.9}, kvstore=kv,
        delay=args.delay, warmup_steps=args.warmup_steps,
        checkpoint_dir=args.checkpoint_dir, checkpoint_every=period)
    assert trainer.resumed_step == 0, 'the checkpoint folder must start empty'
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    shard = data.WorkerShard(images, labels, args.batch_size, rank, kv.num_workers, args.seed)
    # Iteration j's step brings the counter to j + 1: the autosave falls in iteration
    # j = k * period - 1; save_states follows iteration k * period + window - 1; the
    # windows compared start at those iterations and at k * period + 2 * window - 1.
    total = args.warmup_steps + (args.cycles + 1) * period
    time_parts()
    times, writing, batches, epoch = [], [], iter(()), 0
    saved, saved_in = [0], []   # the counters saved at, the iterations that saved
    for j in range(total):
        _ITERATION[0] = j
        start = time.perf_counter()
        try:
            x, y = next(batches)
        except StopIteration:
            batches, epoch = iter(shard.batches(epoch)), epoch + 1
            x, y = next(batches)
        x, y = nd.array(x), nd.array(y)
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(x.shape[0])
        if (j + 1) % period == args.window:
            trainer.save_states(os.path.join(args.checkpoint_dir, 'explicit'))
        loss.mean().asscalar()
        times.append(time.perf_counter() - start)
        writer = trainer._autosave._writer  # pylint: disable=protected-access
        writing.append(writer is not None and writer.is_alive())
        if trainer._autosave._saved != saved[-1]:  # pylint: disable=protected-access
            saved.append(trainer._autosave._saved)  # pylint: disable=protected-access
            saved_in.append(j)
    trainer._autosave.wait()  # pylint: disable=protected-access
    # A periodic save falls in the first iteration at or after k * period - 1 that applied a
    # pull (mxdelay.autosave): the windows start there, and save_states' and the control's
    # a window and two later.
    windows = {'autosave': [], 'save_states': [], 'none': []}
    for first in saved_in:
        if first < args.warmup_steps + args.window or first + period > total:
            continue   # the synchronous warm-up, or too close to it; or the last save
        k = (first + 1) // period   # it fell at most delay - 1 iterations late
        windows['autosave'].append(first)
        windows['save_states'].append(k * period + args.window - 1)
        windows['none'].append(k * period + 2 * args.window - 1)
    with open(args.out.format(rank=rank), 'w', encoding='utf-8') as out:
        json.dump({'rank': rank, 'times': times, 'writing': writing, 'parts': PARTS,
                   'writes': WRITES,
                   'window': args.window, 'windows': windows, 'period': period,
                   'warmup_steps': args.warmup_steps, 'delay': args.delay,
                   'sizes': {name: os.path.getsize(os.path.join(args.checkpoint_dir, name))
                             for name in os.listdir(args.checkpoint_dir)}}, out)


if __name__ == '__main__':
    main()
