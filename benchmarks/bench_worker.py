"""One worker (and, under a launcher, every other role) of the benchmarks' training jobs.

The model, data and seed are those of ``examples/train_fashion_mnist.py``: its
``build_net(--model)`` (default ``'mlp'``), read from the example's source (importing the
example would import mxdelay), and its per-worker shards (``fashion_mnist_data``, numpy
only). ``--model resnet18`` and ``--model resnet50`` are Gluon's model zoo
``resnet18_v1(classes=10)`` and ``resnet50_v1(classes=10)`` on synthetic data instead (the
scaling benchmark's communication-heavy models): :class:`SyntheticShard`, fixed random
3x32x32 images and labels seeded by seed and rank (window runs only); ``--batch-size``
defaults to 8 for resnet50 (issue 37's envelope), 128 for the others. The
optimizer is ``--optimizer`` (SGD with ``--momentum``, Adam or LAMB), ``--lr``, ``--wd``, on
the servers (and mirrored locally by ``DelayedTrainer``); ``--freeze-second-moment`` (delayed
Adam only) makes it ``mxdelay.FrozenVarianceAdam`` frozen at the switch
(``freeze_after=--warmup-steps``, docs/design.md §1.4). The loop is a stock Gluon loop:
forward, backward, ``trainer.step``, read the loss (as a loop that logs its loss does; this
is where a worker waits for what the step left pending). Every step's end
(``time.time()``, comparable across the processes of one machine), the process's CPU
seconds by then (every thread: ``time.process_time()``) and loss are recorded.

Two kinds of run:

- window (default): the first ``--warmup-steps`` + 1 steps (warm-up and switch of
  ``DelayedTrainer``; the same number for every mode) are not timed; the next ``--steps``
  are. The JSON has the window's start and end and the worker's CPU seconds in it (and,
  for a delayed worker, what ran its codecs: :func:`codec_kernels`).
- ``--epochs E``: full training, ``E`` epochs of the shard. Worker 0 copies its weights at
  the end of every ``--eval-every`` steps and of every epoch, and evaluates the copies on the
  10000 test images *after* training, so that evaluation takes no time from training.
  With ``--global-model`` (delayed mode), every worker calls ``trainer.sync_weights()`` just
  before each of these copies, so that worker 0 copies the servers' global weights (its own
  BatchNorm running statistics, which are not trained parameters; with ``--aux-states``
  ``sync_weights(aux_states=True)``: the workers' mean statistics, docs/design.md §2.13); the
  workers' next local steps then start from them (docs/design.md §1.4). Stock
  ``dist_sync``'s worker 0 holds the global weights after every step anyway.

Modes: ``sync`` is stock ``gluon.Trainer`` on ``'dist_sync'``; ``delayed`` is
``mxdelay.DelayedTrainer`` on ``'dist_delay'``. ``--compression`` (``fp16``,
``2bit:THRESHOLD``, or ``int8``, ``int4``, ``ternary`` with an optional ``:BLOCK``, delayed
only: stock MXNet does not know them) passes ``compression_params``; in ``sync`` mode the trainer is then the
tests' ``PushThenPullTrainer`` (``tests/scripts/mlp_model.py``, stock MXNet only): stock
Gluon's ``pushpull`` is refused with compression on ``'dist_sync'``. ``--pull-compression``
(``fp16``, ``int8`` or ``int8:BLOCK``; ``delayed`` only) passes ``pull_compression``
(docs/design.md §2.12). Only ``delayed`` imports
mxdelay (before mxnet, so that its servers are mxdelay's); ``sync`` is stock MXNet in every
process, servers and scheduler included.

Provenance (``benchmarks/provenance.py``): every process (scheduler, servers, workers)
writes ``role-<role>-<rank>.json`` next to ``--out``, before it imports MXNet and again at
exit (a scheduler or server leaves MXNet's import only to exit): whether ``mxdelay``,
``kvstore_ext`` or ``mxnet`` were imported, and the ``MXNET_*``, ``OMP_*`` and ``MXDELAY_*``
variables it saw. A ``sync`` process that finds mxdelay imported exits with code 3 at once.
"""
import json
import os
import sys

import provenance  # standard library only: first, before MXNet


