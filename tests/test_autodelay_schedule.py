"""The schedule of ``delay='auto'`` (``PullSchedule.amend``: the decided k and the fallback
round F) against a brute-force statement of docs/design.md §1.2.

The statement: step t is synchronous iff t <= W or t >= F; the delayed steps t0 <= t < F
issue a pull when ``(t - t0) % k == k - 1`` and the next step applies it if it is delayed
too; the pulled rounds are the synchronous ones and the issuing ones; ``previous(t)`` is
the largest pulled round below t (-1: none). Every predicate is compared with it at every
step of many (k, W, F). Also the amendments' checks, the unchanged behaviour of a fixed k,
and the checkpoint state. Tolerance: none, everything is integer and exact.
"""
import json

import pytest

from kvstore_ext.protocol.schedule import PullSchedule
from mxdelay.schedule import DELAYED, SWITCH, SYNCHRONOUS, WARMUP, DelaySchedule


def statement(k, warmup, fallback, end):
    """Per step: (phase, synchronous, issues, applies, pulled, previous), by walking."""
    t0 = warmup + 1
    sync = [t <= warmup or (fallback is not None and t >= fallback) for t in range(end)]
    issues = [not sync[t] and t >= t0 and (t - t0) % k == k - 1 for t in range(end)]
    applies = [t > 0 and not sync[t] and issues[t - 1] for t in range(end)]
    pulled = [sync[t] or issues[t] for t in range(end)]
    previous = [max([r for r in range(t) if pulled[r]], default=-1) for t in range(end)]
    phases = [WARMUP if t < warmup else SWITCH if t == warmup else
              SYNCHRONOUS if sync[t] else DELAYED for t in range(end)]
    return list(zip(phases, sync, issues, applies, pulled, previous))


def observed(schedule, end):
    return [(schedule.phase(t), schedule.is_synchronous(t), schedule.issues_pull(t),
             schedule.applies_pull(t), schedule.pulled(t), schedule.previous(t))
            for t in range(end)]


CASES = [(k, w, j) for k in (2, 3, 4) for w in (0, 1, 5) for j in (None, 1, 2, 3)]


@pytest.mark.parametrize('k,warmup,periods', CASES)
def test_decided_delay_and_fallback_follow_the_statement(k, warmup, periods):
    t0 = warmup + 1
    fallback = None if periods is None else t0 + periods * k
    schedule = PullSchedule('auto', warmup)
    schedule.amend(delay=k, synchronous_from=fallback)
    end = t0 + 6 * k + 3
    assert observed(schedule, end) == statement(k, warmup, fallback, end)
    assert schedule.decided


@pytest.mark.parametrize('warmup', [0, 1, 5])
def test_staying_synchronous_needs_no_delay(warmup):
    schedule = PullSchedule('auto', warmup)
    schedule.amend(synchronous_from=warmup + 1)
    assert schedule.decided and schedule.delay is None
    end = warmup + 12
    # k is never asked: any k gives the same statement when F = t0.
    assert observed(schedule, end) == statement(1, warmup, warmup + 1, end)


@pytest.mark.parametrize('k', [1, 2, 4, 5])
@pytest.mark.parametrize('warmup', [0, 3])
def test_a_fixed_delay_is_the_statement_without_fallback(k, warmup):
    schedule = PullSchedule(k, warmup)
    end = warmup + 6 * k + 3
    assert observed(schedule, end) == statement(k, warmup, None, end)
    assert schedule.decided and not schedule.auto
    with pytest.raises(ValueError, match="only a delay='auto' schedule"):
        schedule.amend(delay=k)


def test_undecided_auto_answers_the_warmup_and_refuses_delayed_steps():
    schedule = PullSchedule('auto', 3)
    assert not schedule.decided
    assert [schedule.is_synchronous(t) for t in range(4)] == [True] * 4
    assert [schedule.pulled(t) for t in range(4)] == [True] * 4
    assert schedule.previous(4) == 3
    for predicate in (schedule.is_synchronous, schedule.issues_pull, schedule.pulled):
        with pytest.raises(RuntimeError, match="before the job decided k"):
            predicate(5)
    assert schedule.describe() == {'delay': 'auto', 'warmup_steps': 3}


@pytest.mark.parametrize('delay,fallback,match', [
    (1, None, 'decides k >= 2'),
    (0, None, 'delay'),
    (257, None, 'delay'),
    ('4', None, 'delay'),
    (4, 3, 'synchronous_from'),          # before t0 = 4
    (4, 6, 'does not start a period'),   # t0 + 2
    (None, 8, 'does not start a period'),
])
def test_amend_checks(delay, fallback, match):
    schedule = PullSchedule('auto', 3)
    with pytest.raises(ValueError, match=match):
        schedule.amend(delay=delay, synchronous_from=fallback)
    assert schedule.amendments() == {'delay': None, 'synchronous_from': None}


@pytest.mark.parametrize('delay', ['Auto', 'fast', None, 2.0])
def test_delay_must_be_an_int_or_auto(delay):
    with pytest.raises(ValueError, match="delay='auto'"):
        PullSchedule(delay, 3)


def test_checkpoint_state_keeps_the_decisions():
    schedule = DelaySchedule('auto', 2, step=11)
    assert schedule.state_dict() == {'step': 11, 'delay': 'auto', 'warmup_steps': 2,
                                     'amendments': {'delay': None, 'synchronous_from': None}}
    schedule.amend(delay=4, synchronous_from=11)
    state = json.loads(json.dumps(schedule.state_dict()))
    restored = DelaySchedule(state['delay'], state['warmup_steps'], state['step'])
    restored.amend(**state['amendments'])
    assert observed(restored, 30) == observed(schedule, 30)
    # A fixed delay's state is unchanged (checkpoints of earlier versions load as before).
    assert DelaySchedule(4, 2, step=3).state_dict() == {'step': 3, 'delay': 4,
                                                       'warmup_steps': 2}
