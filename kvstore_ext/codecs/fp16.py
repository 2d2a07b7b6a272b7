"""The ``'fp16'`` codec: float16 pushes (``compression_params={'type': 'fp16'}``).

With float16 pushes (docs/design.md §2.11) a worker casts its gradient to float16 in the copy
into its send buffer, so every push carries half the bytes. The servers sum a round in
float32 and keep ``W`` and the optimizer state in float32; pulls return float32 ``W``:

- every chunk keeps its R slot keys for the pushes, now float16 keys, and the servers run
  MXNet's *multi-precision* mode (:func:`enable_float32_sums`), in which the native server
  casts each float16 push to float32 and sums in float32 (``kvstore_dist_server.h``,
  ``DataHandleDefault``);
- every chunk gets R float32 *pull keys* (``KeyLayout.pull_key``), which pulls read: the
  codec's wire is ``'pull_keys'`` (:mod:`kvstore_ext.worker.wires.pull_keys`).

This module is the codec (:class:`Float16`, registered as ``'fp16'``) and the float16 copy of
one tensor's pushes (:class:`Float16Tensor`): the codec kernel's cast of a CPU gradient on
the Python thread (``kernels.to_float16``, MXNet's bits), else MXNet's cast in its engine
(on a GPU, cast there first; docs/design.md §2.15: the kernel's cast measured not slower on
a real job, though it waits for each gradient's backward).
"""
from kvstore_ext.codecs import (Codec, CompressionError, TensorCodec, float32_only, host, kernels,
                                register)

__all__ = ['Float16', 'Float16Tensor', 'enable_float32_sums', 'fill_send_buffer']

#: MXNet's command id of ``kSetMultiPrecision`` (``kvstore_dist_server.h``, ``CommandType``);
#: handled by the native server in C++, never by mxdelay's controller.
_SET_MULTI_PRECISION = 1


def enable_float32_sums(native):
    """Switch every server to MXNet's multi-precision mode: float16 keys are summed in
    float32 (an exact cast of each push, then float32 additions). Sent once, by rank 0,
    before any key is initialised (MXNet refuses it while pushes are under way)."""
    native._send_command_to_servers(_SET_MULTI_PRECISION, '')  # pylint: disable=protected-access


def fill_send_buffer(source, buf, factor):
    """Copy `source` (float32, on any device) into the float16 `buf`, times `factor` if not
    None; the cast rounds to nearest, as numpy's ``astype(float16)``, in MXNet's engine."""
    if factor is not None:
        source = source * factor  # in float32, then one rounding to float16
    if not host.readable(source.context):
        # MXNet copies between devices only within one dtype: cast on the gradient's device
        # (a GPU), then copy half the bytes.
        source = source.astype(buf.dtype)
    source.copyto(buf)  # on the host, the copy casts


class Float16(Codec):
    """float16 pushes (``{'type': 'fp16'}``, mxdelay's own: Horovod and BytePS offer it, MXNet
    1.9.1 does not): gradients travel as float16 and are summed in float32 on the servers,
    which keep float32 weights; pulls return float32 (docs/design.md §2.11). Stateless; the
    finish counter's flags (0, 1, ... N) are exact in float16."""
    type_name = 'fp16'
    wire_dtype = 'float16'
    pull_keys = True
    sparse_values = False
    wire = 'pull_keys'

    def describe(self):
        return {'type': self.type_name}

    def prepare_servers(self, native, rank):
        if rank == 0:
            # Before any key exists: the servers then sum float16 keys in float32 (§2.11).
            enable_float32_sums(native)

    def check_dtype(self, name, dtype):
        # A float16 parameter already pushes float16 (no saving); its server keys would
        # run in MXNet's multi-precision mode, which float16 pushes switch on for the whole
        # job, with pulls of float16 values (docs/design.md §2.11).
        float32_only(name, dtype, "compression_params={'type': 'fp16'} needs float32 "
                                  "parameters, but %s is %s; cast the model to float32 "
                                  "(net.cast('float32')) or remove compression_params")

    def for_tensor(self, size):
        return Float16Tensor()


class Float16Tensor(TensorCodec):
    """The float16 copy of one tensor's pushes."""

    def __init__(self):
        super(Float16Tensor, self).__init__()
        self.factor = None

    def encode(self, source, buf, factor):
        if factor is None and host.readable(source.context):
            # The kernel, on this thread: it waits for the gradient's backward and for the
            # buffer's readers and writers in MXNet's engine (the slot's last push, the
            # ordering of its pulls), then casts in one pass (§2.15).
            kernels.to_float16(host.view(source), out=host.view(buf, write=True))
        else:
            fill_send_buffer(source, buf, factor)   # in MXNet's engine
        self.factor = factor

    def sent(self, buf, grad):
        """``float32(float16(grad))``: the send buffer cast back to float32, not a second cast
        of `grad` (a float32-to-float16 cast costs several copies, docs/design.md §2.11)."""
        if self.factor is not None or buf.context != grad.context:
            # float16(factor * g) was sent, and the rule reads g rounded on its own (§1.4);
            # or `grad` is on a GPU (MXNet copies across devices only within one dtype).
            return grad.astype(buf.dtype).astype(grad.dtype)
        return self._copy_of(buf, grad)


def _parse_float16(params):
    extra = sorted(set(params) - {'type'}, key=str)
    if extra:
        raise CompressionError("compression_params=%r: fp16 compression takes no other setting, "
                               "got %s; pass {'type': 'fp16'}" % (params, extra))
    return Float16()


register('fp16', _parse_float16)
