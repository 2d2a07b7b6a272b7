"""Checkpoint parts written in the background (kvstore_ext/checkpoint/background.py, the
server's ``SAVE`` with ``background``, ``StoreCheckpoint.save_in_background``; docs/design.md
§6.4), on an offline server (no network).

- A server answers a ``SAVE`` in the background before its file exists; the file it writes
  holds the state of that command, not of a round applied while the thread writes, and its
  sha256 is left beside it with the save's id. It loads (``LOAD`` with that sha256).
- A write that fails leaves its failure beside the part: the waiting worker raises at once,
  naming it, instead of waiting out its timeout; nothing was written.
- A sha256 file of another save (an earlier run's) is waited past; a missing one times out.
- Worker 0's kvstore index of such a save is written only once the servers' files are,
  with their sha256; the servers' sha256 files then go.
"""
import threading
import types

import numpy as np
import pytest

import mxdelay  # noqa: F401
import mxnet as mx

from kvstore_ext.checkpoint import background, files
from kvstore_ext.protocol import commands
from kvstore_ext.protocol.commands import Command
from kvstore_ext.protocol.keys import KeyLayout
from kvstore_ext.server.controller import DelayServer
from kvstore_ext.worker.store_checkpoint import StoreCheckpoint

pytestmark = pytest.mark.timeout(60)


def sgd_server():
    """A server of one worker holding chunk 0 (3 floats) with SGD-momentum, after one round."""
    server = DelayServer.offline(rank=0, num_workers=1)
    server.command(Command.HELLO, {'rank': 0, 'protocol': commands.PROTOCOL_VERSION,
                                   'slots': 2, 'config': {}})
    server.command(Command.REGISTER, {'chunks': [[0, 0, 0, 'w', 1.0, 1.0, 3]]})
    server.command(Command.OPTIMIZER, {'rank': 0, 'optimizer': commands.encode_optimizer(
        mx.optimizer.create('sgd', learning_rate=0.1, momentum=0.9))})
    one_round(server, 0)
    return server


def one_round(server, slot):
    server.complete_round(KeyLayout(1, 2).slot_key(0, slot, 0), mx.nd.array([0.5, 0.5, 0.5]),
                          mx.nd.array([1.0, 2.0, 3.0]))


@pytest.fixture
def release(monkeypatch):
    """Every write_encoded waits until this event is set (at the latest when the test ends)."""
    event, real = threading.Event(), files.write_encoded

    def write_encoded(*args):
        assert event.wait(30)
        return real(*args)
    monkeypatch.setattr(files, 'write_encoded', write_encoded)
    yield event
    event.set()


def test_a_server_answers_first_and_writes_the_state_of_the_command(tmp_path, release):
    server = sgd_server()
    weight = server.weight(0).asnumpy()
    momentum = server.updater.states[0].asnumpy()
    path = str(tmp_path / 'ckpt.kvstore.server0')
    reply = server.command(Command.SAVE, {'rank': 0, 'paths': [path], 'save_id': 's1',
                                          'background': True})
    assert reply == {'path': path, 'chunks': 1}   # no sha256: the file is not written yet
    one_round(server, 1)                          # training goes on meanwhile
    assert server.applied_rounds(0) == 2 and np.any(server.weight(0).asnumpy() != weight)
    assert not (tmp_path / 'ckpt.kvstore.server0').exists()
    release.set()
    digest = background.wait(path, 's1', 30)
    assert digest == files.file_sha256(path)
    assert open(background.digest_file(path)).read() == 's1\n' + digest
    saved = files.read_archive(path, files.SERVER, 's1', digest)
    np.testing.assert_array_equal(saved['chunks'][0]['weight'], weight)
    np.testing.assert_array_equal(saved['updater']['states'][0].asnumpy(), momentum)
    assert saved['chunks'][0]['next_round'] == 1
    # The next command that touches the file waits for the thread; the file loads.
    assert server.command(Command.LOAD, {
        'rank': 0, 'paths': [path], 'save_id': 's1', 'sha256': [digest], 'rounds': {'0': 1},
        'finish_rounds': 0, 'check_only': True}) == {'path': path, 'valid': True}


def test_a_save_in_the_background_needs_a_save_id(tmp_path):
    with pytest.raises(ValueError, match=r'a save in the background needs a save_id'):
        sgd_server().command(Command.SAVE, {'rank': 0, 'paths': [str(tmp_path / 'k.server0')],
                                            'background': True})


def test_a_failed_write_is_left_for_the_waiting_worker(tmp_path, monkeypatch, caplog):
    def write_encoded(*args):
        raise OSError(28, 'No space left on device')
    monkeypatch.setattr(files, 'write_encoded', write_encoded)
    path = str(tmp_path / 'ckpt.kvstore.server0')
    sgd_server().command(Command.SAVE, {'rank': 0, 'paths': [path], 'save_id': 's1',
                                        'background': True})
    with pytest.raises(ValueError, match=r'ckpt.kvstore.server0 could not be written: '
                                         r'OSError: \[Errno 28\] No space left on device'):
        background.wait(path, 's1', 30)   # at once, not after 30 s
    assert not (tmp_path / 'ckpt.kvstore.server0').exists()
    assert 'server 0: %s could not be written' % path in caplog.text


def test_a_sha256_of_another_save_is_waited_past(tmp_path):
    part = str(tmp_path / 'ckpt.worker1')
    background.leave(part, 'earlier', lambda: 'a' * 64)
    with pytest.raises(TimeoutError, match=r'ckpt.worker1.sha256 of save now did not appear '
                                           r'within 0.1 s: its writer stopped'):
        background.wait(part, 'now', 0.1)
    timer = threading.Timer(0.2, background.leave, (part, 'now', lambda: 'b' * 64))
    timer.start()
    assert background.wait(part, 'now', 30) == 'b' * 64
    timer.join()


def fake_session(server):
    """What StoreCheckpoint reads of a worker's session: one key at round 1, no optimizer,
    and commands run on `server`."""
    return types.SimpleNamespace(
        rank=0, optimizer=None, num_servers=1, job_rescale_grad=1.0, finish=None,
        settings=types.SimpleNamespace(slack=2, chunk_size=1000),
        tensors={0: types.SimpleNamespace(next_round=1)},
        command=lambda command, body: [server.command(command, dict(body, rank=0))])


def test_the_kvstore_index_waits_for_the_servers_files(tmp_path, release):
    server = sgd_server()
    index = str(tmp_path / 'ckpt.kvstore')
    write_index = StoreCheckpoint(fake_session(server), None).save_in_background(index, 's1')
    with pytest.raises(TimeoutError):
        write_index(0.1)
    assert not (tmp_path / 'ckpt.kvstore').exists()
    release.set()
    digest = write_index(30)
    state = files.read_json(index, files.KVSTORE_INDEX, digest)
    path = files.server_files(index, 1)[0]
    assert state['save_id'] == 's1' and state['rounds'] == {'0': 1}
    assert state['servers_sha256'] == [files.file_sha256(path)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ['ckpt.kvstore',
                                                          'ckpt.kvstore.server0']