def _option(name, default=None):
    """The value of `--name X` or `--name=X` in sys.argv (before argparse can run)."""
    argv = sys.argv[1:]
    for index, arg in enumerate(argv):
        if arg == name and index + 1 < len(argv):
            return argv[index + 1]
        if arg.startswith(name + '='):
            return arg.split('=', 1)[1]
    return default


if _option('--out'):
    provenance.record(os.path.dirname(os.path.abspath(_option('--out'))), _option('--mode'),
                      stock=_option('--mode') != 'delayed')
# The servers of a job run what their `import` makes of them: mxdelay's server if mxdelay is
# imported before mxnet, else MXNet's stock one. The baseline is stock MXNet throughout.
if _option('--mode') == 'delayed':
    import mxdelay  # noqa: F401  pylint: disable=unused-import

import argparse  # noqa: E402  pylint: disable=wrong-import-position,wrong-import-order
import ast  # noqa: E402  pylint: disable=wrong-import-position,wrong-import-order
import contextlib  # noqa: E402  pylint: disable=wrong-import-position,wrong-import-order
import time  # noqa: E402  pylint: disable=wrong-import-position,wrong-import-order

import mxnet as mx  # noqa: E402  pylint: disable=wrong-import-position
import numpy as np  # noqa: E402  pylint: disable=wrong-import-position,wrong-import-order
from mxnet import autograd, gluon, nd  # noqa: E402  pylint: disable=wrong-import-position

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'examples')
sys.path.insert(0, EXAMPLES)
import fashion_mnist_data as data  # noqa: E402  pylint: disable=wrong-import-position


def build_net(model='mlp'):
    """The example's ``build_net``, compiled from its source without importing the example."""
    path = os.path.join(EXAMPLES, 'train_fashion_mnist.py')
    with open(path, encoding='utf-8') as src:
        tree = ast.parse(src.read(), path)
    function = next(node for node in tree.body
                    if isinstance(node, ast.FunctionDef) and node.name == 'build_net')
    namespace = {'gluon': gluon}
    exec(compile(ast.Module(body=[function], type_ignores=[]), path, 'exec'),  # pylint: disable=exec-used
         namespace)
    return namespace['build_net'](model)


#: --model -> the shape of one input example (the first forward's, which sizes the layers)
INPUT_SHAPE = {'mlp': (1, 28, 28), 'cnn': (1, 28, 28), 'cnn-bn': (1, 28, 28),
               'resnet18': (3, 32, 32), 'resnet50': (3, 32, 32)}
#: the models of Gluon's model zoo, trained on SyntheticShard (window runs only)
ZOO = {'resnet18': 'resnet18_v1', 'resnet50': 'resnet50_v1'}
#: --batch-size when not given: 8 for ResNet-50 (issue 37), else 128
DEFAULT_BATCH = {'resnet50': 8}


def build_model(model):
    """The network of `model`: the example's ``build_net`` or ``<ZOO[model]>(classes=10)``."""
    if model in ZOO:
        return getattr(gluon.model_zoo.vision, ZOO[model])(classes=10)
    return build_net(model)


