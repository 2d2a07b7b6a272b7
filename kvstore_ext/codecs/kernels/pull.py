"""The pull codecs' kernels (``'fp16'``, ``'int8'``, :mod:`kvstore_ext.codecs.pulls`) and the
float16 casts of float16 pushes (:mod:`kvstore_ext.codecs.fp16`).

A server's pulled round is :func:`int8_pull_broadcast` / :func:`fp16_pull_broadcast`: ``d = W
- x̂``, its payload, ``x̂ := x̂ + dec(q)`` in one pass over memory; a worker's is
:func:`int8_pull_decode_add` / :func:`fp16_pull_decode_add`: ``x̂ := x̂ + dec(q)``. Payloads
are laid out as :mod:`kvstore_ext.codecs.pull_payloads` lays them out (a float32 header
element, then the codec's bytes).
"""
import numpy as np

from kvstore_ext.codecs.pull_payloads import fp16_size, int8_blocks, int8_size
from . import _reference
from ._dispatch import F32, address, check_block, flat, in_place, library, ranges, run

__all__ = ['int8_pull_size', 'int8_pull_encode', 'int8_pull_broadcast', 'int8_pull_decode_add',
           'fp16_pull_size', 'fp16_pull_encode', 'fp16_pull_broadcast', 'fp16_pull_decode_add',
           'to_float16', 'to_float32']

#: Alignment of a thread's part of a float16 array: whole cache lines.
_LINE = 32


def int8_pull_size(n, block):
    """Float32 elements of an int8 pull payload of `n` values (``Int8Pull.payload_size``)."""
    return int8_size(n, check_block(block))


def _buffer(payload, size):
    """A payload of `size` float32, `payload` if given, whose elements the kernels do not
    write in full (the header, the last one's padding) are 0."""
    if payload is None:
        return np.zeros(size, dtype=F32)
    payload = in_place(payload, 'payload', size)
    payload[0] = payload[-1] = 0
    return payload


def _int8_encode(weight, model, out, block, threads, payload=None):
    # d = weight - model (model None: d = weight); model := model + dec, or out = dec.
    n = weight.size
    blocks = int8_blocks(n, block)
    payload = _buffer(payload, int8_pull_size(n, block))
    base = address(payload)
    run(library().mxd_i8pull_encode,
        [(address(weight), None if model is None else address(model),
          None if out is None else address(out), base + 4, base + 4 * (1 + blocks), n, block,
          lo, hi) for lo, hi in ranges(blocks * block, block, threads)], threads)
    return payload


def int8_pull_encode(d, block, threads=1):
    """``Int8Pull(block).encode(d)``: ``(payload, dec)``, the payload of the flat float32
    difference `d` and the values it stands for."""
    d = flat(d)
    check_block(block)
    if library() is None:
        return _reference.int8_pull_encode(d, block)
    dec = np.empty(d.size, dtype=F32)
    return _int8_encode(d, None, dec, block, threads), dec


def int8_pull_broadcast(weight, model, block, payload=None, threads=1):
    """A server's pulled round (``ServerModel.broadcast``): the payload of ``weight - model``
    (into `payload` if given: contiguous float32 of :func:`int8_pull_size`, e.g. the model
    key's memory, so that no fresh array is touched); `model` (x̂: contiguous float32,
    `weight`'s size) := ``model + dec`` in place."""
    weight = flat(weight)
    model = in_place(model, 'model', weight.size)
    check_block(block)
    if library() is None:
        return _filled(payload, _reference.int8_pull_broadcast(weight, model, block))
    return _int8_encode(weight, model, None, block, threads, payload)


def _filled(payload, result):
    """`result` (the fallback's payload), copied into `payload` if given."""
    if payload is None:
        return result
    in_place(payload, 'payload', result.size)[...] = result
    return payload


