"""Reading a worker's timeline back: backward, pushes, pulls and waits per step.

Reads a Chrome trace written by :func:`mxdelay.timeline.recording` (MXNet's profiler) and
needs no MXNet: :func:`summarize` gives one row per step, :func:`totals` sums the rows,
:func:`format_table` prints both, :func:`parameter_rows` gives the per-parameter marks.
Definitions. Times are in ms from the first recorded event. *Communication* is this worker's
push and pull operations (``KVStoreDistDefaultPush``, ``KVStoreDistDefaultStoragePull``:
MXNet's engine runs one from the request to the server's answer, so a push lasts until its
round is complete on the server, a pull until the weights have arrived). A synchronous step
sends each chunk's round and receives its weights in one ``KVStoreDistDefaultStoragePushPull``
(docs/design.md §8), which counts as both a push and a pull; its ``MXKVStorePushPull`` calls
are the step's pull calls. *Local work* is
every other engine operator (forward, backward segments, copies, the local update), except
``WaitForVar`` and ``DeleteVariable`` (bookkeeping, they compute nothing). A step's *span*
runs from its first push's start to the next step's: it holds the step's backward tail,
its communication, its update and the next forward, which is where a synchronous step
waits. The last recorded step's span ends with the last local operator of the trace (after
it the end of `recording` only drains outstanding communication): its communication time
and wait leave out what a next step would have overlapped, so they are a lower bound.

MXNet's trace does not say which end of two overlapping operations of one name belongs
to which start (they are paired first in, first out): sums over a step and unions of
intervals are exact, the duration of a single push is not.

Per step. The steps are counted on the Python thread (a step's push calls follow its
``backward`` call); the push operations, in start order, are cut into as many equal blocks.
A block may hold more than ``pushes_per_step`` pushes: the kvstore's own per-round traffic
(``'dist_delay'`` pushes a two-element flag each round), which waits for no gradient and
starts first; those extra pushes count as communication but not as gradient pushes.

- ``backward_end``: the end of the last compute operation (a bulk segment or a backward
  operator) before the step's last push started -- the first layer's gradient is written;
- ``first_push``: the start of the step's first gradient push (the last layer's);
- ``last_push``: the start of the step's last push (the first layer's);
- ``overlap``: ``first_push < backward_end``: communication started while backward ran;
- ``push_ms``: the gradient pushes' total duration (request to acknowledgement, summed);
- ``hidden_ms``: the part of ``push_ms`` during which compute ran on this worker;
- ``comm_ms``: wall time in the step's span during which any push or pull was outstanding;
- ``comm_hidden_ms``: the part of ``comm_ms`` during which local work ran;
- ``backward_hidden_ms``: the part of ``comm_hidden_ms`` before ``backward_end`` (between
  the first push and the end of backward the only local work is backward and the copies
  that feed the pushes): communication hidden behind backward;
- ``pull_issued``: when the trainer called pull (the step's first pull call on the Python
  thread; None if the step issued no pull). Which step issued a pull is read from the
  order of the Python thread's calls (it follows that step's push calls), not from the
  schedule;
- ``pull_sent``: the start of the step's first pull operation, when the request goes out
  (``'dist_delay'`` orders a pull after its round's push, so it starts once that push is
  acknowledged);
- ``pull_received``: the end of the step's last pull operation: all weights have arrived;
- ``pull_applied`` and ``applied_step``: when, and at which step, the pulled weights
  replace the worker's weights. A copy into the weights is one ``CopyCPU2CPU`` among many
  in the trace, so this is derived, not read off one event: a synchronous step (warm-up,
  switch) pulls straight into the weights (applied = received, same step); in the delayed
  phase the trainer applies them at the next step's local update, which runs once that
  step's backward is over (applied = max(received, next step's ``backward_end``)). Needs
  the ``schedule`` argument; without it the pull is assumed synchronous;
- ``wait_ms``: time the worker's computation stood still because of communication. In the
  step's span, take every gap in which no local work ran; if a push or pull completed
  within the gap, the time from the gap's start to the last such completion counts as
  waiting (the work that resumed was released by it: the next forward waiting for a pull,
  the delayed update waiting for its pull, a gradient copy waiting for its slot's previous
  round). Gaps in which no communication completed (Python issuing the next operations,
  the data loader) do not count; nor does the tail of a gap after its last completion.
  It is a measure of idle time: it cannot tell a gap that Python caused from one that
  communication caused if a push or pull happened to complete in it.

:func:`totals` gives, over the rows (or the rows of one phase): the communication time,
the fraction of it hidden behind local work and behind backward, and the mean wait per
step.

Command line: ``python -m mxdelay.trace FILE...`` prints, per trace, the
per-step table, the totals, and :func:`step_budget`: the mean step, the share of it this
worker stood still waiting for communication, and what removing that wait would save at
most (an upper bound of what the delayed update can give on this job). A trace written
with ``MXDELAY_TIMELINE`` carries the keys per step, the schedule and the bytes of a push and
a pull (``otherData.mxdelay``; then the bytes sent and received per step are printed too,
and, from its warm-up steps, an estimate of what each delay and compression would save:
:mod:`mxdelay.estimate`);
for one written by :func:`mxdelay.timeline.recording` pass ``--keys-per-step`` (the trainer's
``keys_per_step``) and, for the phases, ``--warmup-steps`` and ``--delay``; ``--first-step``
numbers the rows. ``--merge OUT FILE...`` writes the workers' traces as one
(:mod:`mxdelay.trace_merge`).
"""
import argparse
import bisect
import json
import sys

