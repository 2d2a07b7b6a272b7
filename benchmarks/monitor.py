"""What a job's processes use while it runs: CPU time per role, and bytes per link.

A :class:`CpuMonitor` samples, every `interval` seconds, the CPU time (user + system) of
every descendant of the processes it watches, labelled by role from each process's
environment (``DMLC_ROLE`` and ``MXDELAY_RANK``, as ``mxdelay-launch`` sets them; the
launcher itself is ``launcher``), and the machine's busy time from ``/proc/stat``.
:meth:`CpuMonitor.usage` then returns, for a time window, how many cores each label used
on average, and how many the rest of the machine used (``other``: processes that are not
the job's, and kernel work charged to no process of the job, such as a bridge's packets).

Reading another process's environment needs the same user or root; a process whose role
cannot be read is labelled ``unknown``. :func:`job_tree` is the same walk for other readers
of ``/proc`` (the memory benchmark's).

On a shaped network (``benchmarks/netns.py``) a :class:`PortCounters` samples the byte
counters of every node's bridge port, and :func:`eth0_counters` reads each node's own
``eth0``: what each node sent and received, TCP/IP headers included.
"""
import json
import os
import subprocess
import threading
import time

__all__ = ['Sampler', 'CpuMonitor', 'PortCounters', 'eth0_counters', 'job_tree']

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


def _children():
    """``{parent pid: [pids]}`` of every process now."""
    found = {}
    for entry in os.listdir('/proc'):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None:
                found.setdefault(stat[0], []).append(int(entry))
    return found


def job_tree(roots, labels):
    """The pids of `roots` (``{pid: label or None}``) and of every process below them, now.

    `labels` (``{pid: label}``, updated in place) gets each one's label: its root's, else its
    role read from its environment (:func:`_label`). A label is read again while it is
    ``launcher`` or ``unknown``: a child reads as its parent until it execs.
    """
    tree, found, todo = _children(), [], list(roots)
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(tree.get(pid, []))
    for pid in found:
        if labels.get(pid, 'launcher') in ('launcher', 'unknown'):
            labels[pid] = roots.get(pid) or _label(pid)
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

    def _around(self, when):
        """The samples just before and just after time `when` (the first or the last beyond
        them), and `when`'s weight between the two."""
        before = max((s for s in self.samples if s[0] <= when), key=lambda s: s[0],
                     default=self.samples[0])
        after = min((s for s in self.samples if s[0] >= when), key=lambda s: s[0],
                    default=self.samples[-1])
        span = after[0] - before[0]
        return before, after, (when - before[0]) / span if span > 0 else 0.0


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

    def sample(self):
        """Take one sample now."""
        now = time.time()
        for pid in job_tree(self.roots, self._labels):
            stat = _stat(pid)
            if stat is not None:
                self._last[pid] = stat[1]
        per_label = {}
        for pid, seconds in self._last.items():
            label = self._labels[pid]
            per_label[label] = per_label.get(label, 0.0) + seconds
        self.samples.append((now, per_label, _machine_busy()))

    def _at(self, when):
        """Interpolate (per-label cpu seconds, machine busy seconds) at time `when`."""
        before, after, weight = self._around(when)
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


class PortCounters(Sampler):
    """Sample the byte counters of every bridge port of `net` (a ``netns.ShapedNetwork``) in
    a background thread.

    Port ``p<i>`` is the peer of node i's ``eth0``: what the port receives, the node sent.
    One ``ip -j -s link`` of the switch namespace reads them all (one process per sample).
    """

    def __init__(self, net, interval=0.25):
        super().__init__(interval)   # samples: (time, {node index: (sent, received)})
        self.net = net

    def sample(self):
        """Take one sample now (its time: the middle of the read)."""
        before = time.time()
        links = json.loads(subprocess.run(
            ['ip', '-n', self.net.switch, '-j', '-s', 'link', 'show'], capture_output=True,
            text=True, check=True).stdout)
        now = (before + time.time()) / 2
        counts = {int(link['ifname'][1:]): (link['stats64']['rx']['bytes'],
                                            link['stats64']['tx']['bytes'])
                  for link in links if link['ifname'].startswith('p')}
        self.samples.append((now, counts))

    def at(self, when):
        """{node index: (sent, received)} interpolated at time `when`."""
        before, after, weight = self._around(when)
        return {node: tuple(b + weight * (a - b) for a, b in zip(after[1][node], counts))
                for node, counts in before[1].items()}

    def between(self, start, end):
        """{node index: (sent, received)} bytes in [start, end]."""
        first, last = self.at(start), self.at(end)
        return {node: (last[node][0] - first[node][0], last[node][1] - first[node][1])
                for node in first}


def eth0_counters(net):
    """``{namespace: (tx bytes, rx bytes)}`` of every node's ``eth0`` in `net`, now."""
    result = {}
    for name, _ in net.nodes:
        link = json.loads(subprocess.run(['ip', '-n', name, '-j', '-s', 'link', 'show', 'eth0'],
                                         capture_output=True, text=True, check=True).stdout)[0]
        result[name] = (link['stats64']['tx']['bytes'], link['stats64']['rx']['bytes'])
    return result
