"""Train an MLP or a small CNN on Fashion-MNIST with mxdelay's k-step delayed update.

Run 1 scheduler, 1 server and 2 workers on this machine (about 25 s on 2 idle CPU cores)::

    mxdelay-launch -n 2 -s 1 python examples/train_fashion_mnist.py --epochs 2

with the README's settings, ``delay='auto'`` and ``compression_params='auto'`` (the job measures
its link at the first step and its steps at the switch, and logs what it chose), or settings
of your own, e.g. the headline's (k=4, ternary pushes, int8 pulls)::

    mxdelay-launch -n 2 -s 1 python examples/train_fashion_mnist.py --epochs 2 \
        --delay 4 --compression ternary --pull-compression int8

and the same job with stock MXNet (``gluon.Trainer`` on ``'dist_sync'``), for comparison::

    mxdelay-launch -n 2 -s 1 python examples/train_fashion_mnist.py --epochs 2 --trainer sync

``--trainer sync`` is a stock baseline: no process of its job imports mxdelay (the script
checks it before importing MXNet), so its servers are MXNet's own. ``./dev demo --link
100mbit`` runs both on emulated per-node links (``examples/compare_links.py``).

On one machine the processes share its cores and loopback is fast: the log then shows less
time waiting for communication with ``delayed`` than with ``sync``, but not more samples/s
(the waiting worker's core served the other worker). The delayed update pays off where
communication, not computation, is the bottleneck: slow networks between machines.

Every line that differs from a stock distributed Gluon script ends with a ``# mxdelay:``
comment. The five changes of the README's diff: ``import mxdelay`` before ``import mxnet``;
the kvstore type ``'dist_delay'``; ``mxdelay.DelayedTrainer`` instead of ``gluon.Trainer``
(delay, warm-up, local rule, push and pull compression; ``freeze_after`` for
``'frozenvarianceadam'``); ``trainer.join()`` at the end of each epoch; and
``trainer.sync_weights()`` before the final evaluation. Two more for what the README's diff
leaves out: ``save_states``/``load_states``, which every worker calls (they are collective),
and the GPU chosen by ``mxdelay.local_rank()``.

Without a launcher (no ``DMLC_ROLE`` in the environment) the script trains in this one
process with ``kvstore='local'``: ``DelayedTrainer`` then is exactly ``gluon.Trainer`` and
``--delay`` has no effect (a warning says so). That is for trying the script quickly; the
delayed update needs a distributed job.

Data: the four Fashion-MNIST idx files in ``--data-dir`` (Debian: ``apt-get install
dataset-fashion-mnist``); nothing is downloaded. Worker r of N trains on its own 1/N of the
60000 training images (see ``fashion_mnist_data.WorkerShard``). Worker 0 (kvstore rank 0:
its lines say ``rank 0``; the launcher's ``[worker i]`` prefix counts processes and may show
another i) evaluates its weights on the full 10000-image test set after each epoch and logs
one line per epoch with *its own* training loss, accuracy and communication wait, and the
job's throughput as N times its own samples/s (every worker runs as many steps); the other
workers' numbers are not collected. In the delayed phase a worker's weights are its local weights
(the global weights of the last pull plus at most ``delay`` local steps).
``--eval-every N`` also keeps a copy of worker 0's weights every N steps and evaluates the
copies after training, so that evaluation takes no training time: accuracy against training
time (``--metrics-file`` records of kind ``'eval'``).

Periodic checkpoints need no code: ``mxdelay-launch --checkpoint-dir D --checkpoint-every N
--max-restarts R ...`` makes the trainer save one every N steps and, when the launcher
restarts a failed job, resume from the newest; ``trainer.resumed_step`` says where, and the
script skips the batches trained before it.

Checkpoints of whole epochs (``--checkpoint-dir``, a folder that every worker and server of the job can
reach; after every epoch, replacing the previous one): ``epoch-NNNN.params`` (worker 0's net
parameters), ``epoch-NNNN.states`` and its side files (the trainer state of every worker and
server), and ``latest.json``, written last, naming the last complete checkpoint;
``--resume`` continues from it. MXNet's ``dist_sync`` kvstore cannot save its servers'
optimizer state, so with ``--trainer sync`` in a distributed job only the parameters are
saved and a resumed run restarts the momentum from zero (a warning says so).
"""
import sys


