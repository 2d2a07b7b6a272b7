"""Layer-wise pushes during backward (CN111985609A), read off a real 2-worker job's timeline.

tests/scripts/timeline_job.py records MXNet's profiler trace of a 6-layer MLP (one large
layer) over the last warm-up steps (W=10), the switch and the first delayed steps (k=2);
the test reads mxdelay.timeline's summary of it: the first push of a step (the last
layer's) must start before backward has finished (the first layer's gradient written). The
same job with pushes forced after backward (``mx.nd.waitall()`` first) must show no such
overlap: the criterion can fail.

The pull columns are checked against the schedule, which summarize does not use to place
them (it reads the Python thread's calls): every synchronous step pulls, and its pull is
received after it was issued and after the step's last push started; in the delayed phase
exactly the steps ``t0 + 1, t0 + 3`` pull (t0 = W + 1), and their weights are applied at
the next step, once its backward is over. Waits are >= 0, never longer than the step, and
a synchronous step (it waits for the round trip) waits.

The definitions themselves (communication, hidden, wait) are checked exactly on a small
hand-made trace. Tolerance: 1e-9 ms on that trace; none elsewhere (orderings only).
"""
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from support.jobs import assert_ok, job_env, run_job
from mxdelay import timeline, trace
from mxdelay.schedule import DelaySchedule

HERE = os.path.dirname(os.path.abspath(__file__))
WARMUP, DELAY, FIRST = 10, 2, 7           # timeline_job.py: W=STEPS, k=2, records 7..14


def run_timeline(tmp_path, mode):
    result = run_job([sys.executable, os.path.join(HERE, 'scripts', 'timeline_job.py'), mode,
                      str(tmp_path), str(WARMUP)], num_workers=2, num_servers=1, timeout=150)
    assert_ok(result)
    return [json.load(open(str(tmp_path / ('timeline%d.json' % rank)))) for rank in range(2)]


@pytest.mark.jobs
@pytest.mark.parametrize('mode', ['layerwise', 'after_backward'])
def test_pushes_start_while_backward_runs(tmp_path, mode):
    workers = run_timeline(tmp_path, mode)
    if mode == 'layerwise':
        # At least one of the 2 x 4 delayed steps. Synchronous steps send one pushpull per
        # chunk (docs/design.md §8); with this observer on, their first pushpull has not
        # started before backward ends (an open point of §8), so they are not required to.
        steps = [row for w in workers for row in w['rows'] if row['phase'] == 'delayed']
        assert any(row['overlap'] for row in steps), steps
    for worker in workers:
        rows = worker['rows']
        assert (worker['warmup_steps'], worker['delay']) == (WARMUP, DELAY)
        assert [row['step'] for row in rows] == list(range(FIRST, FIRST + 8)), rows
        assert [row['phase'] for row in rows] == ['warm-up'] * 3 + ['switch'] + ['delayed'] * 4
        overlapping = [row for row in rows if row['overlap']]
        if mode == 'after_backward':
            assert not overlapping, overlapping        # impossible by construction
            assert all(row['backward_hidden_ms'] == 0 for row in rows), rows
        else:
            # MXNet's CPU engine queue is FIFO by readiness: the copy that starts a layer's
            # push can land behind the next backward segment, so on a loaded machine steps
            # lose the overlap (8 of 8 overlap on a quiet machine; 5 of 8 seen at load 6).
            # Pushes after backward can never overlap: 2 of the 4 delayed steps cannot
            # happen by chance (synchronous steps: see above).
            assert len([row for row in overlapping if row['phase'] == 'delayed']) >= 2, rows
            assert sum(row['backward_hidden_ms'] for row in rows) > 0, rows
        check_pulls(rows)
        check_waits(rows)
        check_parameter_rows(worker['parameter_rows'], worker['forward_order'])
        assert '| all steps (8) |' in worker['table']
        # The trace is a real Chrome trace that MXNet's profiler wrote.
        trace = tmp_path / ('%s-%d.trace.json' % (mode, worker['rank']))
        assert 'traceEvents' in json.load(open(str(trace)))


