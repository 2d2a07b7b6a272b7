"""An emulated cluster on one machine: network namespaces behind shaped links (root only).

``ShapedNetwork(count, rate)`` creates `count` node namespaces and one *switch* namespace
holding a bridge. Each node has an interface ``eth0`` with address ``10.77.0.(i+1)/24``,
one end of a veth pair whose other end is a port of the bridge. With a `rate` (a ``tc``
rate such as ``'1gbit'`` or ``'100mbit'``), each link is shaped with a token bucket
(``tc qdisc ... tbf``) in both directions: on the node's ``eth0`` (what the node sends) and
on the bridge port (what it receives). So every node has a link of its own, as on a
switched cluster, and a node that talks to several others at once shares its link between
them (a parameter server's link carries every worker's pushes and pulls).

Every namespace lives in the switch namespace or names a node, so deleting them all removes
every interface as well. Names are ``mxb<pid>-sw`` and ``mxb<pid>-<i>``: the PID of the
creating process tells a stale network (its creator is dead) from a live one;
:func:`remove_stale` deletes the stale ones.

Example::

    with ShapedNetwork(4, '1gbit') as net:
        net.write_hostfile('hosts')   # for mxdelay-launch --launcher netns -H hosts
"""
import os
import re
import subprocess
import sys

__all__ = ['ShapedNetwork', 'netns_available', 'remove_stale', 'rate_bits', 'measure_rate',
           'PREFIX']

PREFIX = 'mxb'
_SUBNET = '10.77.0.%d'
_NAME = re.compile(r'^%s(\d+)-(sw|\d+)$' % PREFIX)


def _ip(*args):
    result = subprocess.run(('ip',) + args, capture_output=True, text=True, timeout=30,
                            check=False)
    if result.returncode:
        raise RuntimeError('ip %s failed: %s' % (' '.join(args), result.stderr.strip()))
    return result.stdout


def _list_namespaces():
    return [line.split()[0] for line in _ip('netns', 'list').splitlines() if line.strip()]


def netns_available():
    """Return None if shaped networks can be built here, else the reason why not."""
    if os.geteuid() != 0:
        return 'network namespaces and tc need root (this process runs as uid %d)' % os.geteuid()
    name = '%s%d-probe' % (PREFIX, os.getpid())
    try:
        _ip('netns', 'add', name)
    except (RuntimeError, OSError) as err:
        return str(err)
    try:
        _ip('netns', 'exec', name, 'tc', 'qdisc', 'show')
    except RuntimeError as err:
        return 'tc does not work in a network namespace: %s' % err
    finally:
        _ip('netns', 'del', name)
    return None


def remove_stale():
    """Delete the namespaces of networks whose creating process is gone; return their names."""
    removed = []
    for name in _list_namespaces():
        match = _NAME.match(name)
        if match and not os.path.exists('/proc/%s' % match.group(1)):
            _ip('netns', 'del', name)
            removed.append(name)
    return removed


def rate_bits(rate):
    """Bits per second of a ``tc`` rate such as ``'100mbit'``, ``'1gbit'`` or ``'10gbit'``."""
    match = re.match(r'^(\d+(?:\.\d+)?)([kmg]?)bit$', rate)
    if not match:
        raise ValueError("rate must look like '100mbit', '1gbit' or '10gbit', got %r" % rate)
    return float(match.group(1)) * {'': 1, 'k': 1e3, 'm': 1e6, 'g': 1e9}[match.group(2)]


def _burst(rate):
    """The token bucket's depth: about 2 ms at `rate`, at least 64 KiB (a GSO packet).

    The depth scales with the rate: tbf needs at least rate / HZ of it (``tc-tbf(8)``), or
    the link carries less than its rate. At 10 Gbit/s (2.5 MB) one TCP stream carried
    9.5 Gbit/s of payload here on a quiet machine (:func:`measure_rate`).
    """
    return '%db' % max(65536, int(rate_bits(rate) / 8 * 0.002))