def _stock_baseline(argv):
    """Whether the command line asks for stock MXNet (``--trainer sync``); read before
    argparse can run, because it decides the first import."""
    for index, arg in enumerate(argv):
        if arg == '--trainer' and argv[index + 1:index + 2] == ['sync']:
            return True
        if arg == '--trainer=sync':
            return True
    return False


# The stock baseline imports nothing of mxdelay, in any role: its servers are MXNet's.
STOCK = __name__ == '__main__' and _stock_baseline(sys.argv[1:])
if not STOCK:
    import mxdelay  # mxdelay: before mxnet; in a server process it runs mxdelay's server
elif 'mxdelay' in sys.modules or 'kvstore_ext' in sys.modules:
    sys.exit('--trainer sync must be stock MXNet, but this process has imported mxdelay '
             '(a sitecustomize or mxdelay-run?); run the script with plain python')

import argparse  # noqa: E402  pylint: disable=wrong-import-position,wrong-import-order
import itertools  # noqa: E402  pylint: disable=wrong-import-position,wrong-import-order
import json  # noqa: E402  pylint: disable=wrong-import-position,wrong-import-order
import logging  # noqa: E402  pylint: disable=wrong-import-position,wrong-import-order
import math  # noqa: E402  pylint: disable=wrong-import-position,wrong-import-order
import os  # noqa: E402  pylint: disable=wrong-import-position,wrong-import-order
import time  # noqa: E402  pylint: disable=wrong-import-position,wrong-import-order

import mxnet as mx  # noqa: E402  pylint: disable=wrong-import-position
from mxnet import autograd, gluon, nd  # noqa: E402  pylint: disable=wrong-import-position

import fashion_mnist_data as data  # noqa: E402  pylint: disable=wrong-import-position

try:
    from tqdm import tqdm
except ImportError:  # the progress bar is optional
    tqdm = None

_LOG = logging.getLogger('train_fashion_mnist')
LAUNCH = 'mxdelay-launch -n 2 -s 1 python examples/train_fashion_mnist.py'
#: --optimizer -> default learning rate (the benchmarks' settings, docs/benchmarks).
LEARNING_RATES = {'sgd': 0.05, 'adam': 0.001, 'frozenvarianceadam': 0.001, 'lamb': 0.005}
PUSH_CODECS = ('none', 'auto', 'fp16', 'int8', 'int4', 'ternary')
PULL_CODECS = ('none', 'fp16', 'int8')
LATEST = 'latest.json'