def check_pulls(rows):
    t0 = WARMUP + 1
    by_step = {row['step']: row for row in rows}
    for row in rows:
        t = row['step']
        if t <= WARMUP:        # warm-up and switch: push, then pull W_{t+1} and wait for it
            assert row['pull_issued'] is not None, row
            assert row['pull_issued'] < row['pull_received'], row
            assert row['last_push'] < row['pull_received'], row
            assert row['pull_sent'] <= row['pull_received'], row
            assert (row['pull_applied'], row['applied_step']) == (row['pull_received'], t)
        elif (t - t0) % DELAY == DELAY - 1:          # t0 + 1, t0 + 3: issue, apply next
            assert row['pull_issued'] is not None, row
            assert row['pull_issued'] < row['pull_received'], row
            assert row['applied_step'] == t + 1, row
            if t + 1 in by_step:
                assert row['pull_applied'] >= row['pull_received'], row
                assert row['pull_applied'] >= by_step[t + 1]['backward_end'], row
        else:                                        # t0, t0 + 2: no pull
            assert row['pull_issued'] is None and row['pull_received'] is None, row
    assert [row['step'] for row in rows if row['pull_issued'] is not None] == \
        [7, 8, 9, 10, 12, 14]


def check_parameter_rows(rows, parameters):
    """Per step and parameter (recording(path, trainer)): every parameter's gradient and
    acknowledged push in each of the 8 steps, its pull exactly at the pulling steps, the
    delayed pulls applied at the next step."""
    steps = range(FIRST, FIRST + 8)
    by_key = {(row['step'], row['parameter']): row for row in rows}
    assert set(by_key) == {(t, name) for t in steps for name in parameters}, sorted(by_key)
    for (t, name), row in by_key.items():
        assert row['gradient'] is not None and row['pushed'] is not None, row
        pulls = t in (7, 8, 9, 10, 12, 14)
        assert (row['pull_received'] is not None) == pulls, row
        if pulls and (t <= WARMUP or t + 1 in steps):
            assert row['pull_applied'] is not None and \
                row['pull_applied'] >= row['pull_received'], row
    # Each mark follows its cause's mark (the watcher chains them): backward wrote the
    # gradient, then the round was acknowledged, then the pull arrived, then it was applied.
    for row in rows:
        assert row['gradient'] <= row['pushed'], row
        if row['pull_received'] is not None:
            assert row['pushed'] <= row['pull_received'], row
    # Beyond the chaining, the typical row has real time between gradient and push.
    assert np.median([r['pushed'] - r['gradient'] for r in rows]) > 0, rows
    pulled = [r for r in rows if r['pull_received'] is not None]
    assert np.median([r['pull_received'] - r['pushed'] for r in pulled]) > 0, pulled


def check_waits(rows):
    for row, after in zip(rows, rows[1:]):
        assert 0 <= row['wait_ms'] <= after['first_push'] - row['first_push'], row
    for row in rows:
        assert 0 <= row['comm_hidden_ms'] <= row['comm_ms'], row
        assert 0 <= row['backward_hidden_ms'] <= row['comm_hidden_ms'], row
    assert all(row['wait_ms'] > 0 for row in rows if row['phase'] == 'warm-up'), rows
    total = timeline.totals(rows)
    assert total['steps'] == 8 and total['pulls'] == 6
    assert 0 <= total['hidden_backward'] <= total['hidden'] <= 1


# -- the definitions, exactly, on a hand-made trace ----------------------------------------
def _op(name, start, end, tid=1):
    return [{'name': name, 'cat': 'operator', 'ph': 'B', 'ts': start * 1000, 'tid': tid},
            {'name': name, 'cat': 'operator', 'ph': 'E', 'ts': end * 1000, 'tid': tid}]


