"""Faults in real distributed jobs (scheduler, server and workers over sockets, run by
mxdelay-launch), with DelayedTrainer mid-training (delay 3, warm-up 3, checkpoints).

1. Fault matrix: kill -9 a worker, the server or the scheduler, or let a worker raise. The
   job must end within 15 s with a non-zero exit and a launcher verdict naming the role and
   rank, leave no process, and its last complete checkpoint must resume to exactly the
   weights of a run that never failed (N = 2: the server's sums are exact, so bit for bit).
2. A second job on the same machine does not disturb a running one.
3. Broken checkpoint files given to ``DelayedTrainer.load_states`` raise ValueError on
   every worker and change nothing (training continues bit for bit as without the load).
4. Mismatched settings across workers fail at start-up naming both values; a kvstore typo
   fails at construction.

Every job has a hard timeout (``--timeout`` and the test's own), a free port chosen by the
launcher, and a ``PidFile``: the tests kill only the PIDs it recorded, and check that none
is left. Data is a pure function of (rank, step) (scripts/fault_job.py).

Set ``MXDELAY_FAULTS_TABLE=path`` to write the measured fault matrix as a Markdown table
(docs/limits.md's section "Faults and bad input" states the behaviour).
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import mxdelay
import reference
from scripts import mlp_model
from support.jobs import JobResult, PidFile, assert_ok, run_job, started_job, worker_lines

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, 'scripts', 'fault_job.py')

NAMES = ('w1', 'b1', 'w2', 'b2')
#: Checkpoints after steps 3 (the switch), 7, 11, 15 (a pull pending) and 19.
BASE = {'steps': 22, 'batch': 6, 'lr': 0.1, 'momentum': 0.9, 'wd': 1e-3, 'delay': 3,
        'warmup_steps': 3, 'ckpt_every': 4}
MARK = 12             # faults land after step 12: the checkpoint after step 11 is complete
PACE = 0.3            # seconds per step after MARK: the fault lands mid-training
JOB_TIMEOUT = 60      # hard limit of every job, in the launcher (--timeout) and here
EXIT_WITHIN = 15.0    # a job must end this soon after a fault
LIMIT = ('--timeout', str(JOB_TIMEOUT))
#: The tolerance against the numpy reference (see test_trainer_distributed.py).
RTOL, ATOL = 1e-5, 1e-6

FAULT_ROWS = []


def command(config, out):
    return [sys.executable, SCRIPT, json.dumps(config), str(out)]


def histories_in(out, num_workers=2):
    """{rank: {'first': int, name: (steps - first, ...) array}} of a finished job."""
    result = {}
    for rank in range(num_workers):
        with np.load(str(out / ('worker%d.npz' % rank))) as npz:
            result[rank] = {key: npz[key] for key in npz.files}
    return result


def run_fault_job(out, config, num_workers=2, pids=None, expect_ok=True):
    """Run fault_job.py to its end; return (JobResult, histories or None)."""
    out.mkdir(parents=True, exist_ok=True)
    pids = pids or PidFile(out / 'pids')
    result = run_job(pids.wrap(command(config, out)), num_workers=num_workers,
                     timeout=JOB_TIMEOUT + 15, extra_launcher_args=LIMIT)
    pids.assert_all_dead()
    if not expect_ok:
        return result, None
    assert_ok(result)
    return result, histories_in(out, num_workers)


def assert_bitwise(histories, expected, what):
    """Each worker's trajectory equals `expected`'s from its first step on, bit for bit."""
    for rank, history in histories.items():
        first = int(history['first'])
        for name in NAMES:
            np.testing.assert_array_equal(
                history[name], expected[rank][name][first:],
                err_msg='%s: worker %d, parameter %s (steps %d..)' % (what, rank, name, first))


def simulate(config):
    def grad_fn(weights, rank, step):
        x, y = mlp_model.batch(rank, step, config['batch'])
        return mlp_model.numpy_grad(weights, x, y)
    return reference.simulate(
        mlp_model.init_params(), grad_fn, 2, config['steps'], config['delay'],
        config['warmup_steps'], config['lr'], momentum=config['momentum'], wd=config['wd'],
        rescale_grad=1.0 / config['batch'], rule='mirror')


def assert_matches_simulation(histories, config):
    trajectory = simulate(config)
    for rank, history in histories.items():
        for name in NAMES:
            for t, got in enumerate(history[name]):
                np.testing.assert_allclose(got, trajectory.local[t][rank][name], rtol=RTOL,
                                           atol=ATOL, err_msg='worker %d step %d %s'
                                           % (rank, t, name))


def wait_for(condition, popen, what, timeout=JOB_TIMEOUT):
    """Poll `condition` until true; fail with the job's output if the job ends first."""
    deadline = time.monotonic() + timeout
    while not condition():
        if popen.poll() is not None:
            stdout, stderr = popen.communicate()
            raise AssertionError('job ended (exit %s) before %s\n--- stdout\n%s--- stderr\n%s'
                                 % (popen.returncode, what, stdout, stderr))
        if time.monotonic() > deadline:
            raise AssertionError('no %s within %g s' % (what, timeout))
        time.sleep(0.02)


