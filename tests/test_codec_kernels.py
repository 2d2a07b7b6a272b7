"""The codec kernels (kvstore_ext/codecs/kernels) against the numpy code, bit for bit.

Every test runs the compiled kernels: the module fixture fails (it does not skip) when they
cannot be built, so a silent fallback to numpy cannot pass for them. The numpy code is called
as the job called it before the kernels were wired in: :mod:`kvstore_ext.codecs.quantize`,
``PayloadTensor.encode`` and ``DecodeRows.decode`` with the kernels switched to their numpy
fallback (:func:`numpy_path`: ``quantize`` per chunk, the decodes summed in a loop),
``Int8Pull`` / ``Float16Pull``'s ``encode`` and the workers' ``Payload.decode_into``, MXNet's
float16 cast.
"""
import contextlib

import platform

import mxnet as mx
import numpy as np
import pytest
from mxnet import nd

from kvstore_ext.codecs import blockwise, pulls, quantize
from kvstore_ext.server import appliers
from kvstore_ext.worker.wires.pulls import Payload
from kvstore_ext.codecs import kernels
from kvstore_ext.codecs.kernels import _dispatch, _library, _reference, ndarray

F32 = np.float32
NAMES = {127: 'int8', 7: 'int4', 1: 'ternary'}
# (n, block): sizes below, at and above a block and a word, block sizes 1 .. 2**20.
SIZES = [(0, 256), (1, 1), (5, 1), (19, 2), (21, 3), (1000, 7), (4097, 20), (10007, 256),
         (7687, 255), (25000, 257), (70000, 4096), (300001, 1000), (2 ** 20 + 3, 2 ** 20)]


@pytest.fixture(scope='module', autouse=True)
def compiled():
    kernels.require_compiled()


@pytest.fixture(autouse=True)
def small_parts(monkeypatch):
    # Threads take parts of 2**20 elements and more; small ones here, so that the tests'
    # arrays are split wherever they ask for threads.
    monkeypatch.setattr(_dispatch, '_MIN_PART', 1 << 12)


