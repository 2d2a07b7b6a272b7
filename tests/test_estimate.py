"""The estimate of what ``delay`` and each compression would save (mxdelay.estimate).

On synthetic rows the arithmetic is exact: three warm-up steps 100 ms apart (two whole
spans), each waiting 60 ms with 80 ms of communication, so S = 100, W = 60, C = 40, T = 80,
and 1000 bytes pushed and pulled per round. The model (module docstring): k = 1,
C + W (P'+Q')/(P+Q); k >= 2, max(C, T (P' + Q'/k)/(P+Q)).

Against a committed measurement (docs/benchmarks/overlap/overlap.md, 1 Gbit/s links, per-layer
pushes, bulk 4, the same 6-layer MLP in warm-up and at k=2): warm-up step 551.0 ms, wait
527.4 ms, the last pull arriving 545 ms after the first push (taken as T: communication is
outstanding all along); the delayed k=2 step was 327.1 ms, a speed-up of 1.68x. The
estimate gives max(23.6, 545 x 0.75) = 408.75 ms, 1.35x: below the measured speed-up
(the model lets pushes and pulls share the link; on this full-duplex link they travel in
opposite directions). The test checks the figures are still the file's, the estimate's
value exactly, and that the estimate stays below the measured speed-up. Tolerance: 1e-9.
"""
import os
import re

import pytest

from mxdelay import estimate

HERE = os.path.dirname(os.path.abspath(__file__))
SETTINGS = {'no compression': [1000, 1000], 'fp16 pushes': [500, 1000],
            '2bit pushes': [63, 1000], 'fp16 pulls': [1000, 502], 'int8 pulls': [1000, 260]}
BYTES = {'push': 1000, 'pull': 1000, 'compression': None, 'pull_compression': None,
         'row_sparse_keys': 0, 'settings': SETTINGS}


def row(step, first_push, phase, wait=60.0, comm=80.0, pulled=True):
    return {'step': step, 'first_push': first_push, 'phase': phase, 'wait_ms': wait,
            'comm_ms': comm, 'pull_issued': first_push + 1 if pulled else None}


ROWS = [row(1, 0.0, 'warm-up'), row(2, 100.0, 'warm-up'), row(3, 200.0, 'warm-up'),
        row(4, 300.0, 'switch', wait=999.0), row(5, 310.0, 'delayed', pulled=False)]


def test_synchronous_budget_uses_the_warm_up_only():
    budget = estimate.synchronous_budget(ROWS)
    assert budget == {'steps': 2, 'step_ms': 100.0, 'wait_ms': 60.0, 'compute_ms': 40.0,
                      'comm_ms': 80.0}
    assert estimate.synchronous_budget(ROWS[:1]) is None
    assert estimate.synchronous_budget(ROWS[3:]) is None     # no warm-up step


@pytest.mark.parametrize('setting, k, step_ms', [
    ('no compression', 1, 40 + 60 * 2000 / 2000),        # as measured
    ('no compression', 2, 80 * (1000 + 500) / 2000),
    ('no compression', 4, 80 * (1000 + 250) / 2000),
    ('no compression', 8, 80 * (1000 + 125) / 2000),
    ('fp16 pushes', 1, 40 + 60 * 1500 / 2000),
    ('fp16 pushes', 2, 40.0),                             # 80 x 1000/2000 = C: hidden
    ('fp16 pushes', 8, 40.0),                             # compute-bound
    ('2bit pushes', 1, 40 + 60 * 1063 / 2000),
    ('int8 pulls', 2, 80 * (1000 + 130) / 2000),
    ('fp16 pulls', 4, 80 * (1000 + 125.5) / 2000),
])
def test_estimate_on_synthetic_rows(setting, k, step_ms):
    rows = {(r['setting'], r['delay']): r
            for r in estimate.estimate(estimate.synchronous_budget(ROWS), BYTES)}
    assert len(rows) == len(SETTINGS) * len(estimate.DELAYS)
    got = rows[(setting, k)]
    assert got['step_ms'] == pytest.approx(step_ms, abs=1e-9)
    assert got['speedup'] == pytest.approx(100.0 / step_ms, abs=1e-9)


def test_bytes_per_step():
    per = estimate.bytes_per_step(ROWS, BYTES)
    assert per == {'steps': 5, 'pulls': 4, 'sent': 1000, 'received': 800.0}


def test_format_estimate_says_it_is_an_estimate():
    text = estimate.format_estimate(ROWS, BYTES)
    assert text.startswith('ESTIMATE, not a measurement, from 2 synchronous steps: step S = '
                           '100.0 ms, waiting for communication W = 60.0 ms, compute C = '
                           'S - W = 40.0 ms, communication T = 80.0 ms')
    assert 'Assumes communication time proportional to bytes' in text
    assert ('| no compression | 1,000 | 1,000 | 100.0 (1.00x) | 60.0 (1.67x) | 50.0 (2.00x) '
            '| 45.0 (2.22x) |') in text
    assert '| fp16 pushes | 500 | 1,000 | 85.0 (1.18x) | 40.0 (2.50x) | 40.0 (2.50x) |' in text
    assert estimate.format_estimate(ROWS[3:], BYTES).startswith('No estimate: it needs at '
                                                                'least 2 recorded warm-up')


def test_estimate_against_the_committed_overlap_measurement():
    path = os.path.join(HERE, '..', 'docs', 'benchmarks', 'overlap', 'overlap.md')
    text = re.sub(r'\s+', ' ', open(path, encoding='utf-8').read())
    section = text.split('## 1 Gbit/s links (run B, 3 rounds)', 1)[1].split('## ', 1)[0]
    assert ('| per layer, during backward | 4 | 551.0 (538.0-582.3) | 327.1 (323.7-338.9) |'
            in section)
    assert '| 527.4 / 316.9 |' in section
    assert 'the last pull arrives 545, 470 and 603-612 ms after it' in section
    step, wait, comm, delayed = 551.0, 527.4, 545.0, 327.1
    size = 18_400_000   # the same bytes pushed and pulled (no compression)
    counted = {'push': size, 'pull': size, 'settings': {'no compression': [size, size]}}
    budget = {'steps': 3, 'step_ms': step, 'wait_ms': wait, 'compute_ms': step - wait,
              'comm_ms': comm}
    k2 = [r for r in estimate.estimate(budget, counted) if r['delay'] == 2][0]
    assert k2['step_ms'] == pytest.approx(545.0 * 0.75, abs=1e-9)
    measured = step / delayed
    assert k2['speedup'] == pytest.approx(1.348, abs=1e-3) and measured == \
        pytest.approx(1.684, abs=1e-3)
    assert k2['speedup'] < measured      # conservative here, by 20%
