"""``delay='auto'`` (mxdelay.autodelay, docs/design.md §1.2): the choice, the arguments, and
real jobs.

What is tested, and against what:

- :func:`mxdelay.autodelay.choose` on fabricated measurements, against the estimate written
  out by hand (``max(C, W (P + Q/k)/(P + Q))``): the smallest k within 5% of the best, and
  staying synchronous when no k is estimated faster than the measured step;
- :class:`mxdelay.autodelay.AutoDelay`'s decisions on fabricated measurements: S from the
  warm-up's wall clock up to the first step whose wait is measured (the steps that
  measurement slows left out), W from the sampled steps' waits; the fallback only above
  (1 + FALLBACK_MARGIN) S (just inside: keeps k; just outside: falls back);
- the arguments: ``delay='auto'`` needs ``warmup_steps >= 5`` and ``slack >= 4``, takes
  slack 4 by default, and names the argument, the value and the fix otherwise;
- real 2-worker jobs (marked ``jobs``; ``MXDELAY_AUTO_DELAY_FORCE`` forces the decisions):
  with ternary pushes and int8 pulls (the servers' pulled rounds follow the decisions),
  a job deciding k=4 equals the job pinned with ``delay=4, slack=4`` bit for bit; a job
  staying synchronous equals the job pinned all warm-up (``warmup_steps`` >= its steps)
  bit for bit; a job that falls back at F equals the pinned k=4 job before F bit for bit,
  and from F on its workers hold the same weights (synchronous steps) and differ from the
  pinned job's. Without compression, k=2 against ``delay=2, slack=4``;
- the fallback against the numpy reference (``reference.simulate(synchronous_from=F)``,
  itself checked against the delayed reference before F and the all-warm-up one for
  F = t0): real 2-worker jobs falling back at F, or staying synchronous (F = t0, against
  the reference with W at least the job's steps), plain (the reference's own gradients, at
  reference_jobs.RTOL/ATOL) and with ternary + int8 pulls (the job's recorded gradients
  replayed, bit for bit); and the same reference with F a period earlier or later, or no
  fallback, is refused by each comparison (the test sees F).
Tolerance: none (bit for bit; the choice: the hand-written estimate to 1e-12), except the
plain reference comparisons (rtol 1e-5, atol 1e-6: Gluon's backward against numpy's).
"""
import concurrent.futures
import json
import logging
import os
import re
import sys
import types

import numpy as np
import pytest

import mxdelay
from mxnet import gluon

from mxdelay.autodelay import (CANDIDATES, FALLBACK_MARGIN, MARGIN, SLACK, WAIT_STEPS,
                               AutoDelay, choose)
from mxdelay.schedule import DelaySchedule
from mxdelay.steplog import StepTimes
import reference
from scripts import mlp_model
from support.jobs import SCRIPTS, assert_ok, run_job, worker_lines
from support.model import MLP_NAMES
from support.reference_jobs import (MLP_BASE, assert_matches_reference,
                                    assert_rounds_equal_reference, rounds_differ_from_reference,
                                    run_mlp_job, simulate_mlp_job)


def by_hand(step, wait, push, pull, k):
    return max(step - wait, wait * (push + pull / k) / (push + pull))


@pytest.mark.parametrize('step,wait,push,pull', [
    (100.0, 80.0, 1000, 1000),     # communication-bound: k=4 clearly best
    (100.0, 40.0, 1000, 1000),     # compute-bound from k=2 on: k=2 ties k=4
    (100.0, 60.0, 100, 1000),      # pulls dominate the bytes
    (100.0, 52.0, 1000, 1000),     # k=4 within 5% of ... (see the assertion)
    (50.0, 30.0, 1000, 250),
])
def test_choice_is_the_smallest_k_within_the_margin(step, wait, push, pull):
    k, rows = choose(step, wait, push, pull, candidates=TWO)
    estimates = {c: by_hand(step, wait, push, pull, c) for c in TWO}
    assert [row['delay'] for row in rows] == list(TWO)
    for row in rows:
        assert abs(row['step_ms'] - estimates[row['delay']]) < 1e-12
        assert abs(row['speedup'] - step / estimates[row['delay']]) < 1e-12
    best = min(estimates.values())
    assert k == min(c for c in TWO if estimates[c] <= best * (1 + MARGIN))


