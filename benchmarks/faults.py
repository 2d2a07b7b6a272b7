"""How fast a job ends after a fault: the fault matrix of tests/test_faults.py, and the misuse
case of tests/test_uneven_data.py, run ``--rounds`` times each, with the time from the fault
to the launcher's exit.

Cases (the jobs of the tests, launched by ``mxdelay/launcher.py`` run as a plain file with
``-n 2 -s 1 --timeout 60`` and an explicit environment: this one minus every ``DMLC_*``,
``MXNET_*`` and ``MXDELAY_*`` variable, plus ``OMP_NUM_THREADS=1`` and the repository on
``PYTHONPATH``):

``kill-worker0``, ``kill-server0``, ``kill-scheduler``, ``worker1-raises``
    tests/scripts/fault_job.py: DelayedTrainer (delay 3, warm-up 3), SGD with momentum 0.9 and
    weight decay 1e-3, a checkpoint after every 4th step. After step 12 launcher worker 0
    sleeps 0.3 s before each step and launcher worker 1 runs on into the collective
    checkpoint after step 15, where it waits. Once both have passed step 12 (their marker
    files), the driver sends SIGKILL to the role (its PID as recorded by the job's PID file);
    the fault time is taken right after ``os.kill``. For ``worker1-raises``, launcher worker 1
    raises an uncaught exception before step 13; the fault time is the one it writes just
    before the ``raise``.
``misuse``
    tests/scripts/mlp_job.py with batches [3, 5] for 2 epochs: ps-lite rank 0 calls no
    ``join`` and its script ends after its 6 steps, while rank 1 joins at its epoch end and
    trains on; rank 1 must raise at its next push or barrier. The fault time is the end of
    rank 0's script (its last line, before what runs at exit, which fills rank 1's rounds
    and then waits in ps-lite's exit barrier); the table also gives the job's whole wall
    time.

Time to exit: from the fault to the return of ``waitpid`` on the launcher, on
``time.time()`` (markers are polled every 5 ms). The procedure is fixed here: ``--rounds`` rounds, each running every
case of ``--cases`` once, every other round in the reverse order; nothing is excluded. Each run
records the load average before and after, and the CPU other processes used during it
(``cpu_other``, cores, from /proc; a run above 0.25 cores is flagged noisy). Also recorded
per run: the exit code, the launcher's verdict line, whether every process of the job is gone
5 s after the launcher's exit, and the checkpoints left (complete: the index exists).

Writes ``faults.json`` (every run, the commit, command, machine and load) and ``faults.md``
into ``--out`` (default docs/benchmarks); each run's launcher output and files go to
``bench_out/faults/`` (not committed).

Usage: ``python benchmarks/faults.py [--rounds 3] [--cases kill-worker0,...,misuse]``
"""
import argparse
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time

from cpu_monitor import CpuMonitor
import harness
import provenance
import report

REPO = harness.REPO
SCRIPTS = os.path.join(REPO, 'tests', 'scripts')

JOB_TIMEOUT = 60
NOISY_CORES = report.NOISE_CORES
POLL = 0.005
#: tests/test_faults.py's BASE, MARK and PACE.
FAULT_BASE = {'steps': 22, 'batch': 6, 'lr': 0.1, 'momentum': 0.9, 'wd': 1e-3, 'delay': 3,
              'warmup_steps': 3, 'ckpt_every': 4, 'marker_at': 12, 'pace': 0.3,
              'by_launcher_rank': {'1': {'pace': 0.0}}}
#: tests/test_uneven_data.py's misuse case (on tests/test_trainer_distributed.py's BASE).
MISUSE = {'steps': 16, 'batch': 6, 'lr': 0.1, 'momentum': 0.9, 'wd': 1e-3, 'batches': [3, 5],
          'epochs': 2, 'join': [1], 'delay': 2, 'warmup_steps': 1, 'end_marker': True}
