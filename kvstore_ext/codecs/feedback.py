"""Error feedback: a decorator that gives any quantizer one residual per tensor.

A quantizer sends fewer distinct values than a gradient has; error feedback keeps what it did
not send in a residual and adds it to the next push (docs/design.md §2.8), as BytePS's
``ErrorFeedback`` compressor wraps another. :class:`ErrorFeedback` is the job's codec made of a
:class:`Quantizer`; each tensor gets a :class:`FeedbackTensor` that owns its residual (on the
CPU, like the send buffers), the batch-size factor of its last push, and saves and loads the
residual. A new quantizer implements :meth:`Quantizer.quantize` and gets all of that.
"""
import mxnet as mx
import numpy as np
from mxnet import nd

from kvstore_ext.codecs import Codec, TensorCodec

__all__ = ['Quantizer', 'ErrorFeedback', 'ResidualTensor', 'FeedbackTensor']


class Quantizer(Codec):
    """A codec whose values are quantized with error feedback (wrap it in
    :class:`ErrorFeedback` to use it)."""

    def quantize(self, buf, residual, source=None):
        """Add the gradient to `residual`, write the quantized values into `buf` (a flat
        float32 send buffer) and keep the error in `residual`, in place. The gradient is
        `source` (a flat float32 array on `buf`'s device) if given, else `buf`'s contents."""
        raise NotImplementedError


class ErrorFeedback(Codec):
    """The codec of `quantizer` with one residual per tensor.

    Parameters
    ----------
    quantizer : Quantizer
        What the wire carries; its settings are this codec's.
    """

    def __init__(self, quantizer):
        self.quantizer = quantizer

    type_name = property(lambda self: self.quantizer.type_name)
    flag_unit = property(lambda self: self.quantizer.flag_unit)
    wire_dtype = property(lambda self: self.quantizer.wire_dtype)
    pull_keys = property(lambda self: self.quantizer.pull_keys)
    sparse_values = property(lambda self: self.quantizer.sparse_values)
    exact_pushes = property(lambda self: self.quantizer.exact_pushes)
    wire = property(lambda self: self.quantizer.wire)

    def describe(self):
        return self.quantizer.describe()

    def server_settings(self):
        return self.quantizer.server_settings()

    def prepare_servers(self, native, rank):
        self.quantizer.prepare_servers(native, rank)

    def configure_native(self, native):
        self.quantizer.configure_native(native)

    def check_dtype(self, name, dtype):
        self.quantizer.check_dtype(name, dtype)

    def for_tensor(self, size):
        return FeedbackTensor(self.quantizer, size)

    def push_bytes(self, size, dtype):
        return self.quantizer.push_bytes(size, dtype)


class ResidualTensor(TensorCodec):
    """What every codec with error feedback keeps per tensor: a float32 ``residual`` (set by
    the subclass: an NDArray or a numpy array, on the CPU) saved and loaded with the
    checkpoint, and the batch-size factor of its last push, which :meth:`sent` divides out.
    Subclasses set ``residual`` and ``_factor``, and implement :meth:`encode` and
    :meth:`state`."""

    _factor = None

    def sent(self, buf, grad):
        """The values sent divided by the push's batch-size factor, if any."""
        if self._factor is None:
            return super(ResidualTensor, self).sent(buf, grad)
        out = self._copy_of(buf, grad)
        nd._internal._div_scalar(out, scalar=self._factor, out=out)  # pylint: disable=protected-access
        return out

    def state_size(self):
        return self.residual.size

    def load_state(self, value):
        self.residual[:] = np.asarray(value, dtype=np.float32).reshape(-1)


class FeedbackTensor(ResidualTensor):
    """One tensor's residual for `quantizer` (`size` elements) and its last push's factor."""

    def __init__(self, quantizer, size):
        super(FeedbackTensor, self).__init__()
        self._quantizer = quantizer
        self.residual = nd.zeros(size, ctx=mx.cpu(), dtype=np.float32)
        self._factor = None

    def encode(self, source, buf, factor):
        if factor is None and source.context == buf.context:
            # The gradient is quantized straight into the buffer: no copy first (§2.8).
            self._quantizer.quantize(buf, self.residual, source)
        else:
            super(FeedbackTensor, self).encode(source, buf, factor)
            # One residual per tensor, quantized in the buffer (as MXNet's worker does in
            # its CPU send buffer); the native store's own quantization of these values is
            # then lossless and its per-slot residuals stay 0 (docs/design.md §2.8).
            self._quantizer.quantize(buf, self.residual)
        self._factor = factor

    def state(self):
        return self.residual.asnumpy()