def _call(name, at):
    return [{'name': name, 'cat': 'MXNET_C_API', 'ph': 'b', 'ts': at * 1000, 'tid': 9},
            {'name': name, 'cat': 'MXNET_C_API', 'ph': 'e', 'ts': at * 1000 + 10, 'tid': 9}]


def _trace(tmp_path, control):
    """Two steps of 2 gradient pushes; step 0 pulls (times in ms). With `control`, each step
    also pushes a flag first (the kvstore's own traffic)."""
    push, pull = trace._PUSH, trace._PULL
    events = (_call('MXAutogradBackwardEx', 0) + _call('MXKVStorePush', 1) +
              _call('MXKVStorePullWithSparse', 2) + _call('MXAutogradBackwardEx', 35) +
              _call('MXKVStorePush', 36) +
              _op('ImperativeBulk', 0, 5) + _op('ImperativeBulk', 5, 10) +   # fwd, bwd
              _op(push, 8, 20, 2) + _op('ImperativeBulk', 10, 14) + _op(push, 14, 22, 2) +
              _op(pull, 22, 30, 2) + _op('CopyCPU2CPU', 30, 31) +          # into weights
              _op('ImperativeBulk', 31, 40) +                               # next forward
              _op('ImperativeBulk', 40, 44) + _op(push, 43, 50, 2) + _op(push, 44, 52, 2) +
              _op('sgd_mom_update', 45, 46) + _op('WaitForVar', 46, 54) +
              _op('mean', 54, 55))
    if control:  # step 0's flag before its gradients; step 1's before step 0's pull
        events += _op(push, 3, 4, 2) + _op(push, 16, 17, 2)
    path = tmp_path / 'trace.json'
    path.write_text(json.dumps({'traceEvents': events}))
    return str(path)


@pytest.mark.parametrize('control', [False, True])
def test_definitions_on_a_known_trace(tmp_path, control):
    rows = timeline.summarize(_trace(tmp_path, control), 2)
    first, second = rows
    assert (first['step'], first['first_push'], first['last_push'], first['backward_end'],
            first['overlap']) == (0, 8, 14, 14, True)
    if not control:
        # MXNet's trace does not say which end belongs to which start of overlapping pushes
        # (paired first in, first out), so only sums over whole steps are exact.
        assert first['push_ms'] == pytest.approx(12 + 8, abs=1e-9)
    # span [8, 43): communication [8, 30]; local work [8, 14] of it (behind backward)
    assert first['comm_ms'] == pytest.approx(22, abs=1e-9)
    assert first['comm_hidden_ms'] == pytest.approx(6, abs=1e-9)
    assert first['backward_hidden_ms'] == pytest.approx(6, abs=1e-9)
    # idle [14, 30] ends with the pull's arrival: waiting; idle [40, 43] released by nothing
    assert first['wait_ms'] == pytest.approx(16, abs=1e-9)
    assert (first['pull_issued'], first['pull_sent'], first['pull_received'],
            first['pull_applied'], first['applied_step']) == (2, 22, 30, 30, 0)
    # span [43, 55]: communication [43, 52]; local [43, 44] + [45, 46]; WaitForVar is no
    # work, so idle [46, 54] counts up to the last push's acknowledgement at 52
    assert (second['first_push'], second['backward_end']) == (43, 44)
    assert second['comm_ms'] == pytest.approx(9, abs=1e-9)
    assert second['comm_hidden_ms'] == pytest.approx(2, abs=1e-9)
    assert second['backward_hidden_ms'] == pytest.approx(1, abs=1e-9)
    assert second['wait_ms'] == pytest.approx(6, abs=1e-9)
    assert second['pull_issued'] is None and second['applied_step'] is None
    total = timeline.totals(rows)
    assert total['comm_ms'] == pytest.approx(31, abs=1e-9)
    assert total['hidden'] == pytest.approx(8 / 31, abs=1e-9)
    assert total['hidden_backward'] == pytest.approx(7 / 31, abs=1e-9)
    assert total['wait_ms'] == pytest.approx(11, abs=1e-9)
    assert total['pulls'] == 1
    table = timeline.format_table(rows)
    assert '| all steps (2) | 31.0 | 26% | 23% | 11.0 |' in table


