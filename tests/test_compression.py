"""Gradient compression ('2bit') in one process: the parser, the quantizer, the errors.

The quantizer is pinned to MXNet 1.9.1's own kernel, bit for bit: a local ``'device'``
kvstore with the same setting quantizes each push with a residual of its key and
dequantizes it (``CommDevice::ReduceCompressed``), so a pull returns exactly what MXNet's
worker would send. Every error is compared with MXNet's for the same input (its message is
part of ours, and ours is an ``MXNetError`` too).
"""
import re

import numpy as np
import pytest
import mxnet as mx
from mxnet import nd
from mxnet.base import MXNetError

import mxdelay
from support.model import small_params
from support.stores import offline_store
from kvstore_ext import codecs
from kvstore_ext.codecs import CompressionError, CompressionTypeError
from kvstore_ext.codecs.feedback import ErrorFeedback
from kvstore_ext.codecs.twobit import TwoBitQuantizer

F32 = np.float32


def quantize_all(threshold, grads):
    """Our quantizer over a sequence of gradients; returns (sent values, final residual)."""
    codec = codecs.parse({'type': '2bit', 'threshold': threshold}).for_tensor(grads[0].size)
    sent = []
    for g in grads:
        buf = nd.zeros(g.size)
        codec.encode(nd.array(g), buf, None)
        sent.append(buf.asnumpy())
    return sent, codec.state()


def mxnet_quantize_all(threshold, grads):
    """MXNet's worker-side quantization of the same sequence (one key, one residual)."""
    kv = mx.kv.create('device')
    kv.set_gradient_compression({'type': '2bit', 'threshold': threshold})
    kv.init(0, nd.zeros(grads[0].size))
    sent = []
    for g in grads:
        kv.push(0, nd.array(g))
        out = nd.zeros(g.size)
        kv.pull(0, out=out)
        sent.append(out.asnumpy())
    return sent


def test_closed_form_thresholds_and_residual_carry_over():
    t = 0.5
    g1 = np.array([0.6, -0.6, 0.4, -0.4, 0.5, -0.5, 0.0, 1.7], dtype=F32)
    sent, residual = quantize_all(t, [g1])
    np.testing.assert_array_equal(sent[0], [t, -t, 0, 0, t, -t, 0, t])
    half = F32(0.5)
    np.testing.assert_array_equal(residual, [F32(0.6) - half, F32(-0.6) + half, F32(0.4),
                                             F32(-0.4), 0, 0, 0, F32(1.7) - half])
    # The residual carries: 0.4 + 0.2 reaches t; 1.2 (1.7 - 0.5) still exceeds t alone.
    g2 = np.array([0, 0, 0.2, -0.2, 0, 0, 0, 0], dtype=F32)
    sent, residual = quantize_all(t, [g1, g2])
    np.testing.assert_array_equal(sent[1], [0, 0, t, -t, 0, 0, 0, t])
    assert residual[7] == F32(F32(1.7) - F32(0.5)) - F32(0.5)


@pytest.mark.parametrize('threshold', [0.5, 0.1, 0.01, 2, '0.25'])
def test_quantizer_is_mxnet_kernel_bit_for_bit(threshold):
    rs = np.random.RandomState(3)
    grads = [(rs.randn(37) * 0.7).astype(F32) for _ in range(12)]   # 37: a partial 16-block
    ours, _ = quantize_all(threshold, grads)
    theirs = mxnet_quantize_all(threshold, grads)
    nonzero = 0
    for t, (a, b) in enumerate(zip(ours, theirs)):
        np.testing.assert_array_equal(a, b, err_msg='push %d' % t)
        nonzero += np.count_nonzero(a)
    assert 0 < nonzero < 12 * 37   # it quantizes: some values sent, some kept back


def test_requantizing_a_quantized_value_is_lossless():
    # What the native store does with our buffer: its own residual (zero) stays zero.
    rs = np.random.RandomState(4)
    sent, _ = quantize_all(0.1, [(rs.randn(50) * 0.3).astype(F32) for _ in range(4)])
    again = mxnet_quantize_all(0.1, sent)
    for a, b in zip(sent, again):
        np.testing.assert_array_equal(a, b)
    codec = codecs.parse({'type': '2bit', 'threshold': 0.1}).for_tensor(50)
    for s in sent:
        buf = nd.zeros(50)
        codec.encode(nd.array(s), buf, None)
        np.testing.assert_array_equal(buf.asnumpy(), s)
    assert not codec.state().any()


def test_flag_unit_survives_the_wire():
    comp = codecs.parse({'type': '2bit', 'threshold': 0.1})
    flags = [np.array([comp.flag_unit, 0], dtype=F32), np.array([comp.flag_unit] * 2, dtype=F32)]
    for a, b in zip(flags, mxnet_quantize_all(0.1, flags)):
        np.testing.assert_array_equal(a, b)


