"""``mxdelay-launch``: start a parameter-server job and supervise it.

Accepts the options of MXNet's ``tools/launch.py`` (``-n -s -H --launcher local|ssh
--env-server --env-worker --env``) and runs one scheduler, ``-s`` servers and ``-n``
workers, each running the same command with the DMLC variables of its role::

    mxdelay-launch -n 2 -s 1 mxdelay-run python train.py --epochs 3

What it adds to MXNet's launcher:

1. A free TCP port for the scheduler (``--port`` to choose one). Local jobs bind every role
   to loopback (``DMLC_PS_ROOT_URI=DMLC_NODE_HOST=127.0.0.1``), so two jobs on one machine
   do not meet.
2. Every output line is prefixed with its role and rank (``[worker 1] ``, ``[server 0] ``,
   ``[scheduler] ``): stdout lines go to stdout, stderr lines to stderr, whole lines only.
   ``MXDELAY_RANK`` is the index within the role; ps-lite assigns MXNet's own worker rank,
   which may differ. ``PYTHONUNBUFFERED=1`` is set unless already set, so that Python
   output arrives when printed and is not lost when a process is killed.
3. Fail-fast supervision: the first process that exits non-zero or dies by a signal ends
   the whole job (SIGTERM to each process group started, SIGKILL after
   :data:`KILL_GRACE` seconds); the launcher names its role and rank and returns its exit
   code (128 + signal number for a signal). When every worker has exited 0, the servers
   and the scheduler get ``MXDELAY_SHUTDOWN_WAIT`` seconds (default 30) to exit by
   themselves, then are killed with a warning. ``--timeout`` bounds the whole job (exit
   124). SIGINT, SIGTERM and SIGHUP stop the job (exit 130, 143, 129).
4. No process is left behind: each child runs in its own session and process group, which
   is killed as a whole at the end; each child also gets ``PR_SET_PDEATHSIG=SIGKILL``, so
   it dies if the launcher itself is killed. That covers what the child ``exec``\\ s, but
   not grandchildren a shell forks, when the launcher dies by SIGKILL (they are killed
   with their process group in every other case).
5. Bad options fail at once with exit code 2, before anything starts; options it does not
   know are refused (MXNet's launcher silently appends them to the command), and so are a
   ``--timeout`` that is not a finite positive number and ``--env-server``, ``--env-worker``
   or ``--env`` naming a variable the launcher sets itself (``DMLC_ROLE``,
   ``DMLC_NUM_WORKER``, ``DMLC_NUM_SERVER``, ``DMLC_PS_ROOT_URI``, ``DMLC_PS_ROOT_PORT``,
   ``DMLC_NODE_HOST``, ``MXDELAY_RANK``).

Every worker also gets ``MXDELAY_LOCAL_RANK`` and ``MXDELAY_LOCAL_SIZE``: its index among
the workers of its host (a hostfile destination; all of them in local mode) and their
number, for choosing a GPU (``mx.gpu(mxdelay.local_rank() % GPUS)``).

``--launcher ssh`` (the default with ``-H``): the scheduler runs here; servers, then
workers, are assigned round-robin over the hostfile's slots (lines ``host``,
``host:port`` with ``port`` the ssh port, 22 or above, or either followed by ``slots=N``,
which counts as the line written N times; blank lines and ``#`` comments are ignored) and
started with
``ssh -o StrictHostKeyChecking=no -o BatchMode=yes [-p port] -- host 'sh -c ...'``
(``--ssh-option KEY=VALUE`` adds options and replaces either default of the same key, e.g.
``--ssh-option StrictHostKeyChecking=yes`` to check host keys; a host
name that starts with ``-`` or holds a space or control character is refused). The remote
shell ``cd``\\ s to the launcher's working directory and starts the command under ``env``
with the role's variables, the ``--env`` variables and the role's pairs. Remote hosts need
a POSIX ``sh`` and ``setsid`` (util-linux).

How a remote process is stopped: ssh without a terminal does not signal the remote command
when the client dies, so the remote shell runs the command in a session of its own
(``setsid``) and a watcher reads the ssh connection's stdin, which the launcher holds open
and never writes. When the connection closes (the launcher stops the job, or the ssh
client or the launcher dies), the watcher reads end-of-file and sends SIGTERM to the
command's process group, then SIGKILL 3 s later if it is still there.

``--launcher netns`` (root only; never the default): every role runs on this machine, each
in the Linux network namespace the hostfile gives it, as ``ip netns exec NAME COMMAND``
(which execs the command: supervision, prefixes and cleanup are those of local mode,
and the environment is inherited). Hostfile lines are ``NETNS_NAME IP``, IP being an IPv4
address of that namespace's (blank lines and ``#`` comments are ignored). The first line
hosts the scheduler; servers, then workers, are assigned round-robin over the remaining
lines (over the first line too if it is the only one): with 1 + S + N lines, each role has
a line of its own, in the order scheduler, servers, workers. ``DMLC_PS_ROOT_URI`` is the
scheduler's IP and ``DMLC_NODE_HOST`` each role's own. For emulating a cluster on one
machine: one namespace per node, linked through veth pairs to a bridge, each link shaped
with ``tc`` (``benchmarks/netns.py`` builds such a network). The launcher checks that every
namespace exists and has its IP before starting anything; the free port is chosen in the
launcher's own namespace.

What it cannot see: a process that hangs instead of exiting. In MXNet 1.9.1 that includes
a worker leaving through ``sys.exit`` or an uncaught exception while another worker waits
for it: its kvstore's destructor waits in ps-lite's exit barrier forever. Such a worker
must leave with ``os._exit``, or disable the barrier first
(``MXKVStoreSetBarrierBeforeExit(handle, 0)``); ``--timeout`` bounds the rest.

The launcher never loads MXNet and never changes its own environment (each child gets its
own copy), and runs as a plain file too (``python path/to/mxdelay/launcher.py``), like
MXNet's ``tools/launch.py``.
"""
import argparse
import ctypes
import ipaddress
import logging
import math
import os
import selectors
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time