@contextlib.contextmanager
def numpy_path():
    """The kernels' numpy fallback inside the block (the job's code before the kernels)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(_dispatch._STATE, 'library', None)   # pylint: disable=protected-access
        assert kernels.backend() == 'numpy'
        yield


def assert_same(new, old, nan_bits=True):
    """The same bits; with ``nan_bits=False`` a NaN's bits may differ (a sum of two NaNs is
    either one: compilers and numpy's loops may swap an addition's operands)."""
    new, old = np.asarray(new), np.asarray(old)
    assert new.dtype == old.dtype and new.shape == old.shape
    if not nan_bits:
        nan = np.isnan(old)
        assert np.array_equal(np.isnan(new), nan)
        new, old = new[~nan], old[~nan]
    assert new.tobytes() == old.tobytes()


def values(rng, n, block, h=127):
    """n float32 values whose blocks are each of one kind: normal at any magnitude, exact
    ties of p / s, zeros, -0, subnormals, float32's largest, with inf, -inf or NaN, one
    value alone."""
    out = np.empty(n, dtype=F32)
    for start in range(0, n, block):
        m = min(block, n - start)
        kind = rng.integers(12)
        if kind == 0:    # p / s = k + 1/2 exactly: ties to even
            e = float(2.0 ** rng.integers(-20, 20))
            v = (rng.integers(-h, h, m) + 0.5) * e
            v[rng.integers(m)] = h * e * rng.choice([-1, 1])
        elif kind == 1:
            v = np.zeros(m)
        elif kind == 2:
            v = np.full(m, -0.0)
        elif kind == 3:  # subnormal
            v = rng.integers(-300, 300, m) * 1e-45
        elif kind == 4:  # subnormal and normal
            v = rng.standard_normal(m) * np.where(rng.random(m) < 0.5, 1e-40, 1e-36)
        elif kind == 5:
            v = rng.choice([3.4028235e38, -3.4028235e38, 1e38, 0.0], m)
        elif kind in (6, 7, 8):
            v = rng.standard_normal(m)
            v[rng.integers(m, size=1 + m // 50)] = [np.inf, -np.inf, np.nan][kind - 6]
        elif kind == 9:
            v = np.zeros(m)
            v[rng.integers(m)] = rng.standard_normal()
        else:
            v = rng.standard_normal(m) * 10.0 ** rng.uniform(-30, 30)
        out[start:start + m] = v
    return out


@pytest.mark.parametrize('n, block', SIZES)
@pytest.mark.parametrize('h', [127, 7, 1])
def test_push_encode_and_decode_are_todays_bits(h, n, block):
    rng = np.random.default_rng(n * 31 + h)
    p = values(rng, n, block, h)
    payload, c = quantize.encode(p, h, block)
    new_payload, new_c = kernels.encode(p, h, block)
    assert_same(new_payload, payload)
    assert_same(new_c, c)
    assert_same(kernels.decode(payload, h, block, n), quantize.decode(payload, h, block, n))


def test_many_random_sizes_and_blocks():
    rng = np.random.default_rng(11)
    for _ in range(300):
        h = int(rng.choice([127, 7, 1]))
        n, block = int(rng.integers(0, 6000)), int(rng.integers(1, 3000))
        p = values(rng, n, block, h)
        payload, c = quantize.encode(p, h, block)
        new_payload, new_c = kernels.encode(p, h, block)
        assert_same(new_payload, payload)
        assert_same(new_c, c)
        assert_same(kernels.decode(payload, h, block, n), c)
        if n:
            d_payload, dec = pulls.Int8Pull(block).encode(p)
            new_payload, new_dec = kernels.int8_pull_encode(p, block)
            assert_same(new_payload, d_payload)
            assert_same(new_dec, dec)


@pytest.mark.parametrize('h', [127, 7, 1])
def test_every_level_at_every_digit_position(h):
    # Each level in each position of a word, in blocks of one value (scale |p| / h): every
    # digit and every code's float32 word (the largest codes included).
    digits = kernels.LEVELS[h][1]
    levels = np.arange(-h, h + 1, dtype=F32)
    p = np.concatenate([np.roll(np.tile(levels, digits), shift) for shift in range(digits)])
    p = np.concatenate([p, np.full(digits, h, dtype=F32), np.full(digits, -h, dtype=F32)])
    for block in (1, 2 * h + 1):
        payload, c = quantize.encode(p, h, block)
        assert_same(kernels.encode(p, h, block)[0], payload)
        assert_same(kernels.decode(payload, h, block, p.size), c)


@pytest.mark.parametrize('h', [127, 7, 1])
def test_the_workers_step_is_payload_tensors(h):
    rng = np.random.default_rng(h)
    n, block = 50000, 256
    chunks = [(0, 12345), (12345, 12346), (12346, 40000), (40000, n)]
    grad, residual = values(rng, n, block, h), values(rng, n, block, h) * F32(0.01)
    # The worker's step in numpy (PayloadTensor.encode on a CPU gradient, numpy_path), then
    # as the job runs it (the compiled kernel).
    tensor, wired = (blockwise.Blockwise(NAMES[h], block).for_tensor(n) for _ in range(2))
    tensor.ranges = wired.ranges = chunks
    tensor.residual, wired.residual = residual.copy(), residual.copy()
    buf, wired_buf = nd.zeros(n), nd.zeros(n)
    with numpy_path():
        tensor.encode(nd.array(grad), buf, None)
    calls = kernels.compiled_calls().get('mxd_%s_encode' % NAMES[h], 0)
    wired.encode(nd.array(grad), wired_buf, None)
    assert kernels.compiled_calls()['mxd_%s_encode' % NAMES[h]] == calls + 1
    for new, old in zip(wired.payloads, tensor.payloads):
        assert_same(new, old)
    assert_same(wired_buf.asnumpy(), buf.asnumpy())
    assert_same(wired.residual, tensor.residual)
    for threads in (1, 3):
        new_residual = residual.copy()
        payloads, sent = kernels.encode_with_feedback(grad, new_residual, h, block, chunks,
                                                      threads=threads)
        assert len(payloads) == len(chunks)
        for new, old in zip(payloads, tensor.payloads):
            assert_same(new, old)
        assert_same(sent, buf.asnumpy())
        assert_same(new_residual, tensor.residual)


CONTEXTS = [mx.cpu()] + [mx.gpu(i) for i in range(mx.context.num_gpus())]


@pytest.mark.parametrize('context', CONTEXTS, ids=str)
@pytest.mark.parametrize('h', [127, 7, 1])
def test_the_ndarray_encode_is_todays_bits_on_every_context(h, context):
    # No GPU here: on a machine with one, this checks MXNet's CUDA arithmetic too.
    rng = np.random.default_rng(20 + h)
    for shape, block, chunks in (((9000,), 256, [(0, 1000), (1000, 1001), (1001, 9000)]),
                                 ((7, 111), 1000, None), ((20,), 1, None)):
        n = int(np.prod(shape))
        grad, residual = values(rng, n, block, h), values(rng, n, block, h) * F32(0.01)
        left = residual.copy()
        payloads, sent = _reference.encode_with_feedback(grad, left, h, block,
                                                         chunks or [(0, n)], None)
        new_left = nd.array(residual, ctx=context)
        new_payloads, new_sent = ndarray.encode_with_feedback_nd(
            nd.array(grad.reshape(shape), ctx=context), new_left, h, block, chunks)
        assert len(new_payloads) == len(payloads)
        # A NaN scale's sign may differ (MXNet's |NaN| is positive): c and r follow it.
        for new, old in zip(new_payloads, payloads):
            assert_same(new, old, nan_bits=False)
        assert new_sent.context == context
        assert_same(new_sent.asnumpy(), sent, nan_bits=False)
        assert_same(new_left.asnumpy(), left, nan_bits=False)


@pytest.mark.parametrize('workers', [1, 2, 4])
@pytest.mark.parametrize('h', [127, 7, 1])
def test_the_servers_sum_is_decode_rows(h, workers):
    rng = np.random.default_rng(workers * 10 + h)
    n, block = 30001, 100
    rows = np.stack([quantize.encode(values(rng, n, block, h), h, block)[0]
                     for _ in range(workers)])
    ranks = rng.permutation(workers)   # the merged array's rows, in arrival order
    merged = nd.sparse.row_sparse_array((rows[ranks], ranks.astype(np.int64)), shape=rows.shape)
    decoder = appliers.DecodeRows(None, {'type': NAMES[h], 'block_size': block})
    with numpy_path():
        old = decoder.decode('chunk', merged, n)   # the numpy decodes, summed in a loop
    assert_same(decoder.decode('chunk', merged, n), old, nan_bits=False)   # as the job runs
    for threads in (1, 2):
        assert_same(kernels.decode_sum(rows[ranks], np.argsort(ranks), h, block, n,
                                       threads=threads), old, nan_bits=False)
    out = np.full(n, np.nan, dtype=F32)
    assert kernels.decode_sum(rows[ranks], np.argsort(ranks), h, block, n, out=out) is out
    assert_same(out, old, nan_bits=False)


def test_threads_split_on_block_and_word_boundaries():
    rng = np.random.default_rng(3)
    n_big = 2 ** 21 + 5
    for h, block in ((1, 256), (7, 3), (127, 5000), (1, 2 ** 20)):
        n = 3 * (1 << 14) + 11 if block < n_big else n_big
        p = values(rng, n, block, h)
        payload, c = quantize.encode(p, h, block)
        for threads in (2, 3, 4):
            assert_same(kernels.encode(p, h, block, threads)[0], payload)
            assert_same(kernels.decode(payload, h, block, n, threads), c)


def _code_word(code):
    high = code >> 23
    sign = high // 254
    return np.array([(sign << 31) | ((high - 254 * sign + 1) << 23) | (code & 0x7fffff)],
                    dtype=np.uint32).view(F32)[0]


@pytest.mark.parametrize('h', [127, 7, 1])
def test_bad_payloads_raise_todays_errors(h):
    n, block = 1000, 64
    digits = kernels.LEVELS[h][1]
    payload, _ = quantize.encode(np.random.default_rng(0).standard_normal(n).astype(F32), h,
                                 block)
    bad_words = [0.0, 1e-40, np.inf, np.nan, _code_word((2 * h + 1) ** digits)]
    for position in (-(-n // block), payload.size - 1):
        for word in bad_words:
            damaged = payload.copy()
            damaged[position] = word
            with pytest.raises(ValueError) as old:
                quantize.decode(damaged, h, block, n)
            with pytest.raises(ValueError, match=str(old.value)):
                kernels.decode(damaged, h, block, n)
            rows = np.stack([payload, damaged, payload])
            with pytest.raises(ValueError, match=str(old.value)):
                kernels.decode_sum(rows, [2, 0, 1], h, block, n)
    with pytest.raises(ValueError) as old:
        quantize.decode(payload[:-1], h, block, n)
    with pytest.raises(ValueError, match=str(old.value).replace('(', r'\(').replace(')', r'\)')):
        kernels.decode(payload[:-1], h, block, n)


@pytest.mark.parametrize('n, block', SIZES[1:-1] + [(3, 5000)])
def test_int8_pulls_are_todays_bits(n, block):
    rng = np.random.default_rng(n + block)
    codec = pulls.Int8Pull(block)
    d = values(rng, n, block)
    payload, dec = codec.encode(d)
    new_payload, new_dec = kernels.int8_pull_encode(d, block)
    assert_same(new_payload, payload)
    assert_same(new_dec, dec)
    # The server's round: x̂ := x̂ + dec(C(W - x̂)).
    weight, model = values(rng, n, block), values(rng, n, block)
    old_payload, old_dec = codec.encode(weight - model)
    new_model = model.copy()
    assert_same(kernels.int8_pull_broadcast(weight, new_model, block, threads=2), old_payload)
    assert_same(new_model, model + old_dec, nan_bits=False)   # x̂ + dec: both may be NaN
    store = np.full(old_payload.size, np.nan, dtype=F32)      # the model key's memory
    assert kernels.int8_pull_broadcast(weight, model.copy(), block, payload=store) is store
    assert_same(store, old_payload)
    # The worker's round, as Payload.decode_into computes it in MXNet's engine.
    old_model = _worker_decode(codec, n, old_payload, model)
    kernels.int8_pull_decode_add(old_payload, model, n, block)
    assert_same(model, old_model, nan_bits=False)


def _worker_decode(codec, n, payload, model):
    receive = Payload(codec, n)
    receive._memory[:] = payload.view(np.uint8)   # pylint: disable=protected-access
    target = nd.array(model)
    receive.decode_into(target)
    return target.asnumpy()


@pytest.mark.parametrize('n', [1, 2, 1001, 300001])
def test_fp16_pulls_are_todays_bits(n):
    rng = np.random.default_rng(n)
    codec = pulls.Float16Pull()
    d = np.concatenate([half_edges(), values(rng, n, 97)])[:n]
    rng.shuffle(d)
    payload, dec = codec.encode(d)
    new_payload, new_dec = kernels.fp16_pull_encode(d, threads=2)
    assert_same(new_payload, payload)
    assert_same(new_dec, dec)
    weight, model = d[::-1].copy(), values(rng, n, 33)
    old_payload, old_dec = codec.encode(weight - model)
    new_model = model.copy()
    assert_same(kernels.fp16_pull_broadcast(weight, new_model), old_payload)
    store = np.full(old_payload.size, np.nan, dtype=F32)
    assert kernels.fp16_pull_broadcast(weight, model.copy(), payload=store) is store
    assert_same(store, old_payload)
    assert_same(new_model, model + old_dec, nan_bits=False)
    old_model = _worker_decode(codec, n, old_payload, model)
    kernels.fp16_pull_decode_add(old_payload, model, n, threads=2)
    assert_same(model, old_model, nan_bits=False)


def half_edges():
    """float32 values around every float16: each one, the midpoints to its neighbours and
    one float32 step either side of them; beyond float16's range; random bit patterns (NaNs
    of every payload among them)."""
    halves = np.arange(0x7c00, dtype=np.uint16).view(np.float16).astype(np.float64)
    middles = (halves[:-1] + halves[1:]) / 2
    edges = [halves, middles, [65504.0, 65519.99, 65520.0, 65536.0, 1e38, 2.0 ** -25,
                               2.0 ** -26, 5.96e-8, 2.0 ** -24 * 1.5]]
    one = np.concatenate(edges).astype(F32)
    near = np.concatenate([one, np.nextafter(one, F32(np.inf)), np.nextafter(one, F32(0))])
    random = np.random.default_rng(5).integers(0, 2 ** 32, 200000, dtype=np.uint64)
    both = np.concatenate([near, -near, random.astype(np.uint32).view(F32)])
    return np.concatenate([both, np.array([np.inf, -np.inf, np.nan], dtype=F32)])


def test_float16_casts_are_mxnets_and_numpys():
    x = half_edges()[:-2]   # a multiple of 3 values
    mxnet_cast = nd.array(x).astype(np.float16).asnumpy()
    assert_same(kernels.to_float16(x), mxnet_cast)
    assert_same(kernels.to_float16(x.reshape(-1, 3), threads=3), mxnet_cast.reshape(-1, 3))
    assert_same(kernels.to_float16(x), x.astype(np.float16))
    every = np.arange(2 ** 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    assert_same(kernels.to_float32(every), nd.array(every, dtype=np.float16).astype(F32).asnumpy())
    assert_same(kernels.to_float32(every), every.astype(F32))


def _has_avx2():
    with open('/proc/cpuinfo', encoding='ascii', errors='replace') as info:
        return platform.machine() == 'x86_64' and ' avx2' in info.read()


BUILDS = [pytest.param(('-DMXD_NO_CLONES',), id='baseline'),
          pytest.param(('-DMXD_NO_CLONES', '-march=x86-64-v3'), id='x86-64-v3', marks=[
              pytest.mark.skipif(not _has_avx2(), reason='this CPU has no AVX2')])]


@pytest.mark.parametrize('flags', BUILDS)
def test_every_build_is_todays_bits(flags, monkeypatch):
    # The tests above run the clone this CPU picks (x86-64-v4 here); these builds are what
    # older CPUs pick, and what a compiler without target_clones builds (cached as the
    # kernels are).
    built = _library.load(flags)
    monkeypatch.setitem(_dispatch._STATE, 'library', built)  # pylint: disable=protected-access
    rng = np.random.default_rng(17)
    for h in (127, 7, 1):
        for n, block in SIZES[1:9]:
            p = values(rng, n, block, h)
            payload, c = quantize.encode(p, h, block)
            assert_same(kernels.encode(p, h, block)[0], payload)
            assert_same(kernels.decode_sum(np.stack([payload, payload]), [1, 0], h, block, n),
                        c + c)
            left = p.copy()
            payloads, sent = kernels.encode_with_feedback(c, left, h, block)
            old_left = p.copy()
            assert_same(payloads[0], _reference.encode_with_feedback(
                c, old_left, h, block, [(0, n)], None)[0][0])
            assert_same(left, old_left)
            if n:
                assert_same(kernels.int8_pull_encode(p, block)[0],
                            pulls.Int8Pull(block).encode(p)[0])
    x = half_edges()
    assert_same(kernels.to_float16(x), x.astype(np.float16))
    assert_same(kernels.fp16_pull_encode(x)[1], x.astype(np.float16).astype(F32))


def test_the_numpy_fallback_is_the_same(monkeypatch):
    rng = np.random.default_rng(9)
    n, block = 20000, 256
    grad, residual = values(rng, n, block), values(rng, n, block)

    def outputs():
        left = residual.copy()
        payloads, sent = kernels.encode_with_feedback(grad, left, 1, block, [(0, 5), (5, n)])
        model = residual.copy()
        kernels.int8_pull_decode_add(kernels.int8_pull_encode(grad, block)[0], model, n, block)
        store = np.full(kernels.fp16_pull_size(n), np.nan, dtype=F32)
        kernels.fp16_pull_broadcast(grad, model, payload=store)
        return (list(kernels.encode(grad, 7, block)) + payloads + [sent, left, model]
                + list(kernels.int8_pull_encode(grad, block))
                + list(kernels.fp16_pull_encode(grad)) + [kernels.to_float16(grad), store])

    compiled = outputs()
    monkeypatch.setitem(_dispatch._STATE, 'library', None)   # pylint: disable=protected-access
    assert kernels.backend() == 'numpy'
    with pytest.raises(RuntimeError, match='run in numpy'):
        kernels.require_compiled()
    fallback = outputs()
    assert len(compiled) == len(fallback) == 13
    for new, old in zip(compiled, fallback):
        assert_same(new, old, nan_bits=False)


def test_the_switch_demands_the_compiled_kernels(monkeypatch, tmp_path, caplog):
    monkeypatch.delitem(_dispatch._STATE, 'library')   # pylint: disable=protected-access
    monkeypatch.setenv('HOME', str(tmp_path))
    monkeypatch.setenv('PATH', str(tmp_path))          # no compiler
    monkeypatch.setenv('MXDELAY_CODEC_KERNELS', 'compiled')
    with pytest.raises(_library.KernelBuildError, match='no C compiler found.*gcc'):
        kernels.backend()
    monkeypatch.setenv('MXDELAY_CODEC_KERNELS', 'auto')
    assert kernels.backend() == 'numpy'
    assert 'codec kernels unavailable' in caplog.text
    monkeypatch.delitem(_dispatch._STATE, 'library')   # pylint: disable=protected-access
    monkeypatch.setenv('MXDELAY_CODEC_KERNELS', 'fast')
    with pytest.raises(ValueError, match="MXDELAY_CODEC_KERNELS='fast' is not one of auto, compiled, numpy"):
        kernels.backend()


def test_bad_arguments_are_refused():
    p = np.zeros(10, dtype=F32)
    with pytest.raises(ValueError, match='h=3 .* use 127'):
        kernels.encode(p, 3, 256)
    with pytest.raises(ValueError, match='block=0 must be an integer in 1..1048576'):
        kernels.encode(p, 1, 0)
    with pytest.raises(ValueError, match='threads=0 must be an integer >= 1'):
        kernels.encode(p, 1, 4, threads=0)
    with pytest.raises(ValueError, match='residual must be a writeable contiguous float32'):
        kernels.encode_with_feedback(p, np.zeros(10), 1, 4)
    with pytest.raises(ValueError, match='separate arrays'):
        kernels.encode_with_feedback(p, p, 1, 4)
    with pytest.raises(ValueError, match=r'chunks=\[\(0, 4\), \(5, 10\)\] must be'):
        kernels.encode_with_feedback(p, p.copy(), 1, 4, [(0, 4), (5, 10)])
    with pytest.raises(ValueError, match='model must be a writeable contiguous float32'):
        kernels.int8_pull_broadcast(p, p[::2], 256)
    with pytest.raises(ValueError, match='a payload of 3 floats for an fp16 pull of 10 values'):
        kernels.fp16_pull_decode_add(np.zeros(3, F32), p, 10)


@pytest.mark.big
@pytest.mark.timeout(3600)
def test_float16_cast_of_every_float32():
    # All 2**32 bit patterns against numpy's cast (MXNet's bits, checked above on the edges):
    # a few minutes (-m big).
    step = 1 << 24
    low = np.arange(step, dtype=np.uint32)
    for start in range(0, 1 << 32, step):
        x = (low + np.uint32(start)).view(F32)
        assert np.array_equal(kernels.to_float16(x).view(np.uint16),
                              x.astype(np.float16).view(np.uint16)), start
