"""Stock ``dist_sync`` against mxdelay, side by side on emulated per-node links (root only).

``./dev demo --link 100mbit`` (or ``1gbit``) runs this: one job of stock MXNet
(``train_fashion_mnist.py --trainer sync``: no process of it imports mxdelay, and it runs with
MXNet's default environment), then one of mxdelay (``delay='auto'``,
``compression_params='auto'``, the README's settings: on these links they choose k=4,
ternary pushes and int8 pulls; its log says so), both training the Fashion-MNIST MLP with 2 workers and 1 server on
the same network: four network namespaces (scheduler, server, two workers) behind a bridge,
each with its own full-duplex link shaped by ``tc tbf`` to the rate (``benchmarks/netns.py``).

The comparison is time to accuracy: the target is the test accuracy stock reached at the
end of its steps; each job's time to it is its training time (worker 0's, from the first
step, the kvstore's initialisation included, evaluation excluded) at its first evaluation at
or above it. mxdelay runs more steps (about the same training time as stock's), so that it
can reach the target; "not reached" is printed if it does not. Both jobs have the same
data, seed, batch and links. It prints both times, the speed-up, the accuracies and the
time per step, and writes accuracy against training time of both (``accuracy.png``, with
matplotlib). These are two short real runs on this machine, not the README's figures.
"""
import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(HERE, 'train_fashion_mnist.py')
BENCHMARKS = os.path.join(os.path.dirname(HERE), 'benchmarks')

#: --link -> (stock's steps, mxdelay's steps, mxdelay's warm-up steps): about two minutes on
#: 2 cores, the two jobs training for about the same time.
LINKS = {'100mbit': (20, 72, 50), '1gbit': (120, 234, 50)}
#: Each job trains within one epoch: 60000 images / 2 workers / batch 128.
EPOCH_STEPS = 234
#: Evaluations of each job (of copies of worker 0's weights, after training: 1-2 s each).
LABELS = {'100mbit': '100 Mbit/s', '1gbit': '1 Gbit/s'}
POINTS = {'stock': 4, 'mxdelay': 6}
#: mxdelay's settings: chosen by the job (on these links: k=4, ternary pushes, int8 pulls).
DELAYED = ['--trainer', 'delayed', '--delay', 'auto', '--compression', 'auto']
STOCK = ['--trainer', 'sync']
NODES = 4   # scheduler, server, 2 workers: each on its own link


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n', 1)[0])
    parser.add_argument('--link', choices=tuple(LINKS), required=True,
                        help='the rate of every node\'s link, in each direction')
    for index, (name, what) in enumerate((('stock-steps', "stock's steps"),
                                          ('mxdelay-steps', "mxdelay's steps"),
                                          ('warmup-steps', "mxdelay's synchronous warm-up"))):
        parser.add_argument('--' + name, type=int, help='%s (default: %s)' % (what, ', '.join(
            '%s %d' % (link, value[index]) for link, value in LINKS.items())))
    parser.add_argument('--out', help='folder of the logs, metrics and accuracy.png (default: '
                                      'mxdelay-demo-LINK in the temporary folder)')
    parser.add_argument('--timeout', type=float, default=600,
                        help='seconds each job may take (default: %(default)s)')
    args = parser.parse_args(argv)
    for name, default in zip(('stock_steps', 'mxdelay_steps', 'warmup_steps'),
                             LINKS[args.link]):
        if getattr(args, name) is None:
            setattr(args, name, default)
        if getattr(args, name) < (0 if name == 'warmup_steps' else 1):
            parser.error('--%s must be at least %d, got %d' % (
                name.replace('_', '-'), 0 if name == 'warmup_steps' else 1, getattr(args, name)))
        if name != 'warmup_steps' and getattr(args, name) > EPOCH_STEPS:
            parser.error('--%s must be at most %d (one epoch), got %d' % (
                name.replace('_', '-'), EPOCH_STEPS, getattr(args, name)))
    args.out = os.path.abspath(args.out or os.path.join(tempfile.gettempdir(),
                                                        'mxdelay-demo-%s' % args.link))
    return args


def shaped_network_module():
    """``benchmarks/netns.py`` (its public API: ShapedNetwork, netns_available)."""
    sys.path.insert(0, BENCHMARKS)
    try:
        import netns  # pylint: disable=import-outside-toplevel
    finally:
        sys.path.remove(BENCHMARKS)
    return netns


def launcher_file():
    """mxdelay's launcher as a plain file, found without importing mxdelay (the stock job's
    launcher must not set anything of mxdelay's, as the benchmarks' jobs)."""
    spec = importlib.util.find_spec('mxdelay')
    if spec is None or not spec.submodule_search_locations:
        sys.exit('compare_links: mxdelay is not installed; run it through ./dev demo --link')
    return os.path.join(spec.submodule_search_locations[0], 'launcher.py')


def job_env():
    """This environment without any DMLC_, MXNET_ or MXDELAY_ variable: stock MXNet's
    defaults for the baseline (mxdelay's job sets its own when it imports mxdelay)."""
    env = {name: value for name, value in os.environ.items()
           if not name.startswith(('DMLC_', 'MXNET_', 'MXDELAY_'))}
    env.update(OMP_NUM_THREADS='1', PYTHONUNBUFFERED='1')
    return env


