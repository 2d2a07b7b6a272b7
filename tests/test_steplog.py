"""The step log (``MXDELAY_LOG_EVERY=N``, mxdelay.steplog) and the bytes it reports.

A DelayedTrainer on the in-process stand-in of the native store (support.native: one
worker, mxdelay's real servers in process) trains mlp_model (parameters of 128, 16, 64 and
4 float32 values) for 16 steps with W=4, k=2 and N=5. What is checked:

- the lines: one after each 5 steps (steps 5, 10, 15), each naming the worker, the step and
  the window, with the bytes exactly: 848 bytes sent per step, and received 848 times the
  window's pulls (every step up to the switch at 4, then 6, 8, ..., 14) over 5;
- samples/s against the test's own clock: the window's samples over the time between the
  step() calls that open and close it, measured around those calls (25% tolerance: the
  log's clock runs inside step(), the test's outside it, a few ms per window of ~ms steps);
- the wait share is in [0, 1];
- off (unset, and 0): the trainer's log is the no-op object and no helper thread exists;
- a bad value is refused at construction, naming the variable;
- ``round_bytes`` as configured with 2bit pushes and int8 pulls: exact (MXNet's 2bit packs
  16 values per float32; an int8 pull of a chunk of n <= 256 values is a float32 header, a
  scale, and 256 bytes of levels);
- the blockwise push codecs' settings ('int8', 'int4', 'ternary' pushes, block 256): a
  chunk of n values sends a float32 scale per block, ceil(n/D) float32 words of D levels
  (D = 4, 8, 20) and the row's int64 id, the format's exact bytes; as configured (ternary
  pushes) equal to the setting; and counted on the chunks the codec would have where its
  (N, P) keys must be smaller than the store's chunks (64 workers, a bound of 1100
  elements: int8 splits the 128-value tensor into two chunks of 64, ternary does not).
"""
import logging
import re
import threading
import time

import pytest

import mxdelay
import mxnet as mx

from mxdelay import steplog
from support.model import BATCH, backward_at, mlp_params
from support.native import delay_store

SIZES = (128, 16, 64, 4)     # w1, b1, w2, b2 (float32)
LINE = re.compile(r'DelayedTrainer: worker 0 step (\d+): ([\d.]+) samples/s over the last '
                  r'(\d+) steps, (\d+)% of the time waiting for communication, ([\d,]+) '
                  r'bytes sent and ([\d,]+) received per step$')


def trainer_of(**kwargs):
    params = mlp_params([mx.cpu()])
    trainer = mxdelay.DelayedTrainer(params, 'sgd', {'learning_rate': 0.1}, kvstore=delay_store(),
                                     delay=2, warmup_steps=4, **kwargs)
    return trainer, params


def train(trainer, params, steps):
    """Steps 0..steps-1; returns the time just before and just after each step() call."""
    around = []
    for step in range(steps):
        backward_at(params, [mx.cpu()], step)
        before = time.perf_counter()
        trainer.step(BATCH)
        around.append((before, time.perf_counter()))
    mx.nd.waitall()
    return around


def log_lines(caplog, count, timeout=20):
    """The step log's lines, once `count` of them are written (by its helper thread)."""
    deadline = time.time() + timeout
    while True:
        lines = [r.getMessage() for r in caplog.records if 'samples/s over' in r.getMessage()]
        if len(lines) >= count or time.time() > deadline:
            return lines
        time.sleep(0.05)


def test_a_line_every_n_steps(monkeypatch, caplog):
    monkeypatch.setenv('MXDELAY_LOG_EVERY', '5')
    caplog.set_level(logging.INFO, logger='mxdelay.trainer')
    trainer, params = trainer_of()
    assert isinstance(trainer._delayed.step_log, steplog.StepLog)
    around = train(trainer, params, 16)
    lines = log_lines(caplog, 3)
    assert len(lines) == 3, lines
    pulls = {5: 4, 10: 3, 15: 2}   # steps 1-4 synchronous; 6, 8, 10, 12, 14 end a period
    for line, (end, window_pulls) in zip(lines, sorted(pulls.items())):
        match = LINE.match(line)
        assert match, line
        step, rate, steps, share, sent, received = match.groups()
        assert (int(step), int(steps)) == (end, 5), line
        assert sent == '{:,}'.format(4 * sum(SIZES)) == '848'
        assert received == '{:,.0f}'.format(848 * window_pulls / 5), line
        assert 0 <= int(share) <= 100
        # Opened by step end - 5's call, closed by step end's.
        low = 5 * BATCH / (around[end][1] - around[end - 5][0])
        high = 5 * BATCH / (around[end][0] - around[end - 5][1])
        assert 0.75 * low <= float(rate) <= 1.25 * high, (line, low, high)


