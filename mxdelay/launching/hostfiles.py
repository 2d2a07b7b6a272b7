"""``mxdelay-launch``'s hostfiles: ssh destinations and network namespaces, read and checked.

Every function takes ``fail(message)``, which reports a bad hostfile and does not return
(the option parser's ``error``: usage, the message, exit code 2), so that a mistake stops
the launcher before anything starts.
"""
import ipaddress
import socket
import subprocess

__all__ = ['read_hostfile', 'read_netns_hostfile', 'address_seen_by']


def _check_host_name(path, number, host, fail, hint=''):
    """Refuse a name that ssh or ip would take for an option, or that is not one word."""
    if not host or host.startswith('-') or any(c.isspace() or not c.isprintable() for c in host):
        fail('-H/--hostfile %r line %d: %r is not a host name (it is empty, starts with "-" '
             'or holds a space or control character); write one host name or address a line%s'
             % (path, number, host, hint))


def _hostfile_lines(path, fail, form):
    """Return ``(number, line)`` for the hostfile's lines, comments and blank lines dropped."""
    try:
        with open(path, encoding='utf-8') as file:
            lines = file.read().splitlines()
    except OSError as err:
        fail('-H/--hostfile %r cannot be read (%s); pass a file with one %s a line'
             % (path, err.strerror, form))
    lines = [(number, line.split('#', 1)[0].strip()) for number, line in enumerate(lines, 1)]
    lines = [(number, line) for number, line in lines if line]
    if not lines:
        fail('-H/--hostfile %r lists no host; write one %s a line' % (path, form))
    return lines


#: Below this, ``host:N`` is refused as ambiguous: no ssh server listens on ports 1-21,
#: and ``horovodrun -H host:4`` means 4 process slots, so such a line is most likely a slot
#: count written the Horovod way.
_LOWEST_SSH_PORT = 22


def read_hostfile(path, fail):
    """Return the ssh destinations ``(host, port or None)``, one per process slot.

    A line is ``host``, ``host:port`` (ssh port) or either followed by ``slots=N``
    (OpenMPI/Horovod style: the host appears N times in a row in the round-robin list, as
    if the line were written N times).
    """
    hosts = []
    form = "host, host:port or 'host slots=N'"
    for number, line in _hostfile_lines(path, fail, form):
        fields = line.split()
        hint = "; for N processes on one host write 'host slots=N'"
        if len(fields) > 1 and not fields[1].startswith(('slots=', 'max_slots=')):
            _check_host_name(path, number, line, fail, hint)  # 'two words': not one host
        host, colon, port = fields[0].partition(':')
        _check_host_name(path, number, host, fail, hint)
        if colon and not (port.isdigit() and 0 < int(port) < 65536):
            fail('-H/--hostfile %r line %d: %r is not host or host:port (port 1..65535); write '
                 "'host', 'host:PORT' or 'host slots=N'" % (path, number, line))
        if colon and int(port) < _LOWEST_SSH_PORT:
            fail("-H/--hostfile %r line %d: %r is ambiguous: here host:N is ssh port N, while "
                 "Horovod reads it as N process slots; write '%s slots=%s' for %s processes on "
                 "%s, or 'host:PORT' with the ssh port (%d or above)"
                 % (path, number, line, host, port, port, host, _LOWEST_SSH_PORT))
        slots = 1
        if len(fields) > 1:
            key, equals, value = fields[1].partition('=')
            if (len(fields) > 2 or key not in ('slots', 'max_slots') or not equals
                    or not (value.isdigit() and int(value) > 0)):
                fail("-H/--hostfile %r line %d: %r is not 'host slots=N' (N a positive integer); "
                     "write e.g. '%s slots=4' for 4 processes on %s, or just '%s'"
                     % (path, number, line, fields[0], host, fields[0]))
            if key == 'max_slots':
                fail("-H/--hostfile %r line %d: %r: max_slots is not supported (processes are "
                     "assigned round-robin over the slots); write '%s slots=%s'"
                     % (path, number, line, fields[0], value))
            slots = int(value)
        hosts.extend([(host, int(port) if colon else None)] * slots)
    return hosts


def read_netns_hostfile(path, fail):
    """Return the hostfile's ``(namespace, ip)`` pairs, each checked against the namespace."""
    hosts = []
    for number, line in _hostfile_lines(path, fail, "'NETNS_NAME IP'"):
        try:
            name, address = line.split()
            ipaddress.IPv4Address(address)
        except ValueError:
            fail("-H/--hostfile %r line %d: %r is not 'NETNS_NAME IP' (an IPv4 address) as "
                 '--launcher netns needs' % (path, number, line))
        _check_host_name(path, number, name, fail)
        hosts.append((name, address))
    # A wrong address would not fail: ps-lite would wait for the scheduler forever.
    addresses = {}
    for name, address in hosts:
        if name not in addresses:
            listed = subprocess.run(['ip', '-n', name, '-o', '-4', 'addr', 'show'],
                                    capture_output=True, text=True, check=False)
            if listed.returncode != 0:
                fail('-H/--hostfile %r: network namespace %r is not usable (%s); create it with '
                     '`ip netns add %s` or fix the name'
                     % (path, name, listed.stderr.strip(), name))
            addresses[name] = {field.split('/')[0] for line in listed.stdout.splitlines()
                               for field in line.split()[3:4]}
        if address not in addresses[name]:
            fail('-H/--hostfile %r: %s is not an address of network namespace %r (it has %s); '
                 'give the address of an interface in that namespace'
                 % (path, address, name, ', '.join(sorted(addresses[name])) or 'none'))
    return hosts


def address_seen_by(hosts, fail):
    """Return the scheduler's address for the hosts: loopback, or the local interface's."""
    addresses = []
    for host, _ in hosts:
        try:
            addresses.append(socket.gethostbyname(host))
        except OSError as err:
            fail('-H/--hostfile: cannot resolve host %r (%s); fix the name or use its address'
                 % (host, err))
    if all(ipaddress.ip_address(address).is_loopback for address in addresses):
        return '127.0.0.1'
    # Connecting a UDP socket sends nothing; it only selects the route and so the interface.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((addresses[0], hosts[0][1] or 22))
        return sock.getsockname()[0]
