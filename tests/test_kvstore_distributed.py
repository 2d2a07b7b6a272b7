"""The 'dist_delay' kvstore and mxdelay's server in real jobs (tests/scripts/kv_job.py).

Values pushed encode the worker's rank and the round (``round + 1000 * rank``), so a pulled
sum tells exactly which gradients a round contained.
"""
import os
import sys

import pytest

from support.jobs import KV_JOB, assert_ok, kv_results, run_job



def run_kv(mode, args, num_workers, num_servers, tmp_path=None, timeout=90):
    env = {'MXDELAY_CHUNK_SIZE': '1000'}   # the 2500-element key spans 3 chunks
    result = run_job([sys.executable, KV_JOB, mode] + [str(a) for a in args],
                     num_workers=num_workers, num_servers=num_servers, env=env,
                     timeout=timeout)
    return result


@pytest.mark.jobs
@pytest.mark.parametrize('num_workers,num_servers', [(2, 1), (3, 2)])
def test_every_round_holds_one_gradient_of_each_worker(num_workers, num_servers):
    # Worker 1 sleeps 30 ms before each push; the others run ahead within the slack and
    # pull every round without waiting. Every pull must be exactly its own round's sum.
    rounds = 12
    result = run_kv('rounds', [3, rounds, 0.03], num_workers, num_servers)
    assert_ok(result)
    results = kv_results(result)
    assert sorted(results) == list(range(num_workers))
    for rank, data in results.items():
        assert data['bad'] == [], 'worker %d pulled wrong sums: %s' % (rank, data['bad'])
        # Every chunk (5: the 2500-element key has 3) completed all rounds on one server.
        applied = [c['rounds'] for server in data['stats'] for c in server['chunks'].values()]
        assert sorted(applied) == [rounds] * 5
        assert all(c['held'] == 0 for s in data['stats'] for c in s['chunks'].values())


@pytest.mark.jobs
@pytest.mark.alone   # its 5 free rounds take < 50 ms: not while another test's job runs
def test_fast_worker_runs_ahead_only_within_the_slack():
    # slack 3: worker 0 prepares rounds 0..4 without waiting (round t's buffer is free until
    # round t - 4 must be acknowledged), then waits for the slow worker (0.25 s per round).
    sleep = 0.25
    result = run_kv('slack', [3, sleep], 2, 1)
    assert_ok(result)
    fast = kv_results(result)[0]
    assert fast['ok']
    waits = fast['waits']
    slack = fast['slack']
    assert max(waits[:slack + 2]) < sleep / 5, waits
    assert waits[slack + 2] > sleep / 2, waits


@pytest.mark.jobs
def test_controller_commands(tmp_path):
    # Closed forms with N = 2 workers, SGD lr 0.5 then 0.25, rescale 1, weights start at 1,
    # every worker pushes ones: W1 = 1 - 0.5*2 = 0, W2 = W1 - 0.25*2 = -0.5, W3 = -1.0;
    # after reloading the state saved at W2 and pushing twos: W3' = -0.5 - 0.25*4 = -1.5.
    result = run_kv('commands', [str(tmp_path)], 2, 2)
    assert_ok(result)
    results = kv_results(result)
    for data in results.values():
        assert data['after_round0'] == 0.0
        assert data['after_round1'] == -0.5          # set_learning_rate reached the server
        assert data['after_round2'] == -1.0
        assert data['after_reload'] == -1.5          # weights, lr and rounds restored
        assert data['rounds_after_reload'] == 3
        assert data['after_broken_load'] == -1.5     # a refused load changed nothing
        owned = [s['chunks'] for s in data['stats']]
        assert {'0': {'rounds': 2, 'held': 0}} in owned and {} in owned
    rank0 = results[0]
    assert 'not a readable mxdelay server state' in rank0['broken_load']
    assert rank0['bogus'][0] is False and "unknown mxdelay command 'bogus'" in rank0['bogus'][1]
    assert rank0['bogus'][2] == 99                   # the reply answers that command
    assert os.path.exists(str(tmp_path / 'kv.states'))
    assert not [n for n in os.listdir(str(tmp_path)) if n.endswith('.tmp')]


@pytest.mark.jobs
@pytest.mark.parametrize('num_servers', [1, 2])
def test_commands_act_after_the_pushes_issued_before_them(num_servers):
    # The gradient of rounds 0 and 1 takes 1 s in the engine, so the pushes are still queued
    # when server_stats() and set_learning_rate() are called. With N = 2 workers pushing ones:
    # W1 = -0.5*2 = -1, W2 = -2 (lr 0.5), W3 = -2 - 0.25*2 = -2.5 (lr 0.25 from round 2).
    result = run_kv('ordering', [], 2, num_servers)
    assert_ok(result)
    for data in kv_results(result).values():
        assert data['rounds'] == [1]          # STATS saw this worker's round 0
        assert data['after_round2'] == -2.5   # SET_HYPER did not reach round 1


@pytest.mark.jobs
def test_stock_server_is_detected():
    # The script imports mxnet before mxdelay, so MXNet's stock servers run: the worker must
    # refuse to train and say how to launch.
    result = run_kv('stock_first', [], 2, 1, timeout=60)
    assert result.returncode != 0
    assert "not mxdelay's server" in result.stderr
    assert 'mxdelay-run' in result.stderr
    assert 'RESULT' not in result.stdout
