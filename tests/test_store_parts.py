"""The store's parts in one process: its face, unknown keys, and error feedback around a
quantizer.

- ``DistDelay``'s public members are MXNet's KVStore API (what Gluon, Module and a user call)
  plus ``set_learning_rate``, ``close`` and ``delayed``; the delayed update's own calls are
  on the parts of ``delayed``, which cannot be replaced.
- A key that was never initialised raises what MXNet raises (``mx.base.MXNetError``), which
  is also the ``KeyError`` it always was, with the same message (issue 22).
- :class:`kvstore_ext.codecs.feedback.ErrorFeedback` gives a quantizer its residual: a push with a
  batch-size factor (copied, scaled, then quantized in the buffer) sends what the fused path
  sends for the scaled gradient, and ``sent`` undoes the factor; the residual is saved and
  loaded by the tensor's codec.
"""
import functools

import numpy as np
import pytest
import mxnet as mx
from mxnet import nd

from support.stores import offline_store
from kvstore_ext import codecs
from kvstore_ext.worker.dist_delay import DistDelay, UnknownKeyError

#: MXNet's KVStore API that DistDelay implements (mxnet.kvstore.KVStore's public members,
#: less the ones only a native store has, _barrier and the like being private).
KVSTORE_API = {'type', 'rank', 'num_workers', 'is_capable', 'init', 'broadcast', 'push', 'pull',
               'pushpull', 'row_sparse_pull', 'set_optimizer', 'set_gradient_compression',
               'save_optimizer_states', 'load_optimizer_states',
               'register', 'OPTIMIZER', 'kv_registry'}   # KVStoreBase's class members


def test_the_face_is_mxnets_kvstore_and_the_delayed_protocol_is_in_parts():
    face = {name for name in dir(DistDelay) if not name.startswith('_')}
    assert KVSTORE_API <= set(dir(mx.kvstore.KVStore))
    assert face == KVSTORE_API | {'set_learning_rate', 'close', 'delayed'}
    parts = offline_store().delayed
    assert parts._fields == ('settings', 'rounds', 'uneven', 'state_fetch', 'checkpoint', 'job',
                             'traffic', 'aux')
    with pytest.raises(AttributeError):
        parts.rounds = None


@pytest.mark.parametrize('call', ['push', 'pull', 'row_sparse_pull', 'delayed.traffic.num_chunks',
                                  'delayed.rounds.rounds'])
def test_an_unknown_key_is_an_mxnet_error_and_a_key_error(call):
    store = offline_store()
    args = {'push': (7, nd.zeros(6)), 'pull': (7,), 'row_sparse_pull': (7,),
            'delayed.traffic.num_chunks': (7,), 'delayed.rounds.rounds': (7,)}[call]
    kwargs = {'pull': {'out': nd.zeros(6)},
              'row_sparse_pull': {'out': nd.zeros(6).tostype('row_sparse'),
                                  'row_ids': nd.array([0])}}.get(call, {})
    method = functools.reduce(getattr, call.split('.'), store)
    with pytest.raises(mx.base.MXNetError, match=r"key 7 was not initialised on the dist_delay "
                                                 r"kvstore; call init or broadcast first"):
        method(*args, **kwargs)
    with pytest.raises(KeyError) as info:
        method(*args, **kwargs)
    assert type(info.value) is UnknownKeyError


def test_error_feedback_with_a_factor_quantizes_the_scaled_gradient():
    codec = codecs.parse({'type': '2bit', 'threshold': 0.25})
    rs = np.random.RandomState(5)
    fused, copied = codec.for_tensor(40), codec.for_tensor(40)
    for _ in range(5):
        grad = nd.array((rs.randn(40) * 0.3).astype(np.float32))
        a, b = nd.zeros(40), nd.zeros(40)
        fused.encode(grad * 2.0, a, None)
        copied.encode(grad, b, 2.0)
        np.testing.assert_array_equal(a.asnumpy(), b.asnumpy())
        np.testing.assert_array_equal(copied.sent(b, grad).asnumpy(), b.asnumpy() / 2)
    np.testing.assert_array_equal(fused.state(), copied.state())
    restored = codec.for_tensor(40)
    restored.load_state(copied.state())
    np.testing.assert_array_equal(restored.state(), copied.state())