def test_parse_defaults_and_description():
    comp = codecs.parse({'type': '2bit'})
    assert isinstance(comp, ErrorFeedback) and isinstance(comp.quantizer, TwoBitQuantizer)
    assert comp.quantizer.threshold == F32(0.5)   # MXNet's default
    assert comp.describe() == {'type': '2bit', 'threshold': 0.5}
    assert codecs.parse(None) is None
    assert codecs.parse({'type': '2bit', 'threshold': np.float32(0.25)}) \
        .quantizer.threshold == 0.25
    assert 'fp16' in codecs.known_types() and '2bit' in codecs.known_types()


def stock_error(params):
    """MXNet 1.9.1's message for `params` (a local 'device' store: the same parser)."""
    with pytest.raises(MXNetError) as info:
        mx.kv.create('device').set_gradient_compression(params)
    return str(info.value).strip().splitlines()[-1].replace('MXNetError: ', '')


@pytest.mark.parametrize('params,kind', [
    ({'type': '1bit'}, CompressionError),
    ({'type': '2BIT'}, CompressionError),
    ({'type': 2}, CompressionError),
    ({'threshold': 0.5}, CompressionError),
    ({}, CompressionError),
    ({'type': '2bit', 'threshold': 0}, CompressionError),
    ({'type': '2bit', 'threshold': -1}, CompressionError),
    ({'type': '2bit', 'threshold': -0.25}, CompressionError),
    ({'type': '2bit', 'threshold': float('nan')}, CompressionError),
    ({'type': '2bit', 'threshold': 'abc'}, CompressionTypeError),
    ({'type': '2bit', 'threshold': None}, CompressionTypeError),
    ({'type': '2bit', 'threshold': True}, CompressionTypeError),
], ids=repr)
def test_errors_carry_mxnets_message(params, kind):
    expected = stock_error(params)
    with pytest.raises(kind) as info:
        codecs.parse(params)
    assert isinstance(info.value, (MXNetError, ValueError))
    assert isinstance(info.value, MXNetError) and isinstance(info.value, ValueError)
    assert expected in str(info.value), (expected, str(info.value))
    assert 'compression_params' in str(info.value)          # names the argument
    if kind is CompressionTypeError:
        assert isinstance(info.value, TypeError)


@pytest.mark.parametrize('params,message', [
    ('2bit', r"compression_params must be a dict or None, got '2bit' \(str\)"),
    ({'type': '2bit', 'treshold': 0.1}, r"unknown keys \['treshold'\].*only 'threshold'"),
    ({'type': '2bit', 'threshold': float('inf')}, r"must be finite, got inf"),
    ({'type': '2bit', 'threshold': 1e-7}, r"threshold'\]=1e-07 cannot be sent exactly.*"
                                          r"'0\.000000'"),
    ({'type': '2bit', 'threshold': 1.481409}, r"parses it as 1\.4814091"),
    ({'type': 'fp16', 'scale': 2}, r"fp16 compression takes no other setting, got \['scale'\]"),
], ids=repr)
def test_errors_stricter_than_mxnet(params, message):
    # MXNet accepts these (or raises an AssertionError for a str): unknown keys are ignored,
    # inf sends nothing, and a threshold that the servers receive rounded trains silently
    # differently. Refused with the argument, the value and the fix.
    with pytest.raises(ValueError, match=message):
        codecs.parse(params)


def test_set_after_init_is_refused():
    # Stock MXNet accepts it (kvstore_dist.h: later pushes are compressed, the residual
    # starts then; a key split over servers would mismatch): refused, naming the fix.
    store = offline_store(placed=True)
    with pytest.raises(ValueError, match=r'set_gradient_compression.*before the first init'):
        store.set_gradient_compression({'type': '2bit', 'threshold': 0.5})


def test_store_refuses_non_float32_keys():
    store = offline_store(placed=False)
    store.set_gradient_compression({'type': '2bit', 'threshold': 0.5})
    with pytest.raises(ValueError, match=r'only supported for float32.*key 3 is float16'):
        store.init(3, nd.zeros(2, dtype='float16'))   # refused before any network use


def test_delayed_trainer_validates_compression_at_construction():
    with pytest.raises(CompressionError, match=re.escape('Unknown type for gradient '
                                                         'compression 1bit')):
        mxdelay.DelayedTrainer(small_params(), 'sgd', {'learning_rate': 0.1},
                               kvstore='dist_delay', compression_params={'type': '1bit'})
    with pytest.raises(ValueError, match='threshold must be greater than 0'):
        mxdelay.DelayedTrainer(small_params(), 'sgd', {'learning_rate': 0.1},
                               kvstore='dist_delay',
                               compression_params={'type': '2bit', 'threshold': 0})