if __package__:
    from kvstore_ext import env
else:  # run as a file, like MXNet's tools/launch.py: find the package next to this one
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from kvstore_ext import env  # noqa: E402  pylint: disable=wrong-import-position

__all__ = ['main', 'build_parser', 'KILL_GRACE']

# __name__ is '__main__' under `python -m`; the logger keeps one name however it runs.
_LOG = logging.getLogger('mxdelay.launcher')

#: Seconds between SIGTERM and SIGKILL when the launcher stops a job.
KILL_GRACE = 3.0

_LAUNCHERS = ('local', 'ssh', 'netns')
_EXIT_TIMEOUT = 124  # as coreutils' timeout(1)
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_POLL_SECONDS = 0.05
_DRAIN_SECONDS = 1.0  # how long to wait for the last output of a process that has exited
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>

#: The variables the launcher sets for each role (``_Job._role_env``), and where they come
#: from: --env-server, --env-worker and --env may not set them (the role's value would be
#: lost silently, or the job broken: a worker told it is a server).
_OWN_VARIABLES = {
    'DMLC_ROLE': 'each process gets its role from -n/-s',
    'DMLC_NUM_WORKER': 'use -n/--num-workers',
    'DMLC_NUM_SERVER': 'use -s/--num-servers',
    'DMLC_PS_ROOT_URI': "it is the scheduler's address (--host-ip with --launcher ssh)",
    'DMLC_PS_ROOT_PORT': 'use --port',
    'DMLC_NODE_HOST': "it is each process's host (the hostfile's with ssh and netns)",
    'MXDELAY_RANK': "it is each process's index within its role",
    'MXDELAY_LOCAL_RANK': "it is each worker's index among the workers of its host",
    'MXDELAY_LOCAL_SIZE': "it is the number of workers on each worker's host",
}