@pytest.mark.jobs
def test_delayed_pull_is_applied_at_the_next_step(tmp_path):
    # Steps 2 and 3 of warmup_steps=0, k=2 (t0 = 1): step 2 issues a pull, step 3 applies it
    # once step 3's backward is over (at 44, after the pull arrived at 30).
    rows = timeline.summarize(_trace(tmp_path, False), 2, DelaySchedule(2, 0), first_step=2)
    assert [(row['step'], row['phase']) for row in rows] == [(2, 'delayed'), (3, 'delayed')]
    assert (rows[0]['pull_received'], rows[0]['pull_applied'], rows[0]['applied_step']) == \
        (30, 44, 3)


def test_pushes_per_step_is_checked(tmp_path):
    with pytest.raises(ValueError, match='pushes_per_step must be a positive int'):
        timeline.summarize(_trace(tmp_path, False), 0)


def test_step_budget_on_a_known_trace(tmp_path):
    # One full span, [8, 43) = 35 ms, of which 16 ms waiting (the last row has no span).
    budget = trace.step_budget(timeline.summarize(_trace(tmp_path, False), 2))
    assert budget['steps'] == 1
    assert budget['step_ms'] == pytest.approx(35, abs=1e-9)
    assert budget['wait_ms'] == pytest.approx(16, abs=1e-9)
    assert budget['wait_share'] == pytest.approx(16 / 35, abs=1e-9)
    assert budget['speedup_bound'] == pytest.approx(35 / 19, abs=1e-9)
    assert trace.step_budget(timeline.summarize(_trace(tmp_path, False), 2)[:1]) is None


def run_cli(args):
    return subprocess.run([sys.executable, '-m', 'mxdelay.trace'] + args, env=job_env(),
                          capture_output=True, text=True, timeout=60, check=False)


def test_command_line_prints_the_tables(tmp_path):
    path = _trace(tmp_path, False)
    result = run_cli(['--keys-per-step', '2', '--warmup-steps', '0', '--delay', '2',
                      '--first-step', '2', path, path])
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.count('## %s' % path) == 2  # one section per file
    assert '| step | first push | backward end |' in out
    assert '| 2 delayed | 8.0 | 14.0 | yes | 22.0 | 27% |' in out
    assert '| all steps (2) | 31.0 | 26% | 23% | 11.0 |' in out
    assert ('| steps | mean step (ms) | mean wait (ms) | wait share | speed-up if no wait |'
            in out)
    assert '| 1 | 35.0 | 16.0 | 46% | 1.84x |' in out
    assert 'mxnet' not in result.stderr.lower()


def test_command_line_prints_bytes_and_the_estimate(tmp_path):
    # The hand-made trace with the bytes a MXDELAY_TIMELINE trace carries; both steps
    # synchronous (W=10): one whole span of 35 ms, waiting 16, communication 22 (step 0).
    path = _trace(tmp_path, False)
    content = json.load(open(path))
    content['otherData'] = {'mxdelay': {'bytes': {
        'push': 1000, 'pull': 1000, 'compression': None, 'pull_compression': None,
        'row_sparse_keys': 0, 'settings': {'no compression': [1000, 1000],
                                           'fp16 pushes': [500, 1000]}}}}
    json.dump(content, open(path, 'w'))
    result = run_cli(['--keys-per-step', '2', '--warmup-steps', '10', '--delay', '2', path])
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert '| all steps (2) | 2 | 1,000 | 1,000 |' in out, out     # both steps pull
    assert 'ESTIMATE, not a measurement, from 1 synchronous steps: step S = 35.0 ms' in out
    # C = 35 - 16 = 19; k=2: max(19, 22 x 1500/2000 = 16.5) = 19; fp16, k=1: 19 + 16 x 0.75
    assert '| no compression | 1,000 | 1,000 | 35.0 (1.00x) | 19.0 (1.84x) |' in out, out
    assert '| fp16 pushes | 500 | 1,000 | 31.0 (1.13x) | 19.0 (1.84x) |' in out, out