def finish(popen, started):
    """Wait for a started job's launcher (hard timeout); return its JobResult."""
    try:
        stdout, stderr = popen.communicate(timeout=JOB_TIMEOUT + 15)
    except subprocess.TimeoutExpired:
        raise AssertionError('launcher still running %g s after the fault'
                             % (JOB_TIMEOUT + 15)) from None
    return JobResult(popen.returncode, stdout, stderr, time.monotonic() - started)


def launcher_errors(stderr):
    return [line[len('mxdelay-launch: '):] for line in stderr.splitlines()
            if line.startswith('mxdelay-launch: ') and 'stopping the job' in line]


def complete_checkpoints(ckpt_dir):
    """Steps whose checkpoint is complete: the index (written last) and every part."""
    steps = []
    for name in os.listdir(ckpt_dir):
        match = re.fullmatch(r'step(\d+)', name)
        if match:
            prefix = os.path.join(ckpt_dir, name)
            parts = ['', '.kvstore', '.kvstore.server0'] + [
                suffix % rank for rank in range(2)
                for suffix in ('.worker%d', '.net.worker%d.params')]
            assert all(os.path.exists(prefix + part) for part in parts), \
                'checkpoint %s has an index but lacks a part' % prefix
            steps.append(int(match.group(1)))
    return sorted(steps)


@pytest.fixture(scope='module')
def reference_run(tmp_path_factory):
    """The uninterrupted run: (out dir, histories); checked against the numpy reference."""
    out = tmp_path_factory.mktemp('reference')
    _, histories = run_fault_job(out, BASE)
    assert_matches_simulation(histories, BASE)
    assert complete_checkpoints(out / 'ckpt') == [3, 7, 11, 15, 19]
    return out, histories


@pytest.fixture(scope='module', autouse=True)
def fault_table():
    yield
    path = os.environ.get('MXDELAY_FAULTS_TABLE')
    if path and FAULT_ROWS:
        lines = ['| fault | exit code | launcher message | time to exit | checkpoint usable |',
                 '|---|---|---|---|---|']
        lines += ['| %s | %d | `%s` | %.2f s | %s |' % row for row in FAULT_ROWS]
        with open(path, 'w', encoding='utf-8') as table:
            table.write('\n'.join(lines) + '\n')


# -- 1. fault matrix --------------------------------------------------------------------------

FAULTS = [
    # (description, role, launcher rank, how)
    ('kill -9 worker 0', 'worker', 0, 'kill'),
    ('kill -9 server 0', 'server', 0, 'kill'),
    ('kill -9 scheduler', 'scheduler', 0, 'kill'),
    ('worker 1 raises', 'worker', 1, 'raise'),
]


@pytest.mark.jobs
@pytest.mark.parametrize('description,role,rank,how', FAULTS,
                         ids=['kill-worker0', 'kill-server0', 'kill-scheduler', 'worker1-raises'])