COMM_WAIT_HELP = (
    "Definition of 'comm wait' in the log and comm_wait_s in the metrics: the wall time this "
    'worker spends inside trainer.step() plus the time it then waits, before its next forward, '
    'until the weights can be read and the gradient buffers written again. With --trainer sync '
    "that is the push, the servers' round and the pull. With --trainer delayed it is the wait "
    'for a pulled version, the wait of a worker that is more than the slack ahead of the '
    'slowest, and also the local update (a few element-wise operations per step, a little '
    'computation). To separate it from compute, the script waits for the gradients before '
    'every trainer.step(), a synchronisation point that a stock script does not have (it '
    'costs the overlap of backward with the first pushes).')


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description='Train an MLP or a CNN on Fashion-MNIST with mxdelay.DelayedTrainer '
                    "('dist_delay') or stock gluon.Trainer ('dist_sync').",
        epilog='Launch: %s --epochs 2. %s' % (LAUNCH, COMM_WAIT_HELP))
    parser.add_argument('--data-dir', default=data.DEFAULT_DATA_DIR,
                        help='folder with the four Fashion-MNIST idx(.gz) files (default: '
                             '%(default)s, Debian package dataset-fashion-mnist)')
    parser.add_argument('--model', choices=('mlp', 'cnn', 'cnn-bn'), default='mlp',
                        help='mlp: 784-1024-1024-10 ReLU (1.86M parameters); cnn: 2 conv + '
                             '2 dense; cnn-bn: the same with BatchNorm after each conv '
                             '(225k trained parameters) (default: %(default)s)')
    parser.add_argument('--epochs', type=int, default=2,
                        help='epochs to train (default: %(default)s)')
    parser.add_argument('--batch-size', type=int, default=128,
                        help='batch size of each worker (default: %(default)s)')
    parser.add_argument('--optimizer', choices=tuple(LEARNING_RATES), default='sgd',
                        help="the servers' optimizer; 'frozenvarianceadam' (delayed only: "
                             'mxdelay.FrozenVarianceAdam, Adam whose second moment stops at the '
                             'end of the warm-up) is the README\'s choice for Adam '
                             '(default: %(default)s)')
    parser.add_argument('--lr', type=float,
                        help='learning rate (default: %s)' % ', '.join(
                            '%s %g' % item for item in LEARNING_RATES.items()))
    parser.add_argument('--momentum', type=float, default=0.9,
                        help="momentum of SGD (default: %(default)s)")
    parser.add_argument('--delay', type=_delay, default='auto',
                        help="delayed: pull the global weights every DELAY steps, or 'auto' "
                             '(the job measures its warm-up and chooses; default: %(default)s)')
    parser.add_argument('--warmup-steps', type=int, default=200,
                        help='delayed: synchronous steps before the delayed phase '
                             '(default: %(default)s)')
    parser.add_argument('--compression', choices=PUSH_CODECS, default=None,
                        help="delayed: compression_params={'type': ...} of the pushes; "
                             "'auto' (the default with --trainer delayed): the job chooses "
                             'the push and pull codecs')
    parser.add_argument('--pull-compression', choices=PULL_CODECS, default='none',
                        help="delayed: pull_compression={'type': ...} of the pulls "
                             '(default: %(default)s)')
    parser.add_argument('--local-rule', default='mirror',
                        choices=('mirror', 'sgd', 'dc', 'dc_adaptive'),
                        help='delayed: local update rule between pulls (default: %(default)s)')
    parser.add_argument('--trainer', choices=('delayed', 'sync'), default='delayed',
                        help="delayed: mxdelay.DelayedTrainer on 'dist_delay'; sync: stock "
                             "gluon.Trainer on 'dist_sync' (default: %(default)s)")
    parser.add_argument('--checkpoint-dir',
                        help='write a checkpoint here after every epoch, replacing the previous '
                             'one (a folder that every worker and server can reach)')
    parser.add_argument('--resume', action='store_true',
                        help='continue from the last complete checkpoint in --checkpoint-dir '
                             '(start afresh, with a warning, if there is none)')
    parser.add_argument('--seed', type=int, default=1,
                        help='seed of the initial weights, the shards and the data order '
                             '(default: %(default)s)')
    parser.add_argument('--max-steps-per-epoch', type=int,
                        help='stop every epoch after this many steps (for tests)')
    parser.add_argument('--metrics-file',
                        help="worker 0 appends one JSON line per epoch (kind 'epoch'): epoch, "
                             'loss, train_acc, test_acc, samples_per_s (whole job), '
                             "comm_wait_s, time, steps; and with --eval-every (kind 'eval'): "
                             'step, time (training time since the first step), test_acc')
    parser.add_argument('--eval-every', type=int, metavar='N',
                        help="keep a copy of worker 0's weights every N steps and evaluate the "
                             'copies after training (evaluation takes no training time)')
    parser.add_argument('--no-progress', action='store_true', help='no progress bar')
    parser.add_argument('--gpus', type=int, default=0, metavar='N',
                        help='GPUs per host: each worker trains on mx.gpu(local rank %% N), the '
                             'local rank being its index among the workers of its host '
                             '(mxdelay.local_rank()); 0: the CPU (default: %(default)s)')
    args = parser.parse_args(argv)
    for name in ('epochs', 'batch_size', 'max_steps_per_epoch', 'eval_every'):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error('--%s must be at least 1, got %d' % (name.replace('_', '-'), value))
    if args.compression is None:     # the default: the job chooses; stock cannot compress
        args.compression = 'none' if args.trainer == 'sync' else 'auto'
    if args.compression == 'auto' and args.pull_compression != 'none':
        parser.error("--pull-compression %s needs --compression set to a codec ('auto', the "
                     'default, chooses the pull codec too): e.g. --compression ternary '
                     '--pull-compression %s' % (args.pull_compression, args.pull_compression))
    if args.trainer == 'sync':
        # Stock MXNet 1.9.1: gluon.Trainer's pushpull refuses compression on 'dist_sync',
        # and FrozenVarianceAdam is mxdelay's.
        for name, value in (('compression', args.compression),
                            ('pull-compression', args.pull_compression)):
            if value != 'none':
                parser.error('--%s %s needs --trainer delayed: stock gluon.Trainer on '
                             "'dist_sync' cannot compress" % (name, value))
        if args.optimizer == 'frozenvarianceadam':
            parser.error("--optimizer frozenvarianceadam needs --trainer delayed (it is "
                         "mxdelay's); use --optimizer adam for the stock baseline")
    if args.lr is None:
        args.lr = LEARNING_RATES[args.optimizer]
    if args.gpus < 0:
        parser.error('--gpus must be 0 (train on the CPU) or the number of GPUs per host, got %d'
                     % args.gpus)
    if args.resume and not args.checkpoint_dir:
        parser.error('--resume needs --checkpoint-dir DIR (the folder of the checkpoints)')
    return args


