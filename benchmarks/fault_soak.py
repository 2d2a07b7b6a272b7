"""Fault soak: the example's MLP on 1 Gbit/s per-node links, SIGKILL of a random role at random
times, ``mxdelay-launch --max-restarts`` and periodic checkpoints bringing the job back.

One job of ``examples/train_fashion_mnist.py`` (2 workers, 1 server, k=4; every role in a
network namespace of its own behind a 1 Gbit/s link, ``benchmarks/netns.py``) runs under
``mxdelay-launch --launcher netns --max-restarts R --checkpoint-dir D --checkpoint-every N``.
The driver kills a role (scheduler, server 0, worker 0 or worker 1, drawn with ``--seed``)
with SIGKILL, by the PID the role recorded, a random ``--gap`` seconds after the previous
resumed job made its first step, until the job ends. Worker 0 logs every step
(``MXDELAY_LOG_EVERY=1``), which dates each step. Per failure: the role, when, the step the
job had reached, the step it resumed at, the steps lost, and the restart time (from the
kill to the first step after the resume). Then the same job without kills: the final test
accuracy of both, and whether the final parameters are the same bytes (a resumed job
continues bit for bit, and the data of a step depends only on its index).

Usage (root; about 20 minutes): ``python benchmarks/fault_soak.py`` writing ``--out``
(default docs/benchmarks/restarts/soak/): results.json and results.md.
"""
import argparse
import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

import harness

__all__ = ['main']

EXAMPLE = os.path.join(harness.REPO, 'examples', 'train_fashion_mnist.py')
COMMAND = 'python benchmarks/fault_soak.py'
ROLES = (('scheduler', 0), ('server', 0), ('worker', 0), ('worker', 1))
# Worker 0's log lines (the example's format: date, time, rank, level, message).
_STAMP = r'^\[worker \d\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) rank 0 INFO '
_STEP = re.compile(_STAMP + r'DelayedTrainer: worker 0 step (\d+):')
_RESUMED = re.compile(_STAMP + r'DelayedTrainer: (?:resumed from \S+ at step (\d+)|no complete '
                      r'checkpoint in \S+: starting at step (\d+))')
_EPOCH = re.compile(_STAMP + r'epoch (\d+)/\d+: .* test acc ([0-9.]+)')


def _seconds(stamp):
    """The wall time of a log stamp (local time, milliseconds)."""
    whole, millis = stamp.split(',')
    return time.mktime(time.strptime(whole, '%Y-%m-%d %H:%M:%S')) + int(millis) / 1e3


class _Watch:
    """The job's output, copied to a log and read for worker 0's steps, resumes and epochs."""

    def __init__(self, popen, log):
        self.steps = []      # (wall time, step index)
        self.resumes = []    # (wall time, step)
        self.epochs = {}     # epoch -> test accuracy (the last line of each epoch wins)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._read, args=(popen, log), daemon=True)
        self._thread.start()

    def _read(self, popen, log):
        for line in popen.stdout:
            log.write(line)
            with self._lock:
                for pattern, found in ((_STEP, self.steps), (_RESUMED, self.resumes)):
                    match = pattern.match(line)
                    if match:
                        found.append((_seconds(match.group(1)),
                                      int(next(g for g in match.groups()[1:] if g))))
                match = _EPOCH.match(line)
                if match:
                    self.epochs[int(match.group(2))] = float(match.group(3))

    def join(self):
        self._thread.join()

    def first_step_after(self, since):
        """(time, step) of the first step logged after wall time `since`, or None."""
        with self._lock:
            return next(((t, s) for t, s in self.steps if t > since), None)

    def last_step_before(self, until):
        with self._lock:
            return max((s for t, s in self.steps if t <= until), default=None)

    def resume_after(self, since):
        with self._lock:
            return next(((t, s) for t, s in self.resumes if t > since), None)


def _pids(path):
    """The newest PID of each role (each attempt's roles append theirs)."""
    pids = {}
    if os.path.exists(path):
        with open(path, encoding='ascii') as src:
            for line in src:
                fields = line.split()
                if len(fields) == 3:
                    pids[(fields[1], int(fields[2]))] = int(fields[0])
    return pids