# The remote side of one ssh role (see the module docstring), one line so that any login
# shell passes it to `sh -c` unchanged. fd 3 keeps the ssh connection's stdin for the
# watcher; the command and everything else read /dev/null. The command and the watcher
# each get a session (and process group) of their own, so that each can be killed whole:
# the watcher kills the command's group on end of file, the shell kills the watcher's group
# (its cat or sleep included) when the command has exited. Only the command writes to the
# connection: the watcher's output could hold the ssh session open, and the shell's (sh
# reports a killed job) would kill the shell by SIGPIPE once the connection is gone.
_REMOTE_SCRIPT = ('cd {cwd} || exit 127; exec 3<&0 </dev/null; setsid {command} 3<&- & pid=$!; '
                  "setsid sh -c 'cat; kill -TERM -$0; sleep 3; kill -KILL -$0' $pid "
                  '<&3 >/dev/null 2>&1 & watcher=$!; exec 3<&- >/dev/null 2>&1; '
                  'wait $pid; rc=$?; kill -KILL -$watcher; exit $rc')


#: The ssh options every remote role gets unless --ssh-option sets the same key. Host keys
#: are not checked (a first connection to a new host would otherwise stop at a prompt that
#: nobody answers; pass --ssh-option StrictHostKeyChecking=yes to check them) and ssh never
#: asks for a password (BatchMode: a key is needed).
_SSH_DEFAULTS = ('StrictHostKeyChecking=no', 'BatchMode=yes')


def build_parser():
    """Return the argument parser of ``mxdelay-launch``.

    Returns
    -------
    argparse.ArgumentParser
        Options before the command are the launcher's; everything from the first
        non-option word on is the command (``--`` may separate them).
    """
    parser = argparse.ArgumentParser(
        prog='mxdelay-launch', allow_abbrev=False,
        description='Launch a distributed MXNet job: 1 scheduler, S servers and N workers all '
                    'running COMMAND; prefix their output with role and rank; stop the whole job '
                    'when any process fails.',
        epilog='Example: mxdelay-launch -n 2 -s 1 mxdelay-run python train.py --epochs 3')
    parser.add_argument('-n', '--num-workers', type=int, required=True, metavar='N',
                        help='number of worker processes (at least 1)')
    parser.add_argument('-s', '--num-servers', type=int, metavar='S',
                        help='number of server processes (at least 1; default: N)')
    parser.add_argument('-H', '--hostfile', metavar='FILE',
                        help="hosts for --launcher ssh, one 'host', 'host:port' (ssh port) or "
                             "'host slots=N' (N process slots) a line; for "
                             "--launcher netns, one 'NETNS_NAME IP' a line")
    parser.add_argument('--launcher', metavar='|'.join(_LAUNCHERS),
                        help='where to run the servers and workers (default: ssh with -H, '
                             'else local; netns: each role in a network namespace of this '
                             'machine, as the hostfile says)')
    parser.add_argument('--env-server', action='append', default=[], metavar='NAME:VALUE',
                        help='set NAME=VALUE for the servers (repeatable)')
    parser.add_argument('--env-worker', action='append', default=[], metavar='NAME:VALUE',
                        help='set NAME=VALUE for the workers (repeatable)')
    parser.add_argument('--env', action='append', default=[], metavar='NAME',
                        help="pass NAME from this environment to remote roles (repeatable; local "
                             'roles inherit the whole environment)')
    parser.add_argument('--timeout', type=float, metavar='SECONDS',
                        help='stop the job (exit 124) if it runs longer than this')
    parser.add_argument('--port', type=int,
                        help="the scheduler's TCP port (default: a free one)")
    parser.add_argument('--host-ip', metavar='ADDRESS',
                        help="ssh: the scheduler's address as seen by the hosts (default: "
                             '127.0.0.1 for loopback hosts, else the address of the interface '
                             'that reaches the first host)')
    parser.add_argument('--ssh-option', action='append', default=[], metavar='KEY=VALUE',
                        help='ssh: pass -o KEY=VALUE to ssh (repeatable), e.g. '
                             'IdentityFile=~/.ssh/id_ed25519; it replaces the default '
                             'StrictHostKeyChecking=no or BatchMode=yes of the same key')
    parser.add_argument('command', nargs=argparse.REMAINDER, metavar='COMMAND',
                        help='the command every role runs, e.g. mxdelay-run python train.py')
    return parser


