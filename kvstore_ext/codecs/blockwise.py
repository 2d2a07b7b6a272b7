"""Push codecs of 8, 4 and 1.6 bits per value: ``'int8'``, ``'int4'`` and ``'ternary'``.

``compression_params={'type': 'int8' | 'int4' | 'ternary', 'block_size': B}`` (B default
256) quantizes each push by blocks with error feedback (:mod:`kvstore_ext.codecs.quantize`,
docs/design.md §2.14). MXNet's native server sums a dense key's N pushes before mxdelay's
updater sees them, which rules out a scale per worker; these codecs use another wire, *one
row per worker*:

- every chunk's R slot keys are row_sparse keys of shape (N, P), N workers, P the chunk's
  payload size (:func:`kvstore_ext.codecs.quantize.payload_size`), initialised with all N rows of
  zeros (MXNet's server aborts on a row_sparse init without rows);
- worker r pushes a ``RowSparseNDArray`` holding only row r, its payload; the rows are
  disjoint, so the native server's merged array holds every worker's payload bit for bit
  (the packed words are normal float32 numbers);
- the servers find this codec in the registry from the chunk's ``'payload'`` setting
  (:func:`kvstore_ext.codecs.decoder`), decode each row with it (:meth:`Blockwise.decode`),
  sum the N workers' values in rank order in float32 and run the round as for any dense
  chunk (:class:`kvstore_ext.server.appliers.DecodeRows`); W goes into float32 pull keys,
  which pulls read. The codec's wire is ``'rows'`` (:mod:`kvstore_ext.worker.wires.rows`).

Each tensor's side (:class:`PayloadTensor`) keeps one float32 residual and encodes a gradient
in host memory with the fused kernel (:func:`kvstore_ext.codecs.kernels.encode_with_feedback`,
numpy's bits), reading it where it lies (this waits for backward), and a gradient on another
device (a GPU) there, with MXNet's operators
(:func:`kvstore_ext.codecs.kernels.ndarray.encode_with_feedback_nd`: the same bits; the
residual then lives on that device), so that only the payloads and ``c`` come to the host.
What it sent, ``c``, stays in the float32 send buffer, which the local rule reads
(``sent``). The servers decode and sum the rows with the kernel too
(:meth:`Blockwise.decode_sum`). docs/design.md §2.15.
"""
import numbers

import numpy as np
from mxnet import nd

from kvstore_ext.codecs import (Codec, CompressionError, CompressionTypeError, float32_only,
                                heap, host, kernels, quantize, register)
from kvstore_ext.codecs.feedback import ResidualTensor
from kvstore_ext.codecs.kernels import ndarray as device_kernels
from kvstore_ext.protocol import commands

__all__ = ['Blockwise', 'PayloadTensor', 'parse_payload', 'largest_chunk', 'DEFAULT_BLOCK',
           'MAX_BLOCK']

#: The block size when ``compression_params`` has none.
DEFAULT_BLOCK = 256
#: The largest block size.
MAX_BLOCK = quantize.MAX_BLOCK
_EXAMPLE = "e.g. compression_params={'type': 'int8', 'block_size': 256}"


class Blockwise(Codec):
    """The codec of ``{'type': name, 'block_size': block}`` (`name` a key of
    :data:`kvstore_ext.codecs.quantize.LEVELS`): blockwise quantization with error feedback over the
    one-row-per-worker wire."""
    wire_dtype = 'float32'   # the payload's words; also gives the job float32 pull keys
    pull_keys = True
    sparse_values = False
    wire = 'rows'

    def __init__(self, name, block):
        self.type_name = name
        self.block = block
        self.levels = quantize.LEVELS[name]

    def describe(self):
        return {'type': self.type_name, 'block_size': self.block}

    def server_settings(self):
        return {'payload': self.describe()}

    def check_dtype(self, name, dtype):
        float32_only(name, dtype, "compression_params={'type': '%s'} needs float32 parameters, "
                                  "but %%s is %%s; cast the model to float32 "
                                  "(net.cast('float32')) or remove compression_params"
                     % self.type_name)

    def for_tensor(self, size):
        return PayloadTensor(self, size)

    def payload_size(self, size):
        """Float32 elements of the payload of a chunk of `size` values."""
        return quantize.payload_size(size, self.levels, self.block)

    def decode(self, payload, size):
        """On the servers: the values ``c`` one worker's `payload` stands for."""
        return quantize.decode(payload, self.levels, self.block, size)

    def decode_sum(self, rows, order, size, threads=1):
        """On the servers: the rows' values summed in `order`, in one pass (the kernel)."""
        return kernels.decode_sum(rows, order, self.levels, self.block, size, threads=threads)

    def chunk_limit(self, workers):
        # The (N, P) slot keys stay below MXNET_KVSTORE_BIGARRAY_BOUND (RowWire.place).
        return largest_chunk(self, workers, commands.bigarray_bound())

    def push_bytes(self, size, dtype):
        # One row of floats, plus its int64 row id.
        return 4 * self.payload_size(size) + 8


