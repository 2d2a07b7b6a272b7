"""``mxdelay-run CMD...``: the command MXNet's launcher runs for every role.

Scheduler and servers: ``import mxdelay`` (this module's package) runs them and never
returns. Workers: ``exec CMD`` with ``'dist_delay'`` meaning mxdelay's store in CMD's
Python processes (:func:`kvstore_ext.bootstrap.run_role`). Loads no MXNet on a worker.
"""
import sys

from kvstore_ext.bootstrap import run_role

__all__ = ['main']


def main(argv=None):
    """Entry point of ``mxdelay-run``: dispatch on ``DMLC_ROLE``; exec the command on workers."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ('-h', '--help'):
        sys.stdout.write('usage: mxdelay-run CMD [ARG...]\n\n'
                         'Run under a DMLC launcher (mxdelay-launch or MXNet tools/launch.py): the '
                         "scheduler and server roles run mxdelay's parameter server; workers exec CMD, "
                         "in which 'dist_delay' is mxdelay's kvstore even without import mxdelay.\n")
        return 0
    try:
        run_role(argv)
    except (ValueError, OSError) as err:
        sys.stderr.write('mxdelay-run: error: %s\n' % err)
        return 2 if isinstance(err, ValueError) else 127
    return 0


if __name__ == '__main__':
    sys.exit(main())
