"""Bytes on the wire per pull: compressed pulls against float32 pulls (root only).

The procedure of ``benchmarks/fp16_bytes.py`` (every role in a network namespace of its own,
unshaped links; the kernel's counters of each node's ``eth0``, TCP/IP headers included;
per step = the difference between a ``3 * --steps`` and a ``--steps`` job over
``2 * --steps``): one tensor of ``--size`` float32 elements, two workers, one server, no
optimizer. Every step pushes the tensor and pulls it back; the store is told that every
round is pulled (``set_config(delay=1, warmup_steps=10**9)``), so every step's pull is a
compressed one where the method has compressed pulls. Methods, side by side in one run:

- ``fp32``: ``'dist_delay'``, exact float32 pulls (``pull``);
- ``pull-fp16``: ``set_pull_compression({'type': 'fp16'})``, ``pull_compressed``;
- ``pull-int8``: ``{'type': 'int8', 'block_size': 256}``;
- ``2bit+pull-int8``: the same with ``'2bit'`` pushes (threshold 0.5).

Usage (writes the JSON and markdown files)::

    python benchmarks/pull_bytes.py --out docs/benchmarks/pull-bytes/results
"""
import argparse
import json
import os
import sys

import fp16_bytes
import harness
import provenance

NUM_WORKERS = fp16_bytes.NUM_WORKERS
REPO = harness.REPO
METHODS = ('fp32', 'pull-fp16', 'pull-int8', '2bit+pull-int8')
_PULLS = {'pull-fp16': {'type': 'fp16'}, 'pull-int8': {'type': 'int8', 'block_size': 256},
          '2bit+pull-int8': {'type': 'int8', 'block_size': 256}}


def worker(method, steps, size):
    """Every role of one job (the scheduler and server return from the imports)."""
    import mxdelay  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    import mxnet as mx  # pylint: disable=import-outside-toplevel
    from mxnet import nd  # pylint: disable=import-outside-toplevel
    kv = mx.kv.create('dist_delay')
    if method.startswith('2bit'):
        kv.set_gradient_compression({'type': '2bit', 'threshold': 0.5})
    pull = kv.pull
    if method in _PULLS:
        kv.set_config(delay=1, warmup_steps=10 ** 9)   # every round is pulled
        kv.set_pull_compression(_PULLS[method])
        pull = kv.pull_compressed
    grad, out = nd.ones(size) * 0.25, nd.zeros(size)
    kv.init(0, nd.zeros(size))
    for _ in range(steps):
        kv.push(0, grad)
        pull(0, out=out)
        out.wait_to_read()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--role', nargs=3, help=argparse.SUPPRESS)
    parser.add_argument('--steps', type=int, default=10)
    parser.add_argument('--size', type=int, default=1 << 20, help='elements of the tensor')
    parser.add_argument('--out', default=os.path.join(REPO, 'docs', 'benchmarks', 'pull-bytes',
                                                      'results'))
    args = parser.parse_args()
    if args.role:
        worker(args.role[0], int(args.role[1]), int(args.role[2]))
        return
    import netns  # pylint: disable=import-outside-toplevel
    reason = netns.netns_available()
    if reason:
        sys.exit('pull_bytes needs network namespaces: %s' % reason)
    from kvstore_ext.codecs import pulls  # pylint: disable=import-outside-toplevel
    meta = {'command': 'python benchmarks/pull_bytes.py --steps %d --size %d'
                       % (args.steps, args.size),
            'started': provenance.now(), 'code_start': provenance.code_version(),
            'machine': provenance.machine(), 'load_before': list(os.getloadavg())}
    rows = []
    with netns.ShapedNetwork(1 + 1 + NUM_WORKERS) as net:
        hostfile = os.path.join('/tmp', 'pull-bytes-hosts-%d' % os.getpid())
        net.write_hostfile(hostfile)
        for method in METHODS:
            rows.append(dict(method=method, **fp16_bytes.traffic(
                net, hostfile, lambda steps, method=method: [
                    sys.executable, os.path.abspath(__file__), '--role', method, str(steps),
                    str(args.size)], args.steps)))
        os.remove(hostfile)
    meta.update(finished=provenance.now(), code_end=provenance.code_version(),
                load_after=list(os.getloadavg()))
    for row in rows:
        codec = pulls.parse(_PULLS.get(row['method']))
        row['payload_bytes'] = pulls.payload_bytes(codec, args.size)
    result = dict(meta, size=args.size, float32_bytes=4 * args.size, workers=NUM_WORKERS,
                  steps=[args.steps, 3 * args.steps], rows=rows)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + '.json', 'w', encoding='utf-8') as out:
        json.dump(result, out, indent=1)
    lines = ['# Bytes per pull: compressed pulls (`%s`)' % meta['command'], '',
             provenance.meta_line(meta), '',
             'One tensor of %d float32 elements (%d bytes), pushed and pulled every step; %d '
             'workers, 1 server, each role in its own network namespace; bytes from the '
             'kernel counters of each node\'s `eth0` (headers included), per step = '
             'difference between a %d-step and a %d-step job / %d. Worker columns: the mean '
             'of the workers. "payload" is the model key\'s size '
             '(`pulls.payload_bytes`).' % (args.size, 4 * args.size, NUM_WORKERS,
                                                  3 * args.steps, args.steps, 2 * args.steps),
             '', '| method | worker sends (push) | worker receives (pull) | payload | '
             'pull / fp32 |', '|---|---|---|---|---|']
    base = rows[0]['worker_rx']
    for row in rows:
        lines.append('| %s | %.0f | %.0f | %d | %.3f |' % (
            row['method'], row['worker_tx'], row['worker_rx'], row['payload_bytes'],
            row['worker_rx'] / base))
    with open(args.out + '.md', 'w', encoding='utf-8') as out:
        out.write('\n'.join(lines) + '\n')
    print('\n'.join(lines))


if __name__ == '__main__':
    main()
