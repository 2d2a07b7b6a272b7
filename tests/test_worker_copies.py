"""What a worker holds in the delayed phase (issue 37 item 4, docs/design.md §2.3).

In one process through the real store and servers (support/native.py, one worker), SGD with
momentum, k = 2 after a warm-up of 2, 9 steps (every slot used), for plain pushes, float16
pushes, int8 pulls (with float32 and float16 pushes) and ternary pushes with int8 pulls:

- the period's pull is applied from memory the store keeps anyway (no pull buffer): x̂ with
  compressed pulls, else the slot's send buffer (plain) or the receive buffer (float16 and
  ternary pushes, which read float32 pull keys);
- pull keys: one receive buffer per tensor for every slot, and a mark per slot;
- ternary pushes: one send buffer for every slot; float32 and float16 pushes: R;
- the mirror keeps no ``pre_weight`` (it does not read ``grad_sync``), the rule ``'dc'`` does;
- the weights after every step are the numpy reference's, bit for bit (where the reference
  has the configuration), and x̂ the servers'.
"""
import numpy as np
import pytest

import mxdelay
import mxnet as mx

from kvstore_ext.codecs import host
from support.model import BATCH, backward_at, mlp_params
from support.native import delay_store
from support.reference_jobs import assert_equal_to_reference
from test_pull_compression import INT8, OPT, PUSH_FP16, models_of, simulate

TERNARY = {'type': 'ternary', 'block_size': 32}
DELAY, WARMUP, STEPS = 2, 2, 9
CASES = {   # name: (pull_compression, compression_params)
    'plain': (None, None),
    'fp16': (None, PUSH_FP16),
    'int8-pulls': (INT8, None),
    'int8-pulls-fp16': (INT8, PUSH_FP16),
    'ternary-int8': (INT8, TERNARY),
}


def shares(a, b):
    """Whether NDArrays `a` and `b` (on the CPU) hold the same memory."""
    return np.shares_memory(host.view(a), host.view(b))


def train(case, rule='mirror'):
    pull_compression, compression = CASES[case]
    store = delay_store()
    params = mlp_params([mx.cpu()])
    trainer = mxdelay.DelayedTrainer(params, 'sgd', dict(OPT), kvstore=store, delay=DELAY,
                                     warmup_steps=WARMUP, local_rule=rule,
                                     pull_compression=pull_compression,
                                     compression_params=compression)
    history = []
    for t in range(STEPS):
        backward_at(params, [mx.cpu()], t)
        trainer.step(BATCH)
        history.append({p.name: p.data().asnumpy() for p in params})
    return store, trainer, history


@pytest.mark.parametrize('case', sorted(CASES))
def test_the_pull_is_applied_from_the_stores_memory(case):
    store, trainer, history = train(case)
    pull_compression, compression = CASES[case]
    states = [s for s in trainer._delayed.states if s.trained]   # pylint: disable=protected-access
    for s in states:
        tensor = store._session.tensors[s.index]   # pylint: disable=protected-access
        assert s.started and s.pre_weight is None
        if pull_compression is not None:
            held = tensor.pull_state.model
        elif compression is None:
            # the send buffer of round 8, whose pull the last step issued
            held = tensor.buffers[8 % (DELAY + 1)]
        else:
            held = tensor.wire_state.buffer
        assert shares(s.pulled, held), (case, s.param.name)
        distinct = {id(b) for b in tensor.buffers}
        assert len(distinct) == (1 if compression is TERNARY else DELAY + 1)
        if compression is not None:   # float32 pull keys: one receive buffer, a mark per key
            assert len(tensor.wire_state.marks) == len(tensor.chunks[0].pull_keys)
            assert not any(shares(tensor.wire_state.buffer, b) for b in tensor.buffers)
    if pull_compression is not None:
        assert all(np.array_equal(mine, theirs) for mine, theirs in models_of(store).values())
    if compression is not TERNARY:
        assert_equal_to_reference([history], simulate(1, STEPS, DELAY, WARMUP, pull_compression,
                                                      compression))


def test_a_rule_that_reads_grad_sync_keeps_pre_weight():
    _, trainer, _ = train('plain', rule='dc')
    for s in trainer._delayed.states:   # pylint: disable=protected-access
        if s.trained:
            assert s.pre_weight is not None and s.pre_weight.shape == s.param.shape