def test_the_candidates_are_k4():
    # k=2 tied k=4 wherever the step is compute-bound and then pulled twice as often.
    assert CANDIDATES == (4,)
    assert choose(100.0, 40.0, 1000, 1000)[0] == 4
    assert choose(100.0, 0.0, 1000, 1000)[0] is None


#: Two candidates, for the rule's margin.
TWO = (2, 4)


def test_choice_examples():
    # Communication-bound: k=2 gives max(20, 60) = 60, k=4 max(20, 50) = 50: k=4.
    assert choose(100.0, 80.0, 1000, 1000, candidates=TWO)[0] == 4
    # Compute-bound: both give C = 60: the smaller k.
    assert choose(100.0, 40.0, 1000, 1000, candidates=TWO)[0] == 2
    # k=2: max(48, 39) = 48 = k=4's: the smaller k again.
    assert choose(100.0, 52.0, 1000, 1000, candidates=TWO)[0] == 2
    # k=2 max(10, 67.5) = 67.5 is 20% slower than k=4's max(10, 56.25): 4.
    assert choose(100.0, 90.0, 1000, 1000, candidates=TWO)[0] == 4
    # The margin: k=2 max(51, 52.5) is within 5% of k=4's 51 (53.55): the smaller k; with
    # C = 49, k=2's 52.5 is above 1.05 x 49 = 51.45: k=4.
    assert choose(121.0, 70.0, 1000, 1000, candidates=TWO)[0] == 2
    assert choose(119.0, 70.0, 1000, 1000, candidates=TWO)[0] == 4


@pytest.mark.parametrize('step,wait', [(100.0, 0.0), (0.0, 0.0)])
def test_no_wait_stays_synchronous(step, wait):
    # Nothing to hide: every k is estimated at the measured step, none faster.
    k, rows = choose(step, wait, 1000, 1000)
    assert k is None and all(row['step_ms'] == step for row in rows)


def small_params():
    net = gluon.nn.Dense(2, in_units=3)
    net.initialize()
    return net.collect_params()


def trainer(**kwargs):
    return mxdelay.DelayedTrainer(small_params(), 'sgd', {'learning_rate': 0.1},
                                  kvstore='dist_delay', **kwargs)


def test_auto_takes_slack_4_and_is_undecided():
    made = trainer(delay='auto', warmup_steps=5)
    assert made._delayed._slack == SLACK == 4
    assert made.schedule.auto and not made.schedule.decided
    assert trainer(delay='auto', warmup_steps=5, slack=6)._delayed._slack == 6


@pytest.mark.parametrize('kwargs,match', [
    ({'delay': 'auto', 'warmup_steps': 4}, r"warmup_steps=4 with delay='auto'.*warmup_steps >= 5"),
    ({'delay': 'auto', 'warmup_steps': 5, 'slack': 3},
     r"slack.*3.*delay='auto' may choose k up to 4 \(slack >= 4\)"),
    ({'delay': 'Auto', 'warmup_steps': 5}, r"delay.*'Auto'.*delay='auto'"),
    ({'delay': 4, 'warmup_steps': 5, 'slack': 3}, r'slack >= delay=4'),
])
def test_argument_checks(kwargs, match):
    with pytest.raises(ValueError, match=match):
        trainer(**kwargs)


def test_module_checks_auto_alike():
    with pytest.raises(ValueError, match=r"warmup_steps=2 with delay='auto'"):
        mxdelay.DelayedModule(None, delay='auto', warmup_steps=2)


