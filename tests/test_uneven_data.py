"""Uneven data: workers with different numbers of batches finish cleanly, and exactly.

Real jobs (scheduler, servers, workers over sockets) of tests/scripts/mlp_model.py, whose data
is a function of (rank, round), checked step by step against the numpy reference of
docs/design.md §1 in which a worker without data in a round contributes a zero gradient (and, in its
delayed phase, makes its local update with it): that is what ``trainer.join()`` and the
padding at a script's end promise. Stock MXNet ``dist_sync`` hangs in every one of these
configurations (the longer worker waits forever for a round the shorter one never pushes).
"""
import json
import os
import sys

import mxdelay  # noqa: F401  before mxnet
import mxnet as mx
import numpy as np
import pytest

from kvstore_ext.checkpoint import files
from support.jobs import SCRIPTS, run_job
from support.reference_jobs import (MLP_BASE as BASE, assert_uneven_matches_reference, run_mlp_job,
                                    simulate_uneven)
from scripts import mlp_model


CASES = [
    # (num_workers, num_servers, batches per epoch, delay, warmup_steps, slack)
    (2, 1, [5, 8], 2, 3, None),    # the switch and delayed phase inside the filled rounds
    (2, 1, [8, 5], 3, 0, 6),       # the other rank short; slack beyond the period
    (2, 1, [1, 4], 1, 2, None),    # one batch against four
    (2, 1, [3, 3], 2, 1, None),    # even data: join costs no round
    (3, 2, [6, 0, 3], 3, 2, None),  # an empty shard: that worker never takes a step
    (3, 1, [2, 5, 4], 2, 6, None),  # three lengths, the warm-up across the epoch end
]
IDS = ['N%d-S%d-%s-k%d-W%d' % (c[0], c[1], '-'.join(map(str, c[2])), c[3], c[4]) for c in CASES]


@pytest.mark.jobs
@pytest.mark.parametrize('num_workers,num_servers,batches,delay,warmup,slack', CASES, ids=IDS)
def test_join_at_every_epoch_end_is_exact(tmp_path, num_workers, num_servers, batches, delay,
                                          warmup, slack):
    config = dict(BASE, batches=batches, epochs=2, join=True, delay=delay, warmup_steps=warmup,
                  slack=slack)
    histories = run_mlp_job(tmp_path, num_workers, config, num_servers=num_servers)
    assert_uneven_matches_reference(histories, config,
                                    simulate_uneven(config, num_workers, warmup))


@pytest.mark.jobs
@pytest.mark.parametrize('num_workers,num_servers,batches,delay,warmup,slack',
                         [c for c in CASES if min(c[2]) > 0], ids=[
                             i for i, c in zip(IDS, CASES) if min(c[2]) > 0])
def test_scripts_that_end_first_fill_the_rounds_of_the_others(
        tmp_path, num_workers, num_servers, batches, delay, warmup, slack):
    # No join at all: a worker whose data runs out goes straight on into its next epoch, and
    # when its script ends it pushes zero gradients into the others' remaining rounds at
    # exit. Every recorded step of every worker is exact.
    config = dict(BASE, batches=batches, epochs=2, delay=delay, warmup_steps=warmup,
                  slack=slack)
    histories = run_mlp_job(tmp_path, num_workers, config, num_servers=num_servers)
    assert_uneven_matches_reference(histories, config,
                                    simulate_uneven(config, num_workers, warmup))


@pytest.mark.jobs
@pytest.mark.parametrize('join', [True, False], ids=['join', 'no-join'])
def test_other_and_smaller_last_batch_sizes_scale_each_workers_gradient(tmp_path, join):
    # Worker 1 uses batches of 4 against worker 0's 6, and every epoch ends with a batch of
    # 2: each worker's gradient is scaled by its own batch size (the servers apply worker 0's
    # 1/6; the others' pushes are scaled relative to it), without a command and without
    # rescaling anyone else's gradient.
    config = dict(BASE, batches=[3, 5], epochs=2, join=join, delay=2, warmup_steps=2,
                  batch_sizes={'1': 4}, last_batch=2)
    histories = run_mlp_job(tmp_path, 2, config)
    assert_uneven_matches_reference(histories, config, simulate_uneven(config, 2, 2))


@pytest.mark.jobs
def test_stock_gluon_trainer_with_uneven_data_finishes(tmp_path):
    # A stock gluon.Trainer on 'dist_delay': the same padding at exit (synchronous SGD,
    # i.e. the reference with warm-up over every round).
    config = dict(BASE, batches=[4, 9], epochs=1, delay=1, warmup_steps=0, trainer='gluon',
                  kvstore='dist_delay')
    histories = run_mlp_job(tmp_path, 2, config)
    assert_uneven_matches_reference(histories, config, simulate_uneven(config, 2, 9))


@pytest.mark.jobs
def test_save_states_meets_uneven_workers(tmp_path):
    # save_states is collective: it joins first, so workers that arrive after different
    # numbers of steps meet at the same round and save it.
    config = dict(BASE, batches=[2, 5], epochs=1, delay=2, warmup_steps=1, save_at_end=True)
    histories = run_mlp_job(tmp_path, 2, config)
    assert_uneven_matches_reference(histories, config, simulate_uneven(config, 2, 1))
    ckpt = tmp_path / 'out' / 'ckpt'
    for rank in range(2):
        state = files.read_archive('%s.worker%d' % (ckpt, rank), files.WORKER)
        assert state['schedule']['step'] == 5


@pytest.mark.jobs
def test_continuing_after_a_worker_left_is_an_error_not_a_hang(tmp_path):
    # Misuse: worker 0's script ends (no join) while worker 1 joins at its epoch end and
    # trains on. Worker 1 must fail at its next step with a message, and the job must end.
    config = dict(BASE, batches=[3, 5], epochs=2, join=[1], delay=2, warmup_steps=1)
    out = tmp_path / 'out'
    out.mkdir()
    result = run_job([sys.executable, os.path.join(SCRIPTS, 'mlp_job.py'),
                      json.dumps(config), str(out)], num_workers=2, timeout=60)
    assert result.returncode != 0, result.stdout[-3000:]
    assert 'workers ended their training script while this worker goes on' in result.stderr
    assert result.duration < 30


@pytest.mark.parametrize('kvstore', ['local', None])
def test_join_without_a_distributed_kvstore_changes_nothing(kvstore):
    net, _ = mlp_model.build([mx.cpu()])
    trainer = mxdelay.DelayedTrainer(net.collect_params(), 'sgd', {'learning_rate': 0.1},
                                     kvstore=kvstore, delay=2, warmup_steps=0)
    before = {name: p.data().asnumpy() for name, p in net.collect_params().items()}
    assert trainer.join() == 0
    for name, param in net.collect_params().items():
        np.testing.assert_array_equal(param.data().asnumpy(), before[name])
