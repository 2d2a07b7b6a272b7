"""Where the CPU goes during a run: per-role CPU time of a job, and the whole machine's.

A :class:`CpuMonitor` samples, every `interval` seconds, the CPU time (user + system) of
every descendant of the processes it watches, labelled by role from each process's
environment (``DMLC_ROLE`` and ``MXDELAY_RANK``, as ``mxdelay-launch`` sets them; the
launcher itself is ``launcher``), and the machine's busy time from ``/proc/stat``.
:meth:`CpuMonitor.usage` then returns, for a time window, how many cores each label used
on average, and how many the rest of the machine used (``other``: processes that are not
the job's, and kernel work charged to no process of the job, such as a bridge's packets).

Reading another process's environment needs the same user or root; a process whose role
cannot be read is labelled ``unknown``.
"""
import os
import threading
import time

__all__ = ['CpuMonitor', 'Sampler', 'children']

_TICK = os.sysconf('SC_CLK_TCK')


def _stat(pid):
    """Return (ppid, cpu seconds) of `pid`, or None if it is gone."""
    try:
        with open('/proc/%d/stat' % pid, encoding='ascii', errors='replace') as src:
            fields = src.read().rpartition(')')[2].split()
    except OSError:
        return None
    # After the command name: state ppid ... utime (14th field overall) stime (15th).
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK


def children():
    """``{parent pid: [pids]}`` of every process now."""
    found = {}
    for entry in os.listdir('/proc'):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None:
                found.setdefault(stat[0], []).append(int(entry))
    return found


def _label(pid):
    try:
        with open('/proc/%d/environ' % pid, 'rb') as src:
            items = dict(item.split(b'=', 1) for item in src.read().split(b'\0') if b'=' in item)
    except OSError:
        return 'unknown'
    role = items.get(b'DMLC_ROLE', b'').decode()
    if not role:
        return 'launcher'
    if role == 'scheduler':
        return 'scheduler'
    return '%s %s' % (role, items.get(b'MXDELAY_RANK', b'?').decode())


def _machine_busy():
    with open('/proc/stat', encoding='ascii') as src:
        fields = [int(value) for value in src.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal ...: busy = all but idle and iowait
    return (sum(fields[:8]) - fields[3] - fields[4]) / _TICK


class Sampler:
    """Call :meth:`sample` on entry, every `interval` seconds in a background thread, and on
    exit; subclasses define :meth:`sample` and append to :attr:`samples`."""

    def __init__(self, interval):
        self.interval = interval
        self.samples = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.sample()

    def _run(self):
        while not self._stop.wait(self.interval):
            self.sample()

    def sample(self):
        """Take one sample now."""
        raise NotImplementedError()


class CpuMonitor(Sampler):
    """Sample the CPU time of the process trees rooted at `roots` in a background thread.

    Parameters
    ----------
    roots : dict
        ``{pid: label or None}``: the processes to watch, with their descendants (whose
        labels are read from their environment). A label of None means: read it too.
    interval : float
        Seconds between samples.
    """

    def __init__(self, roots, interval=0.5):
        super().__init__(interval)   # samples: (time, {label: cpu seconds}, machine busy s)
        self.roots = dict(roots)
        self._labels = {}
        self._last = {}  # pid -> last cpu seconds seen (a process that exits keeps its total)

    def _descendants(self):
        tree, found, todo = children(), [], list(self.roots)
        while todo:
            pid = todo.pop()
            found.append(pid)
            todo.extend(tree.get(pid, []))
        return found

    def sample(self):
        """Take one sample now."""
        now = time.time()
        for pid in self._descendants():
            stat = _stat(pid)
            if stat is None:
                continue
            # Read again until it is a role: a child reads as its parent until it execs.
            if self._labels.get(pid, 'launcher') in ('launcher', 'unknown'):
                self._labels[pid] = self.roots.get(pid) or _label(pid)
            self._last[pid] = stat[1]
        per_label = {}
        for pid, seconds in self._last.items():
            label = self._labels[pid]
            per_label[label] = per_label.get(label, 0.0) + seconds
        self.samples.append((now, per_label, _machine_busy()))

    def _at(self, when):
        """Interpolate (per-label cpu seconds, machine busy seconds) at time `when`."""
        samples = self.samples
        before = max((s for s in samples if s[0] <= when), key=lambda s: s[0], default=samples[0])
        after = min((s for s in samples if s[0] >= when), key=lambda s: s[0], default=samples[-1])
        span = after[0] - before[0]
        weight = (when - before[0]) / span if span > 0 else 0.0
        labels = set(before[1]) | set(after[1])
        per_label = {label: before[1].get(label, 0.0) + weight * (
            after[1].get(label, 0.0) - before[1].get(label, 0.0)) for label in labels}
        return per_label, before[2] + weight * (after[2] - before[2])

    def usage(self, start, end):
        """Return ``{label: cores used on average}`` in [start, end], plus 'other'."""
        first, busy_first = self._at(start)
        last, busy_last = self._at(end)
        seconds = end - start
        # A label can lose a little where a child was first seen under its parent's label.
        usage = {label: max(0.0, last.get(label, 0.0) - first.get(label, 0.0)) / seconds
                 for label in set(first) | set(last)}
        usage['other'] = max(0.0, (busy_last - busy_first) / seconds - sum(usage.values()))
        return usage