class SyntheticShard:
    """`num_batches` fixed random batches ``(x, y)`` of this worker, the same every epoch.

    Images are standard normal float32 (b, 3, 32, 32), labels uniform over 10 classes, from
    a generator seeded by (seed, rank): the same on every run. The interface is that of
    ``fashion_mnist_data.WorkerShard`` as the loop below uses it. Throughput only: the
    labels are noise (no accuracy to measure).
    """

    def __init__(self, batch_size, rank, seed, num_batches=8, shape=(3, 32, 32)):
        rng = np.random.default_rng([seed, rank])
        self._batches = [(rng.standard_normal((batch_size,) + shape,
                                              dtype=np.float32),
                          rng.integers(0, 10, batch_size).astype(np.float32))
                         for _ in range(num_batches)]

    def __len__(self):
        return len(self._batches)

    def batches(self, epoch):  # pylint: disable=unused-argument
        """Yield the batches (the same in every epoch)."""
        yield from self._batches


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--mode', choices=('sync', 'delayed'), required=True)
    parser.add_argument('--delay', type=_delay, default=4, help="k, or 'auto' (default: 4)")
    parser.add_argument('--local-rule', default='mirror')
    parser.add_argument('--warmup-steps', type=int, default=200)
    parser.add_argument('--steps', type=int, default=300, help='timed steps (window runs)')
    parser.add_argument('--epochs', type=int, help='full training of this many epochs')
    parser.add_argument('--eval-every', type=int, default=78,
                        help='--epochs: worker 0 keeps its weights every this many steps, and '
                             'at every epoch end, for evaluation after training')
    parser.add_argument('--global-model', action='store_true',
                        help='--epochs, delayed: trainer.sync_weights() on every worker before '
                             'each copy of the weights')
    parser.add_argument('--aux-states', action='store_true',
                        help='with --global-model: sync_weights(aux_states=True), the workers\' '
                             'mean BatchNorm statistics')
    parser.add_argument('--model', choices=tuple(INPUT_SHAPE), default='mlp',
                        help="resnet18, resnet50: synthetic data, window runs only "
                             "(default: %(default)s)")
    parser.add_argument('--optimizer', choices=('sgd', 'adam', 'lamb'), default='sgd')
    parser.add_argument('--freeze-second-moment', action='store_true',
                        help="delayed Adam only: 'frozenvarianceadam' with freeze_after "
                             '--warmup-steps')
    parser.add_argument('--batch-size', type=int,
                        help='per worker (default: 8 for resnet50, else 128)')
    parser.add_argument('--lr', type=float, default=0.05)
    parser.add_argument('--momentum', type=float, default=0.9, help='sgd only')
    parser.add_argument('--wd', type=float, default=0.0)
    parser.add_argument('--seed', type=int, default=1)
    parser.add_argument('--compression', default='none',
                        metavar='none|auto|fp16|2bit:THRESHOLD|int8|int4|ternary[:BLOCK]',
                        help="compression_params of the trainer ('auto': delayed only, it "
                             'chooses the pull codec too; default: %(default)s)')
    parser.add_argument('--pull-compression', default='none', metavar='none|fp16|int8[:BLOCK]',
                        help='pull_compression of DelayedTrainer, delayed only '
                             '(default: %(default)s)')
    parser.add_argument('--data-dir', default=data.DEFAULT_DATA_DIR)
    parser.add_argument('--out', required=True,
                        help='output JSON file; {rank} is replaced by the worker rank')
    args = parser.parse_args(argv)
    args.compression = compression_params(args.compression)
    args.pull_compression = pull_compression(args.pull_compression)
    if args.pull_compression and args.mode != 'delayed':
        parser.error('--pull-compression %s needs --mode delayed (stock dist_sync has no '
                     'compressed pulls); drop it for --mode %s'
                     % (args.pull_compression['type'], args.mode))
    if args.compression == 'auto' and (args.mode != 'delayed' or args.pull_compression):
        parser.error("--compression auto needs --mode delayed and no --pull-compression (it "
                     'chooses both codecs), got --mode %s' % args.mode)
    if args.freeze_second_moment and (args.mode != 'delayed' or args.optimizer != 'adam'):
        parser.error('--freeze-second-moment needs --mode delayed and --optimizer adam, got '
                     '--mode %s --optimizer %s' % (args.mode, args.optimizer))
    if args.model in ZOO and args.epochs is not None:
        parser.error('--model %s trains on synthetic data: no --epochs (accuracy) runs, '
                     'got --epochs %d; drop --epochs for a window run'
                     % (args.model, args.epochs))
    if args.batch_size is None:
        args.batch_size = DEFAULT_BATCH.get(args.model, 128)
    return args


def _delay(text):
    """``delay`` of `text`: 'auto' or an integer."""
    return text if text == 'auto' else int(text)


def decided(trainer, args):
    """What ``delay='auto'`` decided (``'k=4'``, ``'synchronous from 21'``, ``'k=4, synchronous
    from 33'``) and what ``compression_params='auto'`` chose (``'ternary+int8'``), or None
    for fixed settings."""
    schedule = trainer.schedule
    parts = []
    if schedule.auto:
        parts += ['k=%d' % schedule.delay] if schedule.delay else []
        if schedule.synchronous_from is not None:
            parts.append('synchronous from %d' % schedule.synchronous_from)
        parts = parts or ['undecided']
    if args.compression == 'auto':
        codecs = trainer.codecs
        parts.append('undecided codecs' if codecs is None else '+'.join(
            (c or {}).get('type', 'none') for c in (codecs['compression_params'],
                                                      codecs['pull_compression'])))
    return ', '.join(parts) or None


