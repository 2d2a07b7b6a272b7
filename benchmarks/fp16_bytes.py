"""Bytes on the wire per step: float16 pushes against float32 and stock MXNet (root only).

Every role runs in a network namespace of its own (``benchmarks/netns.py``, unshaped links:
loopback speed), so the kernel's counters of each node's ``eth0`` count exactly what that
node sent and received, TCP/IP headers included. Each job pushes one tensor of
``--size`` float32 elements every step and pulls it back (a synchronous step of
``gluon.Trainer``: the servers store the round's sum, no optimizer); two workers, one
server. Methods, side by side in one run:

- ``stock``: MXNet's native ``'dist_sync'``, no mxdelay in any process (this file imports
  only MXNet then);
- ``fp32``: ``'dist_delay'``;
- ``fp16``: ``'dist_delay'`` with ``set_gradient_compression({'type': 'fp16'})``.

Each method runs twice, with ``--steps`` and ``3 * --steps`` steps; the difference of the
counters divided by the difference of the steps is the per-step traffic (start-up, the
hand-shake and init cancel out). Usage (writes the JSON and markdown files)::

    python benchmarks/fp16_bytes.py --out docs/benchmarks/fp16-bytes
"""
import argparse
import json
import os
import subprocess
import sys
import time

import harness
import report

NUM_WORKERS = 2
REPO = harness.REPO
METHODS = ('stock', 'fp32', 'fp16')


def worker(method, steps, size):
    """Every role of one job (the scheduler and server return from the imports)."""
    if method != 'stock':
        import mxdelay  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    import mxnet as mx  # pylint: disable=import-outside-toplevel
    from mxnet import nd  # pylint: disable=import-outside-toplevel
    kv = mx.kv.create('dist_sync' if method == 'stock' else 'dist_delay')
    if method == 'fp16':
        kv.set_gradient_compression({'type': 'fp16'})
    grad, out = nd.ones(size) * 0.25, nd.zeros(size)
    kv.init(0, nd.zeros(size))
    for _ in range(steps):
        kv.push(0, grad)
        kv.pull(0, out=out)
        out.wait_to_read()


def counters(net):
    """{namespace: (tx bytes, rx bytes)} of every node's eth0."""
    result = {}
    for name, _ in net.nodes:
        link = json.loads(subprocess.run(['ip', '-n', name, '-j', '-s', 'link', 'show', 'eth0'],
                                         capture_output=True, text=True, check=True).stdout)[0]
        result[name] = (link['stats64']['tx']['bytes'], link['stats64']['rx']['bytes'])
    return result


def run(net, hostfile, command, timeout=300):
    """Run one job of `command` (every role's argv); return the bytes each node sent and
    received ({namespace: (tx, rx)})."""
    before = counters(net)
    env = {k: v for k, v in os.environ.items() if not k.startswith('MXNET_')}
    env['PYTHONPATH'] = REPO
    job = harness.Job(command, None, NUM_WORKERS, hostfile=hostfile, environ=env)
    subprocess.run(job.argv, check=True, env=job.env, timeout=timeout, stdout=subprocess.DEVNULL)
    time.sleep(0.5)   # the last FINs
    after = counters(net)
    return {name: (after[name][0] - before[name][0], after[name][1] - before[name][1])
            for name in after}


def traffic(net, hostfile, command_of, steps, timeout=300):
    """Per-step bytes of the jobs ``command_of(steps)`` and ``command_of(3 * steps)``: the
    difference of their counters over 2 * steps (start-up, hand-shake and init cancel out).
    Returns the workers' mean sends and receives and the server's (``net.nodes``: scheduler,
    server, workers)."""
    short = run(net, hostfile, command_of(steps), timeout)
    long = run(net, hostfile, command_of(3 * steps), timeout)
    per_step = {name: ((long[name][0] - short[name][0]) / (2 * steps),
                       (long[name][1] - short[name][1]) / (2 * steps)) for name in long}
    server = net.nodes[1][0]
    workers = [name for name, _ in net.nodes[2:]]
    return {'worker_tx': sum(per_step[w][0] for w in workers) / len(workers),
            'worker_rx': sum(per_step[w][1] for w in workers) / len(workers),
            'server_rx': per_step[server][1], 'server_tx': per_step[server][0]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--role', nargs=3, help=argparse.SUPPRESS)
    parser.add_argument('--steps', type=int, default=10)
    parser.add_argument('--size', type=int, default=1 << 20, help='elements of the tensor')
    parser.add_argument('--out', default=os.path.join(REPO, 'docs', 'benchmarks', 'fp16-bytes'))
    args = parser.parse_args()
    if args.role:
        worker(args.role[0], int(args.role[1]), int(args.role[2]))
        return
    import netns  # pylint: disable=import-outside-toplevel
    reason = netns.netns_available()
    if reason:
        sys.exit('fp16_bytes needs network namespaces: %s' % reason)
    rows = []
    with netns.ShapedNetwork(1 + 1 + NUM_WORKERS) as net:
        hostfile = os.path.join('/tmp', 'fp16-bytes-hosts-%d' % os.getpid())
        net.write_hostfile(hostfile)
        for method in METHODS:
            rows.append(dict(method=method, **traffic(
                net, hostfile, lambda steps, method=method: [
                    sys.executable, os.path.abspath(__file__), '--role', method, str(steps),
                    str(args.size)], args.steps)))
        os.remove(hostfile)
    payload = 4 * args.size
    result = {'command': 'python benchmarks/fp16_bytes.py --steps %d --size %d'
                         % (args.steps, args.size),
              'size': args.size, 'float32_bytes': payload, 'workers': NUM_WORKERS,
              'steps': [args.steps, 3 * args.steps], 'rows': rows}
    report.write_json(args.out + '.json', result)
    lines = ['# Bytes per step: float16 pushes (`%s`)' % result['command'], '',
             'One tensor of %d float32 elements (%d bytes), pushed and pulled every step; %d '
             'workers, 1 server, each role in its own network namespace; bytes from the '
             'kernel counters of each node\'s `eth0` (headers included), per step = '
             'difference between a %d-step and a %d-step job / %d. Worker columns: the mean '
             'of the workers.' % (args.size, payload, NUM_WORKERS, 3 * args.steps,
                                  args.steps, 2 * args.steps), '']
    lines += report.table('method | worker sends (push) | worker receives (pull) | server '
                          'receives | push / stock', [[row['method']] + ['%.0f' % row[k] for k in (
                              'worker_tx', 'worker_rx', 'server_rx')] + [
                                  '%.3f' % (row['worker_tx'] / rows[0]['worker_tx'])]
                                                      for row in rows], 'lllll')
    report.write_lines(args.out + '.md', lines)
    print('\n'.join(lines))


if __name__ == '__main__':
    main()