# A TCP sink and source for measure_rate (run in the nodes' namespaces; argv: port, or
# address, port and seconds). The sink prints the bytes received and the time from the first
# to the last.
_SINK = r'''
import socket, sys, time
listener = socket.socket()
listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
listener.bind(('0.0.0.0', int(sys.argv[1])))
listener.listen(1)
print('ready', flush=True)
conn, _ = listener.accept()
view = memoryview(bytearray(1 << 20))
total, first, last = 0, None, None
while True:
    size = conn.recv_into(view)
    if not size:
        break
    last = time.time()
    first = first or last
    total += size
print(total, last - first, flush=True)
'''
_SOURCE = r'''
import socket, sys, time
conn = socket.create_connection((sys.argv[1], int(sys.argv[2])))
data, end = bytes(1 << 20), time.time() + float(sys.argv[3])
while time.time() < end:
    conn.sendall(data)
conn.close()
'''


def measure_rate(net, sender=1, receiver=2, seconds=2.0, port=5999):
    """Bits per second of TCP payload that one stream carries from node `sender` of `net`
    to node `receiver` in `seconds` (what the shaped links let through; on a busy machine
    also what its CPU lets through)."""
    sink = subprocess.Popen(  # pylint: disable=consider-using-with
        ['ip', 'netns', 'exec', net.nodes[receiver][0], sys.executable, '-c', _SINK,
         str(port)], stdout=subprocess.PIPE, text=True)
    try:
        sink.stdout.readline()  # listening
        subprocess.run(['ip', 'netns', 'exec', net.nodes[sender][0], sys.executable, '-c',
                        _SOURCE, net.nodes[receiver][1], str(port), str(seconds)],
                       check=True, timeout=seconds + 30)
        total, span = sink.communicate(timeout=30)[0].split()
    finally:
        if sink.poll() is None:
            sink.kill()
            sink.wait()
    return int(total) * 8 / float(span)


class ShapedNetwork:
    """`count` namespaces linked through a bridge, each link shaped to `rate` (or unshaped).

    Parameters
    ----------
    count : int
        Number of node namespaces.
    rate : str, optional
        ``tc`` rate of every link in each direction, e.g. ``'1gbit'``; None: unshaped.
    latency : str
        ``tbf``'s bound on queueing delay (it sets the queue length; more is dropped).

    Attributes
    ----------
    nodes : list of (str, str)
        ``(namespace, ip)`` of each node.
    """

    def __init__(self, count, rate=None, latency='50ms'):
        self.count, self.rate, self.latency = count, rate, latency
        self.switch = '%s%d-sw' % (PREFIX, os.getpid())
        self.nodes = [('%s%d-%d' % (PREFIX, os.getpid(), index), _SUBNET % (index + 1))
                      for index in range(count)]
        self.created = []

    def __enter__(self):
        try:
            self.create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def create(self):
        """Create the namespaces, links and shaping."""
        _ip('netns', 'add', self.switch)
        self.created.append(self.switch)
        _ip('-n', self.switch, 'link', 'add', 'br0', 'type', 'bridge')
        _ip('-n', self.switch, 'link', 'set', 'br0', 'up')
        for index, (name, address) in enumerate(self.nodes):
            port = 'p%d' % index
            _ip('netns', 'add', name)
            self.created.append(name)
            _ip('link', 'add', 'eth0', 'netns', name, 'type', 'veth', 'peer', 'name', port,
                'netns', self.switch)
            _ip('-n', self.switch, 'link', 'set', port, 'master', 'br0', 'up')
            _ip('-n', name, 'addr', 'add', address + '/24', 'dev', 'eth0')
            _ip('-n', name, 'link', 'set', 'eth0', 'up')
            _ip('-n', name, 'link', 'set', 'lo', 'up')
            if self.rate:
                for namespace, device in ((name, 'eth0'), (self.switch, port)):
                    _ip('netns', 'exec', namespace, 'tc', 'qdisc', 'add', 'dev', device, 'root',
                        'tbf', 'rate', self.rate, 'burst', _burst(self.rate),
                        'latency', self.latency)

    def write_hostfile(self, path, first=0):
        """Write ``NETNS_NAME IP`` lines for ``mxdelay-launch --launcher netns``."""
        with open(path, 'w', encoding='utf-8') as out:
            out.write('# scheduler, then servers and workers (one node each)\n')
            for name, address in self.nodes[first:]:
                out.write('%s %s\n' % (name, address))

    def close(self):
        """Delete every namespace created (their interfaces go with them); idempotent."""
        errors = []
        while self.created:
            name = self.created.pop()
            try:
                _ip('netns', 'del', name)
            except (RuntimeError, OSError) as err:
                errors.append(str(err))
        if errors:
            raise RuntimeError('could not delete every namespace: %s' % '; '.join(errors))