class _Config:  # pylint: disable=too-many-instance-attributes,too-few-public-methods
    """The validated options of one job."""

    def __init__(self, args, parser):
        def fail(message):
            parser.error(message)  # prints usage and the message, exits 2

        self.command = args.command[1:] if args.command[:1] == ['--'] else args.command
        if not self.command:
            fail('no command given; put the command every role runs after the options, e.g. '
                 'mxdelay-launch -n 2 -s 1 mxdelay-run python train.py')
        if args.num_workers < 1:
            fail('-n/--num-workers must be at least 1, got %d; pass the number of worker '
                 'processes, e.g. -n 2' % args.num_workers)
        self.num_workers = args.num_workers
        self.num_servers = args.num_workers if args.num_servers is None else args.num_servers
        if self.num_servers < 1:
            fail('-s/--num-servers must be at least 1, got %d; a parameter-server job needs a '
                 'server, e.g. -s 1' % self.num_servers)
        self.launcher = args.launcher or ('ssh' if args.hostfile else 'local')
        if self.launcher not in _LAUNCHERS:
            fail("--launcher %s is not supported; mxdelay-launch supports %s (MXNet's mpi, sge "
                 "and yarn launchers are not implemented: use MXNet's tools/launch.py for them)"
                 % (self.launcher, ' and '.join(_LAUNCHERS)))
        self.env_server = _parse_pairs('--env-server', args.env_server, fail)
        self.env_worker = _parse_pairs('--env-worker', args.env_worker, fail)
        self.pass_env = {}
        for name in args.env:
            # A pass-through of the user's own variable, not one that mxdelay reads: not in env.
            _refuse_own_variable('--env', name, name, fail)
            if name not in os.environ:
                fail('--env %s: %s is not set in the launcher\'s environment; set it or drop '
                     '--env %s' % (name, name, name))
            self.pass_env[name] = os.environ[name]
        if args.timeout is not None and not (math.isfinite(args.timeout) and args.timeout > 0):
            fail('--timeout must be a positive number of seconds, got %g; give a finite one '
                 '(e.g. --timeout 3600), or drop --timeout for no limit' % args.timeout)
        self.timeout = args.timeout
        self.port = _check_port(args.port, fail)
        try:
            self.shutdown_wait = env.get_float('MXDELAY_SHUTDOWN_WAIT')
        except ValueError as err:
            fail(str(err))

        if self.launcher in ('local', 'netns'):  # both start the command on this machine
            only = [('--host-ip', args.host_ip, 'ssh'), ('--ssh-option', args.ssh_option, 'ssh')]
            if self.launcher == 'local':
                only.insert(0, ('-H/--hostfile', args.hostfile, 'ssh or netns'))
            for option, value, launchers in only:
                if value:
                    fail('%s is only used with --launcher %s, got %r with --launcher %s; drop it '
                         'or pass --launcher %s' % (option, launchers, value, self.launcher,
                                                    launchers))
            if not (os.sep in self.command[0] or shutil.which(self.command[0])):
                fail('command %r not found on PATH; give its full path or fix PATH'
                     % self.command[0])
        if self.launcher == 'local':
            self.hosts = []
            self.root_uri = '127.0.0.1'
        elif self.launcher == 'netns':
            if not args.hostfile:
                fail("--launcher netns needs -H/--hostfile FILE with one 'NETNS_NAME IP' a line "
                     '(scheduler first, then servers and workers); got none')
            if os.geteuid() != 0:
                fail('--launcher netns starts each role with `ip netns exec`, which needs root; '
                     'run mxdelay-launch as root or use --launcher local')
            if not shutil.which('ip'):
                fail('--launcher netns needs the ip command, which is not on PATH; install '
                     'iproute2')
            self.hosts = _read_netns_hostfile(args.hostfile, fail)
            self.root_uri = self.hosts[0][1]
        else:
            if not args.hostfile:
                fail('--launcher ssh needs -H/--hostfile FILE listing the hosts; got none')
            if not shutil.which('ssh'):
                fail('--launcher ssh needs the ssh client, which is not on PATH; install '
                     'openssh-client')
            self.hosts = _read_hostfile(args.hostfile, fail)
            for option in args.ssh_option:
                if '=' not in option:
                    fail("--ssh-option %r is not KEY=VALUE; write e.g. --ssh-option "
                         "IdentityFile=/path/to/key" % option)
            self.ssh_options = args.ssh_option
            self.root_uri = args.host_ip or _address_seen_by(self.hosts, fail)