from . import estimate, intervals
from .estimate import step_budget

__all__ = ['MARKER_DOMAIN', 'summarize', 'parameter_rows', 'totals', 'format_table',
           'step_budget', 'phase_groups', 'main']

#: The profiler domain of the per-parameter marks of :func:`mxdelay.timeline.recording`.
MARKER_DOMAIN = 'mxdelay'
_PUSH = 'KVStoreDistDefaultPush'
_PULL = 'KVStoreDistDefaultStoragePull'
_PUSHPULL = 'KVStoreDistDefaultStoragePushPull'   # a push and a pull in one request
_PUSH_CALL = 'MXKVStorePush'
_BACKWARD_CALL = 'MXAutogradBackwardEx'
_PULL_CALLS = ('MXKVStorePullWithSparse', 'MXKVStorePull', 'MXKVStorePullEx',
               'MXKVStorePushPull')
# Engine bookkeeping: they run no computation (WaitForVar "runs" while Python waits).
_NOT_WORK = ('WaitForVar', 'DeleteVariable')


def _read_trace(path):
    """``(events sorted by time, first and last event time in ms)`` of a trace; both
    :func:`summarize` and :func:`parameter_rows` count their times from that first event."""
    with open(path, encoding='utf-8') as src:
        events = sorted(json.load(src)['traceEvents'], key=lambda e: e.get('ts', 0))
    stamps = [e['ts'] / 1000.0 for e in events if 'ts' in e and e.get('ph') in 'BEbe']
    return events, min(stamps or [0.0]), max(stamps or [0.0])


def parameter_rows(path):
    """Per step and parameter, from a trace recorded with ``recording(path, trainer)``.

    Returns
    -------
    list of dict
        Sorted by step, then by the gradient's time: ``step``, ``parameter`` and, in ms from
        the trace's first event (None where the step had no such event), ``gradient``
        (backward wrote it), ``pushed`` (the round was acknowledged: every worker's gradient
        arrived and the server applied it), ``pull_received`` and ``pull_applied`` (the
        weights were replaced: at once in a synchronous step, at the next step's local
        update in the delayed phase, once that update has run; listed under the step that
        issued the pull).
    """
    events, origin, _ = _read_trace(path)
    rows = {}
    for event in events:
        if event.get('ph') != 'n' or not str(event.get('cat', '')).startswith(MARKER_DOMAIN):
            continue
        kind, parameter, step = event['name'].rsplit(' ', 2)
        row = rows.setdefault((int(step), parameter), dict(
            step=int(step), parameter=parameter, gradient=None, pushed=None,
            pull_received=None, pull_applied=None))
        row[kind] = event['ts'] / 1000.0 - origin
    return sorted(rows.values(), key=lambda r: (r['step'], r['gradient'] or 0.0))


