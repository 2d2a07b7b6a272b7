"""Bytes per step, and what ``delay`` and each compression would save on a measured job.

Reads the rows of :func:`mxdelay.trace.summarize` and the bytes a trace written with
``MXDELAY_TIMELINE`` carries (``otherData.mxdelay.bytes``: :func:`mxdelay.traffic.round_bytes`);
needs no MXNet.

:func:`bytes_per_step`: every step sends one push of every trained parameter; it receives
one pull of each at the steps that pulled (every synchronous step; every k-th delayed one).

:func:`estimate`, from synchronous steps (the warm-up is exactly ``dist_sync``). Measured,
per step: the step time ``S`` (mean span, :func:`step_budget`), the wait
``W`` (idle time released by communication), the communication time ``T`` (wall time
with a push or pull outstanding) and the bytes as configured, ``P`` pushed and ``Q``
pulled. The compute time is ``C = S - W``. For a setting that pushes ``P'`` and pulls
``Q'`` bytes per round, with delay k:

- k = 1 (``dist_sync`` with that compression): ``S' = C + W (P' + Q') / (P + Q)``: the wait
  scales with the bytes;
- k >= 2 (the delayed phase): ``S' = max(C, T (P' + Q'/k) / (P + Q))``: a pull every k
  steps; communication is hidden behind compute up to the compute time, and beyond it
  the step is as long as the communication.

The estimated speed-up is ``S / S'``. Assumptions: communication time is proportional to
the bytes (no latency term, the link is the bottleneck), pushes and pulls share it (on a
full-duplex link they travel in opposite directions and overlap in the delayed phase, so
the estimate is then conservative), compute is unchanged (the delayed phase's local update
and the compression's own work are not counted), the workers are alike, and the warm-up's
slower steps are left out (steady state only). It is an estimate to choose what to try
first, not a measurement.
"""

__all__ = ['bytes_per_step', 'step_budget', 'synchronous_budget', 'estimate', 'DELAYS',
           'format_bytes', 'format_estimate']

#: The delays the estimate shows (1: synchronous, dist_sync).
DELAYS = (1, 2, 4, 8)


def bytes_per_step(rows, round_bytes, schedule=None):
    """Bytes sent and received per step over `rows` (of :func:`mxdelay.trace.summarize`).

    Parameters
    ----------
    rows : list of dict
    round_bytes : dict
        ``push`` and ``pull``: bytes of one push and one pull of every trained parameter.
    schedule : mxdelay.schedule.DelaySchedule, optional
        Count the pulls of the schedule (every synchronous step, every k-th delayed one)
        rather than those seen in the trace (the recording ends before the last step's
        pull is issued).

    Returns
    -------
    dict
        ``steps``, ``pulls`` (steps that pulled), ``sent`` and ``received`` (bytes per
        step: ``push``, and ``pull * pulls / steps``).
    """
    if schedule is None:
        pulls = sum(1 for row in rows if row['pull_issued'] is not None)
    else:
        pulls = sum(1 for row in rows if schedule.is_synchronous(row['step']) or
                    schedule.issues_pull(row['step']))
    steps = len(rows)
    return {'steps': steps, 'pulls': pulls, 'sent': round_bytes['push'] if steps else 0,
            'received': round_bytes['pull'] * pulls / steps if steps else 0.0}


def step_budget(rows):
    """The mean step of `rows` and the share of it spent waiting for communication.

    A step's time is its span (first push to the next step's first push), so the last row,
    whose span has no next step, is left out.

    Parameters
    ----------
    rows : list of dict
        Rows of :func:`mxdelay.trace.summarize`, in step order.

    Returns
    -------
    dict or None
        ``steps`` (rows counted), ``step_ms`` (mean span), ``wait_ms`` (mean wait),
        ``wait_share`` (``wait_ms / step_ms``) and ``speedup_bound``
        (``step_ms / (step_ms - wait_ms)``: the speed-up if no step waited, which bounds
        what hiding communication, e.g. by the delayed update, can give); None with fewer
        than 2 rows.
    """
    if len(rows) < 2:
        return None
    spans = [later['first_push'] - row['first_push'] for row, later in zip(rows, rows[1:])]
    step_ms = sum(spans) / len(spans)
    wait_ms = sum(row['wait_ms'] for row in rows[:-1]) / len(spans)
    return {'steps': len(spans), 'step_ms': step_ms, 'wait_ms': wait_ms,
            'wait_share': wait_ms / step_ms if step_ms else 0.0,
            'speedup_bound': step_ms / (step_ms - wait_ms) if step_ms > wait_ms else float('inf')}