def _parse_pairs(option, values, fail):
    pairs = {}
    for value in values:
        name, colon, setting = value.partition(':')
        if not colon or not name.isidentifier():
            fail('%s %r is not NAME:VALUE; write e.g. %s OMP_NUM_THREADS:4'
                 % (option, value, option))
        _refuse_own_variable(option, value, name, fail)
        pairs[name] = setting
    return pairs


def _refuse_own_variable(option, value, name, fail):
    if name in _OWN_VARIABLES:
        fail('%s %s: mxdelay-launch sets %s for every process (%s); drop %s %s'
             % (option, value, name, _OWN_VARIABLES[name], option, value))


def _check_host_name(path, number, host, fail, hint=''):
    """Refuse a name that ssh or ip would take for an option, or that is not one word."""
    if not host or host.startswith('-') or any(c.isspace() or not c.isprintable() for c in host):
        fail('-H/--hostfile %r line %d: %r is not a host name (it is empty, starts with "-" '
             'or holds a space or control character); write one host name or address a line%s'
             % (path, number, host, hint))


def _check_port(port, fail):
    if port is None:
        with socket.socket() as sock:
            sock.bind(('', 0))  # ps-lite's scheduler binds all interfaces
            return sock.getsockname()[1]
    if not 0 < port < 65536:
        fail('--port must be in 1..65535, got %d' % port)
    with socket.socket() as sock:
        # As ZeroMQ does: a port whose last connections are in TIME_WAIT can be bound.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(('', port))
        except OSError as err:
            # Two jobs on one port break both; refuse before starting anything.
            fail('--port %d is not free (%s); drop --port to use a free one' % (port, err.strerror))
    return port


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


def _read_hostfile(path, fail):
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


def _read_netns_hostfile(path, fail):
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


def _address_seen_by(hosts, fail):
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