def test_command_line_places_the_phases_of_an_auto_schedule(tmp_path):
    # A MXDELAY_TIMELINE trace of delay='auto' carries the job's decisions: here k=2 from
    # t0 = 1 and a fallback from round 3, so step 2 is delayed and step 3 synchronous.
    path = _trace(tmp_path, False)
    content = json.load(open(path))
    content['otherData'] = {'mxdelay': {
        'keys_per_step': 2, 'warmup_steps': 0, 'delay': 'auto', 'first_step': 2,
        'amendments': {'delay': 2, 'synchronous_from': 3}}}
    json.dump(content, open(path, 'w'))
    result = run_cli([path])
    assert result.returncode == 0, result.stderr
    assert '| 2 delayed |' in result.stdout and '| 3 synchronous |' in result.stdout, \
        result.stdout


@pytest.mark.parametrize('args, message', [
    (['--keys-per-step', '0', '{path}'], '--keys-per-step must be a positive integer'),
    (['--keys-per-step', '2', '--delay', '2', '{path}'],
     '--warmup-steps and --delay go together'),
    (['--keys-per-step', '2', '{tmp}/missing.json'],
     "{tmp}/missing.json cannot be read as a timeline"),
    (['{path}'], 'does not say its keys per step (it was not written with MXDELAY_TIMELINE); '
                 'pass --keys-per-step K'),
])
def test_command_line_refuses_bad_input(tmp_path, args, message):
    path = _trace(tmp_path, False)
    result = run_cli([arg.format(path=path, tmp=tmp_path) for arg in args])
    assert result.returncode == 2
    assert message.format(tmp=tmp_path) in result.stderr


# A worker that never mentions the timeline: MXDELAY_TIMELINE alone records it.
UNTOUCHED_JOB = '''
import mxdelay
import numpy as np
import mxnet as mx
from mxnet import autograd, gluon, nd
net = gluon.nn.HybridSequential()
net.add(gluon.nn.Dense(64, activation='relu', in_units=32), gluon.nn.Dense(10, in_units=64))
net.initialize(mx.init.Xavier())
trainer = mxdelay.DelayedTrainer(net.collect_params(), 'sgd', {'learning_rate': 0.01},
                                 delay=2, warmup_steps=2)
x, y = nd.array(np.random.rand(16, 32)), nd.array(np.random.randint(0, 10, 16))
for _ in range(9):
    with autograd.record():
        loss = gluon.loss.SoftmaxCrossEntropyLoss()(net(x), y)
    loss.backward()
    trainer.step(16)
    loss.asnumpy()
print('keys', trainer.keys_per_step)
'''


# Its 4 float32 parameters have 2048, 64, 640 and 10 values (one chunk each), in bytes of
# the values: float32 4 a value; float16 2; MXNet's 2bit 16 values per float32, rounded up;
# fp16 pulls a float32 header and 2 bytes a value, in float32 words; int8 pulls a header,
# a float32 scale per block of 256 and a byte per value of the blocks, in float32 words;
# the blockwise push codecs (block 256) a float32 scale per block, D levels per float32 word
# (int8 4, int4 8, ternary 20) and the payload row's int64 id.
SIZES = (2048, 64, 640, 10)


def _words(n):
    return 4 * n