#: case -> (what, role killed or None, launcher rank)
CASES = {
    'kill-worker0': ('kill -9 worker 0', 'worker', 0),
    'kill-server0': ('kill -9 server 0', 'server', 0),
    'kill-scheduler': ('kill -9 scheduler', 'scheduler', 0),
    'worker1-raises': ('uncaught exception in worker 1', None, 1),
    'misuse': ("worker's script ends while the other trains on (no join)", None, None),
}


def pid_alive(pid):
    """Whether process `pid` exists and is not a zombie."""
    try:
        with open('/proc/%d/stat' % pid, encoding='ascii') as stat:
            return stat.read().rpartition(')')[2].split()[0] != 'Z'
    except FileNotFoundError:
        return False


class PidFile:
    """Each role of a job appends ``PID ROLE RANK`` to `path` (as the tests' PidFile does):
    the driver kills a role by its own PID and checks that none is left."""

    def __init__(self, path):
        self.path = path

    def wrap(self, command):
        record = 'echo "$$ $DMLC_ROLE $MXDELAY_RANK" >> %s; exec "$@"' % shlex.quote(self.path)
        return ['sh', '-c', record, 'sh'] + list(command)

    def read(self):
        """``{(role, rank): pid}`` of the roles recorded so far."""
        pids = {}
        if os.path.exists(self.path):
            with open(self.path, encoding='ascii') as src:
                for fields in (line.split() for line in src):
                    if len(fields) == 3:   # a line being written may be incomplete
                        pids[(fields[1], int(fields[2]))] = int(fields[0])
        return pids

    def wait(self, count, timeout=30.0):
        deadline = time.monotonic() + timeout
        while len(self.read()) < count:
            if time.monotonic() > deadline:
                raise RuntimeError('only %r of %d roles recorded in %s' % (self.read(), count,
                                                                          self.path))
            time.sleep(0.05)
        return self.read()


def command(case, folder):
    if case == 'misuse':
        return [sys.executable, os.path.join(SCRIPTS, 'mlp_job.py'), json.dumps(MISUSE), folder]
    config = dict(FAULT_BASE)
    if case == 'worker1-raises':
        config.update(raise_rank=1, raise_at=FAULT_BASE['marker_at'] + 1)
    return [sys.executable, os.path.join(SCRIPTS, 'fault_job.py'), json.dumps(config), folder]


def checkpoints(folder):
    """(complete, partial) checkpoint steps left in `folder`/ckpt."""
    ckpt = os.path.join(folder, 'ckpt')
    names = os.listdir(ckpt) if os.path.isdir(ckpt) else []
    complete = sorted(int(m.group(1)) for m in map(re.compile(r'step(\d+)$').match, names) if m)
    partial = sorted({int(m.group(1)) for m in map(re.compile(r'step(\d+)\.').match, names)
                      if m} - set(complete))
    return complete, partial


