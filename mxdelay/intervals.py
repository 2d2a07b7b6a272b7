"""Arithmetic on time intervals ``[(start, end)]``, in ms, for reading traces
(:mod:`mxdelay.trace`): overlaps, unions, clips, lengths, intersections and gaps. Lists
called *disjoint* are sorted and non-overlapping, as :func:`union` returns them."""

__all__ = ['overlap', 'union', 'clip', 'length', 'intersect', 'gaps']


def overlap(interval, others):
    """The time `interval` shares with each of `others`, summed."""
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
    """`disjoint` cut to [start, end)."""
    return [(max(s, start), min(e, end)) for s, e in disjoint if e > start and s < end]


def length(disjoint):
    """The total time `disjoint` covers."""
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
