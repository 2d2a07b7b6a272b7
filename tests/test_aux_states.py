"""Aux states (BatchNorm's running mean and variance): ``sync_weights(aux_states=True)``
makes every worker's the mean over the workers (docs/design.md §2.13).

What is tested, and against what:

- the servers: an aux chunk (registered ``{'aux': True}``) gets the round's sum, whatever the
  optimizer and AMP; bad aux settings are refused; a checkpoint saved before aux chunks
  (``{}``) loads as aux; with float16 pushes an aux chunk needs no pull keys.
"""
import numpy as np
import pytest
import mxnet as mx
from mxnet import nd

from kvstore_ext import appliers, checkpoint, protocol
from kvstore_ext.appliers import CopySum
from kvstore_ext.layout import KeyLayout
from kvstore_ext.protocol import Command
from kvstore_ext.server import DelayServer

AUX = {'aux': True}


# -- the servers ------------------------------------------------------------------------------
def _server(wire=None):
    server = DelayServer.offline(rank=0, num_workers=2)
    hello = {'rank': 0, 'protocol': protocol.PROTOCOL_VERSION, 'slots': 2, 'config': {}}
    server.command(Command.HELLO, dict(hello, wire=wire) if wire else hello)
    return server


def _entry(codec=None, chunk=0, size=3):
    entry = [chunk, 0, chunk, 'bn%d_running_mean' % chunk, 1.0, 1.0, size]
    return entry if codec is None else entry + [codec]


@pytest.mark.parametrize('optimizer', [None, mx.optimizer.SGD(momentum=0.9),
                                       mx.optimizer.Adam()])
@pytest.mark.parametrize('amp', [False, True])
def test_an_aux_chunk_gets_the_sum_whatever_the_optimizer(optimizer, amp):
    updater = None if optimizer is None else mx.optimizer.get_updater(optimizer)
    assert type(appliers.choose('default', updater, AUX, amp, lambda chunk: None)) is CopySum


def test_the_server_writes_an_aux_rounds_sum_and_keeps_no_optimizer_state():
    server = _server()
    server.command(Command.OPTIMIZER, {'rank': 0, 'optimizer': protocol.encode_optimizer(
        mx.optimizer.SGD(learning_rate=0.5, momentum=0.9, wd=0.1))})
    server.command(Command.REGISTER, {'rank': 0, 'chunks': [_entry(AUX), _entry(chunk=1)]})
    total = np.array([0.25, -3.0, 7.5], np.float32)
    layout = KeyLayout(1, 2)
    for t in range(3):   # every round: the sum, unchanged by lr, momentum and wd
        stored = nd.array([9.0, 9.0, 9.0])
        server.complete_round(layout.slot_key(0, t % 2, 0), nd.array(total * (t + 1)), stored)
        np.testing.assert_array_equal(server.weight(0).asnumpy(), total * (t + 1))
    assert server.applied_rounds(0) == 3
    assert 0 not in server.updater.states
    # The other chunk is trained (and the whole-tensor check sees it alone).
    server.complete_round(layout.slot_key(1, 0, 0), nd.array(total), nd.ones(3))
    assert 1 in server.updater.states
    assert set(server._chunks.tensors()) == {1}   # pylint: disable=protected-access


@pytest.mark.parametrize('codec, message', [
    ({'aux': False}, r'chunk 0: codec setting aux=False is not True'),
    ({'aux': 1}, r'chunk 0: codec setting aux=1 is not True'),
    ({'aux': True, 'sum_scale': 0.5}, r"chunk 0: an aux chunk takes no other codec setting, "
                                      r"got \{'aux': True, 'sum_scale': 0\.5\}"),
])
def test_register_refuses_bad_aux_settings(codec, message):
    server = _server()
    with pytest.raises(ValueError, match=message):
        server.command(Command.REGISTER, {'rank': 0, 'chunks': [_entry(codec)]})
    counter = [9, 0, protocol.FINISH_KEY, protocol.FINISH_KEY, 1.0, 1.0, 2, AUX]
    with pytest.raises(ValueError, match=r'chunk 9 is the finish counter, which takes no codec'):
        server.command(Command.REGISTER, {'rank': 0, 'chunks': [counter]})
    assert server.stats()['chunks'] == {}


def test_workers_that_register_a_chunk_aux_and_not_aux_are_refused():
    server = _server()
    server.command(Command.REGISTER, {'rank': 0, 'chunks': [_entry(AUX)]})
    with pytest.raises(ValueError, match=r"worker 1 registers chunk 0 as .*'codec': \{\}.* but "
                                         r"another worker as .*'codec': \{'aux': True\}"):
        server.command(Command.REGISTER, {'rank': 1, 'chunks': [_entry()]})


def test_an_aux_chunk_has_no_pull_keys_with_float16_pushes():
    server = _server(wire='float16')
    server.command(Command.REGISTER, {'rank': 0, 'chunks': [_entry(AUX), _entry(chunk=1)]})
    layout = KeyLayout(1, 2, pull_keys=2)
    server.complete_round(layout.slot_key(0, 0, 0), nd.array([1.0, 2.0, 3.0]), nd.zeros(3))
    assert server.weight(0).asnumpy().tolist() == [1.0, 2.0, 3.0]
    with pytest.raises(RuntimeError, match='before its pull key was set up'):
        server.complete_round(layout.slot_key(1, 0, 0), nd.ones(3), nd.zeros(3))


def _saved(path, codec):
    chunk = {'param_index': 0, 'name': 'bn0_running_mean', 'lr_mult': 1.0, 'wd_mult': 1.0,
             'size': 3, 'weight': np.arange(3, dtype=np.float32), 'next_round': 2}
    if codec is not None:
        chunk['codec'] = codec
    checkpoint.write_archive(path, checkpoint.SERVER, {
        'server': 0, 'num_workers': 2, 'updater': None, 'chunks': {0: chunk}}, save_id=None)


@pytest.mark.parametrize('codec', [None, {}, AUX])
def test_a_checkpoint_of_before_aux_chunks_loads_as_aux(tmp_path, codec):
    path = str(tmp_path / 'ckpt.server0')
    _saved(path, codec)
    server = _server()
    server.command(Command.REGISTER, {'rank': 0, 'chunks': [_entry(AUX)]})
    assert server.command(Command.LOAD, {'rank': 0, 'paths': [path]})['chunks'] == 1
    assert server.applied_rounds(0) == 2
    assert server.weight(0).asnumpy().tolist() == [0.0, 1.0, 2.0]


def test_a_checkpoint_with_other_settings_does_not_load_as_aux(tmp_path):
    path = str(tmp_path / 'ckpt.server0')
    _saved(path, {'sum_scale': 0.5})
    server = _server()
    server.command(Command.REGISTER, {'rank': 0, 'chunks': [_entry(AUX)]})
    with pytest.raises(ValueError, match=r"chunk 0 was .*'sum_scale': 0\.5.* when saved, is .*"
                                         r"'aux': True.* now"):
        server.command(Command.LOAD, {'rank': 0, 'paths': [path]})
    # And an aux checkpoint does not load into a trained chunk.
    _saved(path, AUX)
    plain = _server()
    plain.command(Command.REGISTER, {'rank': 0, 'chunks': [_entry()]})
    with pytest.raises(ValueError, match=r"when saved, is .*'codec': \{\}.* now"):
        plain.command(Command.LOAD, {'rank': 0, 'paths': [path]})