# -- the decisions on fabricated step records (mxdelay.autodelay.AutoDelay) ------------------
class FakeJob(object):
    def __init__(self):
        self.sent = []

    def decide(self, value):      # one worker: its own value comes back
        return value

    def amend_schedule(self, amendments):
        self.sent.append(dict(amendments))


class FakeUpdate(object):
    """What AutoDelay asks of the trainer's DelayedUpdate: worker 0 of a one-worker job."""
    rank = 0

    def __init__(self, warmup):
        self.schedule = DelaySchedule('auto', warmup)
        self.states = [types.SimpleNamespace(pre_weight='w', rule_state='s')]
        self.parts = types.SimpleNamespace(job=FakeJob(), settings=types.SimpleNamespace(slack=4))

    def round_bytes(self):
        return {'push': 1000, 'pull': 1000}

    def awaited(self, t):
        return [], [], True


def done(value):
    future = concurrent.futures.Future()
    future.set_result(value)
    return future


def records(steps, span, wait):
    """Step records as StepTimes.record makes them: step t issued at t * span seconds, its
    gradients ready 1 ms later, its awaited communication `wait` seconds after that."""
    return [(t, 6, True, t * span, done(t * span + 1e-3), done(t * span + 1e-3 + wait))
            for t in steps]


def measured(auto, span, wait, warmup=10):
    """Worker 0's warm-up as AutoDelay.stepped records it: steps 2 .. `warmup` issued every
    `span` seconds by wall clock, the last WAIT_STEPS of them also sampled (StepTimes
    records) with waits of `wait` seconds."""
    auto._warmup = [(t, t * span) for t in range(2, warmup + 1)]
    auto._sampled = records(range(warmup - WAIT_STEPS + 1, warmup + 1), span, wait)


def auto_delay(monkeypatch, force='measure', warmup=10):
    monkeypatch.setenv('MXDELAY_AUTO_DELAY_FORCE', force)
    update = FakeUpdate(warmup)
    auto = AutoDelay(update)
    auto._times = StepTimes(update)
    return auto, update


def test_the_measured_warmup_decides_k_and_tells_the_servers(monkeypatch, caplog):
    # S = 10 ms, W = 7 ms: k=4 max(3, 4.375), faster than S: k=4.
    # The sampled steps 8-10 slow steps 9 and 10 (issued 200 and 490 ms late): S is steps
    # 3-8's 10 ms a step all the same.
    auto, update = auto_delay(monkeypatch)
    measured(auto, 0.010, 0.007)
    auto._warmup[-2:] = [(9, 0.290), (10, 0.590)]
    with caplog.at_level(logging.INFO, logger='mxdelay.trainer'):
        auto.before_step(11)
    assert update.schedule.amendments() == {'delay': 4, 'synchronous_from': None}
    assert update.parts.job.sent == [{'delay': 4, 'synchronous_from': None}]
    text = caplog.text
    assert 'measured 6 warm-up steps (from step 3): step S = 10.0 ms, waiting for ' \
           'communication W = 7.0 ms, measured on steps 8-10, compute C = S - W = 3.0 ms' \
           in text
    assert 'estimated step max(C, W (P + Q/k)/(P + Q)): k=4 4.4 ms (2.29x)' in text
    assert "chose delay=4 from step 11 on (pin it: delay=4, slack=4)" in text


@pytest.mark.parametrize('share,fallen', [
    (1.001, True),        # just above (1 + FALLBACK_MARGIN) S: falls back
    (0.999, False),       # just below: keeps k
    (0.5, False),         # slower than S, within the margin
    (-0.1, False)])       # faster than S
