"""``benchmarks/bench_worker.py`` whose float16 pushes are cast by the codec kernel on the
Python thread (``kernels.to_float16`` into the send buffer's memory) instead of MXNet's cast
in its engine: the alternative measured by ``run.py``'s ``fp16-kernel`` (docs/design.md,
"Codec kernels"). Every other role and every other codec runs as bench_worker does.

Usage: as bench_worker.py (the same arguments).
"""
import os
import runpy
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
BENCHMARKS = os.path.join(HERE, os.pardir, os.pardir, os.pardir, 'benchmarks')
sys.path.insert(0, BENCHMARKS)

import mxdelay  # noqa: E402,F401  before mxnet (a server or the scheduler runs its role there)
from kvstore_ext.codecs import fp16, host, kernels  # noqa: E402  (imports mxnet)

_ENGINE_ENCODE = fp16.Float16Tensor.encode


def kernel_encode(self, source, buf, factor):
    """Float16Tensor.encode with the kernel: wait for the gradient (backward) and for the
    send buffer's earlier readers (its slot's last push), then cast on this thread."""
    if factor is not None or source.context.device_type != 'cpu':
        _ENGINE_ENCODE(self, source, buf, factor)
        return
    kernels.to_float16(host.view(source), out=host.view(buf, write=True))
    self.factor = None


fp16.Float16Tensor.encode = kernel_encode
kernels.require_compiled()
sys.argv[0] = os.path.join(BENCHMARKS, 'bench_worker.py')
runpy.run_path(sys.argv[0], run_name='__main__')