def choose_context(gpus, local_rank):
    """Return the context one worker trains on: ``mx.gpu(local_rank % gpus)``, or the CPU
    when `gpus` is 0.

    The local rank, not the job-wide rank, keeps the GPUs of one host distinct: the launcher
    assigns workers round-robin over the hosts, so with two hosts of 2 GPUs and 4 workers,
    host A runs ranks 0 and 2 and ``rank % 2`` gives both GPU 0; their local ranks (0 and 1)
    give GPUs 0 and 1.
    """
    return mx.gpu(local_rank % gpus) if gpus > 0 else mx.cpu()


def build_net(model):
    net = gluon.nn.HybridSequential()
    if model == 'mlp':
        net.add(gluon.nn.Dense(1024, activation='relu'),  # Dense flattens (b, 1, 28, 28)
                gluon.nn.Dense(1024, activation='relu'),
                gluon.nn.Dense(10))
    elif model == 'cnn':
        net.add(gluon.nn.Conv2D(32, 3, activation='relu'), gluon.nn.MaxPool2D(2),
                gluon.nn.Conv2D(64, 3, activation='relu'), gluon.nn.MaxPool2D(2),
                gluon.nn.Dense(128, activation='relu'),
                gluon.nn.Dense(10))
    else:
        # BatchNorm's running mean and variance are not trained (differentiable=False):
        # each worker keeps its own, with dist_sync as with dist_delay, until the last
        # epoch's sync_weights(aux_states=True) averages them over the workers.
        for channels in (32, 64):
            net.add(gluon.nn.Conv2D(channels, 3), gluon.nn.BatchNorm(),
                    gluon.nn.Activation('relu'), gluon.nn.MaxPool2D(2))
        net.add(gluon.nn.Dense(128, activation='relu'),
                gluon.nn.Dense(10))
    return net


