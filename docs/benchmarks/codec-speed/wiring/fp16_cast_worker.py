"""``benchmarks/bench_worker.py`` whose float16 pushes are cast as ``--fp16-cast`` says:
``kernel``, by ``kernels.to_float16`` on the worker's Python thread into the send buffer's
memory (after waiting for the gradient and the buffer), or ``engine``, by MXNet's cast in its
engine (``fp16.fill_send_buffer``); the two variants ``run.py`` compares (docs/design.md
§2.15). Every other role and everything else runs as bench_worker does.

Usage: as bench_worker.py, plus ``--fp16-cast kernel|engine``.
"""
import os
import runpy
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
BENCHMARKS = os.path.join(HERE, *[os.pardir] * 4, 'benchmarks')
sys.path.insert(0, BENCHMARKS)

import mxdelay  # noqa: E402,F401  before mxnet (a server or the scheduler runs its role there)
from kvstore_ext.codecs import fp16, host, kernels  # noqa: E402  (imports mxnet)


def cast(kind):
    """Float16Tensor.encode casting a CPU gradient without batch-size factor by `kind`."""
    def encode(self, source, buf, factor):
        if factor is None and source.context.device_type == 'cpu' and kind == 'kernel':
            kernels.to_float16(host.view(source), out=host.view(buf, write=True))
        else:
            fp16.fill_send_buffer(source, buf, factor)
        self.factor = factor
    return encode


KIND = sys.argv.pop(sys.argv.index('--fp16-cast') + 1)
sys.argv.remove('--fp16-cast')
if KIND not in ('kernel', 'engine'):
    raise SystemExit('--fp16-cast %r: give kernel or engine' % KIND)
fp16.Float16Tensor.encode = cast(KIND)
kernels.require_compiled()
sys.argv[0] = os.path.join(BENCHMARKS, 'bench_worker.py')
runpy.run_path(sys.argv[0], run_name='__main__')
