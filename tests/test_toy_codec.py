"""A codec that no library file knows: float16 pushes with a per-tensor scale (issue 19).

``tests/scripts/toy_codec.py`` defines it and registers it (``'toy_scaled_fp16'``: send
``float16(s * g)``, the servers multiply the round's float32 sum by ``1/s``, told so by the
REGISTER command). A real 2-worker job of ``DelayedTrainer`` (warm-up, then k = 2) trains
with it; its workers import the codec (``codec_modules``), its servers run no codec code.
The job is compared **bit for bit** with the numpy reference (tests/reference.py) replaying
the job's recorded gradients as the codec sends them, ``float16(s * g) / s`` (exact: s is a
power of 2), as tests/test_fp16.py does for ``'fp16'``; and it differs from the float32
reference, so the test sees the codec's rounding.
"""
import numpy as np
import pytest
from mxnet import nd

import reference
from support.reference_jobs import (MLP_BASE as BASE, assert_rounds_equal_reference,
                                    rounds_differ_from_reference, run_mlp_job)
from support.stores import offline_store
from kvstore_ext import codecs
from mxdelay import traffic
from scripts import mlp_model, toy_codec

NAMES = ('w1', 'b1', 'w2', 'b2')
SCALE = 1024.0
TOY = {'type': toy_codec.TYPE, 'scale': SCALE}


def toy_round_trip(grad):
    """What the toy codec delivers of `grad`: float32(float16(s * g)) / s."""
    return (np.float32(SCALE) * grad).astype(np.float16).astype(np.float32) / np.float32(SCALE)


def replay(histories, config, send):
    """The reference on the job's recorded gradients, each as `send` delivers it."""
    def grad_fn(weights, rank, t):
        rounds = list(histories[rank]['rounds'])
        return {name: send(histories[rank]['grad_' + name][rounds.index(t)]) for name in NAMES}
    steps = max(int(h['rounds'][-1]) for h in histories.values()) + 1
    return reference.simulate(
        mlp_model.init_params(), grad_fn, len(histories), steps, config['delay'],
        config['warmup_steps'], config['lr'], momentum=config['momentum'], wd=config['wd'],
        rescale_grad=1.0 / config['batch'], rule=config.get('local_rule', 'mirror'))


def test_the_codec_is_registered_and_says_what_the_servers_do():
    codec = codecs.parse(dict(TOY))
    assert toy_codec.TYPE in codecs.known_types()
    assert codec.describe() == TOY and codec.server_settings() == {'sum_scale': 1.0 / SCALE}
    with pytest.raises(ValueError, match="takes one setting, a 'scale' > 0"):
        codecs.parse({'type': toy_codec.TYPE, 'scale': -1})
    tensor = codec.for_tensor(3)
    grad = nd.array([1e-6, 0.3, -2.5])
    buf = nd.zeros(3, dtype='float16')
    tensor.encode(grad, buf, None)
    np.testing.assert_array_equal(buf.asnumpy(), (SCALE * grad.asnumpy()).astype(np.float16))
    np.testing.assert_array_equal(tensor.sent(buf, grad).asnumpy(),
                                  toy_round_trip(grad.asnumpy()))
    store = offline_store(placed=False)
    store.set_gradient_compression(dict(TOY))
    settings = store.delayed.settings
    assert settings.compression.describe() == TOY and settings.wire_dtype == 'float16'


def test_the_byte_estimate_compares_the_registered_codecs_that_have_defaults():
    # mxdelay.traffic takes its settings from the registries: every built-in codec at its
    # defaults; the toy codec, registered here, has none (it needs a scale) and is left out.
    assert toy_codec.TYPE in codecs.known_types() and toy_codec.TYPE not in codecs.defaults()
    assert [name for name, _, _ in traffic.settings()] == [
        'no compression', '2bit pushes', 'fp16 pushes', 'int4 pushes', 'int8 pushes',
        'ternary pushes', 'fp16 pulls', 'int8 pulls']


@pytest.mark.jobs
def test_a_two_worker_job_with_the_toy_codec_matches_the_reference_bit_for_bit(tmp_path):
    config = dict(BASE, compression=dict(TOY), codec_modules=['toy_codec'], record_grads=True,
                  delay=2, warmup_steps=3)
    histories = run_mlp_job(tmp_path, 2, config, num_servers=2,
                            env={'MXDELAY_CHUNK_SIZE': 50})
    trajectory = replay(histories, config, toy_round_trip)
    assert_rounds_equal_reference(histories, trajectory)
    assert rounds_differ_from_reference(histories, replay(histories, config, lambda grad: grad))