# -- measurement ---------------------------------------------------------------------------
def _wait_to_write(array):
    # Blocks until every pending read and write of `array` is done. NDArray has only
    # wait_to_read(); this is the C API function behind MXNet's own to_dlpack_for_write().
    mx.base.check_call(mx.base._LIB.MXNDArrayWaitToWrite(array.handle))


def wait_for_communication(params):
    """Wait until the next forward/backward can run: weights readable, gradients writable."""
    for param in params:
        for weight in param.list_data():
            weight.wait_to_read()
        for grad in param.list_grad():
            _wait_to_write(grad)


def wait_for_gradients(params):
    for param in params:
        for grad in param.list_grad():
            grad.wait_to_read()


def evaluate(net, images, labels, ctx):
    """Accuracy of `net` on a whole split."""
    correct = 0
    for x, y in data.iterate(images, labels, 1000):
        pred = net(nd.array(x, ctx=ctx)).argmax(axis=1)
        correct += int((pred == nd.array(y, ctx=ctx)).sum().asscalar())
    return correct / len(images)


class Snapshots(object):
    """Copies of worker 0's weights during training, evaluated after it (``--eval-every``).

    A copy is an asynchronous NDArray copy: taking it costs the training almost nothing,
    and evaluating the copies later keeps the evaluation out of the training time.
    """

    def __init__(self, net, ctx):
        self._params, self._ctx = list(net.collect_params().values()), ctx
        self.taken = []   # (step, training seconds, [weights])

    def take(self, step, seconds):
        self.taken.append((step, seconds, [p.data(self._ctx).copy() for p in self._params]))

    def evaluate(self, net, images, labels):
        """Return ``[(step, seconds, test accuracy)]`` of the copies; `net` keeps its
        weights."""
        current = [p.data(self._ctx).copy() for p in self._params]
        results = []
        for step, seconds, weights in self.taken + [(None, None, current)]:
            # In place: Parameter.set_data would reset a distributed trainer's kvstore.
            for param, value in zip(self._params, weights):
                for array in param.list_data():
                    value.copyto(array)
            if step is not None:
                results.append((step, seconds, evaluate(net, images, labels, self._ctx)))
        return results


# -- progress bar --------------------------------------------------------------------------
class _LineStream(object):
    """A file for tqdm that turns each redraw into a line of its own.

    Under a launcher, output goes through a pipe to a line-based prefixer: a bar redrawn with
    carriage returns would appear only when the epoch ends, as one garbled line.
    """

    def __init__(self, stream):
        self._stream = stream
        self.encoding = getattr(stream, 'encoding', None)

    def write(self, text):
        for part in text.replace('\r', '\n').split('\n'):
            if part.strip():
                self._stream.write(part.rstrip() + '\n')

    def flush(self):
        self._stream.flush()


def progress(iterable, total, description, enabled):
    if not enabled or tqdm is None:
        return iterable
    if sys.stderr.isatty():
        return tqdm(iterable, total=total, desc=description, leave=False)
    return tqdm(iterable, total=total, desc=description, file=_LineStream(sys.stderr),
                mininterval=10, ncols=100, ascii=True)


# -- checkpoints ---------------------------------------------------------------------------
def _atomic_json(path, value):
    tmp = '%s.tmp-%d' % (path, os.getpid())
    with open(tmp, 'w', encoding='utf-8') as out:
        json.dump(value, out)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)  # readers see the old file or the new one, never half of one