def test_fault_ends_job_and_last_checkpoint_resumes_exactly(tmp_path, reference_run,
                                                            description, role, rank, how):
    _, expected = reference_run
    out = tmp_path / 'faulty'
    out.mkdir()
    pids = PidFile(tmp_path / 'pids')
    # Worker 1 does not pace: it runs on into the checkpoint after step 15 (collective) and
    # waits there for worker 0, so the fault lands while a checkpoint is being written.
    config = dict(BASE, marker_at=MARK, pace=PACE, by_launcher_rank={'1': {'pace': 0.0}})
    if how == 'raise':
        config.update(raise_rank=rank, raise_at=MARK + 1)
    markers = [out / ('marker.worker%d' % r) for r in range(2)]
    started = time.monotonic()
    with started_job(pids.wrap(command(config, out)), 2, 1, extra_launcher_args=LIMIT) as popen:
        if how == 'kill':
            wait_for(lambda: all(m.exists() for m in markers), popen,
                     'marker of both workers after step %d' % MARK)
            os.kill(pids.wait(4)[(role, rank)], signal.SIGKILL)
            fault_at = time.time()
        result = finish(popen, started)
        ended_at = time.time()
    if how == 'raise':  # the worker raises by itself, right after its marker
        assert (out / ('marker.worker%d' % rank)).exists()
        fault_at = float((out / ('fault.worker%d' % rank)).read_text())
    elapsed = ended_at - fault_at

    label = role if role == 'scheduler' else '%s %d' % (role, rank)
    if how == 'kill':
        verdict, code = '%s died with signal SIGKILL (exit -9); stopping the job' % label, 137
    else:
        verdict, code = '%s exited with code 1; stopping the job' % label, 1
        assert any('injected fault' in line for line in worker_lines(result.stderr, rank))
    errors = launcher_errors(result.stderr)
    assert errors[:1] == [verdict], result.stderr
    assert result.returncode == code, result.stderr
    assert elapsed < EXIT_WITHIN, 'job took %.1f s to end after the fault' % elapsed
    pids.assert_all_dead()
    assert not (out / 'worker0.npz').exists() and not (out / 'worker1.npz').exists()

    # The last complete checkpoint resumes to exactly the uninterrupted run's weights.
    steps = complete_checkpoints(out / 'ckpt')
    assert steps and steps[-1] >= MARK - 1, steps
    partial = sorted({int(m.group(1)) for m in map(re.compile(r'step(\d+)\.').match,
                                                     os.listdir(str(out / 'ckpt')))
                      if m and int(m.group(1)) not in steps})
    prefix = out / 'ckpt' / ('step%d' % steps[-1])
    _, resumed = run_fault_job(tmp_path / 'resumed', dict(BASE, resume_from=str(prefix)))
    for history in resumed.values():
        assert int(history['first']) == steps[-1] + 1
    assert_bitwise(resumed, expected, 'resumed after %s' % description)
    FAULT_ROWS.append((description, result.returncode, errors[0], elapsed,
                       'yes: step %d%s, resumed bit-identical'
                       % (steps[-1], ''.join(' (step %d partial, ignored)' % p for p in partial))))


# -- 2. two jobs on one machine ---------------------------------------------------------------

@pytest.mark.jobs
def test_second_job_does_not_disturb_a_running_one(tmp_path, reference_run):
    # Job A is held after step 8 (every process alive, mid-training) while job B starts and
    # reaches the same point; then both train to the end at once. B differs (lr, momentum):
    # any cross-talk would move A off the reference run or B off its simulation.
    _, expected = reference_run
    go = tmp_path / 'go'
    configs = {'a': dict(BASE, marker_at=8, hold=str(go), pace=0.05),
               'b': dict(BASE, lr=0.05, momentum=0.5, ckpt_every=None, marker_at=8,
                         hold=str(go), pace=0.05)}
    outs = {name: tmp_path / name for name in configs}
    pids = {name: PidFile(tmp_path / ('pids.' + name)) for name in configs}
    results = {}
    for out in outs.values():
        out.mkdir()
    started = time.monotonic()
    with started_job(pids['a'].wrap(command(configs['a'], outs['a'])), 2, 1,
                     extra_launcher_args=LIMIT) as job_a:
        wait_for(lambda: all((outs['a'] / ('marker.worker%d' % r)).exists() for r in range(2)),
                 job_a, 'job A mid-training')
        with started_job(pids['b'].wrap(command(configs['b'], outs['b'])), 2, 1,
                         extra_launcher_args=LIMIT) as job_b:
            wait_for(lambda: all((outs['b'] / ('marker.worker%d' % r)).exists()
                                 for r in range(2)), job_b, 'job B mid-training')
            assert job_a.poll() is None
            go.touch()
            results['b'] = finish(job_b, started)
        results['a'] = finish(job_a, started)
    for name, result in results.items():
        assert_ok(result)
        pids[name].assert_all_dead()
    ports = {name: re.search(r'scheduler at 127\.0\.0\.1:(\d+)', result.stderr).group(1)
             for name, result in results.items()}
    assert ports['a'] != ports['b']
    assert_bitwise(histories_in(outs['a']), expected, 'job A')
    assert_matches_simulation(histories_in(outs['b']), configs['b'])


# -- 3. broken checkpoint files ---------------------------------------------------------------

def copy_checkpoint(prefix, new_prefix):
    """Copy every file of checkpoint `prefix` to `new_prefix` (the index names the servers'
    files relative to its own folder, so the copy is self-contained)."""
    folder, base = os.path.split(prefix)
    for name in os.listdir(folder):
        if name == base or name.startswith(base + '.'):
            shutil.copyfile(os.path.join(folder, name), new_prefix + name[len(base):])
    return new_prefix