def compression_params(text):
    """``compression_params`` of `text`: 'none', 'auto', 'fp16', '2bit:THRESHOLD', or 'int8',
    'int4' or 'ternary', each optionally ':BLOCK'."""
    kind, colon, value = text.partition(':')
    if kind == 'none' and not colon:
        return None
    if kind == 'auto' and not colon:
        return 'auto'    # DelayedTrainer chooses both codecs
    if kind == 'fp16' and not colon:
        return {'type': 'fp16'}
    if kind == '2bit' and value:
        return {'type': '2bit', 'threshold': float(value)}
    if kind in ('int8', 'int4', 'ternary') and not colon:
        return {'type': kind}
    if kind in ('int8', 'int4', 'ternary') and value.isdigit():
        return {'type': kind, 'block_size': int(value)}
    raise ValueError("--compression must be 'none', 'auto', 'fp16', '2bit:THRESHOLD', or 'int8', "
                     "'int4' or 'ternary' with an optional ':BLOCK' (a positive integer), "
                     "got %r" % text)


def pull_compression(text):
    """``pull_compression`` of `text`: 'none', 'fp16', 'int8' or 'int8:BLOCK'."""
    kind, colon, block = text.partition(':')
    if kind == 'none' and not colon:
        return None
    if kind == 'fp16' and not colon:
        return {'type': 'fp16'}
    if kind == 'int8' and not colon:
        return {'type': 'int8'}
    if kind == 'int8' and block.isdigit():
        return {'type': 'int8', 'block_size': int(block)}
    raise ValueError("--pull-compression must be 'none', 'fp16', 'int8' or 'int8:BLOCK' "
                     "(BLOCK a positive integer), got %r" % text)


def codec_kernels():
    """What ran this (delayed) worker's codecs: ``{'backend': 'compiled' or 'numpy',
    'calls': {C function: calls}}`` (``kvstore_ext.codecs.kernels``; a stock worker has no
    mxdelay to ask)."""
    from kvstore_ext.codecs import kernels  # pylint: disable=import-outside-toplevel
    return {'backend': kernels.backend(), 'calls': kernels.compiled_calls()}


def evaluate(net, images, labels):
    """Accuracy of `net` on a whole split (as the example's ``evaluate``)."""
    correct = 0
    for x, y in data.iterate(images, labels, 1000):
        pred = net(nd.array(x)).argmax(axis=1)
        correct += int((pred == nd.array(y)).sum().asscalar())
    return correct / len(images)


