"""A toy codec for tests/test_toy_codec.py: float16 pushes with a per-tensor scale.

``compression_params={'type': 'toy_scaled_fp16', 'scale': s}``: a worker sends
``float16(s * g)``; the servers sum a round in float32 and multiply the sum by ``1/s`` before
the optimizer (``server_settings``: data in the REGISTER command, the servers run no codec
code). It is all in this file: importing it registers the codec; no library file changes.
"""
import numpy as np
from mxnet import nd

from kvstore_ext import codecs
from kvstore_ext.codecs import fp16

__all__ = ['ScaledFloat16', 'TYPE']

TYPE = 'toy_scaled_fp16'


class ScaledFloat16(fp16.Float16):
    """float16 pushes of ``scale * g`` (pull keys, float32 sums: as ``'fp16'``)."""
    type_name = TYPE

    def __init__(self, scale):
        self.scale = float(scale)

    def describe(self):
        return {'type': TYPE, 'scale': self.scale}

    def server_settings(self):
        return {'sum_scale': 1.0 / self.scale}

    def for_tensor(self, size):
        return _ScaledTensor(self.scale)


class _ScaledTensor(codecs.TensorCodec):

    def __init__(self, scale):
        super(_ScaledTensor, self).__init__()
        self._scale = scale
        self._factor = None

    def encode(self, source, buf, factor):
        scale = self._scale * (1.0 if factor is None else factor)
        (source * scale).copyto(buf)   # in float32, then one rounding to float16
        self._factor = factor

    def sent(self, buf, grad):
        """``float32(float16(s * g)) / s`` (with a batch-size factor: g rounded alone)."""
        if self._factor is not None or buf.context != grad.context:
            out = (grad * self._scale).astype(buf.dtype).astype(grad.dtype)
        else:
            out = self._copy_of(buf, grad)
        return nd._internal._mul_scalar(out, scalar=1.0 / self._scale, out=out)


def _parse(params):
    extra = sorted(set(params) - {'type', 'scale'})
    scale = params.get('scale')
    if extra or not isinstance(scale, (int, float)) or not np.isfinite(scale) or scale <= 0:
        raise codecs.CompressionError(
            "compression_params=%r: %s takes one setting, a 'scale' > 0; e.g. "
            "{'type': %r, 'scale': 1024.0}" % (params, TYPE, TYPE))
    return ScaledFloat16(scale)


codecs.register(TYPE, _parse)
