"""A worker's timeline: when backward ran and when each round's pushes started and ended.

Built on MXNet's own profiler, which timestamps every engine operation (Chrome trace JSON,
viewable in chrome://tracing or Perfetto): :func:`recording` turns it on around a few
steps (off by default, and nothing is recorded outside the block), :func:`summarize` reads
the trace back into one row per step, :func:`format_table` prints them.

Per step (a block of ``pushes_per_step`` push operations, in start order):

- ``backward_end``: the end of the last compute operation (a bulk segment or a backward
  operator) before the step's last push started -- the first layer's gradient is written;
- ``first_push``: the start of the step's first push (the last layer's);
- ``overlap``: ``first_push < backward_end``: communication started while backward ran;
- ``push_ms``: the pushes' total duration (request to acknowledgement);
- ``hidden_ms``: the part of the pushes' time during which compute ran on this worker.
"""
import contextlib
import json

import mxnet as mx

__all__ = ['recording', 'summarize', 'format_table']

_PUSH = 'KVStoreDistDefaultPush'


@contextlib.contextmanager
def recording(path):
    """Record MXNet's profiler trace of the enclosed steps into `path` (Chrome trace JSON).

    MXNet's profiler writes a complete trace only once per process (it cannot be restarted
    after that), so record one window: e.g. the last warm-up steps and the first delayed
    ones.

    Parameters
    ----------
    path : str
        Output file; written when the block ends (after all queued work has finished).
    """
    mx.profiler.set_config(profile_all=True, aggregate_stats=False, filename=path)
    mx.profiler.set_state('run')
    try:
        yield path
    finally:
        mx.nd.waitall()
        mx.profiler.set_state('stop')
        mx.profiler.dump()


def _intervals(events, accept):
    """[(start, end)] in ms of complete operator events whose name passes `accept`."""
    open_events, out = {}, []
    for event in sorted(events, key=lambda e: e.get('ts', 0)):
        name, phase = event.get('name'), event.get('ph')
        if event.get('cat') != 'operator' or not name or not accept(name):
            continue
        key = (name, event.get('tid'))
        if phase == 'B':
            open_events.setdefault(key, []).append(event['ts'])
        elif phase == 'E' and open_events.get(key):
            out.append((open_events[key].pop(0) / 1000.0, event['ts'] / 1000.0))
    return sorted(out)


def _is_compute(name):
    return name == 'ImperativeBulk' or name.startswith('_backward') or \
        name in ('FullyConnected', 'Convolution', 'Activation')


def _overlap(interval, others):
    start, end = interval
    return sum(max(0.0, min(end, e) - max(start, s)) for s, e in others)


def summarize(path, pushes_per_step):
    """One dict per recorded step of the trace at `path` (see the module docstring).

    Parameters
    ----------
    path : str
        A trace written by :func:`recording`.
    pushes_per_step : int
        Push operations per step: the number of kvstore keys a step pushes
        (``DelayedTrainer.keys_per_step``).

    Returns
    -------
    list of dict
        Keys ``step, backward_end, first_push, overlap, push_ms, hidden_ms`` (times in ms
        from the first recorded event).
    """
    with open(path, encoding='utf-8') as src:
        events = json.load(src)['traceEvents']
    pushes = _intervals(events, lambda name: name == _PUSH)
    compute = _intervals(events, _is_compute)
    origin = min([s for s, _ in pushes + compute] or [0.0])
    rows = []
    for step in range(len(pushes) // pushes_per_step):
        block = pushes[step * pushes_per_step:(step + 1) * pushes_per_step]
        last_start = max(s for s, _ in block)
        before = [e for s, e in compute if e <= last_start]
        backward_end = max(before) if before else float('nan')
        first_push = block[0][0]
        rows.append({'step': step, 'backward_end': backward_end - origin,
                     'first_push': first_push - origin, 'overlap': first_push < backward_end,
                     'push_ms': sum(e - s for s, e in block),
                     'hidden_ms': sum(_overlap(iv, compute) for iv in block)})
    return rows


def format_table(rows):
    """Markdown table of :func:`summarize`'s rows."""
    lines = ['| step | first push (ms) | backward end (ms) | push started during backward '
             '| push time (ms) | hidden behind compute |',
             '|---:|---:|---:|:---:|---:|---:|']
    for row in rows:
        hidden = row['hidden_ms'] / row['push_ms'] if row['push_ms'] else 0.0
        lines.append('| %d | %.1f | %.1f | %s | %.1f | %.0f%% |' % (
            row['step'], row['first_push'], row['backward_end'],
            'yes' if row['overlap'] else 'no', row['push_ms'], 100 * hidden))
    return '\n'.join(lines)
