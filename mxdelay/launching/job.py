"""One ``mxdelay-launch`` job: place its roles, start them, supervise them, stop them all.

Fail-fast supervision: the first process that exits non-zero or dies by a signal ends the
whole job (SIGTERM to each process group started, SIGKILL after :data:`KILL_GRACE`
seconds). When every worker has exited 0, the servers and the scheduler get
``MXDELAY_SHUTDOWN_WAIT`` seconds to exit by themselves, then are killed with a warning.
"""
import ctypes
import logging
import shlex
import signal
import time
from typing import NamedTuple, Optional

from .output import Output
from .role import Role, describe, exit_code

__all__ = ['Job', 'Ending', 'KILL_GRACE', 'EXIT_TIMEOUT']

_LOG = logging.getLogger('mxdelay.launcher')

#: Seconds between SIGTERM and SIGKILL when the launcher stops a job.
KILL_GRACE = 3.0

#: The exit code of a job stopped by ``--timeout``, as coreutils' timeout(1).
EXIT_TIMEOUT = 124
_POLL_SECONDS = 0.05
_DRAIN_SECONDS = 1.0  # how long to wait for the last output of a process that has exited


class Ending(NamedTuple):
    """How one run of a job ended: the launcher's exit code for it and, if a role failed
    (the job may run again), that role and how it ended, in words."""

    code: int
    failure: Optional[str] = None


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


class Job:
    """Start the roles of one job, copy their output, and stop them all at the end."""

    def __init__(self, config, port=None):
        self.config = config
        self.port = config.port if port is None else port  # each attempt may get its own
        hosts = config.hosts
        if config.launcher == 'netns':
            self.roles = [Role('scheduler', 0, netns=hosts[0])]
            hosts = hosts[1:] or hosts
        else:
            self.roles = [Role('scheduler', 0)]  # here, also with ssh
        for index in range(config.num_servers + config.num_workers):
            role, rank = (('server', index) if index < config.num_servers
                          else ('worker', index - config.num_servers))
            host = hosts[index % len(hosts)] if hosts else None
            self.roles.append(Role(role, rank, netns=host) if config.launcher == 'netns'
                              else Role(role, rank, host))
        self._local = _local_ranks(self.roles)
        self.output = Output()
        self._libc = ctypes.CDLL(None, use_errno=True)

    def role_env(self, role):
        """Return the variables that `role` gets on top of its inherited environment."""
        config = self.config
        variables = {
            'DMLC_ROLE': role.role,
            'DMLC_PS_ROOT_URI': config.root_uri,
            'DMLC_PS_ROOT_PORT': str(self.port),
            'DMLC_NUM_WORKER': str(config.num_workers),
            'DMLC_NUM_SERVER': str(config.num_servers),
            # The address the others use to reach this process.
            'DMLC_NODE_HOST': (role.host[0] if role.host else role.netns[1] if role.netns
                               else config.root_uri),
            'MXDELAY_RANK': str(role.rank),
            'MXDELAY_JOB_KEY': config.job_key,
        }
        if role.role == 'server':
            variables.update(config.env_server)
        elif role.role == 'worker':
            local_rank, local_size = self._local[role.rank]
            variables['MXDELAY_LOCAL_RANK'] = str(local_rank)
            variables['MXDELAY_LOCAL_SIZE'] = str(local_size)
            variables.update(config.env_worker)
            variables.update(config.checkpoint_env)
        return variables

    def start(self, role):
        """Start `role`'s process with its variables."""
        config = self.config
        argv, stdin, child_env = role.argv(config.command, self.role_env(role), config.pass_env,
                                           config.ssh_options)
        _LOG.debug('%s: %s', role.label,   # the job's key stays out of the log
                   shlex.join(argv).replace(config.job_key, '<MXDELAY_JOB_KEY>'))
        role.start(argv, stdin, child_env, self.output, self._libc)

    def run(self, stop_signal=lambda: None, deadline=None):
        """Run the job to its end; return how it ended.

        Parameters
        ----------
        stop_signal : callable
            Returns the number of a signal that asks the launcher to stop, or None.
        deadline : float, optional
            ``time.monotonic()`` at which ``--timeout`` stops the job.

        Returns
        -------
        Ending
        """
        config = self.config
        _LOG.info('starting 1 scheduler, %d server(s) and %d worker(s) (%s launcher; scheduler '
                  'at %s:%d)', config.num_servers, config.num_workers, config.launcher,
                  config.root_uri, self.port)
        try:
            for role in self.roles:
                try:
                    self.start(role)
                except OSError as err:
                    _LOG.error('cannot start %s: %s; stopping the job', role.label, err)
                    return Ending(127)
            return self._supervise(stop_signal, deadline)
        finally:
            self._stop()
            for role in self.roles:
                if role.popen is not None:
                    role.popen.wait()  # reap, only now that no group is signalled any more

    def _supervise(self, stop_signal, deadline):
        """Wait for the job to succeed or fail."""
        shutdown_wait = self.config.shutdown_wait
        workers_done_at = None
        while True:
            self.output.pump(_POLL_SECONDS)
            signum = stop_signal()
            if signum is not None:
                _LOG.error('received %s; stopping the job', signal.Signals(signum).name)
                return Ending(128 + signum)
            for role in self.roles:
                was_running = role.status is None
                status = role.exited()
                if status == 0 and was_running:
                    _LOG.debug('%s exited with code 0', role.label)
                if status:
                    # Its last words (a traceback, say) before the verdict.
                    self.output.pump(_DRAIN_SECONDS, until_closed=role.pipes)
                    failure = '%s %s' % (role.label, describe(status))
                    _LOG.error('%s; stopping the job', failure)
                    return Ending(exit_code(status), failure)
            running = [role for role in self.roles if role.exited() is None]
            if not running:
                return Ending(0)
            now = time.monotonic()
            if deadline is not None and now > deadline:
                _LOG.error('the job ran longer than --timeout %g s; stopping it',
                           self.config.timeout)
                return Ending(EXIT_TIMEOUT)
            if all(role.role != 'worker' for role in running):
                workers_done_at = workers_done_at or now
                if now - workers_done_at > shutdown_wait:
                    _LOG.warning('every worker finished, but %s still running %g s later '
                                 '(MXDELAY_SHUTDOWN_WAIT); killing them',
                                 ', '.join(role.label for role in running), shutdown_wait)
                    return Ending(0)

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
