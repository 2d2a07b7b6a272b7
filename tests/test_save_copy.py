"""A save in the background copies each chunk at the save's round (kvstore_ext/server/save_copy.py,
docs/design.md §6.4), on an offline server (no network).

Worker 0 sends ``SAVE`` with the index's rounds without waiting for its pushes, so a chunk
may be a round short when it arrives. The reference is the synchronous save of a server that
applied exactly the rounds before the save on every chunk: the background save's file must
be that file's state bit for bit (weights, rounds, optimizer state and update counts, and
with compressed pulls the servers' x̂), although one chunk reaches the save's round only
after the reply, and the other applies a round past it before then. The copy happens when
the round is applied, not later; a round already past the save's is refused, and so are a
save and a load while a copy waits.
"""
import numpy as np
import pytest

import mxdelay  # noqa: F401
import mxnet as mx

from kvstore_ext.checkpoint import background, files
from kvstore_ext.codecs import pulls
from kvstore_ext.optim.optimizers import optimizer_record
from kvstore_ext.protocol import commands
from kvstore_ext.protocol.commands import Command
from kvstore_ext.protocol.keys import KeyLayout
from kvstore_ext.server.controller import DelayServer

pytestmark = pytest.mark.timeout(60)

SIZES = (3, 2)          # chunk 0 (key 0) and chunk 1 (key 1)
SAVED_ROUND = 2         # the save holds both chunks after rounds 0 and 1
PULLS = {'type': 'fp16'}


class Job(object):
    """One offline server with chunks 0 and 1 and `optimizer`, the native server's stored
    arrays per slot, and (`pull_compression`) the model keys of compressed pulls pulled at
    every round."""

    def __init__(self, optimizer, pull_compression=None):
        self.server = server = DelayServer.offline(rank=0, num_workers=1)
        model_keys = 1 if pull_compression else 0
        self.layout = KeyLayout(1, 2, model_keys=model_keys)
        config = {} if not pull_compression else {'pull_compression': pull_compression,
                                                  'delay': 1, 'warmup_steps': 0}
        server.command(Command.HELLO, {'rank': 0, 'protocol': commands.PROTOCOL_VERSION,
                                       'slots': 2, 'model_keys': model_keys, 'config': config})
        assert server.handshake_reply()[0]
        server.command(Command.REGISTER, {'chunks': [[0, 0, 0, 'w', 1.0, 1.0, SIZES[0]],
                                                     [1, 0, 1, 'b', 1.0, 1.0, SIZES[1]]]})
        server.command(Command.OPTIMIZER, {'rank': 0,
                                           'optimizer': commands.encode_optimizer(optimizer)})
        self.stored = {}
        for chunk, size in enumerate(SIZES):
            initial = np.linspace(-1.0, 1.0, size, dtype=np.float32) + chunk
            for slot in range(2):
                self.stored[(chunk, slot)] = mx.nd.array(initial)
            if pull_compression:
                length = pulls.parse(pull_compression).payload_size(size)
                server.complete_round(self.layout.model_key(chunk, 0), mx.nd.zeros(length),
                                      mx.nd.zeros(length))

    def round(self, chunk, rnd):
        """Chunk `chunk`'s round `rnd`, with a gradient of its own."""
        grad = np.cos(np.arange(SIZES[chunk], dtype=np.float32) * (rnd + 1) + chunk)
        self.server.complete_round(self.layout.slot_key(chunk, rnd % 2, 0), mx.nd.array(grad),
                                   self.stored[(chunk, rnd % 2)])
        assert self.server.applied_rounds(chunk) == rnd + 1

    def save(self, path, **body):
        return self.server.command(Command.SAVE, dict(body, rank=0, paths=[path]))


def read(path, digest=None):
    state = files.read_archive(path, files.SERVER, None, digest)
    updater = state['updater']
    return state['chunks'], updater['states'], optimizer_record(updater['optimizer'])


def background_save(path):
    return {'save_id': 's1', 'background': True,
            'rounds': {'0': SAVED_ROUND, '1': SAVED_ROUND}, 'finish_rounds': 0}