def test_the_fallback_compares_the_delayed_steps_with_the_warmup(monkeypatch, caplog, share,
                                                                 fallen):
    assert 0.05 <= FALLBACK_MARGIN <= 0.5
    bound = 10.0 * (1 + FALLBACK_MARGIN)                  # ms
    span = 1e-3 * (10.0 * (1 + share * FALLBACK_MARGIN) if share < 1 else bound * share)
    auto, update = auto_delay(monkeypatch)
    measured(auto, 0.010, 0.007)                          # S = 10 ms
    auto.before_step(11)                                  # k = 4: the check before step 23
    auto._delayed = [(t, t * span) for t in range(14, 23)]   # t0 + k - 1 .. D - 1
    with caplog.at_level(logging.INFO, logger='mxdelay.trainer'):
        auto.before_step(23)
    assert update.schedule.synchronous_from == (23 if fallen else None)
    assert (update.states[0].pre_weight is None) == fallen
    assert len(update.parts.job.sent) == 1 + fallen
    assert ('measured delayed steps 15-22: %.1f ms a step against the warm-up\'s 10.0 ms '
            '(both by wall clock; falling back above %.1f ms, the margin %d%%)'
            % (1e3 * span, bound, round(100 * FALLBACK_MARGIN))) in caplog.text
    assert ('fell back: the job runs synchronously from step 23 on' in caplog.text) == fallen


def test_no_wait_stays_synchronous_and_drops_the_rule_state(monkeypatch, caplog):
    auto, update = auto_delay(monkeypatch)
    measured(auto, 0.010, -0.001)                         # communication before backward ends
    with caplog.at_level(logging.INFO, logger='mxdelay.trainer'):
        auto.before_step(11)
    assert update.schedule.amendments() == {'delay': None, 'synchronous_from': 11}
    assert update.states[0].pre_weight is None and update.states[0].rule_state is None
    assert "stays synchronous from step 11 on" in caplog.text
    auto.before_step(23)                                  # no check without a k
    assert len(update.parts.job.sent) == 1


def test_too_few_warmup_steps_stay_synchronous_with_a_warning(monkeypatch, caplog):
    auto, update = auto_delay(monkeypatch)
    auto._warmup = [(10, 0.1)]                            # e.g. resumed at the switch
    auto._sampled = records([10], 0.010, 0.007)
    with caplog.at_level(logging.WARNING, logger='mxdelay.trainer'):
        auto.before_step(11)
    assert update.schedule.synchronous_from == 11
    assert 'measured 0 warm-up steps, too few to estimate' in caplog.text


def test_stepped_records_the_windows_of_worker_0_only(monkeypatch):
    auto, update = auto_delay(monkeypatch, warmup=6)
    for t in range(7):
        auto.stepped(t, 6)
    assert [r[0] for r in auto._warmup] == list(range(2, 7))   # SKIPPED - 1 .. W
    assert [r[0] for r in auto._sampled] == [4, 5, 6]          # the last WAIT_STEPS
    update.schedule.amend(delay=2)
    for t in range(7, 25):
        auto.stepped(t, 6)
    # t0 = 7, k = 2: four periods (8 steps) after the settling one: the check before step
    # 17; recorded 8 .. 16 (steps 9 to 16 measured).
    assert [r[0] for r in auto._delayed] == list(range(8, 17))
    other = FakeUpdate(6)
    other.rank = 1
    idle = AutoDelay(other)
    idle.stepped(3, 6)
    assert idle._warmup == [] and idle._times is None


def test_the_forced_choice_overrides_the_measurements(monkeypatch):
    auto, update = auto_delay(monkeypatch, force='2')
    measured(auto, 0.010, 0.0)                           # would stay synchronous
    auto.before_step(11)
    assert update.schedule.amendments() == {'delay': 2, 'synchronous_from': None}
    with pytest.raises(ValueError, match='MXDELAY_AUTO_DELAY_FORCE'):
        auto_delay(monkeypatch, force='8')


# -- real jobs -------------------------------------------------------------------------------
W = 5                      # warm-up; t0 = 6; the fallback check at t0 + 4 + 2*4 = 18
STEPS = 24
F = W + 1 + 3 * 4
TERNARY_INT8 = {'compression': {'type': 'ternary', 'block_size': 32},
                'pull_compression': {'type': 'int8', 'block_size': 32}}