def _intervals(events, accept, category='operator', phases='BE'):
    """[(start, end)] in ms of complete events of `category` whose name passes `accept`."""
    open_events, out = {}, []
    for event in events:
        name, phase = event.get('name'), event.get('ph')
        if event.get('cat') != category or not name or not accept(name):
            continue
        key = (name, event.get('tid'))
        if phase == phases[0]:
            open_events.setdefault(key, []).append(event['ts'])
        elif phase == phases[1] and open_events.get(key):
            out.append((open_events[key].pop(0) / 1000.0, event['ts'] / 1000.0))
    return sorted(out)


def _is_compute(name):
    return name == 'ImperativeBulk' or name.startswith('_backward') or \
        name in ('FullyConnected', 'Convolution', 'Activation')


def _is_local(name):
    return name not in (_PUSH, _PULL, _PUSHPULL) and name not in _NOT_WORK and \
        not name.startswith('KVStore')


def _wait(gaps, comm_ends):
    """Idle time released by communication (see the module docstring)."""
    total = 0.0
    for start, end in gaps:
        # The last completion in (start, end]: comm_ends is sorted.
        index = bisect.bisect_right(comm_ends, end) - 1
        if index >= 0 and comm_ends[index] > start:
            total += comm_ends[index] - start
    return total


def _python_steps(events):
    """(steps, {step: first pull call}) from the Python thread's C API calls.

    A step's pushes are the push calls after a ``backward`` call (the next step's pushes
    come after the next backward); a pull call belongs to the step of the push calls
    before it. Returns (0, {}) for a trace without C API events.
    """
    steps, after_backward, issued = 0, False, {}
    for event in events:
        if event.get('cat') != 'MXNET_C_API' or event.get('ph') != 'b':
            continue
        name = event.get('name')
        if name == _BACKWARD_CALL:
            after_backward = True
        elif name == _PUSH_CALL:
            if after_backward or not steps:
                steps += 1
            after_backward = False
        elif name in _PULL_CALLS and steps:
            issued.setdefault(steps - 1, event['ts'] / 1000.0)
    return steps, issued


