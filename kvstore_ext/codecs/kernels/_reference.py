"""The numpy (and MXNet) code the kernels replace, as functions of the kernels' signatures:
the fallback where no C compiler is found, and what the tests compare the kernels with.

Each function is the job's code path before the kernels, unchanged in its arithmetic:
:mod:`kvstore_ext.codecs.quantize` for the push codecs, :mod:`kvstore_ext.codecs.pull_payloads`
for the pull codecs, MXNet's cast for float16.
"""
import numpy as np

from kvstore_ext.codecs import pull_payloads, quantize

__all__ = ['encode', 'decode', 'decode_sum', 'encode_with_feedback', 'int8_pull_encode',
           'int8_pull_broadcast', 'int8_pull_decode_add', 'fp16_pull_encode',
           'fp16_pull_broadcast', 'fp16_pull_decode_add', 'to_float16', 'to_float32']

F32 = np.float32


def encode(p, h, block):
    return quantize.encode(p, h, block)


def decode(payload, h, block, n):
    return quantize.decode(payload, h, block, n)


def decode_sum(rows, order, h, block, n):
    # kvstore_ext.server.appliers.DecodeRows.decode: rank order, float32 additions left to right.
    total = None
    for index in order:
        values = quantize.decode(rows[index], h, block, n)
        total = values if total is None else total + values
    return total


def encode_with_feedback(grad, residual, h, block, ranges, out):
    # kvstore_ext.codecs.blockwise.PayloadTensor.encode, without its MXNet side.
    p = np.array(grad, dtype=F32)
    p += residual
    sent = np.empty_like(p) if out is None else out
    payloads = []
    for start, stop in ranges:
        payload, values = quantize.encode(p[start:stop], h, block)
        payloads.append(payload)
        sent[start:stop] = values
    np.subtract(p, sent, out=residual)
    return payloads, sent


def int8_pull_encode(d, block):
    return pull_payloads.int8_encode(d, block)


def int8_pull_broadcast(weight, model, block):
    # kvstore_ext.server.pulled.ServerModel.broadcast, x̂ updated in place.
    payload, dec = int8_pull_encode(weight - model, block)
    np.add(model, dec, out=model)
    return payload


def int8_pull_decode_add(payload, model, n, block):
    # Int8Pull.decode's NDArray operations in numpy: uint8 to float32 (exact), - 128, times
    # the block's scale, added to the model.
    blocks = pull_payloads.int8_blocks(n, block)
    start = 4 * (1 + blocks)   # bytes: the header, then the scales
    levels = payload.view(np.uint8)[start:start + blocks * block].astype(F32)
    levels -= F32(128)
    dec = (levels.reshape(blocks, block) * payload[1:1 + blocks].reshape(blocks, 1))
    np.add(model, dec.reshape(-1)[:n], out=model)


def fp16_pull_encode(d):
    return pull_payloads.fp16_encode(d)


def fp16_pull_broadcast(weight, model):
    payload, dec = fp16_pull_encode(weight - model)
    np.add(model, dec, out=model)
    return payload


def fp16_pull_decode_add(payload, model, n):
    np.add(model, payload.view(np.float16)[2:2 + n].astype(F32), out=model)


def to_float16(x, out):
    from mxnet import nd   # pylint: disable=import-outside-toplevel
    # MXNet's cast (kvstore_ext.codecs.fp16.fill_send_buffer): numpy's bits, about ten times
    # faster.
    out[...] = nd.array(x, dtype=F32).astype(np.float16).asnumpy()
    return out


def to_float32(x, out):
    out[...] = x   # exact
    return out
