"""``mxdelay-launch``'s options: the parser and :class:`Config`, every option checked once.

Bad options fail at once with exit code 2, before anything starts (``parser.error``).
"""
import argparse
import math
import os
import secrets
import shutil
import socket

from kvstore_ext import env
from . import hostfiles

__all__ = ['build_parser', 'Config', 'OWN_VARIABLES', 'free_port']

_LAUNCHERS = ('local', 'ssh', 'netns')

#: The variables the launcher sets for each role (``job.Job.role_env``), and where they come
#: from: --env-server, --env-worker and --env may not set them (the role's value would be
#: lost silently, or the job broken: a worker told it is a server).
OWN_VARIABLES = {
    'DMLC_ROLE': 'each process gets its role from -n/-s',
    'DMLC_NUM_WORKER': 'use -n/--num-workers',
    'DMLC_NUM_SERVER': 'use -s/--num-servers',
    'DMLC_PS_ROOT_URI': "it is the scheduler's address (--host-ip with --launcher ssh)",
    'DMLC_PS_ROOT_PORT': 'use --port',
    'DMLC_NODE_HOST': "it is each process's host (the hostfile's with ssh and netns)",
    'MXDELAY_RANK': "it is each process's index within its role",
    'MXDELAY_LOCAL_RANK': "it is each worker's index among the workers of its host",
    'MXDELAY_LOCAL_SIZE': "it is the number of workers on each worker's host",
    'MXDELAY_JOB_KEY': "it is the job's key for mxdelay's commands, a new random one per job "
                       "unless MXDELAY_JOB_KEY is set in mxdelay-launch's own environment",
}


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
    parser.add_argument('--max-restarts', type=int, default=0, metavar='N',
                        help='when a process fails, stop the job as always, then start every '
                             'role again, up to N times, after a back-off of 1 s doubling up to '
                             '30 s (default: 0, the first failure ends the launcher)')
    parser.add_argument('--checkpoint-dir', metavar='DIR',
                        help='the workers save a checkpoint in DIR every --checkpoint-every '
                             'steps and resume from the newest complete one (DelayedTrainer; '
                             'a folder that every worker and server can reach)')
    parser.add_argument('--checkpoint-every', type=int, metavar='STEPS',
                        help='steps between two checkpoints (with --checkpoint-dir)')
    parser.add_argument('--keep-checkpoints', type=int, metavar='K',
                        help='complete checkpoints to keep, the newest (with --checkpoint-dir; '
                             'default: %s)' % env.VARIABLES['MXDELAY_KEEP_CHECKPOINTS'][0])
    parser.add_argument('command', nargs=argparse.REMAINDER, metavar='COMMAND',
                        help='the command every role runs, e.g. mxdelay-run python train.py')
    return parser


class Config:  # pylint: disable=too-many-instance-attributes,too-few-public-methods
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
        # Every process of the job signs and checks mxdelay's commands with this key
        # (docs/design.md §4.5): the user's own, or a random one for this launch.
        self.job_key = env.get('MXDELAY_JOB_KEY') or secrets.token_hex(32)
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
        self.port_given = args.port is not None
        self.ssh_options = args.ssh_option
        if args.max_restarts < 0:
            fail('--max-restarts must be 0 or more, got %d; e.g. --max-restarts 3 starts the '
                 'job at most 4 times' % args.max_restarts)
        self.max_restarts = args.max_restarts
        self.checkpoint_dir, self.checkpoint_env = _checkpoint_options(args, self.env_worker,
                                                                       fail)
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
            self.hosts = hostfiles.read_netns_hostfile(args.hostfile, fail)
            self.root_uri = self.hosts[0][1]
        else:
            if not args.hostfile:
                fail('--launcher ssh needs -H/--hostfile FILE listing the hosts; got none')
            if not shutil.which('ssh'):
                fail('--launcher ssh needs the ssh client, which is not on PATH; install '
                     'openssh-client')
            self.hosts = hostfiles.read_hostfile(args.hostfile, fail)
            for option in args.ssh_option:
                if '=' not in option:
                    fail("--ssh-option %r is not KEY=VALUE; write e.g. --ssh-option "
                         "IdentityFile=/path/to/key" % option)
            self.root_uri = args.host_ip or hostfiles.address_seen_by(self.hosts, fail)


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
    if name in OWN_VARIABLES:
        fail('%s %s: mxdelay-launch sets %s for every process (%s); drop %s %s'
             % (option, value, name, OWN_VARIABLES[name], option, value))


def _checkpoint_options(args, env_worker, fail):
    """Return the checkpoint folder (absolute, or None) and the workers' variables for it."""
    options = (('--checkpoint-dir', args.checkpoint_dir, 'MXDELAY_CHECKPOINT_DIR'),
               ('--checkpoint-every', args.checkpoint_every, 'MXDELAY_CHECKPOINT_EVERY'),
               ('--keep-checkpoints', args.keep_checkpoints, 'MXDELAY_KEEP_CHECKPOINTS'))
    given = [option for option in options if option[1] is not None]
    if not given:
        return None, {}
    if args.checkpoint_dir is None or args.checkpoint_every is None:
        fail('%s needs --checkpoint-dir DIR and --checkpoint-every STEPS, got %s; give both, '
             'e.g. --checkpoint-dir ckpt --checkpoint-every 500'
             % (given[0][0], ' '.join('%s %s' % option[:2] for option in given)))
    for option, value, name in given[1:]:
        if value < 1:
            fail('%s must be at least 1, got %d' % (option, value))
    for option, value, name in given:
        if name in env_worker:
            fail('--env-worker %s:... and %s both set %s; drop one' % (name, option, name))
    directory = os.path.abspath(args.checkpoint_dir)  # the servers write there too
    if os.path.exists(directory) and not os.path.isdir(directory):
        fail('--checkpoint-dir %s is a file, not a folder; give a folder (it is created if '
             'missing)' % args.checkpoint_dir)
    variables = {name: str(value) for _, value, name in given}
    variables['MXDELAY_CHECKPOINT_DIR'] = directory
    return directory, variables


def free_port():
    """A TCP port that is free on every interface now (for the scheduler)."""
    with socket.socket() as sock:
        sock.bind(('', 0))  # ps-lite's scheduler binds all interfaces
        return sock.getsockname()[1]


def _check_port(port, fail):
    if port is None:
        return free_port()
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