def int8_pull_decode_add(payload, model, n, block, threads=1):
    """A worker's pulled round (``Int8Pull.decode`` and the addition): `model` (x̂, `n`
    float32 in place) := ``model + (byte - 128) * scale`` of `payload` (float32 words)."""
    payload = _payload(payload, int8_pull_size(n, block), 'int8', n)
    model = in_place(model, 'model', n)
    if library() is None:
        _reference.int8_pull_decode_add(payload, model, n, block)
        return
    blocks = int8_blocks(n, block)
    base = address(payload)
    run(library().mxd_i8pull_decode_add,
        [(base + 4, base + 4 * (1 + blocks), address(model), block, lo, hi)
         for lo, hi in ranges(n, 1, threads)], threads)


def _payload(payload, size, name, n):
    payload = flat(payload)
    if payload.size != size:
        raise ValueError('a payload of %d floats for an %s pull of %d values: expected %d'
                         % (payload.size, name, n, size))
    return payload


def fp16_pull_size(n):
    """Float32 elements of an fp16 pull payload of `n` values (``Float16Pull.payload_size``)."""
    return fp16_size(n)


def _fp16_encode(weight, model, out, threads, payload=None):
    n = weight.size
    payload = _buffer(payload, fp16_pull_size(n))
    run(library().mxd_f16_encode,
        [(address(weight), None if model is None else address(model),
          None if out is None else address(out), address(payload) + 4, lo, hi)
         for lo, hi in ranges(n, _LINE, threads)], threads)
    return payload


def fp16_pull_encode(d, threads=1):
    """``Float16Pull().encode(d)``: ``(payload, dec)``."""
    d = flat(d)
    if library() is None:
        return _reference.fp16_pull_encode(d)
    dec = np.empty(d.size, dtype=F32)
    return _fp16_encode(d, None, dec, threads), dec


def fp16_pull_broadcast(weight, model, payload=None, threads=1):
    """A server's pulled round: the payload of ``float16(weight - model)`` (into `payload` if
    given, as :func:`int8_pull_broadcast`); `model` := ``model + float32(q)`` in place."""
    weight = flat(weight)
    model = in_place(model, 'model', weight.size)
    if library() is None:
        return _filled(payload, _reference.fp16_pull_broadcast(weight, model))
    return _fp16_encode(weight, model, None, threads, payload)


def fp16_pull_decode_add(payload, model, n, threads=1):
    """A worker's pulled round: `model` := ``model + float32(q)`` (`n` values in place)."""
    payload = _payload(payload, fp16_pull_size(n), 'fp16', n)
    model = in_place(model, 'model', n)
    if library() is None:
        _reference.fp16_pull_decode_add(payload, model, n)
        return
    run(library().mxd_f16_decode, [(address(payload) + 4, address(model), 1, lo, hi)
                                   for lo, hi in ranges(n, _LINE, threads)], threads)


def to_float16(x, out=None, threads=1):
    """`x` cast to float16, rounded to nearest even (numpy's and MXNet's bits), shaped as
    `x`; into `out` (contiguous float16 of x's size) if given."""
    source = flat(x)
    if out is None:
        out = np.empty(np.shape(x), dtype=np.float16)
    elif not (isinstance(out, np.ndarray) and out.dtype == np.float16 and out.flags.c_contiguous
              and out.size == source.size and out.flags.writeable):
        raise ValueError('out must be a writeable contiguous float16 numpy array of %d elements'
                         % source.size)
    if not source.size:
        return out
    if library() is None:
        _reference.to_float16(source, out.reshape(-1))
        return out
    run(library().mxd_f16_encode, [(address(source), None, None, address(out), lo, hi)
                                   for lo, hi in ranges(source.size, _LINE, threads)], threads)
    return out


def to_float32(x, out=None, threads=1):
    """float16 `x` as float32 (exact), shaped as `x`; into `out` if given."""
    source = np.ascontiguousarray(x, dtype=np.float16).reshape(-1)
    if out is None:
        out = np.empty(np.shape(x), dtype=F32)
    flat_out = in_place(out, 'out', source.size)
    if library() is None:
        _reference.to_float32(source, flat_out)
        return out
    run(library().mxd_f16_decode, [(address(source), address(flat_out), 0, lo, hi)
                                   for lo, hi in ranges(source.size, _LINE, threads)], threads)
    return out
