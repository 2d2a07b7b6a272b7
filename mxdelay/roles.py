"""Start the right program for this process's DMLC role.

MXNet's launchers run one command for the scheduler, the servers and the workers, and
``import mxnet`` in a server process starts MXNet's *stock* server and exits. mxdelay needs
its own server (``kvstore_ext.server``), so the role is dispatched before MXNet is imported:

- ``mxdelay-run CMD...`` (like BytePS's ``bpslaunch``): scheduler -> MXNet's scheduler,
  server -> mxdelay's server, worker -> ``exec CMD``;
- ``import mxdelay`` at the top of a training script does the same for the scheduler and
  server roles (the script's own code never runs there), and returns on a worker.
"""
import logging
import os
import sys

from . import env

__all__ = ['run_role', 'dispatch_on_import']

_LOG = logging.getLogger(__name__)


def _run_scheduler():
    # MXNet runs the ps-lite scheduler inside `import mxnet` and calls sys.exit() after it.
    import mxnet  # noqa: F401  pylint: disable=unused-import,import-outside-toplevel
    sys.exit(0)


def _run_server():
    from kvstore_ext.server import serve  # pylint: disable=import-outside-toplevel
    serve()
    sys.exit(0)


def run_role(command):
    """Run the scheduler or the server for this process's role, or exec `command` on a worker.

    Parameters
    ----------
    command : list of str
        The worker's command line. It is not run on the scheduler or the servers.

    Raises
    ------
    ValueError
        If ``DMLC_ROLE`` is not one of 'scheduler', 'server', 'worker', or if a worker has
        no command.
    """
    role = env.role()
    if role == 'scheduler':
        _run_scheduler()
    elif role == 'server':
        _run_server()
    elif role == 'worker' or role is None:
        if not command:
            raise ValueError('mxdelay-run needs the worker command, e.g. '
                             '"mxdelay-run python train.py"; got none')
        os.execvp(command[0], command)
    else:
        raise ValueError("DMLC_ROLE=%r is not a role; expected 'scheduler', 'server' or 'worker' "
                         '(launch with mxdelay-launch or MXNet tools/launch.py)' % role)


def dispatch_on_import():
    """Become the scheduler or mxdelay's server when ``import mxdelay`` runs in one.

    Does nothing on a worker or outside a distributed job. If MXNet was imported first in
    a server process, MXNet's stock server has already run; workers detect that at kvstore
    creation (the hand-shake) and say how to launch correctly.
    """
    role = env.role()
    if role == 'scheduler':
        _run_scheduler()
    elif role == 'server':
        _run_server()