def main(argv=None):
    args = parse_args(argv)
    if args.model not in ZOO:
        train_images, train_labels = data.load_split('train', args.data_dir)
    opt = {'learning_rate': args.lr, 'wd': args.wd}
    if args.optimizer == 'sgd':
        opt['momentum'] = args.momentum
    optimizer = args.optimizer
    if args.freeze_second_moment:
        optimizer, opt['freeze_after'] = 'frozenvarianceadam', args.warmup_steps
    kvstore = mx.kv.create('dist_delay' if args.mode == 'delayed' else 'dist_sync')
    rank, num_workers = kvstore.rank, kvstore.num_workers
    if args.mode != 'delayed':
        assert 'mxdelay' not in sys.modules and 'kvstore_ext' not in sys.modules
    mx.random.seed(args.seed)
    net = build_model(args.model)
    net.initialize(mx.init.Xavier(magnitude=2.24))
    # After an inference forward of resnet18 (MKLDNN may then keep convolution weights in
    # its own layout) both methods failed at the first step: stock dist_sync's server
    # aborted ('init 4 first'), dist_delay's pull into the weights raised 'We can't generate
    # TBlob for MKLDNN data'. The zoo's ResNets size their layers in training mode instead
    # (their BatchNorm running statistics move once, towards zeros); the example's models as
    # before.
    with autograd.train_mode() if args.model in ZOO else contextlib.nullcontext():
        net(nd.zeros((1,) + INPUT_SHAPE[args.model]))
    net.hybridize()
    if args.mode == 'delayed':
        trainer = sys.modules['mxdelay'].DelayedTrainer(
            net.collect_params(), optimizer, opt, kvstore=kvstore, delay=args.delay,
            warmup_steps=args.warmup_steps, local_rule=args.local_rule,
            compression_params=args.compression, pull_compression=args.pull_compression)
    elif args.compression and args.mode == 'sync':
        sys.path.insert(0, os.path.join(os.path.dirname(EXAMPLES), 'tests', 'scripts'))
        from mlp_model import PushThenPullTrainer  # pylint: disable=import-outside-toplevel
        trainer = PushThenPullTrainer(net.collect_params(), args.optimizer, opt, kvstore=kvstore,
                                      compression_params=args.compression)
    else:
        trainer = gluon.Trainer(net.collect_params(), args.optimizer, opt, kvstore=kvstore,
                                compression_params=args.compression)
    params = list(net.collect_params().values())  # BatchNorm's running statistics included
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    if args.model in ZOO:
        shard = SyntheticShard(args.batch_size, rank, args.seed,
                               shape=INPUT_SHAPE[args.model])
    else:
        shard = data.WorkerShard(train_images, train_labels, args.batch_size, rank,
                                 num_workers, args.seed)

    full = args.epochs is not None
    skip = 0 if full else args.warmup_steps + 1  # window runs: warm-up and switch not timed
    total = args.epochs * len(shard) if full else skip + args.steps
    step, ends, cpu_ends, losses, start, cpu_start = 0, [], [], [], None, None
    snapshots = []  # (step, epoch, [numpy weights]) of worker 0, evaluated after training
    epoch = 0
    first = time.time()
    while step < total:
        for x, y in shard.batches(epoch):
            if step == skip:
                start, cpu_start = time.time(), time.process_time()
            x, y = nd.array(x), nd.array(y)
            with autograd.record():
                loss = loss_fn(net(x), y)
            loss.backward()
            trainer.step(x.shape[0])
            losses.append(float(loss.mean().asscalar()))
            step += 1
            ends.append(time.time())
            cpu_ends.append(time.process_time())   # every thread of the process
            at_eval = full and (step % args.eval_every == 0 or step % len(shard) == 0)
            if at_eval and args.global_model and args.mode == 'delayed':
                # collective: every worker, at the same steps
                trainer.sync_weights(aux_states=args.aux_states)
            if at_eval and rank == 0:
                snapshots.append((step, step / len(shard),
                                  [p.data().asnumpy() for p in params]))
            if step == total:
                break
        epoch += 1
    nd.waitall()  # what the last step left pending belongs to the window
    end = time.time()
    result = {'rank': rank, 'num_workers': num_workers, 'mode': args.mode,
              'model': args.model, 'optimizer': optimizer, 'optimizer_params': opt,
              'local_rule': args.local_rule if args.mode == 'delayed' else None,
              'global_model': args.global_model and args.mode == 'delayed',
              'aux_states': args.aux_states and args.global_model and args.mode == 'delayed',
              'trained_parameters': sum(p.data().size for p in params
                                        if p.grad_req != 'null'),
              'delay': args.delay if args.mode == 'delayed' else None,
              'warmup_steps': args.warmup_steps if args.mode == 'delayed' else None,
              'compression': args.compression, 'pull_compression': args.pull_compression,
              'seed': args.seed,
              'batch_size': args.batch_size, 'steps': total - skip,
              'steps_per_epoch': len(shard), 'first': first, 'start': start, 'end': end,
              'cpu_s': time.process_time() - cpu_start, 'step_ends': ends[skip:],
              'all_step_ends': ends, 'all_step_cpu': cpu_ends, 'losses': losses,
              'mean_loss': sum(losses) / total,
              'codec_kernels': codec_kernels() if args.mode == 'delayed' else None,
              'decided': decided(trainer, args) if args.mode == 'delayed' else None}
    if snapshots:
        test_images, test_labels = data.load_split('test', args.data_dir)
        evaluated = time.time()
        result['evals'] = []
        # A net of its own: set_data on the trained net would reset the trainer's kvstore.
        eval_net = build_net(args.model)
        eval_net.initialize()
        eval_net(nd.zeros((1, 1, 28, 28)))
        eval_net.hybridize()
        eval_params = list(eval_net.collect_params().values())
        for at_step, at_epoch, weights in snapshots:
            for param, value in zip(eval_params, weights):
                param.set_data(nd.array(value))
            result['evals'].append({'step': at_step, 'epoch': at_epoch,
                                    'test_acc': evaluate(eval_net, test_images, test_labels)})
        result['eval_s'] = time.time() - evaluated
    with open(args.out.format(rank=rank), 'w', encoding='utf-8') as out:
        json.dump(result, out)
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