def save_checkpoint(directory, epoch, net, trainer, rank, save_states, config):
    """Write the checkpoint of `epoch`; collective when `save_states` (every worker calls it)."""
    stem = os.path.join(directory, 'epoch-%04d' % epoch)
    if rank == 0:
        tmp = '%s.params.tmp-%d' % (stem, os.getpid())
        net.save_parameters(tmp)
        os.replace(tmp, stem + '.params')
    if save_states:
        trainer.save_states(stem + '.states')  # mxdelay: collective: every worker calls it
    if rank == 0:
        # Written last: it names only a checkpoint whose every file is complete.
        _atomic_json(os.path.join(directory, LATEST), dict(
            config, epoch=epoch, params=stem + '.params',
            states=stem + '.states' if save_states else None))
        # Only the last complete checkpoint is kept (the trainer state is several times the
        # size of the model). Every worker is past save_states' final barrier: nobody reads it.
        previous = 'epoch-%04d.' % (epoch - 1)
        for name in os.listdir(directory):
            if name.startswith(previous):
                os.remove(os.path.join(directory, name))


def read_checkpoint(directory, config):
    """Return the description of the last complete checkpoint in `directory`, or None."""
    path = os.path.join(directory, LATEST)
    try:
        with open(path, encoding='utf-8') as src:
            latest = json.load(src)
    except FileNotFoundError:
        return None
    for name, value in config.items():
        if latest.get(name) != value:
            raise ValueError('%s was written with --%s %s, this run has %s; resume with the same '
                             'setting or use another --checkpoint-dir'
                             % (path, name.replace('_', '-'), latest.get(name), value))
    return latest


