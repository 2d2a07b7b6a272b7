"""The ``'fp16'`` codec: float16 pushes (``compression_params={'type': 'fp16'}``).

With float16 pushes (docs/design.md §2.11) a worker casts its gradient to float16 in the copy
into its send buffer, so every push carries half the bytes. The servers sum a round in
float32 and keep ``W`` and the optimizer state in float32; pulls return float32 ``W``:

- every chunk keeps its R slot keys for the pushes, now float16 keys, and the servers run
  MXNet's *multi-precision* mode (:func:`enable_float32_sums`), in which the native server
  casts each float16 push to float32 and sums in float32 (``kvstore_dist_server.h``,
  ``DataHandleDefault``);
- every chunk gets R float32 *pull keys* (``KeyLayout.pull_key``): round t's ``W_{t+1}`` is
  written into pull key ``t mod R`` (:class:`kvstore_ext.rounds.RoundKeeper`), and pulls
  read it. The native server hands its updater only the stored value of the key whose round
  completed, so each worker pushes one round of zeros into the pull keys at ``init``; the
  server keeps their stored arrays from that round on (:func:`push_handle_round`).

This module is the whole worker side of it: the codec (:class:`Float16`, registered as
``'fp16'``), the float16 copy (:class:`Float16Tensor`) and the data path of keys with pull
keys (:class:`PullKeyDense`: the engine ordering between a slot's float16 send buffer and
its float32 receive buffer), and with compressed pulls (:class:`PullKeyModelDense`: the
scheduled pulls read the model key, the exact ones the pull keys, docs/design.md §2.12).
"""
from mxnet import nd

from .compression import Codec, CompressionError, TensorCodec, float32_only, register
from .dense import DenseKeys
from .pull_codecs import PulledModel

__all__ = ['Float16', 'Float16Tensor', 'PullKeyDense', 'PullKeyModelDense', 'enable_float32_sums',
           'fill_send_buffer', 'order_pull', 'order_push', 'push_handle_round']

#: MXNet's command id of ``kSetMultiPrecision`` (``kvstore_dist_server.h``, ``CommandType``);
#: handled by the native server in C++, never by mxdelay's controller.
_SET_MULTI_PRECISION = 1


def enable_float32_sums(native):
    """Switch every server to MXNet's multi-precision mode: float16 keys are summed in
    float32 (an exact cast of each push, then float32 additions). Sent once, by rank 0,
    before any key is initialised (MXNet refuses it while pushes are under way)."""
    native._send_command_to_servers(_SET_MULTI_PRECISION, '')  # pylint: disable=protected-access


def fill_send_buffer(source, buf, factor):
    """Copy `source` (float32) into the float16 `buf`, times `factor` if not None; the cast
    rounds to nearest, as numpy's ``astype(float16)``."""
    if factor is not None:
        source = source * factor  # in float32, then one rounding to float16
    source.copyto(buf)  # the copy casts


def order_push(tensor, slot):
    """Before the next push into `slot`: wait in MXNet's engine for the pull of the slot's
    previous round to return (a one-element write on the send buffer that reads the
    receive buffer). Otherwise the push could complete the next round, and the server
    overwrite the pull key, before that pull was served."""
    if slot in tensor.pulled_slots:
        tensor.pull_heads[slot].copyto(tensor.heads[slot])
        tensor.pulled_slots.discard(slot)


def order_pull(tensor, rounds, last):
    """Before the pull of round `last`: wait in MXNet's engine for the push of round `last`
    and of each round in `rounds` to be acknowledged (complete on its server).

    The pull writes the receive buffer of slot ``last mod R``, not the send buffer that the
    push of `last` reads, so this touches every send buffer concerned (a write, which waits
    for its push) and then writes the receive buffer's first element from it; the pull
    (another write on that buffer) then follows. The elements touched are overwritten by
    the next copy and by the pull.
    """
    slots = len(tensor.buffers)
    target = tensor.pull_heads[last % slots]
    for rnd in list(rounds) + [last]:
        head = tensor.heads[rnd % slots]
        nd._internal._plus_scalar(head, scalar=0.0, out=head)  # pylint: disable=protected-access
        head.copyto(target)
    tensor.pulled_slots.add(last % slots)


