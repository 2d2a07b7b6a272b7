"""Arithmetic on time intervals ``(start, end)`` in ms, for reading traces (:mod:`mxdelay.trace`).

No MXNet: the trace reader runs anywhere.
"""
import bisect

__all__ = ['overlap', 'union', 'clip', 'length', 'intersect', 'gaps', 'wait']


def overlap(interval, others):
    """Time of `interval` covered by `others` (summed over them)."""
    start, end = interval
    return sum(max(0.0, min(end, e) - max(start, s)) for s, e in others)


def union(intervals):
    """Sorted, disjoint [(start, end)] covering the same time as `intervals`."""
    out = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def clip(disjoint, start, end):
    """The sorted disjoint intervals `disjoint` cut to [start, end)."""
    return [(max(s, start), min(e, end)) for s, e in disjoint if e > start and s < end]


def length(disjoint):
    """Total time of the disjoint intervals `disjoint`."""
    return sum(e - s for s, e in disjoint)


def intersect(a, b):
    """Intersection of two sorted disjoint interval lists."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def gaps(busy, start, end):
    """The parts of [start, end) not covered by the sorted disjoint intervals `busy`."""
    out, cursor = [], start
    for s, e in clip(busy, start, end):
        if s > cursor:
            out.append((cursor, s))
        cursor = max(cursor, e)
    if cursor < end:
        out.append((cursor, end))
    return out


def wait(gaps, comm_ends):
    """Idle time in `gaps` released by communication: in each gap, the time from its start to
    the last completion (`comm_ends`, sorted) that falls within it (:mod:`mxdelay.trace`)."""
    total = 0.0
    for start, end in gaps:
        # The last completion in (start, end]: comm_ends is sorted.
        index = bisect.bisect_right(comm_ends, end) - 1
        if index >= 0 and comm_ends[index] > start:
            total += comm_ends[index] - start
    return total
