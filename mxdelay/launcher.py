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

6. ``--max-restarts N``: after a failure the job runs again, every role, up to N times,
   after a back-off; ``--checkpoint-dir DIR --checkpoint-every STEPS`` make every
   ``DelayedTrainer`` save checkpoints and resume from the newest
   (:mod:`mxdelay.launching.restarts`, :mod:`mxdelay.autosave`).

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
import logging
import os
import sys

if not __package__:  # run as a file, like MXNet's tools/launch.py: find the packages here
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# pylint: disable=wrong-import-position
from kvstore_ext import env  # noqa: E402
from mxdelay.launching import restarts  # noqa: E402
from mxdelay.launching.job import KILL_GRACE  # noqa: E402
from mxdelay.launching.options import Config, build_parser  # noqa: E402

__all__ = ['main', 'build_parser', 'KILL_GRACE']

# __name__ is '__main__' under `python -m`; the logger keeps one name however it runs.
_LOG = logging.getLogger('mxdelay.launcher')


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
        number for a signal; with ``--max-restarts``, the last failure's), 124 on
        ``--timeout``, 130/143/129 on SIGINT/SIGTERM/SIGHUP.
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
    return restarts.run(Config(args, parser))


if __name__ == '__main__':
    sys.exit(main())
