"""``mxdelay-run CMD...``: the command MXNet's launcher runs for every role."""
import sys

from .roles import run_role

__all__ = ['main']


def main(argv=None):
    """Entry point of ``mxdelay-run``: dispatch on ``DMLC_ROLE``; exec the command on workers."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ('-h', '--help'):
        sys.stdout.write('usage: mxdelay-run CMD [ARG...]\n\n'
                         'Run under a DMLC launcher (mxdelay-launch or MXNet tools/launch.py): the '
                         "scheduler and server roles run mxdelay's parameter server; workers exec CMD.\n")
        return 0
    try:
        run_role(argv)
    except ValueError as err:
        sys.stderr.write('mxdelay-run: error: %s\n' % err)
        return 2
    return 0


if __name__ == '__main__':
    sys.exit(main())