def run(tmp_path, name, config, force=None):
    env = {'MXDELAY_AUTO_DELAY_FORCE': force} if force else None
    return run_mlp_job(tmp_path / name, 2, dict(MLP_BASE, **dict(dict(steps=STEPS), **config)),
                       env=env, timeout=240)


def weights(histories, rank, t):
    return [histories[rank][name][t] for name in MLP_NAMES]


def assert_same_steps(got, want, steps):
    for rank in (0, 1):
        for t in steps:
            for name in MLP_NAMES:
                np.testing.assert_array_equal(got[rank][name][t], want[rank][name][t],
                                              err_msg='worker %d step %d %s' % (rank, t, name))


@pytest.mark.jobs
def test_auto_jobs_with_compressed_pulls_equal_their_pinned_arguments(tmp_path):
    pinned = run(tmp_path, 'pinned', dict(TERNARY_INT8, delay=4, warmup_steps=W, slack=4))
    chosen = run(tmp_path, 'k4', dict(TERNARY_INT8, delay='auto', warmup_steps=W), '4')
    assert_same_steps(chosen, pinned, range(STEPS))
    fallback = run(tmp_path, 'fallback', dict(TERNARY_INT8, delay='auto', warmup_steps=W),
                   '4-fallback')
    assert_same_steps(fallback, pinned, range(F))
    for t in range(F, STEPS):
        # Synchronous from F: every worker holds the pulled model of round t + 1.
        for mine, theirs in zip(weights(fallback, 0, t), weights(fallback, 1, t)):
            np.testing.assert_array_equal(mine, theirs, err_msg='step %d' % t)
    # The delayed job's workers differ there (each its own local steps): the test sees it.
    assert any(not np.array_equal(a, b) for t in range(F, STEPS)
               for a, b in zip(weights(pinned, 0, t), weights(pinned, 1, t)))
    assert any(not np.array_equal(a, b) for t in range(F, STEPS)
               for a, b in zip(weights(fallback, 0, t), weights(pinned, 0, t)))


@pytest.mark.jobs
def test_auto_job_staying_synchronous_equals_an_all_warmup_job(tmp_path):
    pinned = run(tmp_path, 'pinned', dict(TERNARY_INT8, delay=4, warmup_steps=STEPS, slack=4))
    stayed = run(tmp_path, 'stay', dict(TERNARY_INT8, delay='auto', warmup_steps=W), 'stay')
    assert_same_steps(stayed, pinned, range(STEPS))


@pytest.mark.jobs
def test_auto_job_k2_without_compression_equals_delay_2(tmp_path):
    pinned = run(tmp_path, 'pinned', dict(delay=2, warmup_steps=W, slack=4))
    chosen = run(tmp_path, 'k2', dict(delay='auto', warmup_steps=W), '2')
    assert_same_steps(chosen, pinned, range(STEPS))
    # ... and differs from k=4 (the test sees the decided k).
    other = run(tmp_path, 'k4', dict(delay=4, warmup_steps=W, slack=4))
    assert any(not np.array_equal(a, b) for t in range(STEPS)
               for a, b in zip(weights(chosen, 0, t), weights(other, 0, t)))