def summarize(path, pushes_per_step, schedule=None, first_step=0):
    """One dict per recorded step of the trace at `path` (see the module docstring).

    Parameters
    ----------
    path : str
        A trace written by :func:`recording`.
    pushes_per_step : int
        Push operations per step: the number of kvstore keys a step pushes
        (``DelayedTrainer.keys_per_step``). A step that pulls pulls as many.
    schedule : mxdelay.schedule.DelaySchedule, optional
        The trainer's schedule (``trainer.schedule``): adds each row's ``phase`` and tells
        when a pull is applied. Without it every pull counts as synchronous.
    first_step : int, default 0
        The step counter of the first recorded step (``trainer.schedule.step`` when the
        recording started); rows' ``step`` count from it.

    Returns
    -------
    list of dict
        Keys ``step, backward_end, first_push, last_push, overlap, push_ms, hidden_ms, comm_ms,
        comm_hidden_ms, backward_hidden_ms, pull_issued, pull_sent, pull_received,
        pull_applied, applied_step, wait_ms`` and, with a schedule, ``phase``.

    Raises
    ------
    ValueError
        If `pushes_per_step` is not a positive integer.
    """
    if not isinstance(pushes_per_step, int) or pushes_per_step < 1:
        raise ValueError('summarize: pushes_per_step must be a positive int (the trainer\'s '
                         'keys_per_step), got %r' % (pushes_per_step,))
    events, origin, trace_end = _read_trace(path)
    pushes = _intervals(events, lambda name: name in (_PUSH, _PUSHPULL))
    pulls = _intervals(events, lambda name: name in (_PULL, _PUSHPULL))
    compute = _intervals(events, _is_compute)
    local = intervals.union(_intervals(events, _is_local))
    comm = intervals.union(pushes + pulls)
    comm_ends = sorted(e for _, e in pushes + pulls)
    steps, issued = _python_steps(events)
    per_step = pushes_per_step
    if steps and len(pushes) % steps == 0 and len(pushes) // steps >= pushes_per_step:
        per_step = len(pushes) // steps
    # Pushes beyond pushes_per_step are the kvstore's own per-round traffic (mxdelay's
    # 'dist_delay' pushes a two-element flag each round). They wait for no gradient and go
    # first, so they are left out of first_push: it must be the first *gradient* push.
    control = per_step - pushes_per_step
    count = len(pushes) // per_step
    blocks = [pushes[step * per_step:(step + 1) * per_step] for step in range(count)]
    first_pushes = [block[min(control, len(block) - 1)][0] for block in blocks]

    if not issued:
        # No C API events (a trace not written by `recording`): a pull belongs to the last
        # step whose first push started before it.
        for start, _ in pulls:
            step = bisect.bisect_right(first_pushes, start) - 1
            issued.setdefault(max(step, 0), start)
    pulling = sorted(issued)
    per_pull = len(pulls) // len(pulling) if pulling else 0
    pull_blocks = {step: pulls[n * per_pull:(n + 1) * per_pull]
                   for n, step in enumerate(pulling) if per_pull}

    # The last step's span ends with the last local operator: after it, `recording` only
    # drains the communication still outstanding, which a next step would have overlapped.
    last_end = max([e for _, e in local if first_pushes and e > first_pushes[-1]] or
                   [trace_end])
    rows = []
    for step, block in enumerate(blocks):
        last_start = max(s for s, _ in block)
        before = [e for s, e in compute if e <= last_start]
        backward_end = max(before) if before else float('nan')
        first_push = first_pushes[step]
        span_end = first_pushes[step + 1] if step + 1 < count else last_end
        step_comm = intervals.clip(comm, first_push, span_end)
        hidden = intervals.intersect(step_comm, local)
        row = {'step': first_step + step, 'backward_end': backward_end - origin,
               'first_push': first_push - origin, 'last_push': last_start - origin,
               'overlap': first_push < backward_end,
               'push_ms': sum(e - s for s, e in block[control:]),
               'hidden_ms': sum(intervals.overlap(iv, compute) for iv in block[control:]),
               'comm_ms': intervals.length(step_comm),
               'comm_hidden_ms': intervals.length(hidden),
               'backward_hidden_ms': intervals.length(
                   intervals.clip(hidden, first_push, backward_end)),
               'wait_ms': _wait(intervals.gaps(local, first_push, span_end), comm_ends),
               'pull_issued': None, 'pull_sent': None, 'pull_received': None,
               'pull_applied': None, 'applied_step': None}
        if schedule is not None:
            row['phase'] = schedule.phase(first_step + step)
        rows.append(row)
    for step, block in pull_blocks.items():
        if not block or step >= len(rows):
            continue
        row = rows[step]
        received = max(e for _, e in block)
        row.update(pull_issued=issued[step] - origin, pull_sent=block[0][0] - origin,
                   pull_received=received - origin)
        t = row['step']
        if schedule is None or schedule.is_synchronous(t):
            row.update(pull_applied=row['pull_received'], applied_step=t)
        else:
            later = rows[step + 1]['backward_end'] if step + 1 < len(rows) else float('nan')
            row.update(pull_applied=max(row['pull_received'], later)
                       if later == later else None, applied_step=t + 1)
    return rows