def run(folder, hostfile, args, kills):
    """One job; with `kills`, kill roles as the module docstring says. Returns its record."""
    pids = os.path.join(folder, 'pids')
    ckpt = os.path.join(folder, 'ckpt')
    command = ['sh', '-c', 'echo "$$ $DMLC_ROLE $MXDELAY_RANK" >> %s; exec "$@"' % pids, 'sh',
               sys.executable, EXAMPLE, '--epochs', str(args.epochs), '--seed', str(args.seed),
               '--no-progress', '--checkpoint-dir', os.path.join(folder, 'epochs')]
    argv = [sys.executable, harness.LAUNCHER, '-n', '2', '-s', '1', '--launcher', 'netns',
            '-H', hostfile, '--timeout', str(args.timeout), '--max-restarts',
            str(args.max_restarts), '--checkpoint-dir', ckpt, '--checkpoint-every',
            str(args.every), '--']
    rng = random.Random(args.seed)
    failures = []
    started = time.time()
    with open(os.path.join(folder, 'job.log'), 'w', encoding='utf-8') as log:
        log.write('$ %s\n' % ' '.join(argv + command))
        popen = subprocess.Popen(  # pylint: disable=consider-using-with
            argv + command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, cwd=harness.REPO, start_new_session=True,
            env=harness.job_env(MXDELAY_LOG_EVERY='1'))
        watch = _Watch(popen, log)
        try:
            running_since = None
            while popen.poll() is None:
                time.sleep(0.2)
                if not kills:
                    continue
                if running_since is None:
                    # The first step after the attempt's resume (or fresh start): steps logged
                    # after a kill by the dying attempt do not count.
                    resumed = watch.resume_after(failures[-1]['killed'] if failures else 0)
                    first = resumed and watch.first_step_after(resumed[0])
                    if not first:
                        continue
                    running_since = first[0]
                    if failures:
                        failures[-1].update(resumed_step=resumed[1], first_step=first[1],
                                            restart_s=first[0] - failures[-1]['killed'])
                    next_kill = running_since + rng.uniform(*args.gap)
                    role = rng.choice(ROLES)
                if time.time() < next_kill:
                    continue
                pid = _pids(pids)[role]
                killed = time.time()
                os.kill(pid, signal.SIGKILL)
                reached = watch.last_step_before(killed)
                failures.append({'role': '%s %d' % role if role[0] != 'scheduler' else role[0],
                                 'pid': pid, 'killed': killed, 'at_s': killed - started,
                                 'reached_step': reached})
                running_since = None
        finally:
            if popen.poll() is None:
                os.killpg(popen.pid, signal.SIGTERM)
            popen.wait()
            watch.join()
    final = sorted(name for name in os.listdir(os.path.join(folder, 'epochs'))
                   if name.endswith('.params'))
    with open(os.path.join(folder, 'epochs', final[-1]), 'rb') as params:
        digest = hashlib.sha256(params.read()).hexdigest()
    for failure in failures:
        if failure.get('resumed_step') is not None and failure['reached_step'] is not None:
            failure['steps_lost'] = failure['reached_step'] + 1 - failure['resumed_step']
    return {'exit': popen.returncode, 'seconds': time.time() - started, 'failures': failures,
            'epochs': watch.epochs, 'params': final[-1], 'params_sha256': digest,
            'steps': watch.steps[-1][1] + 1 if watch.steps else 0}


def markdown(meta, soak, reference):
    lines = ['# Fault soak: the MLP on 1 Gbit/s links, roles killed at random', '',
             'Command: `%s`; commit %s; %s to %s; load %s before, %s after. Checkpoint every '
             '%d steps; kills %g to %g s after the previous resumed job\'s first step; '
             'seed %d.' % (meta['command'], meta['code_start'].get('commit'), meta['started'],
                           meta['finished'], ' '.join('%.2f' % v for v in meta['load_before']),
                           ' '.join('%.2f' % v for v in meta['load_after']), meta['every'],
                           meta['gap'][0], meta['gap'][1], meta['seed']), '',
             '| failure | role killed | at (s) | step reached | resumed at | steps lost | '
             'restart (s) |', '|---:|---|---:|---:|---:|---:|---:|']
    for number, failure in enumerate(soak['failures'], 1):
        lines.append('| %d | %s | %.0f | %s | %s | %s | %s |' % (
            number, failure['role'], failure['at_s'], failure['reached_step'],
            failure.get('resumed_step', '-'), failure.get('steps_lost', '-'),
            '%.1f' % failure['restart_s'] if 'restart_s' in failure else '-'))
    lines += ['', '| run | exit | wall (s) | test accuracy per epoch | final parameters |',
              '|---|---:|---:|---|---|']
    for name, record in (('with kills', soak), ('uninterrupted', reference)):
        lines.append('| %s | %d | %.0f | %s | %s (sha256 %s...) |' % (
            name, record['exit'], record['seconds'],
            ', '.join('%.4f' % record['epochs'][e] for e in sorted(record['epochs'])),
            record['params'], record['params_sha256'][:16]))
    same = soak['params_sha256'] == reference['params_sha256']
    lines += ['', 'Final parameters of the two runs: %s.' % (
        'the same bytes' if same else 'different')]
    return '\n'.join(lines) + '\n'


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--epochs', type=int, default=8)
    parser.add_argument('--every', type=int, default=100, help='--checkpoint-every')
    parser.add_argument('--gap', type=float, nargs=2, default=(40.0, 70.0),
                        help='seconds between a resumed job\'s first step and the next kill')
    parser.add_argument('--max-restarts', type=int, default=20)
    parser.add_argument('--seed', type=int, default=1)
    parser.add_argument('--timeout', type=int, default=3600)
    parser.add_argument('--out', default=os.path.join(harness.REPO, 'docs', 'benchmarks',
                                                      'restarts', 'soak'))
    args = parser.parse_args(argv)
    meta = harness.start_meta(harness.command_line(COMMAND, argv), every=args.every,
                              gap=list(args.gap), seed=args.seed, epochs=args.epochs)
    with harness.shaped_network(4, '1gbit') as (_, hostfile), \
            tempfile.TemporaryDirectory(prefix='fault-soak-') as folder:
        records = {}
        for name, kills in (('soak', True), ('reference', False)):
            os.makedirs(os.path.join(folder, name, 'epochs'))
            records[name] = run(os.path.join(folder, name), hostfile, args, kills)
            print(json.dumps(records[name]), flush=True)
    harness.finish_meta(meta)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, 'results.json'), 'w', encoding='utf-8') as dst:
        json.dump(dict(meta=meta, **records), dst, indent=1)
    text = markdown(meta, records['soak'], records['reference'])
    with open(os.path.join(args.out, 'results.md'), 'w', encoding='utf-8') as dst:
        dst.write(text)
    print(text)


if __name__ == '__main__':
    sys.exit(harness.run_stoppable(main))