class _Role:  # pylint: disable=too-few-public-methods
    """One process of the job: its role, rank, host (ssh: name, port) or network namespace
    (netns: name, ip) and, once started, its Popen."""

    def __init__(self, role, rank, host=None, netns=None):
        self.role, self.rank, self.host, self.netns = role, rank, host, netns
        name = role if role == 'scheduler' else '%s %d' % (role, rank)
        self.prefix = ('[%s] ' % name).encode()
        self.label = name
        if host is not None:
            self.label = '%s (on %s)' % (name, host[0])
        elif netns is not None:
            self.label = '%s (in netns %s)' % (name, netns[0])
        self.popen = None
        self.status = None  # the Popen-style return code once the process has exited

    @property
    def pipes(self):
        """The process's stdout and stderr pipes."""
        return self.popen.stdout, self.popen.stderr

    def exited(self):
        """Return the exit status if the process has exited, else None; do not reap it.

        The exited process stays a zombie until :meth:`_Job.run` reaps it at the very end,
        so its PID, which is also its process group's ID, cannot be reused meanwhile and
        ``killpg`` reaches only what this job started.
        """
        if self.status is None:
            info = os.waitid(os.P_PID, self.popen.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            if info is not None:
                self.status = (info.si_status if info.si_code == os.CLD_EXITED
                               else -info.si_status)
        return self.status

    def signal_group(self, signum):
        """Send `signum` to the process group this role's process leads."""
        try:
            os.killpg(self.popen.pid, signum)
        except ProcessLookupError:
            pass


def _local_ranks(roles):
    """Return ``{worker rank: (local rank, local size)}``: each worker's index among the
    workers of its host, in rank order, and their number.

    A host is a hostfile destination (ssh: name and port; netns: namespace); local roles
    all share this machine. Two names of one machine (``127.0.0.1`` and ``localhost``)
    count as two hosts: the launcher cannot tell, and ssh may well reach two machines.
    """
    by_host = {}
    for role in roles:
        if role.role == 'worker':
            by_host.setdefault(role.host or role.netns, []).append(role.rank)
    return {rank: (index, len(ranks)) for ranks in by_host.values()
            for index, rank in enumerate(ranks)}


def _describe(status):
    if status < 0:
        return 'died with signal %s (exit %d)' % (signal.Signals(-status).name, status)
    return 'exited with code %d' % status


def _exit_code(status):
    return 128 - status if status < 0 else status


class _Output:
    """Copy the children's pipes to our stdout and stderr, one prefixed line at a time."""

    def __init__(self):
        self._selector = selectors.DefaultSelector()
        self._partial = {}

    def add(self, pipe, prefix, sink):
        """Copy `pipe` to `sink` (a binary stream), each line prefixed with `prefix`."""
        os.set_blocking(pipe.fileno(), False)
        self._selector.register(pipe, selectors.EVENT_READ, (prefix, sink))
        self._partial[pipe] = b''

    def pump(self, seconds, until_closed=()):
        """Copy output for `seconds`, or less once every pipe of `until_closed` has closed."""
        deadline = time.monotonic() + seconds
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or (until_closed and
                                  not any(pipe in self._partial for pipe in until_closed)):
                return
            for key, _ in self._selector.select(remaining):
                self._read(key.fileobj, *key.data)

    def _read(self, pipe, prefix, sink):
        chunk = os.read(pipe.fileno(), 65536)
        data = self._partial[pipe] + chunk
        if not chunk:  # end of file: the last line may lack its newline
            self._selector.unregister(pipe)
            del self._partial[pipe]
            pipe.close()
            lines, rest = data, b''
            if lines and not lines.endswith(b'\n'):
                lines += b'\n'
        else:
            cut = data.rfind(b'\n') + 1
            lines, rest = data[:cut], data[cut:]
            self._partial[pipe] = rest
        if lines:
            sink.write(b''.join(prefix + line + b'\n' for line in lines[:-1].split(b'\n')))
            sink.flush()


def _die_with_parent(parent_pid, libc):
    """Return a preexec_fn: the child gets SIGKILL when the launcher dies."""
    def preexec():
        # PDEATHSIG fires when the *thread* that forked exits: the launcher has only one.
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent_pid:  # the launcher died before prctl: nothing would signal us
            os.kill(os.getpid(), signal.SIGKILL)
    return preexec


class _Job:
    """Start the roles of one job, copy their output, and stop them all at the end."""

    def __init__(self, config):
        self.config = config
        hosts = config.hosts
        if config.launcher == 'netns':
            self.roles = [_Role('scheduler', 0, netns=hosts[0])]
            hosts = hosts[1:] or hosts
        else:
            self.roles = [_Role('scheduler', 0)]  # here, also with ssh
        for index in range(config.num_servers + config.num_workers):
            role, rank = (('server', index) if index < config.num_servers
                          else ('worker', index - config.num_servers))
            host = hosts[index % len(hosts)] if hosts else None
            self.roles.append(_Role(role, rank, netns=host) if config.launcher == 'netns'
                              else _Role(role, rank, host))
        self._local = _local_ranks(self.roles)
        self.output = _Output()
        self._signal = None
        self._libc = ctypes.CDLL(None, use_errno=True)

    def _role_env(self, role):
        """Return the variables that `role` gets on top of its inherited environment."""
        config = self.config
        variables = {
            'DMLC_ROLE': role.role,
            'DMLC_PS_ROOT_URI': config.root_uri,
            'DMLC_PS_ROOT_PORT': str(config.port),
            'DMLC_NUM_WORKER': str(config.num_workers),
            'DMLC_NUM_SERVER': str(config.num_servers),
            # The address the others use to reach this process.
            'DMLC_NODE_HOST': (role.host[0] if role.host else role.netns[1] if role.netns
                               else config.root_uri),
            'MXDELAY_RANK': str(role.rank),
        }
        if role.role == 'server':
            variables.update(config.env_server)
        elif role.role == 'worker':
            local_rank, local_size = self._local[role.rank]
            variables['MXDELAY_LOCAL_RANK'] = str(local_rank)
            variables['MXDELAY_LOCAL_SIZE'] = str(local_size)
            variables.update(config.env_worker)
        return variables

    def _start(self, role):
        config = self.config
        variables = self._role_env(role)
        if role.host is None:  # a local process inherits the launcher's environment
            argv, stdin = config.command, subprocess.DEVNULL
            if role.netns is not None:  # ip exec()s the command: same PID, group and PDEATHSIG
                argv = ['ip', 'netns', 'exec', role.netns[0]] + argv
            child_env = {'PYTHONUNBUFFERED': '1', **os.environ, **variables}
        else:
            remote_env = {'PYTHONUNBUFFERED': '1', **config.pass_env, **variables}
            command = shlex.join(['env'] + ['%s=%s' % item for item in remote_env.items()]
                                 + config.command)
            script = _REMOTE_SCRIPT.format(cwd=shlex.quote(os.getcwd()), command=command)
            host, port = role.host
            # ssh keeps the first value of an option: a default the user sets is left out.
            given = {option.split('=', 1)[0].strip().lower() for option in config.ssh_options}
            argv = ['ssh']
            for option in _SSH_DEFAULTS:
                if option.split('=', 1)[0].lower() not in given:
                    argv += ['-o', option]
            for option in config.ssh_options:
                argv += ['-o', option]
            # '--': the host is never read as an option (the hostfile refuses '-' names too).
            argv += ((['-p', str(port)] if port else [])
                     + ['--', host, 'sh -c ' + shlex.quote(script)])
            # Held open and never written: its end of file tells the remote side to stop.
            stdin, child_env = subprocess.PIPE, None
        _LOG.debug('%s: %s', role.label, shlex.join(argv))
        # pylint: disable-next=consider-using-with,subprocess-popen-preexec-fn
        role.popen = subprocess.Popen(
            argv, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=child_env,
            start_new_session=True,
            preexec_fn=_die_with_parent(os.getpid(), self._libc))
        self.output.add(role.popen.stdout, role.prefix, sys.stdout.buffer)
        self.output.add(role.popen.stderr, role.prefix, sys.stderr.buffer)

    def run(self):
        """Run the job to its end and return the launcher's exit code."""
        config = self.config
        _LOG.info('starting 1 scheduler, %d server(s) and %d worker(s) (%s launcher; scheduler '
                  'at %s:%d)', config.num_servers, config.num_workers, config.launcher,
                  config.root_uri, config.port)
        previous = {signum: signal.signal(signum, self._on_signal) for signum in _STOP_SIGNALS}
        try:
            for role in self.roles:
                try:
                    self._start(role)
                except OSError as err:
                    _LOG.error('cannot start %s: %s; stopping the job', role.label, err)
                    return 127
            return self._supervise()
        finally:
            self._stop()
            for role in self.roles:
                if role.popen is not None:
                    role.popen.wait()  # reap, only now that no group is signalled any more
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _on_signal(self, signum, _frame):
        self._signal = self._signal or signum

    def _supervise(self):
        """Wait for the job to succeed or fail; return the exit code."""
        timeout = self.config.timeout
        deadline = time.monotonic() + timeout if timeout else None
        shutdown_wait = self.config.shutdown_wait
        workers_done_at = None
        while True:
            self.output.pump(_POLL_SECONDS)
            if self._signal is not None:
                _LOG.error('received %s; stopping the job', signal.Signals(self._signal).name)
                return 128 + self._signal
            for role in self.roles:
                was_running = role.status is None
                status = role.exited()
                if status == 0 and was_running:
                    _LOG.debug('%s exited with code 0', role.label)
                if status:
                    # Its last words (a traceback, say) before the verdict.
                    self.output.pump(_DRAIN_SECONDS, until_closed=role.pipes)
                    _LOG.error('%s %s; stopping the job', role.label, _describe(status))
                    return _exit_code(status)
            running = [role for role in self.roles if role.exited() is None]
            if not running:
                return 0
            now = time.monotonic()
            if deadline is not None and now > deadline:
                _LOG.error('the job ran longer than --timeout %g s; stopping it', timeout)
                return _EXIT_TIMEOUT
            if all(role.role != 'worker' for role in running):
                workers_done_at = workers_done_at or now
                if now - workers_done_at > shutdown_wait:
                    _LOG.warning('every worker finished, but %s still running %g s later '
                                 '(MXDELAY_SHUTDOWN_WAIT); killing them',
                                 ', '.join(role.label for role in running), shutdown_wait)
                    return 0

    def _stop(self):
        """End every process started: SIGTERM, SIGKILL after a grace, and collect the output."""
        started = [role for role in self.roles if role.popen is not None]
        for role in started:
            if role.popen.stdin:
                role.popen.stdin.close()  # ssh: the remote side stops on end of file
            role.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + KILL_GRACE
        while time.monotonic() < deadline and any(role.exited() is None for role in started):
            self.output.pump(_POLL_SECONDS)
        # Every group, exited leaders included: it also ends what their children left behind.
        for role in started:
            role.signal_group(signal.SIGKILL)
        self.output.pump(_DRAIN_SECONDS,
                         until_closed=[pipe for role in started for pipe in role.pipes])


def main(argv=None):
    """Entry point of ``mxdelay-launch``: parse the options, run the job, return its exit code.

    Parameters
    ----------
    argv : list of str, optional
        The arguments after the program name (default: ``sys.argv[1:]``).

    Returns
    -------
    int
        0 when every worker exited 0; else the first failure's exit code (128 + signal
        number for a signal), 124 on ``--timeout``, 130/143/129 on SIGINT/SIGTERM/SIGHUP.
        Bad options exit 2 (``SystemExit``) before anything starts.
    """
    parser = build_parser()
    if not _LOG.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter('mxdelay-launch: %(message)s'))
        _LOG.addHandler(handler)
        _LOG.propagate = False
    try:
        _LOG.setLevel(env.log_level())
    except ValueError as err:
        parser.error(str(err))
    args, unknown = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if unknown:
        parser.error('unknown option %s before the command; mxdelay-launch takes the options '
                     'listed above, and options meant for the command go after it'
                     % ' '.join(unknown))
    return _Job(_Config(args, parser)).run()


if __name__ == '__main__':
    sys.exit(main())