@pytest.mark.parametrize('value', [None, '0'])
def test_off_costs_nothing(monkeypatch, caplog, value):
    if value is None:
        monkeypatch.delenv('MXDELAY_LOG_EVERY', raising=False)
    else:
        monkeypatch.setenv('MXDELAY_LOG_EVERY', value)
    caplog.set_level(logging.INFO, logger='mxdelay.trainer')
    threads = set(threading.enumerate())
    trainer, params = trainer_of()
    assert trainer._delayed.step_log is steplog.OFF
    train(trainer, params, 7)
    assert not [t for t in set(threading.enumerate()) - threads
                if t.name.startswith('mxdelay-steplog')]
    assert not [r for r in caplog.records if 'samples/s' in r.getMessage()]


def test_bad_value_is_refused(monkeypatch):
    monkeypatch.setenv('MXDELAY_LOG_EVERY', 'often')
    with pytest.raises(ValueError, match="MXDELAY_LOG_EVERY='often' is not a valid integer"):
        trainer_of()


def test_round_bytes_as_configured():
    trainer, params = trainer_of(compression_params={'type': '2bit', 'threshold': 0.5},
                                 pull_compression={'type': 'int8'})
    train(trainer, params, 1)
    counted = trainer.round_bytes()
    assert counted['push'] == sum(4 * -(-n // 16) for n in SIZES) == 56
    assert counted['pull'] == len(SIZES) * 4 * (1 + 1 + 256 // 4) == 1056
    assert counted['compression'] == {'type': '2bit', 'threshold': 0.5}
    assert counted['pull_compression'] == {'type': 'int8', 'block_size': 256}
    assert counted['settings']['no compression'] == [4 * sum(SIZES)] * 2
    assert counted['settings']['fp16 pushes'] == [2 * sum(SIZES), 4 * sum(SIZES)]


def _blockwise(digits, sizes=SIZES):
    return sum(4 * (-(-n // 256) + -(-n // digits)) + 8 for n in sizes)


def test_round_bytes_of_the_blockwise_push_codecs():
    assert (_blockwise(4), _blockwise(8), _blockwise(20)) == (
        4 * (1 + 32 + 1 + 4 + 1 + 16 + 1 + 1) + 32, 4 * (1 + 16 + 1 + 2 + 1 + 8 + 1 + 1) + 32,
        4 * (1 + 7 + 1 + 1 + 1 + 4 + 1 + 1) + 32) == (260, 156, 100)
    trainer, params = trainer_of()
    train(trainer, params, 1)
    settings = trainer.round_bytes()['settings']
    float32 = 4 * sum(SIZES)
    assert settings['int8 pushes'] == [_blockwise(4), float32]
    assert settings['int4 pushes'] == [_blockwise(8), float32]
    assert settings['ternary pushes'] == [_blockwise(20), float32]
    trainer, params = trainer_of(compression_params={'type': 'ternary'},
                                 pull_compression={'type': 'int8'})
    train(trainer, params, 1)
    counted = trainer.round_bytes()
    assert counted['push'] == counted['settings']['ternary pushes'][0] == _blockwise(20)
    assert counted['pull'] == len(SIZES) * 4 * (1 + 1 + 256 // 4)
    assert counted['settings']['no compression'] == [float32] * 2


def test_round_bytes_counts_a_blockwise_codec_on_its_own_chunks(monkeypatch):
    trainer, params = trainer_of()
    train(trainer, params, 1)
    # As if the job had 64 workers and MXNET_KVSTORE_BIGARRAY_BOUND=1100: an int8 chunk of n
    # values needs 64 x (ceil(n/256) + ceil(n/4)) < 1100 elements, so n <= 64; ternary's
    # 128 values take 64 x (1 + 7) = 512.
    monkeypatch.setattr(trainer._kvstore._session.native, 'num_workers', 64)
    monkeypatch.setenv('MXNET_KVSTORE_BIGARRAY_BOUND', '1100')
    settings = trainer.round_bytes()['settings']
    assert settings['int8 pushes'][0] == _blockwise(4, (64, 64, 16, 64, 4)) == 272
    assert settings['ternary pushes'][0] == _blockwise(20) == 100
    assert settings['no compression'] == [4 * sum(SIZES)] * 2