@pytest.mark.parametrize('optimizer,pull_compression', [
    (lambda: mx.optimizer.Adam(learning_rate=0.1, wd=0.01), None),
    (lambda: mx.optimizer.SGD(learning_rate=0.1, momentum=0.9), PULLS),
])
def test_each_chunk_is_copied_when_it_reaches_the_saves_round(tmp_path, optimizer,
                                                               pull_compression):
    # The reference: every chunk after rounds 0 and 1, saved by a save that waits.
    reference = Job(optimizer(), pull_compression)
    for rnd in range(SAVED_ROUND):
        for chunk in range(2):
            reference.round(chunk, rnd)
    expected = str(tmp_path / 'reference.server0')
    reference.save(expected, save_id='s0')
    expected_chunks, expected_states, expected_optimizer = read(expected)
    if pull_compression:
        assert all(expected_chunks[c]['model'] is not None for c in range(2))

    job = Job(optimizer(), pull_compression)
    job.round(0, 0)
    job.round(0, 1)
    job.round(1, 0)                      # chunk 1: its round 1 still to come
    path = str(tmp_path / 'ckpt.server0')
    assert job.save(path, **background_save(path)) == {'path': path, 'chunks': 2}
    job.round(0, 2)                      # worker 0's next round, past the save on chunk 0
    assert not (tmp_path / 'ckpt.server0').exists()
    assert not (tmp_path / 'ckpt.server0.sha256').exists()
    with pytest.raises(ValueError, match=r'cannot save .*still waits for rounds before it '
                                         r'copies chunks \[1\]'):
        job.save(str(tmp_path / 'next.server0'), save_id='s2')
    with pytest.raises(ValueError, match=r'cannot load .*still waits for rounds'):
        job.server.command(Command.LOAD, {'rank': 0, 'paths': [path], 'check_only': True})
    job.round(1, 1)                      # chunk 1 reaches the save's round: copied now
    after_save = job.server.weight(1).asnumpy()
    job.round(1, 2)                      # and goes on
    assert np.any(job.server.weight(1).asnumpy() != after_save)
    digest = background.wait(path, 's1', 30)
    chunks, states, optimizer_saved = read(path, digest)
    for chunk in range(2):
        for name in ('next_round', 'skipped', 'stype', 'size', 'name', 'param_index'):
            assert chunks[chunk][name] == expected_chunks[chunk][name]
        assert chunks[chunk]['next_round'] == SAVED_ROUND
        for name in ('weight',) + (('model',) if pull_compression else ()):
            np.testing.assert_array_equal(chunks[chunk][name], expected_chunks[chunk][name])
        saved, wanted = states[chunk], expected_states[chunk]
        saved, wanted = ((saved,), (wanted,)) if not isinstance(saved, tuple) else (saved,
                                                                                    wanted)
        for array, reference_array in zip(saved, wanted):
            np.testing.assert_array_equal(array.asnumpy(), reference_array.asnumpy())
    np.testing.assert_array_equal(chunks[1]['weight'], after_save)
    assert optimizer_saved == expected_optimizer
    assert optimizer_saved['fields']['num_update'] == SAVED_ROUND
    # The live optimizer has counted chunk 0's round 2 and chunk 1's; the file has not.
    assert job.server.optimizer.num_update == SAVED_ROUND + 1
    # The file loads against the index's rounds.
    assert job.server.command(Command.LOAD, {
        'rank': 0, 'paths': [path], 'save_id': 's1', 'sha256': [digest],
        'rounds': {'0': SAVED_ROUND, '1': SAVED_ROUND}, 'finish_rounds': 0,
        'check_only': True}) == {'path': path, 'valid': True}


def test_a_round_past_the_saves_is_refused(tmp_path):
    job = Job(mx.optimizer.SGD(learning_rate=0.1))
    for rnd in range(3):
        job.round(0, rnd)
    path = str(tmp_path / 'ckpt.server0')
    with pytest.raises(ValueError, match=r"chunk 0 \(key 0\) has applied 3 rounds, past the "
                                         r"save's round 2"):
        job.save(path, **background_save(path))
    with pytest.raises(ValueError, match=r"the rounds name no round for key 1 \(chunk 1\)"):
        job.save(path, save_id='s1', background=True, rounds={'0': 3})
    assert not (tmp_path / 'ckpt.server0').exists()
    # Nothing waits: the next save runs.
    job.round(1, 0)
    assert job.save(path, save_id='s1', background=True, rounds={'0': 3, '1': 1})['chunks'] == 2
    assert background.wait(path, 's1', 30) == files.file_sha256(path)


def test_a_learning_rate_set_while_a_chunk_waits_is_saved(tmp_path):
    # A worker sets the learning rate before pushing chunk 1's round 1 (so after the save
    # arrived, and before the save's round 2 on any chunk): the state at round 2 has it.
    reference = Job(mx.optimizer.SGD(learning_rate=0.1, momentum=0.9))
    for chunk, rnd in ((0, 0), (1, 0), (0, 1)):
        reference.round(chunk, rnd)
    reference.server.command(Command.SET_HYPER, {'rank': 0, 'lr': 0.05})
    reference.round(1, 1)
    expected = str(tmp_path / 'reference.server0')
    reference.save(expected, save_id='s0')

    job = Job(mx.optimizer.SGD(learning_rate=0.1, momentum=0.9))
    for chunk, rnd in ((0, 0), (0, 1), (1, 0)):
        job.round(chunk, rnd)
    path = str(tmp_path / 'ckpt.server0')
    job.save(path, **background_save(path))
    job.server.command(Command.SET_HYPER, {'rank': 0, 'lr': 0.05})
    job.round(1, 1)
    job.server.command(Command.SET_HYPER, {'rank': 0, 'lr': 0.01})   # for round 2: not saved
    job.round(0, 2)
    chunks, _, optimizer_saved = read(path, background.wait(path, 's1', 30))
    expected_chunks, _, expected_optimizer = read(expected)
    assert optimizer_saved == expected_optimizer
    assert optimizer_saved['fields']['lr'] == 0.05
    for chunk in range(2):
        np.testing.assert_array_equal(chunks[chunk]['weight'], expected_chunks[chunk]['weight'])