@pytest.mark.jobs
def test_measured_choice_is_logged_and_its_pin_repeats_the_job(tmp_path):
    # Measured on loopback (no forcing): whatever worker 0 decides, its log states the
    # measurements, each candidate's estimate and the arguments that pin the choice, and the
    # job run with those arguments computes the same weights, bit for bit (up to a fallback,
    # which has no pinned form; from there the workers hold the same weights).
    warmup, steps = 10, 30
    config = dict(MLP_BASE, steps=steps, delay='auto', warmup_steps=warmup, log_info=True)
    out = tmp_path / 'auto'
    out.mkdir()
    result = run_job([sys.executable, os.path.join(SCRIPTS, 'mlp_job.py'), json.dumps(config),
                      str(out)], num_workers=2, timeout=240)
    assert_ok(result)
    auto = {rank: np.load(str(out / ('worker%d.npz' % rank))) for rank in (0, 1)}
    # ps-lite's rank 0 decides: either of the launcher's workers.
    logs = ['\n'.join(worker_lines(result.stderr, rank)) for rank in (0, 1)]
    log = next(text for text in logs if "delay='auto' measured" in text)
    measured = re.search(r"delay='auto' measured 6 warm-up steps \(from step 3\): step S = "
                         r'[\d.]+ ms, waiting for communication W = [\d.]+ ms, measured on '
                         r'steps 8-10, .*: '
                         r'k=4 [\d.]+ ms \([\d.]+x\)', log)
    assert measured, log
    chose = re.search(r"delay='auto' chose delay=(\d) from step 11 on \(pin it: "
                      r'delay=(\d), slack=4\)', log)
    stayed = "delay='auto' stays synchronous from step 11 on" in log
    assert bool(chose) != stayed, log
    for other in logs:    # every worker adopted the same decision
        assert (chose.group(0) if chose else "stays synchronous from step 11") in other
    if stayed:
        pin = dict(delay=4, warmup_steps=steps, slack=4)
    else:
        pin = dict(delay=int(chose.group(2)), warmup_steps=warmup, slack=4)
    fell = re.search(r'fell back: the job runs synchronously from step (\d+) on', log)
    end = int(fell.group(1)) if fell else steps
    pinned = run(tmp_path, 'pinned', dict(pin, steps=steps))
    assert_same_steps(auto, pinned, range(end))
    for t in range(end, steps):
        for mine, theirs in zip(weights(auto, 0, t), weights(auto, 1, t)):
            np.testing.assert_array_equal(mine, theirs, err_msg='step %d' % t)


@pytest.mark.jobs
@pytest.mark.parametrize('save_at', [2, 10, 20])
def test_a_resumed_auto_job_continues_exactly(tmp_path, save_at):
    # Saved before the switch (the resumed job decides again: forced alike), after the
    # decision k=4 (the resumed job keeps it and falls back at F), after the fallback (it
    # stays synchronous; fresh servers learn both decisions from worker 0's load).
    config = dict(TERNARY_INT8, delay='auto', warmup_steps=W)
    full = run(tmp_path, 'full', config, '4-fallback')
    run(tmp_path, 'first', dict(config, save_at=save_at, stop_after=save_at + 1), '4-fallback')
    ckpt = str(tmp_path / 'first' / 'out' / 'ckpt')
    resumed = run(tmp_path, 'resumed', dict(config, resume_from=ckpt), '4-fallback')
    for rank in range(2):
        assert int(resumed[rank]['first']) == save_at + 1
        for name in MLP_NAMES:
            np.testing.assert_array_equal(resumed[rank][name], full[rank][name][save_at + 1:],
                                          err_msg='worker %d %s after resume' % (rank, name))


# -- the fallback against the numpy reference (reference.simulate(synchronous_from=F)) ------
#: The reference's arguments of TERNARY_INT8 (ternary: h = 1; one chunk a tensor).
TERNARY_INT8_REFERENCE = dict(blockwise=(1, 32, None), pull_compression=('int8', 32))
PLAIN = dict(MLP_BASE, steps=STEPS, delay=4, warmup_steps=W)


@pytest.mark.parametrize('compressed', [False, True], ids=['plain', 'ternary-int8'])
def test_the_reference_fallback_is_synchronous_from_f(compressed):
    # The reference alone: equal to the delayed reference before F, to the all-warm-up one
    # with F = t0; from F on both workers hold W_{t+1} (x̂ with compressed pulls).
    kw = TERNARY_INT8_REFERENCE if compressed else {}
    delayed = simulate_mlp_job(PLAIN, 2, **kw)
    fallen = simulate_mlp_job(PLAIN, 2, synchronous_from=F, **kw)
    stayed = simulate_mlp_job(PLAIN, 2, synchronous_from=W + 1, **kw)
    warm = simulate_mlp_job(dict(PLAIN, warmup_steps=STEPS), 2, **kw)
    for t in range(STEPS):
        for rank in (0, 1):
            for name in MLP_NAMES:
                if t < F:
                    np.testing.assert_array_equal(fallen.local[t][rank][name],
                                                  delayed.local[t][rank][name])
                else:
                    pulled = (fallen.xhat if compressed else fallen.glob)[t][name]
                    np.testing.assert_array_equal(fallen.local[t][rank][name], pulled)
                np.testing.assert_array_equal(stayed.local[t][rank][name],
                                              warm.local[t][rank][name])
    assert fallen.pulls == delayed.pulls[:delayed.pulls.index(F)]
    assert stayed.pulls == []


