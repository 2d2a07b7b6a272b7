"""The phase schedule (``mxdelay.schedule.DelaySchedule``) against the timing of docs/design.md §1.2.

What is tested: ``phase``, ``is_synchronous``, ``issues_pull``, ``applies_pull`` and
``first_delayed_step`` for every step t of many (delay k, warm-up W) pairs, compared with
an independent statement of docs/design.md §1.2 (warm-up ``t < W``, switch ``t == W``, delayed
``t >= t0 = W + 1``; pulls issued at ``t0 + k - 1, t0 + 2k - 1, ...`` and applied one step
later); the same pull steps as the numpy reference (tests/reference.py); and the
``state_dict`` round trip used by checkpoints.

Tolerance: none, everything here is integer and exact.
"""
import json

import numpy as np
import pytest

import reference
from mxdelay.schedule import DelaySchedule, WARMUP, SWITCH, DELAYED

DELAYS = [1, 2, 3, 4, 5, 8]
WARMUPS = [0, 1, 2, 3, 7, 200]


def spec_pull_steps(delay, warmup_steps, horizon):
    """Steps that issue a pull, built by walking the periods: t0+k-1, t0+2k-1, ..."""
    t0 = warmup_steps + 1
    steps, t = set(), t0 + delay - 1
    while t < horizon:
        steps.add(t)
        t += delay
    return steps


def horizon(delay, warmup_steps):
    return warmup_steps + 6 * delay + 5


@pytest.mark.parametrize('delay', DELAYS)
@pytest.mark.parametrize('warmup_steps', WARMUPS)
def test_predicates_follow_spec_timing(delay, warmup_steps):
    sched = DelaySchedule(delay, warmup_steps)
    end = horizon(delay, warmup_steps)
    pulls = spec_pull_steps(delay, warmup_steps, end + 1)
    assert sched.first_delayed_step == warmup_steps + 1
    for t in range(end):
        want_phase = WARMUP if t < warmup_steps else SWITCH if t == warmup_steps else DELAYED
        assert sched.phase(t) == want_phase, t
        assert sched.is_synchronous(t) == (t <= warmup_steps), t
        assert sched.issues_pull(t) == (t in pulls), t
        assert sched.applies_pull(t) == (t - 1 in pulls), t


@pytest.mark.parametrize('delay', DELAYS)
@pytest.mark.parametrize('warmup_steps', WARMUPS)
def test_pull_structure(delay, warmup_steps):
    # Consequences stated in docs/design.md §1.2, checked without re-deriving the formula.
    sched = DelaySchedule(delay, warmup_steps)
    t0 = sched.first_delayed_step
    end = horizon(delay, warmup_steps)
    issued = [t for t in range(end) if sched.issues_pull(t)]
    # never during warm-up or the switch step; nothing to apply at t0 (W's pull was waited for)
    assert all(t >= t0 for t in issued)
    assert not any(sched.applies_pull(t) for t in range(t0 + 1))
    # the first pull ends the first period; then exactly one pull per k steps
    assert issued[0] == t0 + delay - 1
    assert np.all(np.diff(issued) == delay)
    # n delayed steps issue n // k pulls
    for n in range(0, end - t0):
        assert sum(sched.issues_pull(t) for t in range(t0, t0 + n)) == n // delay
    # a pull issued at t is applied at t + 1 and nowhere else
    for t in range(end):
        assert sched.applies_pull(t + 1) == sched.issues_pull(t)


def test_delay_one_pulls_every_delayed_step():
    sched = DelaySchedule(1, 3)
    assert [sched.issues_pull(t) for t in range(8)] == [False] * 4 + [True] * 4
    assert [sched.applies_pull(t) for t in range(8)] == [False] * 5 + [True] * 3


def test_warmup_zero_starts_with_the_switch():
    sched = DelaySchedule(4, 0)
    assert sched.phase(0) == SWITCH and sched.is_synchronous(0)
    assert sched.phase(1) == DELAYED and not sched.is_synchronous(1)
    assert [t for t in range(14) if sched.issues_pull(t)] == [4, 8, 12]


@pytest.mark.parametrize('delay,warmup_steps', [(1, 0), (2, 3), (3, 2), (4, 1), (5, 0)])
def test_same_pull_steps_as_numpy_reference(delay, warmup_steps):
    # tests/reference.py implements the timing on its own; its applied pulls must coincide.
    steps = horizon(delay, warmup_steps)
    traj = reference.simulate({'w': np.zeros(2, np.float32)},
                              lambda w, rank, t: {'w': np.ones(2, np.float32)},
                              num_workers=1, steps=steps, delay=delay,
                              warmup_steps=warmup_steps, lr=0.1, rule='sgd')
    sched = DelaySchedule(delay, warmup_steps)
    assert traj.pulls == [t for t in range(steps) if sched.applies_pull(t)]
    assert traj.pulls  # the horizon covers several periods


def test_default_counter_is_zero():
    assert DelaySchedule(4, 200).step == 0


@pytest.mark.parametrize('delay,warmup_steps,step', [(4, 200, 0), (3, 2, 17), (1, 0, 5)])
def test_state_dict_round_trip(delay, warmup_steps, step):
    sched = DelaySchedule(delay, warmup_steps, step=step)
    state = sched.state_dict()
    assert state == {'step': step, 'delay': delay, 'warmup_steps': warmup_steps}
    # checkpoints store it as JSON (the trainer's index file)
    restored = DelaySchedule(**json.loads(json.dumps(state)))
    assert restored.state_dict() == state
    for t in range(horizon(delay, min(warmup_steps, 10))):
        assert restored.phase(t) == sched.phase(t)
        assert restored.issues_pull(t) == sched.issues_pull(t)
        assert restored.applies_pull(t) == sched.applies_pull(t)


def test_state_dict_is_a_snapshot():
    sched = DelaySchedule(3, 2, step=5)
    state = sched.state_dict()
    sched.step = 9
    assert state['step'] == 5
    state['step'] = 1
    assert sched.step == 9
