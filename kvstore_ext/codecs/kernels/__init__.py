"""Fused codec kernels: the push codecs ``'int8'``, ``'int4'`` and ``'ternary'``
(:mod:`kvstore_ext.codecs.quantize`), the pull codecs ``'fp16'`` and ``'int8'``
(:mod:`kvstore_ext.codecs.pulls`) and float16 casts, in one or two passes over memory.

Every function returns the bits the numpy (and MXNet) code returns, for every input
(``tests/test_codec_kernels.py``), but for which NaN a NaN is: where a block holds NaNs of
several bit patterns (numpy's ``max`` picks one by its own reduction order, the kernels the
first), and where an addition or subtraction meets two NaNs (``g + r``, ``W - x̂``, the
servers' sum: compilers, and numpy's loops, may swap the operands, and the result is either
NaN).

The kernels are C (``codec_kernels.c``), compiled once per machine with the system's C
compiler into ``~/.cache/mxdelay`` and called through :mod:`ctypes`, which releases the GIL:
the ``threads`` argument splits a call over that many threads (a server decodes pushes and
encodes pulls with the cores it has, :func:`cores`). They run where the job encodes and
decodes (docs/design.md §2.15): the workers' blockwise encode and float16 cast, the servers'
sum of the rows and compressed-pull encode; :func:`compiled_calls` counts them. Without a
compiler every function falls back to the numpy code (:mod:`._reference`: the same bits,
slower), with one warning. ``MXDELAY_CODEC_KERNELS`` chooses: ``auto`` (the default:
compiled if possible), ``compiled`` (an error if the kernels cannot be built) or ``numpy``
(always the fallback).

Arrays are numpy arrays; inputs are converted to flat contiguous float32 (copied only if
they are not), arrays updated in place must already be flat contiguous float32. The worker's
encode of a gradient on another device (a GPU) is :mod:`.ndarray` (MXNet operators, not
imported here).
"""
from ._dispatch import (LEVELS, MAX_BLOCK, MODES, backend, compiled_calls, cores, payload_size,
                        require_compiled)
from .pull import (fp16_pull_broadcast, fp16_pull_decode_add, fp16_pull_encode, fp16_pull_size,
                   int8_pull_broadcast, int8_pull_decode_add, int8_pull_encode, int8_pull_size,
                   to_float16, to_float32)
from .push import decode, decode_sum, encode, encode_with_feedback

__all__ = ['LEVELS', 'MAX_BLOCK', 'MODES', 'backend', 'require_compiled', 'cores',
           'compiled_calls', 'payload_size',
           'encode', 'decode', 'decode_sum', 'encode_with_feedback', 'int8_pull_size',
           'int8_pull_encode', 'int8_pull_broadcast', 'int8_pull_decode_add', 'fp16_pull_size',
           'fp16_pull_encode', 'fp16_pull_broadcast', 'fp16_pull_decode_add', 'to_float16',
           'to_float32']