def run_case(case, folder):
    """Run one job of `case` and inject its fault; return the run's record."""
    what, role, rank = CASES[case]
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    pids = PidFile(os.path.join(folder, 'pids'))
    # The repository first on the jobs' path: the test scripts import mxdelay from it.
    job = harness.Job(pids.wrap(command(case, folder)), JOB_TIMEOUT, env={
        'PYTHONPATH': os.pathsep.join([REPO] + [p for p in os.environ.get(
            'PYTHONPATH', '').split(os.pathsep) if p])})
    record = dict(case=case, fault=what, load_before=os.getloadavg()[0])
    fault_at = None
    with open(os.path.join(folder, 'stdout.txt'), 'wb') as out, \
            open(os.path.join(folder, 'stderr.txt'), 'wb') as err, \
            CpuMonitor({os.getpid(): 'driver'}) as monitor:
        started = time.time()
        popen = job.start(stdout=out, stderr=err, cwd=REPO)
        deadline = time.monotonic() + JOB_TIMEOUT + 30
        try:
            markers = [os.path.join(folder, 'marker.worker%d' % r) for r in range(2)]
            # Poll for both markers and kill, then block in waitpid, which returns as the
            # launcher exits.
            while role is not None and fault_at is None and popen.poll() is None and \
                    time.monotonic() < deadline:
                if all(map(os.path.exists, markers)):
                    os.kill(pids.wait(4)[(role, rank)], signal.SIGKILL)
                    fault_at = time.time()
                time.sleep(POLL)
            try:
                popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise RuntimeError('%s: the launcher did not exit within %d s'
                                   % (case, JOB_TIMEOUT + 30)) from None
            ended = time.time()
        finally:
            if popen.poll() is None:
                os.killpg(popen.pid, signal.SIGKILL)
                popen.wait()
    if case == 'worker1-raises':
        with open(os.path.join(folder, 'fault.worker1'), encoding='ascii') as src:
            fault_at = float(src.read())
    if case == 'misuse':   # the leaving worker's script end (the other never reaches its own)
        ends = {}
        for worker in range(2):
            path = os.path.join(folder, 'ended.worker%d' % worker)
            if os.path.exists(path):
                with open(path, encoding='ascii') as src:
                    ends[worker] = float(src.read())
        if ends:
            record['left'] = 'rank %d' % min(ends, key=ends.get)
            fault_at = min(ends.values())
    with open(os.path.join(folder, 'stderr.txt'), encoding='utf-8', errors='replace') as src:
        stderr = src.read()
    verdicts = [line[len('mxdelay-launch: '):] for line in stderr.splitlines()
                if line.startswith('mxdelay-launch: ') and 'stopping the job' in line]
    left_deadline = time.monotonic() + 5
    while any(map(pid_alive, pids.read().values())) and time.monotonic() < left_deadline:
        time.sleep(0.05)
    complete, partial = checkpoints(folder)
    record.update(
        exit_code=popen.returncode, verdict=verdicts[0] if verdicts else None,
        fault_seen=fault_at is not None,
        seconds_to_exit=None if fault_at is None else ended - fault_at,
        job_seconds=ended - started, load_after=os.getloadavg()[0],
        cpu_other=monitor.usage(started, ended)['other'],
        processes_left=sorted('%s %d' % key for key, pid in pids.read().items()
                              if pid_alive(pid)),
        roles_recorded=len(pids.read()), checkpoints_complete=complete,
        checkpoints_partial=partial,
        raised=('injected fault' in stderr if case == 'worker1-raises' else
                'workers ended their training script while this worker goes on' in stderr
                if case == 'misuse' else None))
    return record


def _range(values, fmt='%.2f'):
    values = [v for v in values if v is not None]
    if not values:
        return 'n/a'
    if len(values) == 1:
        return fmt % values[0]
    return (fmt + ' (%s-%s)') % (statistics.median(values), fmt % min(values), fmt % max(values))