def run_job(name, trainer_args, steps, args, hostfile):
    """Run one job of `steps` steps to its end; return (wall seconds, [(step, seconds,
    accuracy)])."""
    metrics = os.path.join(args.out, name + '-metrics.jsonl')
    if os.path.exists(metrics):
        os.remove(metrics)
    command = [sys.executable, launcher_file(), '-n', '2', '-s', '1', '--launcher', 'netns',
               '-H', hostfile, '--timeout', str(int(args.timeout)), '--',
               sys.executable, EXAMPLE, '--epochs', '1', '--max-steps-per-epoch', str(steps),
               '--eval-every', str(max(1, steps // POINTS[name])), '--no-progress',
               '--metrics-file', metrics] + trainer_args
    log = os.path.join(args.out, name + '.log')
    print('%-8s running (log: %s)' % (name, log), flush=True)
    begun = time.monotonic()
    with open(log, 'wb') as sink:
        code = subprocess.call(command, stdin=subprocess.DEVNULL, stdout=sink,
                               stderr=subprocess.STDOUT, env=job_env(), cwd=args.out,
                               timeout=args.timeout + 60)
    wall = time.monotonic() - begun
    if code != 0:
        sys.exit('compare_links: the %s job exited with %d; see %s' % (name, code, log))
    with open(metrics, encoding='utf-8') as src:
        records = [json.loads(line) for line in src]
    return wall, [(r['step'], r['time'], r['test_acc']) for r in records if r['kind'] == 'eval']


def time_to(curve, target):
    """Training seconds of the first point of `curve` at or above `target`, or None."""
    return next((seconds for _, seconds, accuracy in curve if accuracy >= target), None)


def summary(runs):
    """The lines that compare the runs: {'stock': (wall, curve), 'mxdelay': ...}, a curve
    being [(step, training seconds, test accuracy)] ending with the final model."""
    lines = []
    for name, label in (('stock', 'stock dist_sync'), ('mxdelay', 'mxdelay')):
        steps, seconds, accuracy = runs[name][1][-1]
        lines.append('%-16s %d steps in %.1f s of training (%.2f s a step), test accuracy '
                     '%.4f; the whole job %.1f s (start-up and evaluation included)'
                     % (label + ':', steps, seconds, seconds / steps, accuracy, runs[name][0]))
    target = runs['stock'][1][-1][2]
    stock, mine = (time_to(runs[name][1], target) for name in ('stock', 'mxdelay'))
    if mine is None:
        lines.append("time to %.4f (stock's final test accuracy): stock %.1f s, mxdelay did "
                     'not reach it in %d steps' % (target, stock, runs['mxdelay'][1][-1][0]))
    else:
        lines.append("time to %.4f (stock's final test accuracy): stock %.1f s, mxdelay %.1f "
                     's: %.2fx faster' % (target, stock, mine, stock / mine))
    return lines


def plot(runs, link, path):
    """Write accuracy against training time; return a sentence on what was done."""
    try:
        import matplotlib  # pylint: disable=import-outside-toplevel
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
    except ImportError:
        return ('no picture: matplotlib is not installed (pip install matplotlib, or '
                "mxdelay's [examples] extra)")
    figure, axes = plt.subplots(figsize=(6, 4))
    for name, label in (('stock', 'stock dist_sync'), ('mxdelay', 'mxdelay k=4 + ternary + '
                                                                   'int8 pulls')):
        curve = runs[name][1]
        axes.plot([c[1] for c in curve], [c[2] for c in curve], marker='o', label=label)
    axes.set_xlabel('training time (s)')
    axes.set_ylabel('test accuracy')
    axes.set_title('Fashion-MNIST MLP, 2 workers + 1 server,\n%s per-node links (emulated)'
                   % LABELS[link], fontsize=10)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    return 'accuracy against training time: %s' % path


def main(argv=None):
    args = parse_args(argv)
    netns = shaped_network_module()
    reason = netns.netns_available()
    if reason is not None:
        sys.exit('./dev demo --link %s needs root, network namespaces and tc (ip netns, tc '
                 'tbf) to emulate the links: %s. Run it as root on Linux, or run ./dev demo '
                 'without --link for the loopback demo.' % (args.link, reason))
    os.makedirs(args.out, exist_ok=True)
    print('Fashion-MNIST MLP (1.86M parameters), 2 workers + 1 server, each node on its own '
          '%s link (emulated: full duplex, tc tbf) on this machine, batch 128 a worker; '
          'stock dist_sync %d steps; mxdelay %d steps, k=4, ternary pushes, int8 pulls, warm-up '
          '%d steps' % (LABELS[args.link], args.stock_steps, args.mxdelay_steps,
                        args.warmup_steps),
          flush=True)
    runs, load = {}, os.getloadavg()[0]
    with netns.ShapedNetwork(NODES, args.link) as network:
        hostfile = os.path.join(args.out, 'hosts')
        network.write_hostfile(hostfile)
        runs['stock'] = run_job('stock', STOCK, args.stock_steps, args, hostfile)
        runs['mxdelay'] = run_job('mxdelay', DELAYED + [
            '--warmup-steps', str(args.warmup_steps)], args.mxdelay_steps, args, hostfile)
    for name in ('stock', 'mxdelay'):
        print('%-8s %s' % (name, ', '.join('step %d: %.1f s, %.4f' % point
                                            for point in runs[name][1])))
    for line in summary(runs):
        print(line)
    # mxdelay's steps use the CPU more than stock's, which wait for the link: a busy machine
    # slows mxdelay more.
    print('machine: %d cores, load average (1 min) %.1f before, %.1f after'
          % (os.cpu_count(), load, os.getloadavg()[0]))
    print(plot(runs, args.link, os.path.join(args.out, 'accuracy.png')))
    return 0


if __name__ == '__main__':
    sys.exit(main())
