"""``mxdelay-launch --max-restarts``: a failed job runs again, and the options of periodic
checkpoints.

The jobs are small shell scripts that fail on purpose (an exit code, or a SIGKILL of one
role by its PID); every role appends its PID to a file, so that the tests can check that no
process of any attempt is left. Hard timeouts throughout; the back-off's first wait (1 s) is
the launcher's own.
"""
import os
import re
import signal
import subprocess
import time

import pytest

from mxdelay.launching import restarts
from support.jobs import LAUNCHER, job_env, pid_alive, run_job, started_job, worker_lines

pytestmark = pytest.mark.timeout(60)

# Every role records "PID ROLE RANK" in $1 and runs the rest of the script ($2).
RECORD = 'echo "$$ $DMLC_ROLE $MXDELAY_RANK" >> "$1"; %s'


def roles(tmp_path, script):
    """The command of every role: record its PID in tmp_path/pids, then run `script` (sh)."""
    return ['sh', '-c', RECORD % script, 'sh', str(tmp_path / 'pids')]


def assert_all_dead(tmp_path, count):
    """Every role of every attempt recorded its PID, and none is alive."""
    pids = [int(line.split()[0]) for line in (tmp_path / 'pids').read_text().splitlines()]
    assert len(pids) == count, pids
    deadline = time.monotonic() + 5
    while any(pid_alive(pid) for pid in pids):
        assert time.monotonic() < deadline, 'left behind: %r' % [p for p in pids if pid_alive(p)]
        time.sleep(0.05)


def test_backoff_doubles_until_its_cap_and_starts_over_after_a_long_attempt():
    waits, wait = [], None
    for _ in range(7):
        wait = restarts.backoff(wait, ran=1.0)
        waits.append(wait)
    assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert restarts.backoff(30.0, ran=restarts.STABLE_SECONDS) == 1.0


# Worker 0 fails with exit code 3 in its first FAILS attempts (counted in a file), once
# the ROLES roles of the attempt have recorded their PIDs (the launcher stops the others).
FLAKY = ('if [ "$DMLC_ROLE" = worker ] && [ "$MXDELAY_RANK" = 0 ]; then '
         'n=$(($(cat %(count)s 2>/dev/null || echo 0) + 1)); echo $n > %(count)s; '
         'echo "attempt $n"; [ $n -gt %(fails)d ] && exit 0; '
         'while [ $(wc -l < "$1") -lt $((n * %(roles)d)) ]; do sleep 0.02; done; exit 3; fi')


@pytest.mark.jobs
def test_a_failed_job_runs_again_until_it_succeeds(tmp_path):
    script = FLAKY % {'count': tmp_path / 'count', 'fails': 2, 'roles': 4}
    result = run_job(roles(tmp_path, script), num_workers=2, timeout=30,
                     extra_launcher_args=['--max-restarts', '3'])
    assert result.returncode == 0, result.stderr
    assert worker_lines(result.stdout, 0) == ['attempt 1', 'attempt 2', 'attempt 3']
    launcher = [line for line in result.stderr.splitlines() if not line.startswith('[')]
    ended = [line for line in launcher if ' ended after ' in line]
    assert len(ended) == 2
    for attempt, wait, line in zip((1, 2), (1, 2), ended):
        assert re.fullmatch(
            r'mxdelay-launch: attempt %d of at most 4 ended after [0-9.]+ s: worker 0 exited '
            r'with code 3; starting every role again in %d s \(restart %d of 3\); no '
            r'--checkpoint-dir: the job starts over, unless its script resumes by itself'
            % (attempt, wait, attempt), line), line
    assert 'mxdelay-launch: attempt 3 of at most 4' in launcher
    assert re.search(r'the job finished in attempt 3, after surviving 2 failure\(s\): attempt 1 '
                     r'after [0-9.]+ s: worker 0 exited with code 3; attempt 2 after [0-9.]+ s: '
                     r'worker 0 exited with code 3$', result.stderr, re.MULTILINE)
    assert result.duration > 3   # the back-off: 1 s, then 2 s
    assert_all_dead(tmp_path, 3 * 4)