class PayloadTensor(ResidualTensor):
    """One tensor's residual (float32: numpy on the CPU, or an NDArray on the device of its
    gradients), its last push's payloads (one per chunk) and batch-size factor."""

    def __init__(self, codec, size):
        super(PayloadTensor, self).__init__()
        self._codec = codec
        heap.keep_large_blocks()   # the encode's temporaries: no page faults per round
        self.residual = np.zeros(size, dtype=np.float32)
        self._on_device = None     # the residual on a gradient's device, once it is pushed there
        self.payloads = None
        self._factor = None
        self.ranges = [(0, size)]   # the chunks' element ranges (RowWire.place sets them)

    def encode(self, source, buf, factor):
        """p = g * factor + r; per chunk, quantize p by blocks into its payload; the values
        sent, c, go into `buf`; r := p - c (one fused kernel over g and r, or MXNet's
        operators on g's device)."""
        if not host.readable(source.context):
            self._encode_on_device(source, buf, factor)
            return
        self._residual_to_host()
        if factor is None:
            # Straight from the gradient's memory into `buf`, once the slot's ordering writes
            # into it (its last pull, §2.11) and the reads of the last values sent are done:
            # no copy into `buf` first, and no array of c besides `buf` (§2.3).
            out = host.view(buf, write=True)
            grad = host.view(source)      # waits for backward
        else:
            super(PayloadTensor, self).encode(source, buf, factor)   # g * factor, in MXNet
            grad = host.view(buf)         # waits for backward and the slot's last pull
            out = None
        payloads, sent = kernels.encode_with_feedback(grad, self.residual, self._codec.levels,
                                                      self._codec.block, self.ranges, out=out)
        if out is None:
            # An engine copy (no wait here for the buffer's readers); `sent` lives on in it.
            nd.from_numpy(sent.reshape(buf.shape), zero_copy=True).copyto(buf)
        self.payloads = payloads
        self._factor = factor

    def _encode_on_device(self, source, buf, factor):
        """The encode of a gradient outside host memory (a GPU), on its device: g * factor
        and the quantization there, the payloads (their asnumpy waits for backward) and c
        (an engine copy into `buf`) to the host."""
        context = source.context
        if self._on_device is None or self._on_device.context != context:
            self._on_device = nd.array(self.state(), ctx=context)
        grad = source if factor is None else source * factor   # float32, as TensorCodec's
        payloads, sent = device_kernels.encode_with_feedback_nd(
            grad, self._on_device, self._codec.levels, self._codec.block, self.ranges)
        sent.reshape(buf.shape).copyto(buf)
        self.payloads = payloads
        self._factor = factor

    def _residual_to_host(self):
        if self._on_device is not None:
            self.residual[:] = self._on_device.asnumpy()
            self._on_device = None

    def state(self):
        if self._on_device is not None:
            return self._on_device.asnumpy()
        return self.residual.copy()

    def load_state(self, value):
        super(PayloadTensor, self).load_state(value)
        self._on_device = None   # the next push on a device starts from the loaded values


def largest_chunk(codec, workers, bound):
    """The most values a chunk of `codec` can hold with `workers` rows below `bound`
    elements (0 if none)."""
    low, high = 0, bound
    while low < high:   # the largest n with workers * payload_size(n) < bound
        middle = (low + high + 1) // 2
        if workers * codec.payload_size(middle) < bound:
            low = middle
        else:
            high = middle - 1
    return low


def parse_payload(params):
    """The codec of ``{'type': 'int8' | 'int4' | 'ternary', 'block_size': B}``.

    Raises
    ------
    CompressionError
        For unknown keys or a block size outside 1 .. 2**20.
    CompressionTypeError
        For a block size that is not an integer.
    """
    name = params['type']
    unknown = sorted(set(params) - {'type', 'block_size'}, key=str)
    if unknown:
        raise CompressionError("compression_params has unknown keys %s for type %r, which takes "
                               "only 'block_size'; %s" % (unknown, name, _EXAMPLE))
    block = params.get('block_size', DEFAULT_BLOCK)
    if isinstance(block, (bool, np.bool_)) or not isinstance(block, numbers.Integral):
        raise CompressionTypeError("compression_params['block_size'] must be an integer in "
                                   "1..%d, got %r (%s); %s" % (MAX_BLOCK, block,
                                                               type(block).__name__, _EXAMPLE))
    if not 1 <= block <= MAX_BLOCK:
        raise CompressionError("compression_params['block_size'] must be an integer in 1..%d, "
                               "got %r; %s" % (MAX_BLOCK, block, _EXAMPLE))
    return Blockwise(name, int(block))


for _name in quantize.LEVELS:
    register(_name, parse_payload)