def push_handle_round(native, tensors):
    """Push one round of zeros into the pull keys of `tensors` and wait for it (collective:
    every worker does it at ``init``). The server keeps each pull key's stored array from
    this round and writes ``W`` into it from then on; the zeros change nothing (the updater
    leaves the key's initial value). Waiting makes every worker's first push of a slot
    key come after the server holds the handles."""
    keys, views = [], []
    for tensor in tensors:
        for chunk in tensor.chunks:
            for slot, key in enumerate(chunk.pull_keys):
                keys.append(key)
                views.append(tensor.pull_buffers[slot][chunk.start:chunk.stop])
    if keys:
        native.push(keys, views)
        for tensor in tensors:
            for head in tensor.pull_heads:
                # A write waits for the push that reads the buffer to be acknowledged.
                nd._internal._plus_scalar(head, scalar=0.0, out=head)  # pylint: disable=protected-access
                head.wait_to_read()


class Float16(Codec):
    """float16 pushes (``{'type': 'fp16'}``, mxdelay's own: Horovod and BytePS offer it, MXNet
    1.9.1 does not): gradients travel as float16 and are summed in float32 on the servers,
    which keep float32 weights; pulls return float32 (docs/design.md §2.11). Stateless; the
    finish counter's flags (0, 1, ... N) are exact in float16."""
    type_name = 'fp16'
    wire_dtype = 'float16'
    pull_keys = True
    sparse_values = False

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

    def dense_keys(self, native, slots):
        return PullKeyDense(native, slots, self)

    def pulled_model_keys(self, native, slots, pull_codec, schedule):
        return PullKeyModelDense(native, slots, self, pull_codec, schedule)

    def for_tensor(self, size):
        return Float16Tensor()


class Float16Tensor(TensorCodec):
    """The float16 copy of one tensor's pushes."""

    def __init__(self):
        super(Float16Tensor, self).__init__()
        self.factor = None

    def encode(self, source, buf, factor):
        fill_send_buffer(source, buf, factor)
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


class PullKeyDense(DenseKeys):
    """Dense keys pushed in the codec's wire dtype whose pulls read float32 pull keys of
    their own."""

    def init_entries(self, tensor, value):
        # float16 slot keys (their value is never read: pulls read the pull keys, which
        # start at the tensor's float32 value).
        flat = value.reshape(-1)
        keys, values, sizes = [], [], []
        for chunk in tensor.chunks:
            chunk_value = flat[chunk.start:chunk.stop]
            zeros = nd.zeros(chunk.stop - chunk.start, dtype=self._codec.wire_dtype)
            keys.extend(chunk.keys + chunk.pull_keys)
            values.extend([zeros] * len(chunk.keys) + [chunk_value] * len(chunk.pull_keys))
            sizes.append(int(chunk_value.size))
        return keys, values, sizes

    def after_init(self, tensors):
        for tensor in tensors:
            tensor.make_pull_buffers(self._slots)
        push_handle_round(self._native, tensors)

    def _before_push(self, tensor, slot):
        order_push(tensor, slot)

    def _order_after_earlier_rounds(self, tensor, last):
        # The pull lands in a buffer of its own.
        order_pull(tensor, self._earlier_rounds(tensor, last), last)


class PullKeyModelDense(PulledModel, PullKeyDense):
    """:class:`PullKeyDense` with compressed pulls (:class:`kvstore_ext.pull_codecs.PulledModel`):
    the servers write W into the pull keys and, at pulled rounds, ``C(W - x̂)`` into the
    model key; :meth:`pull` (``sync_weights``, the initial ``x̂``) reads the pull keys, the
    scheduled pulls the model key. The compressed pull orders itself behind the float16 send
    buffers' pushes as the exact one does, and the next push into a slot waits for both
    (the model key's wait first, then the pull key's)."""


register('fp16', _parse_float16)