@pytest.mark.jobs
def test_the_last_failure_ends_the_launcher_when_the_restarts_are_used_up(tmp_path):
    script = FLAKY % {'count': tmp_path / 'count', 'fails': 99, 'roles': 3}
    result = run_job(roles(tmp_path, script), num_workers=1, timeout=30,
                     extra_launcher_args=['--max-restarts', '1'])
    assert result.returncode == 3, result.stderr
    assert re.search(r'giving up: attempt 2 of 2 failed \(--max-restarts 1\); the failures: '
                     r'attempt 1 after [0-9.]+ s: worker 0 exited with code 3; attempt 2 after '
                     r'[0-9.]+ s: worker 0 exited with code 3$', result.stderr, re.MULTILINE)
    assert_all_dead(tmp_path, 2 * 3)


@pytest.mark.jobs
def test_no_restart_without_max_restarts(tmp_path):
    script = FLAKY % {'count': tmp_path / 'count', 'fails': 99, 'roles': 3}
    result = run_job(roles(tmp_path, script), num_workers=1, timeout=30)
    assert result.returncode == 3
    assert 'attempt' not in result.stderr and worker_lines(result.stdout, 0) == ['attempt 1']


@pytest.mark.jobs
@pytest.mark.parametrize('victim', [('server', 0), ('scheduler', 0), ('worker', 1)])
def test_a_role_killed_by_its_pid_restarts_the_job(tmp_path, victim):
    # Attempt 1: every role waits; the test kills one by its PID. Attempt 2: all exit 0.
    marker = tmp_path / 'killed'
    script = '[ -e %s ] && exit 0; exec sleep 30' % marker
    with started_job(roles(tmp_path, script), num_workers=2,
                     extra_launcher_args=['--max-restarts', '1']) as launcher:
        deadline = time.monotonic() + 20
        while len(_pids(tmp_path)) < 4:
            assert time.monotonic() < deadline and launcher.poll() is None, 'roles not started'
            time.sleep(0.05)
        marker.touch()
        os.kill(_pids(tmp_path)[victim], signal.SIGKILL)
        stdout, stderr = launcher.communicate(timeout=30)
    assert launcher.returncode == 0, stdout + stderr
    label = victim[0] if victim[0] == 'scheduler' else '%s %d' % victim
    assert re.search(r'attempt 1 of at most 2 ended after [0-9.]+ s: %s died with signal SIGKILL '
                     r'\(exit -9\); starting every role again in 1 s' % label, stderr), stderr
    assert 'the job finished in attempt 2, after surviving 1 failure(s)' in stderr
    assert_all_dead(tmp_path, 2 * 4)


def _pids(tmp_path):
    path = tmp_path / 'pids'
    lines = path.read_text().splitlines() if path.exists() else []
    return {(role, int(rank)): int(pid) for pid, role, rank in
            (line.split() for line in lines if len(line.split()) == 3)}


@pytest.mark.jobs
def test_a_signal_during_the_back_off_stops_the_launcher(tmp_path):
    script = FLAKY % {'count': tmp_path / 'count', 'fails': 99, 'roles': 3}
    with started_job(roles(tmp_path, script), num_workers=1,
                     extra_launcher_args=['--max-restarts', '5']) as launcher:
        seen = []
        for line in launcher.stderr:
            seen.append(line)
            if 'starting every role again in 1 s' in line:
                launcher.send_signal(signal.SIGTERM)
                break
        stdout, stderr = launcher.communicate(timeout=20)
    assert launcher.returncode == 128 + signal.SIGTERM, stdout + ''.join(seen) + stderr
    assert 'received SIGTERM during the back-off; stopping' in stderr
    assert worker_lines(stdout, 0) == ['attempt 1']


@pytest.mark.jobs
def test_timeout_bounds_every_attempt_together(tmp_path):
    script = FLAKY % {'count': tmp_path / 'count', 'fails': 99, 'roles': 3}
    result = run_job(roles(tmp_path, script), num_workers=1, timeout=30,
                     extra_launcher_args=['--max-restarts', '50', '--timeout', '2'])
    assert result.returncode == 124, result.stderr
    assert 'ran longer than --timeout 2 s' in result.stderr
    assert result.duration < 10


