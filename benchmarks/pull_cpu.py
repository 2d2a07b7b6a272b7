"""CPU of compressed pulls' codecs: the server's encoding and the worker's decoding of one
chunk, against a float32 copy of it (one process, no network).

Procedure: docs/benchmarks/pull-cpu/procedure.md. Usage (writes the JSON and markdown
files)::

    python benchmarks/pull_cpu.py --out docs/benchmarks/pull-cpu/results
"""
import argparse
import json
import os
import statistics
import time

import numpy as np

import harness
import provenance

REPO = harness.REPO
SIZE = 524288
ROUNDS, REPEATS, WARM = 7, 20, 2
SETTINGS = (('fp16', {'type': 'fp16'}), ('int8', {'type': 'int8', 'block_size': 256}))


def methods():
    """{name: a function of no argument that runs the method once and waits for it}."""
    import mxdelay  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    from mxnet import nd  # pylint: disable=import-outside-toplevel
    from kvstore_ext.codecs import pulls  # pylint: disable=import-outside-toplevel
    from kvstore_ext.server.rounds import ServerModel  # pylint: disable=import-outside-toplevel
    from kvstore_ext.worker.pulled_model import Payload  # pylint: disable=import-outside-toplevel
    rs = np.random.RandomState(0)
    weights = rs.randn(SIZE).astype(np.float32)
    step = (rs.randn(SIZE) * 1e-3).astype(np.float32)
    source, target = nd.array(weights), nd.zeros(SIZE)

    def copy():
        source.copyto(target)
        target.wait_to_read()
    runs = {'copy': copy}
    for name, setting in SETTINGS:
        codec = pulls.parse(setting)
        model = ServerModel(codec, weights - step)
        model.store = nd.zeros(codec.payload_size(SIZE))
        w = nd.array(weights)

        def encode(model=model, w=w, base=weights - step):
            model.model = base.copy()   # the same difference every time
            model.broadcast(w)
        payload = Payload(codec, SIZE)
        model.store.copyto(payload.payload)
        xhat, out = nd.array(weights), nd.zeros(SIZE)

        def decode(payload=payload, xhat=xhat, out=out):
            payload.decode_into(xhat)
            xhat.copyto(out)
            out.wait_to_read()
        runs['%s encode' % name] = encode
        runs['%s decode' % name] = decode
    return runs


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--out', default=os.path.join(REPO, 'docs', 'benchmarks', 'pull-cpu',
                                                      'results'))
    args = parser.parse_args()
    meta = {'command': 'python benchmarks/pull_cpu.py', 'started': provenance.now(),
            'code_start': provenance.code_version(), 'machine': provenance.machine(),
            'load_before': list(os.getloadavg())}
    runs = methods()
    times = {name: [] for name in runs}
    for _ in range(ROUNDS):
        for name, run in runs.items():
            for _ in range(WARM):
                run()
            start = time.perf_counter()
            for _ in range(REPEATS):
                run()
            times[name].append((time.perf_counter() - start) / REPEATS * 1e3)
    meta.update(finished=provenance.now(), code_end=provenance.code_version(),
                load_after=list(os.getloadavg()))
    medians = {name: statistics.median(values) for name, values in times.items()}
    result = dict(meta, size=SIZE, rounds=ROUNDS, repeats=REPEATS, ms=times, median_ms=medians)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + '.json', 'w', encoding='utf-8') as out:
        json.dump(result, out, indent=1)
    lines = ['# CPU of compressed pulls\' codecs (`%s`)' % meta['command'], '',
             provenance.meta_line(meta), '',
             'One chunk of %d float32 elements; per method the median over %d interleaved '
             'rounds of the mean of %d repetitions (procedure: [procedure.md](procedure.md)).'
             % (SIZE, ROUNDS, REPEATS), '', '| method | ms (median) | min .. max | / copy |',
             '|---|---|---|---|']
    for name, values in times.items():
        lines.append('| %s | %.2f | %.2f .. %.2f | %.1f |' % (
            name, medians[name], min(values), max(values), medians[name] / medians['copy']))
    with open(args.out + '.md', 'w', encoding='utf-8') as out:
        out.write('\n'.join(lines) + '\n')
    print('\n'.join(lines))


if __name__ == '__main__':
    main()