def totals(rows):
    """Sum :func:`summarize`'s rows: communication, the share hidden, the mean wait.

    Parameters
    ----------
    rows : list of dict
        Rows of :func:`summarize` (e.g. those of one phase).

    Returns
    -------
    dict
        ``steps``, ``comm_ms`` (total), ``hidden`` and ``hidden_backward`` (fractions of
        ``comm_ms`` during which local work, and backward, ran; 0 without communication),
        ``wait_ms`` (mean per step), ``pulls`` (steps that issued a pull).
    """
    comm = sum(row['comm_ms'] for row in rows)
    return {'steps': len(rows), 'comm_ms': comm,
            'hidden': sum(row['comm_hidden_ms'] for row in rows) / comm if comm else 0.0,
            'hidden_backward': (sum(row['backward_hidden_ms'] for row in rows) / comm
                                if comm else 0.0),
            'wait_ms': sum(row['wait_ms'] for row in rows) / len(rows) if rows else 0.0,
            'pulls': sum(1 for row in rows if row['pull_issued'] is not None)}


def _ms(value):
    return '' if value is None else '%.1f' % value


def format_table(rows):
    """Markdown: one line per row of :func:`summarize`, then :func:`totals` per phase."""
    lines = ['| step | first push | backward end | push during backward | comm (ms) '
             '| hidden | pull issued | pull sent | pull received | pull applied (step) '
             '| wait (ms) |', '|---:|---:|---:|:---:|---:|---:|---:|---:|---:|---:|---:|']
    for row in rows:
        hidden = row['comm_hidden_ms'] / row['comm_ms'] if row['comm_ms'] else 0.0
        applied = '' if row['pull_applied'] is None else '%.1f (%d)' % (
            row['pull_applied'], row['applied_step'])
        lines.append('| %s | %.1f | %.1f | %s | %.1f | %.0f%% | %s | %s | %s | %s | %.1f |' % (
            '%d %s' % (row['step'], row['phase']) if 'phase' in row else row['step'],
            row['first_push'], row['backward_end'], 'yes' if row['overlap'] else 'no',
            row['comm_ms'], 100 * hidden, _ms(row['pull_issued']), _ms(row['pull_sent']),
            _ms(row['pull_received']), applied, row['wait_ms']))
    lines += ['', '| steps | communication (ms) | hidden behind compute | behind backward '
              '| mean wait per step (ms) |', '|---|---:|---:|---:|---:|']
    for label, group in phase_groups(rows):
        total = totals(group)
        lines.append('| %s (%d) | %.1f | %.0f%% | %.0f%% | %.1f |' % (
            label, total['steps'], total['comm_ms'], 100 * total['hidden'],
            100 * total['hidden_backward'], total['wait_ms']))
    return '\n'.join(lines)


def phase_groups(rows):
    """``[(label, rows)]``: all the rows, then, if there are several phases, each phase's."""
    groups = [('all steps', rows)]
    phases = sorted({row['phase'] for row in rows if 'phase' in row})
    if len(phases) > 1:
        groups += [(phase, [row for row in rows if row.get('phase') == phase])
                   for phase in phases]
    return groups


def _format_budget(budget):
    if budget is None:
        return 'fewer than 2 steps recorded: no step time'
    return ('| steps | mean step (ms) | mean wait (ms) | wait share | speed-up if no wait |\n'
            '|---:|---:|---:|---:|---:|\n| %d | %.1f | %.1f | %.0f%% | %.2fx |'
            % (budget['steps'], budget['step_ms'], budget['wait_ms'],
               100 * budget['wait_share'], budget['speedup_bound']))