def _blockwise(digits):
    return sum(_words(-(-n // 256) + -(-n // digits)) + 8 for n in SIZES)


UNTOUCHED_BYTES = {
    'push': 4 * sum(SIZES), 'pull': 4 * sum(SIZES), 'compression': None,
    'pull_compression': None, 'row_sparse_keys': 0, 'settings': {
        'no compression': [4 * sum(SIZES), 4 * sum(SIZES)],
        'fp16 pushes': [2 * sum(SIZES), 4 * sum(SIZES)],
        '2bit pushes': [sum(_words(-(-n // 16)) for n in SIZES), 4 * sum(SIZES)],
        'int8 pushes': [_blockwise(4), 4 * sum(SIZES)],
        'int4 pushes': [_blockwise(8), 4 * sum(SIZES)],
        'ternary pushes': [_blockwise(20), 4 * sum(SIZES)],
        'fp16 pulls': [4 * sum(SIZES), sum(_words(1 + -(-n // 2)) for n in SIZES)],
        'int8 pulls': [4 * sum(SIZES), sum(_words(1 + -(-n // 256) + 64 * -(-n // 256))
                                           for n in SIZES)]}}
assert UNTOUCHED_BYTES['push'] == 11048 and UNTOUCHED_BYTES['settings']['2bit pushes'][0] == 692
assert UNTOUCHED_BYTES['settings']['ternary pushes'][0] == (
    4 * (8 + 1 + 3 + 1 + 103 + 4 + 32 + 1) + 32)


@pytest.mark.jobs
def test_environment_records_every_worker(tmp_path):
    from support.jobs import python_command, worker_lines
    started = time.time()
    result = run_job(python_command(UNTOUCHED_JOB), num_workers=2, num_servers=1, timeout=90,
                     env={'MXDELAY_TIMELINE': str(tmp_path / 'tl'), 'MXDELAY_TIMELINE_STEPS': '6'})
    ended = time.time()
    assert_ok(result)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ['tl.rank0.json', 'tl.rank1.json'], files
    for rank in range(2):
        path = tmp_path / ('tl.rank%d.json' % rank)
        meta = json.load(open(str(path)))['otherData']['mxdelay']
        keys = int(worker_lines(result.stdout, rank)[-1].split()[1])
        assert meta == {'keys_per_step': keys, 'warmup_steps': 2, 'delay': 2, 'first_step': 1,
                        'rank': rank, 'bytes': UNTOUCHED_BYTES}
        cli = run_cli([str(path)])
        assert cli.returncode == 0, cli.stderr
        out = cli.stdout
        # Steps 1..6 recorded (not 0, which sends the initial weights, nor 7, 8): warm-up
        # step 1 (W = 2), the switch (2), delayed 3..6.
        assert '| all steps (6) |' in out, out
        assert [line.split(' | ')[0] for line in out.splitlines() if line[2:3].isdigit()][:6] \
            == ['| %d %s' % (t, 'warm-up' if t < 2 else 'switch' if t == 2 else 'delayed')
                for t in range(1, 7)], out
        for phase, count in (('warm-up', 1), ('switch', 1), ('delayed', 4)):
            assert '| %s (%d) |' % (phase, count) in out, out
        assert ('| steps | mean step (ms) | mean wait (ms) | wait share | speed-up if no wait |'
                in out)
        assert '| 5 | ' in out.split('speed-up if no wait |', 1)[1], out  # 5 whole spans
        # Every step pushes 11,048 bytes; pulls at 1, 2 (synchronous), 4, 6 (k=2: the
        # schedule's; the recording stops before step 6 issues its pull).
        # Warm-up step 1 alone has no whole span to estimate from.
        assert 'No estimate: it needs at least 2 recorded warm-up' in out, out
        for line in ('| all steps (6) | 4 | 11,048 | 7,365 |', '| warm-up (1) | 1 | 11,048 | '
                     '11,048 |', '| switch (1) | 1 | 11,048 | 11,048 |',
                     '| delayed (4) | 2 | 11,048 | 5,524 |'):
            assert line in out, out
    check_merged(tmp_path, [str(tmp_path / ('tl.rank%d.json' % rank)) for rank in (1, 0)],
                 (started, ended))


def check_merged(tmp_path, paths, window):
    """``--merge``: one trace, a process per rank named ``worker R``, every event of every
    worker kept (only pid, tid and async ids renamed), on the workers' own wall clock."""
    out = tmp_path / 'job.json'
    cli = run_cli(['--merge', str(out)] + paths)
    assert cli.returncode == 0, cli.stderr
    merged = json.load(open(str(out)))
    assert sorted(merged['otherData']['mxdelay']['ranks']) == ['0', '1']
    events = [e for e in merged['traceEvents'] if e['ph'] != 'M']
    names = {e['pid']: e['args']['name'] for e in merged['traceEvents']
             if e['ph'] == 'M' and e['name'] == 'process_name'}
    assert names == {0: 'worker 0', 1: 'worker 1'}
    assert cli.stdout.startswith('%s: 2 workers (ranks 0, 1), %d events' % (out, len(events)))

    def key(event):
        return (event['name'], event['ph'], event.get('cat'), event.get('ts'))
    for rank in (0, 1):
        original = [e for e in json.load(open(paths[1 - rank]))['traceEvents']
                    if e['ph'] != 'M']
        mine = [e for e in events if e['pid'] == rank]
        assert sorted(map(key, mine)) == sorted(map(key, original))   # count for count
        # The profiler's clock is the system clock (µs since the epoch): both workers'
        # events lie within the job's wall-clock window, so they are aligned as recorded.
        stamps = [e['ts'] for e in mine if 'ts' in e]
        assert window[0] * 1e6 <= min(stamps) <= max(stamps) <= window[1] * 1e6
    # Async ids (hashes of the workers' threads) are renamed apart: no rank shares one.
    ids = [{e['id'] for e in events if 'id' in e and e['pid'] == rank} for rank in (0, 1)]
    assert ids[0] and ids[1] and not ids[0] & ids[1]
    # Every thread row is named.
    rows = {(e['pid'], e['tid']) for e in events}
    named = {(e['pid'], e['tid']) for e in merged['traceEvents']
             if e['ph'] == 'M' and e['name'] == 'thread_name'}
    assert rows <= named


def test_summary_refuses_a_merged_trace(tmp_path):
    path = tmp_path / 'job.json'
    path.write_text(json.dumps({'traceEvents': [], 'otherData': {'mxdelay': {'ranks': {}}}}))
    result = run_cli([str(path)])
    assert result.returncode == 2
    assert '%s is a merged trace (--merge)' % path in result.stderr


def test_merge_refuses_two_traces_of_one_rank(tmp_path):
    paths = []
    for name in ('a.rank3.json', 'b.rank3.json'):   # the file name says the rank
        paths.append(str(tmp_path / name))
        os.replace(_trace(tmp_path, False), paths[-1])
    result = run_cli(['--merge', str(tmp_path / 'out.json')] + paths)
    assert result.returncode == 2
    assert '%s and %s are both rank 3; pass one trace per worker' % tuple(paths) \
        in result.stderr


@pytest.mark.parametrize('variables, message', [
    ({'MXDELAY_TIMELINE': '{tmp}/missing/tl'}, "folder '{tmp}/missing' does not exist"),
    ({'MXDELAY_TIMELINE': '{tmp}/tl', 'MXDELAY_TIMELINE_STEPS': '0'},
     "MXDELAY_TIMELINE_STEPS='0' must be an integer >= 1"),
])
def test_environment_recording_refuses_bad_values(tmp_path, monkeypatch, variables, message):
    for name, value in variables.items():
        monkeypatch.setenv(name, value.format(tmp=tmp_path))
    with pytest.raises(ValueError, match=message.format(tmp=tmp_path)):
        timeline.record_from_env(None)   # refused before the trainer is looked at


def test_environment_recording_is_off_by_default(monkeypatch):
    monkeypatch.delenv('MXDELAY_TIMELINE', raising=False)
    assert timeline.record_from_env(None) is None