# -- training ------------------------------------------------------------------------------
def main(argv=None):
    args = parse_args(argv)
    # Before the kvstore exists, a failing worker exits at once and the launcher stops the job.
    train_images, train_labels = data.load_split('train', args.data_dir)
    test_images, test_labels = data.load_split('test', args.data_dir)
    distributed = os.environ.get('DMLC_ROLE') == 'worker'   # the role the launcher gave
    if distributed:
        kvstore = mx.kv.create('dist_delay' if args.trainer == 'delayed'  # mxdelay: 'dist_delay'
                               else 'dist_sync')
        rank, num_workers = kvstore.rank, kvstore.num_workers
    else:
        kvstore, rank, num_workers = 'local', 0, 1
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format='%(asctime)s rank ' + str(rank) + ' %(levelname)s %(message)s')
    if not distributed:
        _LOG.warning("DMLC_ROLE is not set: training in this single process with kvstore='local', "
                     'where DelayedTrainer is exactly gluon.Trainer (--delay has no effect). For '
                     'a distributed job with the delayed update run: %s', LAUNCH)
    if STOCK:   # mxdelay-launch sets a worker's index on its host for any command
        local_rank = int(os.environ.get('MXDELAY_LOCAL_RANK', '0'))
    else:
        local_rank = mxdelay.local_rank()  # mxdelay: one GPU per worker of a host
    ctx = choose_context(args.gpus, local_rank)
    mx.random.seed(args.seed)

    shard = data.WorkerShard(train_images, train_labels, args.batch_size, rank, num_workers,
                             args.seed, args.max_steps_per_epoch)
    _LOG.info('%s, %s trainer, %d worker(s) x %d steps/epoch x batch %d, %s lr %g%s%s',
              args.model, args.trainer, num_workers, len(shard), args.batch_size, args.optimizer,
              args.lr, ', momentum %g' % args.momentum if args.optimizer == 'sgd' else '',
              ', delay %s, warm-up %d steps, local rule %s, push %s, pull %s' % (
                  args.delay, args.warmup_steps, args.local_rule, args.compression,
                  args.pull_compression) if args.trainer == 'delayed' else '')

    net = build_net(args.model)
    net.initialize(mx.init.Xavier(magnitude=2.24), ctx=ctx)
    net(nd.zeros((1, 1, 28, 28), ctx=ctx))  # resolve the deferred shapes
    net.hybridize()

    config = {'model': args.model, 'trainer': args.trainer, 'num_workers': num_workers}
    start_epoch, latest = 0, None
    if args.checkpoint_dir:
        args.checkpoint_dir = os.path.abspath(args.checkpoint_dir)  # the servers write there too
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        if args.resume:
            latest = read_checkpoint(args.checkpoint_dir, config)
            if latest is None:
                _LOG.warning('--resume: no checkpoint in %s yet; starting at epoch 1',
                             args.checkpoint_dir)
            else:
                net.load_parameters(latest['params'], ctx=ctx)
                start_epoch = latest['epoch']

    optimizer_params = {'learning_rate': args.lr}
    if args.optimizer == 'sgd':
        optimizer_params['momentum'] = args.momentum
    elif args.optimizer == 'frozenvarianceadam':
        optimizer_params['freeze_after'] = args.warmup_steps   # mxdelay: v stops at the switch
    if args.trainer == 'delayed':
        trainer = mxdelay.DelayedTrainer(  # mxdelay: instead of gluon.Trainer
            net.collect_params(), args.optimizer, optimizer_params, kvstore=kvstore,
            delay=args.delay, warmup_steps=args.warmup_steps,  # mxdelay:
            local_rule=args.local_rule,  # mxdelay:
            compression_params=_codec(args.compression),  # mxdelay: pushes
            pull_compression=_codec(args.pull_compression))  # mxdelay: pulls
    else:
        trainer = gluon.Trainer(net.collect_params(), args.optimizer, optimizer_params,
                                kvstore=kvstore)
    # MXNet's dist_sync store cannot save its servers' optimizer state (an assertion in
    # KVStore.save_optimizer_states): the stock sync trainer checkpoints parameters only.
    save_states = not (args.trainer == 'sync' and distributed)
    if latest is not None:
        if latest['states'] is not None:
            trainer.load_states(latest['states'])  # mxdelay: collective: every worker calls it
        else:
            _LOG.warning('%s has no trainer state (stock dist_sync cannot save it): the '
                         'momentum restarts from zero', os.path.join(args.checkpoint_dir, LATEST))
        _LOG.info('resumed from %s: epoch %d of %d was complete; continuing at epoch %d',
                  latest['params'], latest['epoch'], args.epochs, latest['epoch'] + 1)
        if start_epoch >= args.epochs:
            _LOG.info('nothing left to train (--epochs %d)', args.epochs)

    # mxdelay: periodic checkpoints (mxdelay-launch --checkpoint-dir D --checkpoint-every N):
    # the trainer resumes from the newest one here; skip the batches trained before it
    skip = trainer.resumed_step if args.trainer == 'delayed' else 0  # mxdelay:
    if skip:
        start_epoch, skip = divmod(skip, len(shard))  # mxdelay: equal shards: steps per epoch
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    params = [p for p in net.collect_params().values() if p.grad_req != 'null']
    snapshots = Snapshots(net, ctx) if args.eval_every and rank == 0 else None
    trained = 0.0   # training seconds of the epochs before this one (evaluation excluded)
    for epoch in range(start_epoch, args.epochs):
        loss_sum, correct, seen, comm_wait = 0.0, 0, 0, 0.0
        start = time.perf_counter()
        batches = progress(itertools.islice(shard.batches(epoch), skip, None),  # mxdelay:
                           len(shard) - skip, 'epoch %d/%d' % (epoch + 1, args.epochs),
                           rank == 0 and not args.no_progress)
        skip = 0
        for batch, (x, y) in enumerate(batches):
            waited = time.perf_counter()
            wait_for_communication(params)
            comm_wait += time.perf_counter() - waited
            step = epoch * len(shard) + batch   # steps done; the weights are ready now
            if snapshots is not None and batch and step % args.eval_every == 0:
                snapshots.take(step, trained + time.perf_counter() - start)
            x, y = nd.array(x, ctx=ctx), nd.array(y, ctx=ctx)
            with autograd.record():
                out = net(x)
                loss = loss_fn(out, y)
            loss.backward()
            wait_for_gradients(params)  # compute ends here (see COMM_WAIT_HELP)
            stepped = time.perf_counter()
            trainer.step(x.shape[0])
            comm_wait += time.perf_counter() - stepped
            loss_sum += float(loss.sum().asscalar())
            correct += int((out.argmax(axis=1) == y).sum().asscalar())
            seen += x.shape[0]
        waited = time.perf_counter()
        if args.trainer == 'delayed' and epoch == args.epochs - 1:
            # mxdelay: the last epoch ends with the servers' global model on every worker
            # (each worker trained its own weights between pulls): evaluated and saved below;
            # with BatchNorm also the workers' mean running statistics (aux states)
            trainer.sync_weights(aux_states=args.model == 'cnn-bn')  # mxdelay:
        elif args.trainer == 'delayed':
            # mxdelay: the workers meet at the epoch's end (with uneven shards the shorter
            # ones push zero gradients until every worker is done; here one small round trip)
            trainer.join()
        wait_for_communication(params)
        comm_wait += time.perf_counter() - waited
        elapsed = time.perf_counter() - start
        trained += elapsed

        if rank == 0:
            test_acc = evaluate(net, test_images, test_labels, ctx)
            record = {'kind': 'epoch', 'epoch': epoch + 1, 'loss': loss_sum / seen, 'train_acc': correct / seen,
                      'test_acc': test_acc, 'samples_per_s': num_workers * seen / elapsed,
                      'comm_wait_s': comm_wait, 'time': elapsed,
                      'steps': (epoch + 1) * len(shard)}
            _LOG.info('epoch %d/%d: loss %.4f, train acc %.4f, test acc %.4f, %.0f samples/s '
                      '(job), comm wait %.1f s of %.1f s', epoch + 1, args.epochs,
                      record['loss'], record['train_acc'], test_acc, record['samples_per_s'],
                      comm_wait, elapsed)
            if not math.isfinite(record['loss']):
                _LOG.error('the loss is not finite: lower --lr')
            if args.metrics_file:
                with open(args.metrics_file, 'a', encoding='utf-8') as sink:
                    sink.write(json.dumps(record) + '\n')
        if args.checkpoint_dir:
            save_checkpoint(args.checkpoint_dir, epoch + 1, net, trainer, rank, save_states, config)
            _LOG.info('checkpoint of epoch %d written to %s', epoch + 1, args.checkpoint_dir)
    if snapshots is not None and start_epoch < args.epochs:
        evaluated = snapshots.evaluate(net, test_images, test_labels)
        evaluated.append((args.epochs * len(shard), trained, test_acc))   # the final model
        for step, seconds, accuracy in evaluated:
            _LOG.info('step %d, %.1f s of training: test acc %.4f', step, seconds, accuracy)
        if args.metrics_file:
            with open(args.metrics_file, 'a', encoding='utf-8') as sink:
                for step, seconds, accuracy in evaluated:
                    sink.write(json.dumps({'kind': 'eval', 'step': step, 'time': seconds,
                                           'test_acc': accuracy}) + '\n')
    _LOG.info('done')
    return 0


def _codec(name):
    """``compression_params``/``pull_compression`` of a --compression choice."""
    if name in ('none', 'auto'):
        return None if name == 'none' else name
    return {'type': name}


def _delay(text):
    """--delay: 'auto' or a whole number."""
    if text == 'auto':
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError("--delay must be a whole number or 'auto', got %r"
                                         % text) from None


if __name__ == '__main__':
    try:
        sys.exit(main())
    except Exception:  # pylint: disable=broad-except
        if os.environ.get('DMLC_ROLE') != 'worker':
            raise
        # A worker that raises would wait in ps-lite's exit barrier for the other workers,
        # which wait for it: the job would hang. Exit at once; the launcher stops the job.
        _LOG.exception('worker failed; exiting without waiting for the other workers')
        logging.shutdown()
        os._exit(1)