def truncate(path):
    with open(path, 'rb') as src:
        data = src.read()
    with open(path, 'wb') as dst:
        dst.write(data[:len(data) // 2])


def gluon_trainer_states(path):
    """Write a stock gluon.Trainer's states file (a momentum state after one step)."""
    from mxnet import autograd, gluon, nd  # pylint: disable=import-outside-toplevel
    net = mlp_model.build()[0]
    trainer = gluon.Trainer(net.collect_params(), 'sgd',
                            {'learning_rate': 0.1, 'momentum': 0.9}, kvstore=None)
    x, y = mlp_model.batch(0, 0, 6)
    with autograd.record():
        loss = gluon.loss.L2Loss()(net(nd.array(x)), nd.array(y))
    loss.backward()
    trainer.step(6)
    trainer.save_states(path)
    return path


def broken_checkpoints(good, folder):
    """{case: (path given to load_states, the broken file, pattern of the message)}."""
    def copy(name):
        return copy_checkpoint(good, str(folder / name))

    cases = {}
    prefix = copy('index_truncated')
    truncate(prefix)
    cases['truncated trainer index'] = (prefix, prefix, 'is not an mxdelay trainer state file')
    prefix = copy('workers_truncated')
    for rank in range(2):
        truncate(prefix + '.worker%d' % rank)
    cases['truncated worker files'] = (prefix, prefix + '.worker', 'is not a readable mxdelay '
                                                                   'worker state')
    prefix = copy('kvstore_truncated')
    truncate(prefix + '.kvstore')
    cases['truncated kvstore index'] = (prefix, prefix + '.kvstore',
                                        'is not an mxdelay kvstore state file')
    gluon_file = gluon_trainer_states(str(folder / 'gluon.states'))
    cases['gluon.Trainer states file'] = (gluon_file, gluon_file,
                                          'is not an mxdelay trainer state file')
    prefix = copy('workers_gluon')
    for rank in range(2):
        shutil.copyfile(gluon_file, prefix + '.worker%d' % rank)
    cases['gluon.Trainer file as worker files'] = (prefix, prefix + '.worker',
                                                   'is not an mxdelay worker state file')
    random_file = str(folder / 'random')
    with open(random_file, 'wb') as dst:
        dst.write(np.random.RandomState(0).bytes(4096))
    cases['random bytes'] = (random_file, random_file, 'is not an mxdelay trainer state file')
    empty = str(folder / 'empty')
    open(empty, 'wb').close()
    cases['empty file'] = (empty, empty, 'is not an mxdelay trainer state file')
    missing = str(folder / 'missing')
    cases['missing file'] = (missing, missing, 'does not exist')
    return cases


@pytest.mark.jobs
def test_broken_checkpoints_raise_valueerror_and_change_nothing(tmp_path, reference_run):
    # After step 9 (a pull is pending) every worker tries each broken checkpoint, then trains
    # on: every load must raise ValueError naming the file, and the trajectory (worker and
    # server weights, rounds, pending pull) must stay exactly the reference run's.
    ref_out, expected = reference_run
    folder = tmp_path / 'broken'
    folder.mkdir()
    cases = broken_checkpoints(str(ref_out / 'ckpt' / 'step11'), folder)
    config = dict(BASE, bad_load_at=9, bad_loads=[c[0] for c in cases.values()],
                  hang_timeout=20)
    out = tmp_path / 'job'
    _, histories = run_fault_job(out, config)
    for rank in range(2):
        loads = load_outcomes(out, rank)
        assert loads['weights_unchanged'], 'worker %d: a failed load changed its weights' % rank
        assert len(loads['outcomes']) == len(cases)
        for (case, (_, bad_file, pattern)), outcome in zip(cases.items(), loads['outcomes']):
            assert outcome['type'] == 'ValueError', (rank, case, outcome)
            assert bad_file in outcome['message'], (rank, case, outcome)
            assert pattern in outcome['message'], (rank, case, outcome)
    assert_bitwise(histories, expected, 'after the failed loads')


def load_outcomes(out, rank):
    """What fault_job.py's worker `rank` recorded of its loads of broken checkpoints."""
    with open(str(out / ('loads.worker%d.json' % rank)), encoding='utf-8') as src:
        return json.load(src)


@pytest.mark.jobs
@pytest.mark.parametrize('suffix', ['.worker1', '.kvstore.server0'],
                         ids=['one-worker-file', 'server-file'])
def test_one_broken_file_raises_valueerror_on_every_worker(tmp_path, reference_run, suffix):
    # Only one worker (or only the server) can see the broken file; the collective check
    # must still make both workers raise, change nothing, and name the file.
    ref_out, expected = reference_run
    prefix = copy_checkpoint(str(ref_out / 'ckpt' / 'step11'), str(tmp_path / 'bad'))
    truncate(prefix + suffix)
    config = dict(BASE, bad_load_at=9, bad_loads=[prefix], hang_timeout=5)
    out = tmp_path / 'job'
    result, _ = run_fault_job(out, config, expect_ok=False)
    assert_ok(result)
    for rank in range(2):
        loads = load_outcomes(out, rank)
        outcome = loads['outcomes'][0]
        assert outcome['type'] == 'ValueError', (rank, outcome)
        assert prefix + suffix in outcome['message'], (rank, outcome)
        assert loads['weights_unchanged'], 'worker %d: a failed load changed its weights' % rank
    assert_bitwise(histories_in(out), expected, 'after the failed load')


@pytest.mark.jobs
def test_copied_checkpoint_resumes_from_its_own_files(tmp_path, reference_run):
    # A user writes ckpt/latest after step 7, backs it up with cp, and training goes on
    # writing ckpt/latest (here: the step-11 checkpoint). Resuming from the backup must
    # resume from step 7: worker files, kvstore index and server files of the backup.
    ref_out, expected = reference_run
    (tmp_path / 'ckpt').mkdir()
    (tmp_path / 'backup').mkdir()
    latest = copy_checkpoint(str(ref_out / 'ckpt' / 'step7'), str(tmp_path / 'ckpt' / 'latest'))
    for name in os.listdir(str(tmp_path / 'ckpt')):      # cp ckpt/latest* backup/
        shutil.copyfile(str(tmp_path / 'ckpt' / name), str(tmp_path / 'backup' / name))
    copy_checkpoint(str(ref_out / 'ckpt' / 'step11'), latest)   # training went on
    backup = str(tmp_path / 'backup' / 'latest')
    _, resumed = run_fault_job(tmp_path / 'resumed', dict(BASE, resume_from=backup))
    for history in resumed.values():
        assert int(history['first']) == 8
    assert_bitwise(resumed, expected, 'resumed from the copied checkpoint')


# -- 4. bad settings: early, clear errors -----------------------------------------------------

MISMATCHES = [('delay', 3, 4), ('warmup_steps', 3, 5)]


@pytest.mark.jobs
@pytest.mark.parametrize('name,value0,value1', MISMATCHES, ids=[m[0] for m in MISMATCHES])
def test_workers_with_different_settings_fail_at_start_naming_both(tmp_path, name, value0,
                                                                   value1):
    config = dict(BASE, by_launcher_rank={'0': {name: value0}, '1': {name: value1}})
    result, _ = run_fault_job(tmp_path / 'job', config, expect_ok=False)
    assert result.returncode == 1, result.stderr
    assert 'step 0 done' not in result.stdout          # no step was taken
    assert re.search(r'worker \d exited with code 1; stopping the job', result.stderr)
    found = re.findall(r"workers disagree on %s: worker 0 \(mxdelay-launch's worker \d\) has "
                       r"(\d+), worker 1 \(mxdelay-launch's worker \d\) has (\d+)" % name,
                       result.stderr)
    assert found and {tuple(sorted(map(int, pair))) for pair in found} == {(value0, value1)}, \
        result.stderr


@pytest.mark.jobs
def test_kvstore_typo_fails_at_construction(tmp_path):
    # In-process: the constructor refuses it before any kvstore exists.
    net = mlp_model.build()[0]
    with pytest.raises(ValueError, match=r"kvstore='dist_dealy'.*kvstore='dist_delay'"):
        mxdelay.DelayedTrainer(net.collect_params(), 'sgd', {'learning_rate': 0.1},
                                         kvstore='dist_dealy', delay=3, warmup_steps=3)
    # In a job: the workers fail at once, the job ends naming one.
    result, _ = run_fault_job(tmp_path / 'job', dict(BASE, kvstore='dist_dealy'),
                              expect_ok=False)
    assert result.returncode == 1, result.stderr
    assert 'step 0 done' not in result.stdout
    assert re.search(r'worker \d exited with code 1; stopping the job', result.stderr)
    assert "ValueError: kvstore='dist_dealy'" in result.stderr