def write_markdown(path, meta, runs, cases):
    lines = [
        '# How fast a job ends after a fault', '',
        '%s; load average (1 min) %.2f before, %.2f after. Every run: [faults.json](faults.json).'
        % (provenance.generated_by(meta), meta['load_before'][0], meta['load_after'][0]), '',
        '`mxdelay/launcher.py -n 2 -s 1 --timeout %d` (as a plain file, explicit environment '
        'without `DMLC_*`/`MXNET_*`/`MXDELAY_*`). The fault matrix runs '
        '`tests/scripts/fault_job.py` as tests/test_faults.py does (DelayedTrainer, delay 3, '
        'warm-up 3, a checkpoint after every 4th step; the fault lands after step 12 while '
        'worker 1 waits in the checkpoint after step 15); the misuse case runs '
        '`tests/scripts/mlp_job.py` as tests/test_uneven_data.py does. Time to exit: from the '
        'fault (right after `kill`; the line before the `raise`; the end of the leaving '
        'worker\'s script) to the launcher\'s exit. %d rounds, every other round in the reverse order; '
        'nothing excluded; median (min-max) over the rounds. A run during which other '
        'processes used more than %.2f cores is noisy: %s.' % (
            JOB_TIMEOUT, meta['rounds'], NOISY_CORES,
            ', '.join('%s round %d (%.2f cores)' % (r['case'], r['round'], r['cpu_other'])
                      for r in runs if r['cpu_other'] > NOISY_CORES) or 'none'), '']
    body = []
    for case in cases:
        rows = [r for r in runs if r['case'] == case]
        body.append([
            CASES[case][0], ' '.join(str(r['exit_code']) for r in rows),
            '; '.join('`%s`' % v for v in sorted({r['verdict'] or '(none)' for r in rows})),
            _range([r['seconds_to_exit'] for r in rows]),
            ' '.join('n/a' if r['seconds_to_exit'] is None else '%.2f' % r['seconds_to_exit']
                     for r in rows),
            _range([r['job_seconds'] for r in rows], '%.1f'),
            'none' if not any(r['processes_left'] for r in rows) else '; '.join(
                ', '.join(r['processes_left']) for r in rows if r['processes_left']),
            ' / '.join('%s; %s' % (','.join(map(str, r['checkpoints_complete'])) or '-',
                                   ','.join(map(str, r['checkpoints_partial'])) or '-')
                       for r in rows) if case != 'misuse' else '(none written)'])
    lines += report.table('fault | exit codes | launcher message | time to exit (s) | per round '
                          '(s) | job wall time (s) | processes left | checkpoints left '
                          '(complete; partial)', body, 'lllrlrll')
    lines += ['', 'Whether a checkpoint resumes bit-identically is tested by '
              '`tests/test_faults.py` (it is not re-checked here).']
    report.write_lines(path, lines)
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--rounds', type=int, default=3)
    parser.add_argument('--cases', default=','.join(CASES))
    parser.add_argument('--out', default=os.path.join(REPO, 'docs', 'benchmarks'))
    parser.add_argument('--raw', default=os.path.join(REPO, 'bench_out', 'faults'))
    args = parser.parse_args(argv)
    cases = [c for c in args.cases.split(',') if c]
    for case in cases:
        if case not in CASES:
            parser.error('unknown case %r; the cases are %s' % (case, ', '.join(CASES)))
    meta = dict(command='python benchmarks/faults.py ' + shlex.join(
                    sys.argv[1:] if argv is None else argv),
                started=provenance.now(),
                load_before=os.getloadavg(), code=provenance.code_version(),
                machine=provenance.machine(),
                rounds=args.rounds, cases=cases, job_timeout=JOB_TIMEOUT,
                fault_config=FAULT_BASE, misuse_config=MISUSE, noisy_cores=NOISY_CORES)
    runs = []
    for round_index in range(1, args.rounds + 1):
        for case in harness.ordered(cases, round_index):
            record = run_case(case, os.path.join(args.raw, '%s-%d' % (case, round_index)))
            record['round'] = round_index
            runs.append(record)
            print('round %d %-15s exit %s, %s s to exit, job %.1f s, other %.2f cores: %s'
                  % (round_index, case, record['exit_code'],
                     'n/a' if record['seconds_to_exit'] is None
                     else '%.2f' % record['seconds_to_exit'], record['job_seconds'],
                     record['cpu_other'], record['verdict']), flush=True)
    harness.finish_meta(meta)
    os.makedirs(args.out, exist_ok=True)
    report.write_json(os.path.join(args.out, 'faults.json'), dict(meta=meta, runs=runs))
    lines = write_markdown(os.path.join(args.out, 'faults.md'), meta, runs, cases)
    print('\n'.join(lines[-3 - len(cases):]))
    ok = all(r['exit_code'] != 0 and r['fault_seen'] and not r['processes_left'] for r in runs)
    return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(main())
