"""One process of a ``mxdelay-launch`` job: where it runs, how it is started, how it ended.

A local role runs the command itself; a netns role runs ``ip netns exec NAME COMMAND``
(which execs the command: same PID, process group and parent-death signal); an ssh role
runs ``ssh ... host 'sh -c SCRIPT'``, where :data:`REMOTE_SCRIPT` starts the command and
stops it when the connection closes (the launcher's module docstring says how).
"""
import os
import shlex
import signal
import subprocess
import sys

__all__ = ['Role', 'describe', 'exit_code', 'REMOTE_SCRIPT', 'SSH_DEFAULTS']

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>

# The remote side of one ssh role (see the module docstring), one line so that any login
# shell passes it to `sh -c` unchanged. fd 3 keeps the ssh connection's stdin for the
# watcher; the command and everything else read /dev/null. The command and the watcher
# each get a session (and process group) of their own, so that each can be killed whole:
# the watcher kills the command's group on end of file, the shell kills the watcher's group
# (its cat or sleep included) when the command has exited. Only the command writes to the
# connection: the watcher's output could hold the ssh session open, and the shell's (sh
# reports a killed job) would kill the shell by SIGPIPE once the connection is gone.
REMOTE_SCRIPT = ('cd {cwd} || exit 127; exec 3<&0 </dev/null; setsid {command} 3<&- & pid=$!; '
                 "setsid sh -c 'cat; kill -TERM -$0; sleep 3; kill -KILL -$0' $pid "
                 '<&3 >/dev/null 2>&1 & watcher=$!; exec 3<&- >/dev/null 2>&1; '
                 'wait $pid; rc=$?; kill -KILL -$watcher; exit $rc')

#: The ssh options every remote role gets unless --ssh-option sets the same key. Host keys
#: are not checked (a first connection to a new host would otherwise stop at a prompt that
#: nobody answers; pass --ssh-option StrictHostKeyChecking=yes to check them) and ssh never
#: asks for a password (BatchMode: a key is needed).
SSH_DEFAULTS = ('StrictHostKeyChecking=no', 'BatchMode=yes')


class Role:  # pylint: disable=too-few-public-methods
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

    def argv(self, command, variables, pass_env=None, ssh_options=()):
        """Return ``(argv, stdin, env)`` that start `command` as this role with `variables`
        on top of its environment (a local role inherits the launcher's; a remote one gets
        `pass_env` and `variables` only)."""
        if self.host is None:  # a local process inherits the launcher's environment
            argv = command
            if self.netns is not None:  # ip exec()s the command: same PID, group and PDEATHSIG
                argv = ['ip', 'netns', 'exec', self.netns[0]] + argv
            return argv, subprocess.DEVNULL, {'PYTHONUNBUFFERED': '1', **os.environ, **variables}
        remote_env = {'PYTHONUNBUFFERED': '1', **(pass_env or {}), **variables}
        remote = shlex.join(['env'] + ['%s=%s' % item for item in remote_env.items()] + command)
        script = REMOTE_SCRIPT.format(cwd=shlex.quote(os.getcwd()), command=remote)
        host, port = self.host
        # ssh keeps the first value of an option: a default the user sets is left out.
        given = {option.split('=', 1)[0].strip().lower() for option in ssh_options}
        argv = ['ssh']
        for option in SSH_DEFAULTS:
            if option.split('=', 1)[0].lower() not in given:
                argv += ['-o', option]
        for option in ssh_options:
            argv += ['-o', option]
        # '--': the host is never read as an option (the hostfile refuses '-' names too).
        argv += (['-p', str(port)] if port else []) + ['--', host, 'sh -c ' + shlex.quote(script)]
        # Held open and never written: its end of file tells the remote side to stop.
        return argv, subprocess.PIPE, None

    def start(self, argv, stdin, child_env, output, libc):
        """Start `argv` in a session of its own, dying with the launcher; copy its output."""
        # pylint: disable-next=consider-using-with,subprocess-popen-preexec-fn
        self.popen = subprocess.Popen(
            argv, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=child_env,
            start_new_session=True, preexec_fn=_die_with_parent(os.getpid(), libc))
        output.add(self.popen.stdout, self.prefix, sys.stdout.buffer)
        output.add(self.popen.stderr, self.prefix, sys.stderr.buffer)

    @property
    def pipes(self):
        """The process's stdout and stderr pipes."""
        return self.popen.stdout, self.popen.stderr

    def exited(self):
        """Return the exit status if the process has exited, else None; do not reap it.

        The exited process stays a zombie until :meth:`Job.run <job.Job.run>` reaps it at
        the very end, so its PID, which is also its process group's ID, cannot be reused
        meanwhile and ``killpg`` reaches only what this job started.
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


def describe(status):
    """How a process with Popen-style return code `status` ended, in words."""
    if status < 0:
        return 'died with signal %s (exit %d)' % (signal.Signals(-status).name, status)
    return 'exited with code %d' % status


def exit_code(status):
    """The shell's exit code for Popen-style `status` (128 + signal number for a signal)."""
    return 128 - status if status < 0 else status


def _die_with_parent(parent_pid, libc):
    """Return a preexec_fn: the child gets SIGKILL when the launcher dies."""
    def preexec():
        # PDEATHSIG fires when the *thread* that forked exits: the launcher has only one.
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent_pid:  # the launcher died before prctl: nothing would signal us
            os.kill(os.getpid(), signal.SIGKILL)
    return preexec