def _parser():
    parser = argparse.ArgumentParser(
        prog='python -m mxdelay.trace', allow_abbrev=False,
        description='Summarize timelines written by mxdelay.timeline.recording: per step, when '
                    'pushes and pulls ran, how much of them was hidden, how long the worker '
                    'waited; then the mean step and the share spent waiting.')
    parser.add_argument('files', nargs='+', metavar='FILE', help='trace files (Chrome JSON)')
    parser.add_argument('--keys-per-step', type=int, metavar='K',
                        help="kvstore keys a step pushes: the trainer's keys_per_step (default: "
                             'what a MXDELAY_TIMELINE trace says)')
    parser.add_argument('--warmup-steps', type=int, metavar='W',
                        help="the trainer's warmup_steps (with --delay: adds each step's phase)")
    parser.add_argument('--delay', type=int, metavar='k', help="the trainer's delay")
    parser.add_argument('--first-step', type=int, metavar='S',
                        help='step counter of the first recorded step (default: what a '
                             'MXDELAY_TIMELINE trace says, else 0)')
    parser.add_argument('--merge', metavar='OUT',
                        help='instead of the tables, write the FILEs (one per worker) as one '
                             'trace OUT, a process per rank (chrome://tracing, Perfetto)')
    return parser


def main(argv=None):
    """Entry point of ``python -m mxdelay.trace``; returns the exit code (bad input: 2)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.keys_per_step is not None and args.keys_per_step < 1:
        parser.error('--keys-per-step must be a positive integer (trainer.keys_per_step), got '
                     '%d' % args.keys_per_step)
    if (args.warmup_steps is None) != (args.delay is None):
        parser.error('--warmup-steps and --delay go together (they give the schedule); pass '
                     'both or neither')
    if args.merge is not None:
        from .trace_merge import merge  # pylint: disable=import-outside-toplevel
        try:
            counts = merge(args.files, args.merge)
        except ValueError as err:
            parser.error(str(err))
        sys.stdout.write('%s: %d workers (ranks %s), %d events\n' % (
            args.merge, len(counts), ', '.join(map(str, sorted(counts))),
            sum(counts.values())))
        return 0
    out = []
    for path in args.files:
        try:
            with open(path, encoding='utf-8') as file:
                meta = json.load(file).get('otherData', {}).get('mxdelay', {})
        except (OSError, ValueError, AttributeError) as err:
            parser.error('%s cannot be read as a timeline (%s); pass a file written by '
                         'mxdelay.timeline.recording or MXDELAY_TIMELINE' % (path, err))
        if 'ranks' in meta:
            parser.error('%s is a merged trace (--merge): it is for viewing; summarize the '
                         "workers' own files, PREFIX.rank<R>.json" % path)
        keys = args.keys_per_step or meta.get('keys_per_step')
        if keys is None:
            parser.error('%s does not say its keys per step (it was not written with '
                         'MXDELAY_TIMELINE); pass --keys-per-step K, K being the trainer\'s '
                         'keys_per_step' % path)
        delay, warmup = ((args.delay, args.warmup_steps) if args.delay is not None
                         else (meta.get('delay'), meta.get('warmup_steps')))
        schedule = None
        if delay is not None:
            from .schedule import DelaySchedule  # pylint: disable=import-outside-toplevel
            try:
                schedule = DelaySchedule(delay, warmup)
                if args.delay is None and meta.get('amendments'):
                    schedule.amend(**meta['amendments'])   # delay='auto''s decisions
            except (TypeError, ValueError) as err:
                parser.error(str(err))
        first = args.first_step if args.first_step is not None else meta.get('first_step', 0)
        try:
            rows = summarize(path, keys, schedule, first)
        except (ValueError, KeyError) as err:
            parser.error('%s cannot be read as a timeline (%s); pass a file written by '
                         'mxdelay.timeline.recording or MXDELAY_TIMELINE' % (path, err))
        out += ['## %s' % path, '', format_table(rows), '', _format_budget(step_budget(rows)), '']
        if meta.get('bytes'):
            out += [estimate.format_bytes(phase_groups(rows), meta['bytes'], schedule), '',
                    estimate.format_estimate(rows, meta['bytes']), '']
    sys.stdout.write('\n'.join(out))
    return 0


if __name__ == '__main__':
    sys.exit(main())
