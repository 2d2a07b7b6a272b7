"""The wired codec paths, chosen by where the gradient lies, against the numpy reference bit
for bit (docs/design.md §2.15):

- a worker's blockwise push (``PayloadTensor.encode``): the compiled kernel for a gradient in
  host memory (``mx.cpu(0)``, ``mx.cpu(1)``), MXNet's operators on the gradient's device for
  any other; over rounds (the residual carried), with and without a batch-size factor, and
  across a checkpoint's residual;
- a worker's float16 push (``Float16Tensor.encode``): the kernel's cast on the Python thread
  for a host gradient without factor, else MXNet's cast, on the gradient's device first;
- a server's pulled round (``ServerModel.broadcast``): the payload written into the model
  key's memory and ``x̂`` advanced in place, as ``PullCodec.encode`` and an addition.

There is no GPU here: ``mx.cpu(1)`` stands for one (:func:`device`, which makes
``host.readable`` refuse it, so that the kernels cannot read it either). Under
``MXDELAY_CODEC_KERNELS=numpy`` the same tests run on the kernels' numpy fallback.
"""
import mxnet as mx
import numpy as np
import pytest
from mxnet import nd

from kvstore_ext.codecs import blockwise, fp16, host, kernels, pulls, quantize
from kvstore_ext.server.pulled import ServerModel

F32 = np.float32
NAMES = {127: 'int8', 7: 'int4', 1: 'ternary'}
GPU_STAND_IN = mx.cpu(1)


@pytest.fixture(params=['cpu(0)', 'cpu(1)', 'device'])
def where(request, monkeypatch):
    """``(context of the gradient, of the send buffer, whether it is a device)``; 'device':
    ``mx.cpu(1)`` refused by ``host.readable``, as a GPU is, and the wire's pinned buffer."""
    if request.param == 'device':
        monkeypatch.setattr(host, 'readable', lambda context: context != GPU_STAND_IN)
        return GPU_STAND_IN, mx.cpu_pinned(), True
    return (mx.cpu(0) if request.param == 'cpu(0)' else mx.cpu(1)), mx.cpu(), False


def gradient(rng, n):
    """Values at many magnitudes, with exact zeros and blocks of ties."""
    g = rng.standard_normal(n).astype(F32) * F32(10.0) ** rng.integers(-6, 4, n).astype(F32)
    g[rng.random(n) < 0.05] = 0
    g[:64] = F32(0.5) * rng.integers(-3, 4, 64)
    return g


def reference_push(grad, residual, factor, h, block, ranges):
    """The numpy reference of one blockwise push: ``(payloads, c)``; `residual` updated."""
    p = (grad if factor is None else grad * F32(factor)) + residual
    sent = np.empty_like(p)
    payloads = []
    for start, stop in ranges:
        payload, sent[start:stop] = quantize.encode(p[start:stop], h, block)
        payloads.append(payload)
    residual[...] = p - sent
    return payloads, sent


def assert_bits(new, old):
    new, old = np.asarray(new), np.asarray(old)
    assert new.dtype == old.dtype and new.shape == old.shape
    assert new.tobytes() == old.tobytes()


@pytest.mark.parametrize('factor', [None, 0.75])
@pytest.mark.parametrize('h', [127, 7, 1])
def test_blockwise_pushes_are_the_reference_where_the_gradient_lies(h, factor, where):
    context, buf_context, device = where
    n, block, ranges = 5000, 64, [(0, 1234), (1234, 1235), (1235, 5000)]
    rng = np.random.default_rng(h)
    tensor = blockwise.Blockwise(NAMES[h], block).for_tensor(n)
    tensor.ranges = ranges
    buf = nd.zeros(n, ctx=buf_context)
    residual = np.zeros(n, dtype=F32)
    name = 'mxd_%s_encode' % NAMES[h]
    for rnd in range(3):
        if rnd == 2:   # a checkpoint's residual, loaded before a push
            residual = gradient(rng, n) * F32(0.01)
            tensor.load_state(residual)
        grad = gradient(rng, n)
        payloads, sent = reference_push(grad, residual, factor, h, block, ranges)
        calls = kernels.compiled_calls().get(name, 0)
        tensor.encode(nd.array(grad, ctx=context), buf, factor)
        kernel_ran = kernels.compiled_calls().get(name, 0) - calls
        assert kernel_ran == (0 if device or kernels.backend() == 'numpy' else 1)
        assert len(tensor.payloads) == len(payloads)
        for new, old in zip(tensor.payloads, payloads):
            assert_bits(new, old)
        assert_bits(buf.asnumpy(), sent)
        assert_bits(tensor.state(), residual)
        # What the local rule reads: c divided by the factor, on the gradient's context.
        grad_nd = nd.zeros(n, ctx=context)
        expected = sent if factor is None else sent / F32(factor)
        assert_bits(tensor.sent(buf, grad_nd).asnumpy(), expected)


@pytest.mark.parametrize('factor', [None, 0.75])
def test_float16_pushes_are_numpy_casts_where_the_gradient_lies(factor, where):
    context, buf_context, _ = where
    rng = np.random.default_rng(3)
    halves = np.arange(0x7c00, dtype=np.uint16).view(np.float16).astype(np.float64)
    grad = np.concatenate([(halves[:-1] + halves[1:]) / 2, gradient(rng, 20000) * 100]).astype(F32)
    grad = np.concatenate([grad, -grad, [np.inf, -np.inf, 70000.0, 1e-9]]).astype(F32)
    tensor = fp16.Float16().for_tensor(grad.size)
    buf = nd.zeros(grad.size, ctx=buf_context, dtype=np.float16)
    calls = kernels.compiled_calls().get('mxd_f16_encode', 0)
    tensor.encode(nd.array(grad, ctx=context), buf, factor)
    expected = (grad if factor is None else grad * F32(factor)).astype(np.float16)
    assert_bits(buf.asnumpy(), expected)
    kernel = (factor is None and host.readable(context) and kernels.backend() == 'compiled')
    assert kernels.compiled_calls().get('mxd_f16_encode', 0) - calls == int(kernel)
    sent = tensor.sent(buf, nd.array(grad, ctx=context))
    assert sent.context == context
    assert_bits(sent.asnumpy(), (expected if factor is None
                                 else grad.astype(np.float16)).astype(F32))


@pytest.mark.parametrize('codec', [pulls.Int8Pull(64), pulls.Float16Pull()],
                         ids=lambda codec: type(codec).__name__)
def test_a_servers_pulled_round_is_encode_and_an_addition(codec):
    n = 3001
    rng = np.random.default_rng(7)
    initial = gradient(rng, n)
    model = ServerModel(codec, initial)
    model.store = nd.full(codec.payload_size(n), np.nan)   # the model key's stored value
    expected = initial.copy()
    for _ in range(3):
        weight = gradient(rng, n)
        payload, dec = codec.encode(weight - expected)   # the numpy reference
        expected = expected + dec
        model.broadcast(nd.array(weight))
        assert_bits(model.store.asnumpy(), payload)
        assert_bits(model.model, expected)
