"""One trace per job: the workers' timelines merged into one Chrome trace, a process per rank.

``MXDELAY_TIMELINE=PREFIX`` writes one trace per worker (``PREFIX.rank<R>.json``): each
worker stops its profiler on its own, so the traces are merged afterwards, by
``python -m mxdelay.trace --merge OUT.json PREFIX.rank*.json`` (:func:`merge`). In the
merged trace (chrome://tracing or Perfetto) rank R is process R, named ``worker R``;
each of a worker's own rows (MXNet's profiler writes a "process" per device and per
domain: ``cpu/0``, ``MXNET_C_API``, ``mxdelay``, ...) becomes a thread of that process,
named after it.

The clock. MXNet's profiler stamps every event with the system clock in microseconds since
the epoch (``std::chrono`` on Linux; checked against ``time.time()``), so the events of
workers on one host are on one clock already and are copied unchanged; workers on several
hosts are aligned as well as the hosts' clocks are (NTP: typically within a millisecond).

Needs no MXNet. Every event is kept (the profiler's metadata events are replaced by the
merged trace's names); only ``pid``, ``tid`` and the ids of async events change: thread
and async ids are hashes of the worker's threads, which other workers may repeat.
"""
import json
import os
import re

__all__ = ['merge']

_RANK_IN_NAME = re.compile(r'\.rank(\d+)\.json$')


def _read(path):
    try:
        with open(path, encoding='utf-8') as file:
            trace = json.load(file)
        events = trace['traceEvents']
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError('%s cannot be read as a timeline (%s); pass files written by '
                         'MXDELAY_TIMELINE or mxdelay.timeline.recording' % (path, err)) from None
    meta = trace.get('otherData', {}).get('mxdelay', {})
    return events, meta


def _rank(path, meta, position):
    """The worker's rank: the trace's own (``MXDELAY_TIMELINE``), else its file name's
    ``.rank<R>.json``, else its position among the files."""
    if 'rank' in meta:
        return int(meta['rank'])
    named = _RANK_IN_NAME.search(os.path.basename(path))
    return int(named.group(1)) if named else position


def merge(paths, out):
    """Write the traces at `paths`, one per worker, as one Chrome trace at `out`.

    Parameters
    ----------
    paths : list of str
        The workers' traces (``PREFIX.rank*.json``), one per rank.
    out : str
        The merged trace: process R is rank R (``worker R``); ``otherData.mxdelay`` holds
        ``{'ranks': {R: the rank's otherData.mxdelay}}``.

    Returns
    -------
    dict
        ``{rank: number of events kept}`` (metadata events not counted).

    Raises
    ------
    ValueError
        If a file cannot be read as a trace, or two files have the same rank.
    """
    merged, ranks, counts, paths_of = [], {}, {}, {}
    ids = {}
    for position, path in enumerate(paths):
        events, meta = _read(path)
        rank = _rank(path, meta, position)
        if rank in paths_of:
            raise ValueError('%s and %s are both rank %d; pass one trace per worker'
                             % (paths_of[rank], path, rank))
        paths_of[rank], ranks[str(rank)] = path, meta
        names = {e.get('pid'): e.get('args', {}).get('name', str(e.get('pid')))
                 for e in events if e.get('ph') == 'M' and e.get('name') == 'process_name'}
        merged.append(_metadata('process_name', rank, None, 'worker %d' % rank))
        merged.append(dict(_metadata('process_sort_index', rank, None, None),
                           args={'sort_index': rank}))
        kept, threads, per_row = 0, {}, {}
        for event in events:
            if event.get('ph') == 'M':
                continue
            event = dict(event)
            row = (event.get('pid'), event.get('tid'))
            if row not in threads:
                threads[row] = len(threads) + 1
                name = names.get(row[0], str(row[0]))
                per_row[row[0]] = per_row.get(row[0], 0) + 1
                if per_row[row[0]] > 1:   # the row's second thread
                    name = '%s (%d)' % (name, per_row[row[0]])
                merged.append(_metadata('thread_name', rank, threads[row], name))
            event['pid'], event['tid'] = rank, threads[row]
            if 'id' in event:
                event['id'] = ids.setdefault((rank, event['id']), len(ids) + 1)
            merged.append(event)
            kept += 1
        counts[rank] = kept
    with open(out, 'w', encoding='utf-8') as file:
        json.dump({'traceEvents': merged, 'displayTimeUnit': 'ms',
                   'otherData': {'mxdelay': {'ranks': ranks}}}, file)
    return counts


def _metadata(name, pid, tid, label):
    event = {'ph': 'M', 'name': name, 'pid': pid}
    if tid is not None:
        event['tid'] = tid
    if label is not None:
        event['args'] = {'name': label}
    return event