# -- periodic checkpoints --------------------------------------------------------------------
ECHO_CHECKPOINTS = ('echo "$DMLC_ROLE ${MXDELAY_CHECKPOINT_DIR-unset} '
                    '${MXDELAY_CHECKPOINT_EVERY-unset} ${MXDELAY_KEEP_CHECKPOINTS-unset}"')


@pytest.mark.jobs
def test_checkpoint_options_reach_the_workers_and_the_restart_says_where_it_resumes(tmp_path):
    folder = tmp_path / 'ckpt'
    folder.mkdir()
    for name in ('step-00000007', 'step-00000007.worker0', 'step-00000013.worker0'):
        (folder / name).write_text('')   # only 7 is complete: 13 has no index
    script = ECHO_CHECKPOINTS + '; ' + FLAKY % {'count': tmp_path / 'count', 'fails': 1,
                                               'roles': 3}
    result = run_job(roles(tmp_path, script), num_workers=1, timeout=30, cwd=tmp_path,
                     extra_launcher_args=['--max-restarts', '1', '--checkpoint-dir', 'ckpt',
                                          '--checkpoint-every', '6', '--keep-checkpoints', '3'])
    assert result.returncode == 0, result.stderr
    assert worker_lines(result.stdout, 0) == ['worker %s 6 3' % folder, 'attempt 1',
                                              'worker %s 6 3' % folder, 'attempt 2']
    # Only the workers train: the servers and the scheduler get nothing of it.
    assert 'server unset unset unset' in result.stdout
    assert ('starting every role again in 1 s (restart 1 of 1); the workers resume from the '
            'checkpoint of step 7 (%s/step-00000007)' % folder) in result.stderr


@pytest.mark.jobs
def test_a_restart_without_a_complete_checkpoint_says_the_job_starts_over(tmp_path):
    script = FLAKY % {'count': tmp_path / 'count', 'fails': 1, 'roles': 3}
    result = run_job(roles(tmp_path, script), num_workers=1, timeout=30, cwd=tmp_path,
                     extra_launcher_args=['--max-restarts', '1', '--checkpoint-dir', 'none-yet',
                                          '--checkpoint-every', '6'])
    assert result.returncode == 0, result.stderr
    assert ('no complete checkpoint in %s yet: the job starts over' % (tmp_path / 'none-yet')
            in result.stderr)


@pytest.mark.parametrize('args, message', [
    (['--max-restarts', '-1'], '--max-restarts must be 0 or more, got -1'),
    (['--checkpoint-every', '5'], '--checkpoint-every needs --checkpoint-dir DIR and '
                                  '--checkpoint-every STEPS, got --checkpoint-every 5'),
    (['--checkpoint-dir', 'ckpt'], '--checkpoint-dir needs --checkpoint-dir DIR and '
                                   '--checkpoint-every STEPS, got --checkpoint-dir ckpt'),
    (['--checkpoint-dir', 'ckpt', '--checkpoint-every', '0'],
     '--checkpoint-every must be at least 1, got 0'),
    (['--checkpoint-dir', 'ckpt', '--checkpoint-every', '5', '--keep-checkpoints', '0'],
     '--keep-checkpoints must be at least 1, got 0'),
    (['--checkpoint-dir', 'a-file', '--checkpoint-every', '5'],
     '--checkpoint-dir a-file is a file, not a folder'),
    (['--checkpoint-dir', 'ckpt', '--checkpoint-every', '5', '--env-worker',
      'MXDELAY_CHECKPOINT_DIR:x'], '--env-worker MXDELAY_CHECKPOINT_DIR:... and '
                                   '--checkpoint-dir both set MXDELAY_CHECKPOINT_DIR; drop one'),
])
def test_bad_restart_and_checkpoint_options_fail_at_once(tmp_path, args, message):
    (tmp_path / 'a-file').write_text('')
    done = subprocess.run(list(LAUNCHER) + ['-n', '1'] + args + ['touch', 'started'],
                          cwd=tmp_path, env=job_env(), capture_output=True, text=True,
                          timeout=20, check=False)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr
    assert not (tmp_path / 'started').exists()