@pytest.mark.parametrize('bad', [W, F + 1, F - 2])
def test_the_reference_fallback_round_is_checked(bad):
    with pytest.raises(ValueError, match=r'synchronous_from must be t0 = 6 or t0 \+ j\*delay'):
        simulate_mlp_job(PLAIN, 2, synchronous_from=bad)


def replay(histories, config, **kw):
    """The reference on the job's recorded raw gradients (every worker has data every step):
    each worker's pushes quantized with its own residual, as the job's."""
    def grad_fn(weights, rank, t):  # pylint: disable=unused-argument
        return {name: histories[rank]['grad_' + name][t] for name in MLP_NAMES}
    return reference.simulate(
        mlp_model.init_params(), grad_fn, 2, config['steps'], config['delay'],
        config['warmup_steps'], config['lr'], momentum=config['momentum'], wd=config['wd'],
        rescale_grad=1.0 / config['batch'], **dict(TERNARY_INT8_REFERENCE, **kw))


@pytest.mark.jobs
def test_a_fallback_job_is_the_reference_synchronous_from_f(tmp_path):
    # Plain: the reference's own gradients, at the reference tolerance. With F a period
    # earlier or later, or no fallback, the reference differs beyond it: the test sees F.
    job = run(tmp_path, 'plain', dict(delay='auto', warmup_steps=W), '4-fallback')
    assert_matches_reference(job, simulate_mlp_job(PLAIN, 2, synchronous_from=F))
    for other in (None, F - 4, F + 4):
        with pytest.raises(AssertionError):
            assert_matches_reference(job, simulate_mlp_job(PLAIN, 2, synchronous_from=other))


@pytest.mark.jobs
def test_a_compressed_fallback_job_is_the_reference_bit_for_bit(tmp_path):
    # Ternary pushes and int8 pulls: the reference replays the job's raw gradients through
    # the quantizers (residuals and x̂ across F); bit for bit, and not with another F.
    job = run(tmp_path, 'compressed', dict(TERNARY_INT8, delay='auto', warmup_steps=W,
                                           record_grads=True), '4-fallback')
    assert_rounds_equal_reference(job, replay(job, PLAIN, synchronous_from=F))
    for other in (None, F - 4, F + 4):
        assert rounds_differ_from_reference(job, replay(job, PLAIN, synchronous_from=other))


@pytest.mark.jobs
def test_a_job_staying_synchronous_is_the_all_warmup_reference(tmp_path):
    # F = t0: the reference with W at least the job's steps (plain, at the tolerance; with
    # ternary + int8, replayed bit for bit); the delayed reference is not it.
    plain = run(tmp_path, 'plain', dict(delay='auto', warmup_steps=W), 'stay')
    assert_matches_reference(plain, simulate_mlp_job(dict(PLAIN, warmup_steps=STEPS), 2))
    with pytest.raises(AssertionError):
        assert_matches_reference(plain, simulate_mlp_job(PLAIN, 2))
    compressed = run(tmp_path, 'compressed', dict(TERNARY_INT8, delay='auto', warmup_steps=W,
                                                  record_grads=True), 'stay')
    assert_rounds_equal_reference(compressed, replay(compressed,
                                                     dict(PLAIN, warmup_steps=STEPS)))
    assert rounds_differ_from_reference(compressed, replay(compressed, PLAIN))