def synchronous_budget(rows):
    """``S``, ``W``, ``T`` and ``C`` (ms per step) of the synchronous rows of `rows`.

    The rows of the warm-up (or, without phases, every row, taken as synchronous); as
    :func:`step_budget`, the last one is left out (its span has no end).

    Returns
    -------
    dict or None
        ``steps``, ``step_ms`` (S), ``wait_ms`` (W), ``comm_ms`` (T), ``compute_ms``
        (C = S - W); None with fewer than 2 synchronous rows.
    """
    if any('phase' in row for row in rows):
        rows = [row for row in rows if row.get('phase') == 'warm-up']
    budget = step_budget(rows)
    if budget is None:
        return None
    step, wait, count = budget['step_ms'], budget['wait_ms'], budget['steps']
    return {'steps': count, 'step_ms': step, 'wait_ms': wait, 'compute_ms': step - wait,
            'comm_ms': sum(row['comm_ms'] for row in rows[:-1]) / count}


def estimate(budget, round_bytes, delays=DELAYS):
    """The estimated step of each setting and delay (see the module docstring).

    Parameters
    ----------
    budget : dict
        :func:`synchronous_budget` of the measured job.
    round_bytes : dict
        ``push``, ``pull`` (as measured) and ``settings``: ``{name: [push, pull]}``.
    delays : tuple of int

    Returns
    -------
    list of dict
        Per setting (in the order of ``settings``) and delay: ``setting``, ``delay``,
        ``step_ms`` and ``speedup`` (measured step / estimated step).
    """
    measured = float(round_bytes['push'] + round_bytes['pull'])
    step, wait = budget['step_ms'], budget['wait_ms']
    compute, comm = budget['compute_ms'], budget['comm_ms']
    out = []
    for name, (push, pull) in round_bytes['settings'].items():
        for k in delays:
            if k == 1:
                estimated = compute + wait * (push + pull) / measured
            else:
                estimated = max(compute, comm * (push + pull / k) / measured)
            out.append({'setting': name, 'delay': k, 'step_ms': estimated,
                        'speedup': step / estimated if estimated else float('inf')})
    return out


def format_bytes(groups, round_bytes, schedule=None):
    """Markdown: bytes sent and received per step of each ``(label, rows)`` of `groups`
    (:func:`mxdelay.trace.phase_groups`: all rows, then each phase's; pulls: the
    schedule's if given, see :func:`bytes_per_step`)."""
    lines = ['| steps | pulls%s | sent per step (bytes) | received per step (bytes) |'
             % (' (schedule)' if schedule is not None else ''), '|---|---:|---:|---:|']
    for label, group in groups:
        per = bytes_per_step(group, round_bytes, schedule)
        lines.append('| %s (%d) | %d | %s | %s |' % (label, per['steps'], per['pulls'],
                                                      '{:,}'.format(per['sent']),
                                                      '{:,.0f}'.format(per['received'])))
    lines.append('')
    lines.append('Values of the parameters only (no ps-lite headers); compression %s, pull '
                 'compression %s.' % (round_bytes.get('compression'),
                                       round_bytes.get('pull_compression')))
    if round_bytes.get('row_sparse_keys'):
        lines.append('%d row_sparse parameters are not counted (their messages carry the '
                     "rows of each step)." % round_bytes['row_sparse_keys'])
    return '\n'.join(lines)


def format_estimate(rows, round_bytes):
    """Markdown: the estimate's table with its inputs and assumptions, or why there is none."""
    budget = synchronous_budget(rows)
    if budget is None:
        return ('No estimate: it needs at least 2 recorded warm-up (synchronous) steps, e.g. '
                'the first steps that MXDELAY_TIMELINE records.')
    lines = ['ESTIMATE, not a measurement, from %d synchronous steps: step S = %.1f ms, '
             'waiting for communication W = %.1f ms, compute C = S - W = %.1f ms, '
             'communication T = %.1f ms; bytes per round as measured: %s pushed, %s pulled.'
             % (budget['steps'], budget['step_ms'], budget['wait_ms'], budget['compute_ms'],
                budget['comm_ms'], '{:,}'.format(round_bytes['push']),
                '{:,}'.format(round_bytes['pull'])),
             'Model (bytes P\', Q\' of the setting, P, Q as measured): k=1: C + W (P\'+Q\')/(P+Q); '
             'k>=2: max(C, T (P\' + Q\'/k)/(P+Q)). Assumes communication time proportional to '
             'bytes, pushes and pulls sharing the link, compute unchanged; steady state (the '
             'warm-up steps are not counted). See mxdelay.estimate. Speed only: what a '
             "setting does to accuracy is not estimated (the README's Settings).", '',
             '| setting | push bytes | pull bytes | %s |'
             % ' | '.join('k=%d%s: step ms (speed-up)' % (k, ' (dist_sync)' if k == 1 else '')
                          for k in DELAYS),
             '|---|---:|---:|%s' % ('---:|' * len(DELAYS))]
    cells = {}
    for row in estimate(budget, round_bytes):
        cells.setdefault(row['setting'], []).append('%.1f (%.2fx)' % (row['step_ms'],
                                                                        row['speedup']))
    for name, (push, pull) in round_bytes['settings'].items():
        lines.append('| %s | %s | %s | %s |' % (name, '{:,}'.format(push), '{:,}'.format(pull),
                                              ' | '.join(cells[name])))
    return '\n'.join(lines)
