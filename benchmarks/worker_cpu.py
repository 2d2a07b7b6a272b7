"""Worker CPU per step of ``DelayedTrainer``'s delayed phase, without network or server.

Each run is one process: ``mxdelay.DelayedTrainer`` (k=4, rule ``'mirror'``, SGD lr 0.05
momentum 0.9) over the Fashion-MNIST MLP's 6 tensors (1,863,690 floats) with fixed random
gradients (no forward or backward), on a ``'dist_delay'`` store whose native store is a stub:
its ``init``, ``push`` and ``pull`` do nothing, and the hand-shake and commands are answered
in the process. A step is then what mxdelay makes a worker's CPU do in the delayed phase:
the copy, float16 cast or 2bit quantization into the send buffer, the local rule's ``g``,
the rule, the ordering of the pull every k steps; not MXNet's own push (ps-lite, and for
2bit the native 2-bit packing) nor the pull's copy. Figure: the process's CPU seconds (all
threads, ``time.process_time``) over ``--steps`` steps after ``--skip`` delayed steps,
``OMP_NUM_THREADS=1``; the last weight element is printed as a check that two checkouts
computed the same.

``--trees NAME=PATH,...`` runs every mode once per tree per round with ``PYTHONPATH=PATH``
(the tree's ``mxdelay`` and ``kvstore_ext``), interleaved (every other round in the reverse
order), so that two checkouts are compared by the same command; default: this checkout.
Writes ``results.json`` (every run, each tree's commit, the command, machine and load) and
``results.md`` into ``--out``.

Usage::

    python benchmarks/worker_cpu.py --trees before=/path/to/old,after=. --rounds 5 \\
        --out docs/benchmarks/worker-cpu
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import harness
import provenance
import report

REPO = harness.REPO
SHAPES = [(1024, 784), (1024,), (1024, 1024), (1024,), (10, 1024), (10,)]
MODES = {'none': None, 'fp16': {'type': 'fp16'}, '2bit': {'type': '2bit', 'threshold': 0.5}}
WARMUP, DELAY = 2, 4


class _StubNative(object):
    """A native store of one worker that sends nothing."""
    rank, num_workers = 0, 1

    def init(self, *args, **kwargs):
        pass

    push = pull = init

    def _send_command_to_servers(self, *args):
        pass

    def set_gradient_compression(self, *args):
        pass

    def _barrier(self):
        pass


class _Channel(object):
    """The servers' side of the hand-shake and commands: an OPTIMIZER command is answered with
    the optimizer it carried, every other command with an empty reply."""

    def handshake(self, hello):
        return [{'rescale_grad': None}]

    def command(self, command, body, refusal=RuntimeError):
        from kvstore_ext.protocol import commands  # pylint: disable=import-outside-toplevel
        from kvstore_ext.optim.optimizers import describe_optimizer  # pylint: disable=import-outside-toplevel
        if 'optimizer' in body and isinstance(body['optimizer'], (str, bytes)):
            return [{'optimizer': describe_optimizer(commands.unpack_object(body['optimizer']))}]
        return [{}]


def run(mode, skip, steps):
    """One run in this process: {'cpu_ms': per step, 'check': last weight element}."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    import mxnet as mx  # pylint: disable=import-outside-toplevel
    from mxnet import gluon, nd  # pylint: disable=import-outside-toplevel
    import mxdelay  # pylint: disable=import-outside-toplevel
    from kvstore_ext.worker.dist_delay import DistDelay  # pylint: disable=import-outside-toplevel
    store = DistDelay(native=_StubNative(), channel_factory=lambda native, layout: _Channel())
    rs = np.random.RandomState(0)
    params = []
    for index, shape in enumerate(SHAPES):
        param = gluon.Parameter('p%d' % index, shape=shape)
        param.initialize(ctx=mx.cpu())
        param.set_data(nd.array(rs.randn(*shape).astype(np.float32) * 0.01))
        param.grad()[:] = nd.array(rs.randn(*shape).astype(np.float32))
        params.append(param)
    trainer = mxdelay.DelayedTrainer(params, 'sgd', {'learning_rate': 0.05, 'momentum': 0.9},
                                     kvstore=store, delay=DELAY, warmup_steps=WARMUP,
                                     compression_params=MODES[mode])
    for step in range(WARMUP + 1 + skip + steps):
        if step == WARMUP + 1 + skip:
            nd.waitall()
            start = time.process_time()
        trainer.step(128, ignore_stale_grad=True)
    nd.waitall()
    cpu = time.process_time() - start
    return {'cpu_ms': 1000 * cpu / steps, 'check': float(params[0].data()[-1, -1].asscalar())}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--modes', default=','.join(MODES))
    parser.add_argument('--trees', default='this=%s' % REPO, metavar='NAME=PATH,...')
    parser.add_argument('--rounds', type=int, default=3)
    parser.add_argument('--skip', type=int, default=8, help='delayed steps not timed')
    parser.add_argument('--steps', type=int, default=48, help='timed steps (whole k periods)')
    parser.add_argument('--out', default=os.path.join(REPO, 'bench_out', 'worker-cpu'))
    parser.add_argument('--run', help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run:
        print(json.dumps(run(args.run, args.skip, args.steps)))
        return 0
    trees = [item.split('=', 1) for item in args.trees.split(',')]
    meta = {'command': 'python benchmarks/worker_cpu.py ' + ' '.join(sys.argv[1:] if argv is None
                                                                    else argv),
            'started': provenance.now(), 'load_before': os.getloadavg(),
            'machine': provenance.machine(),
            'code_start': provenance.code_version(),
            'trees': {name: subprocess.run(['git', '-C', path, 'rev-parse', 'HEAD'],
                                           capture_output=True, text=True,
                                           check=False).stdout.strip()
                      for name, path in trees}}
    rows = []
    for round_index in range(args.rounds):
        for mode in args.modes.split(','):
            for name, path in harness.ordered(trees, round_index + 1):
                env = dict(os.environ, PYTHONPATH=os.path.abspath(path), OMP_NUM_THREADS='1')
                load = os.getloadavg()[0]
                out = subprocess.run([sys.executable, os.path.abspath(__file__), '--run', mode,
                                      '--skip', str(args.skip), '--steps', str(args.steps)],
                                     env=env, check=True, capture_output=True, text=True).stdout
                row = dict(json.loads(out.strip().splitlines()[-1]), tree=name, mode=mode,
                           round=round_index + 1, load_before=load, load_after=os.getloadavg()[0])
                rows.append(row)
                print(json.dumps(row), flush=True)
    harness.finish_meta(meta)
    os.makedirs(args.out, exist_ok=True)
    report.write_json(os.path.join(args.out, 'results.json'), {'meta': meta, 'rows': rows})
    lines = ['# Worker CPU per delayed step, without network or server', '',
             'Generated by %s (do not edit). Trees: %s. Raw runs: [results.json](results.json).'
             % (provenance.meta_line(meta), ', '.join('%s = `%s`' % (n, c[:10])
                                               for n, c in meta['trees'].items())), '',
             'DelayedTrainer k=%d, `mirror`, SGD momentum 0.9, the MLP\'s 6 tensors (1,863,690 '
             'floats), fixed gradients, a stub native store (no network, no server); process CPU '
             'time of %d steps after %d delayed steps, %d interleaved rounds; OMP_NUM_THREADS=1. '
             'Same last weight element in every tree: **%s**.'
             % (DELAY, args.steps, args.skip, args.rounds,
                'yes' if all(len({r['check'] for r in rows if r['mode'] == m}) == 1
                             for m in args.modes.split(',')) else 'NO'), '']
    cpu = {(r['mode'], r['tree']): [] for r in rows}
    for r in rows:
        cpu[r['mode'], r['tree']].append(r['cpu_ms'])
    lines += report.table(['mode'] + ['%s: CPU ms per step, median (runs)' % n for n, _ in trees], [
        [mode] + ['%.1f (%s)' % (statistics.median(cpu[mode, name]), ' '.join(
            '%.1f' % v for v in cpu[mode, name])) for name, _ in trees]
        for mode in args.modes.split(',')])
    report.write_lines(os.path.join(args.out, 'results.md'), lines)
    print('\n'.join(lines))
    return 0


if __name__ == '__main__':
    sys.exit(main())
