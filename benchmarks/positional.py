"""Argument check shared by the worker scripts that take positional arguments.

The worker scripts run under a launcher with a fixed argument order, so they keep positional
arguments; this gives them ``--help`` (their docstring) and a usage error instead of an
IndexError when arguments are missing. Standard library only: the workers import it before
MXNet.
"""
import sys


def positional(doc, required, argv=None):
    """The script's arguments, or exit: with its docstring on ``-h``/``--help`` (code 0), with a
    usage error when fewer than `required` arguments are given (code 2)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if '-h' in argv or '--help' in argv:
        sys.stdout.write(doc)
        sys.exit(0)
    if len(argv) < required:
        sys.exit('%s: %d argument(s) required, %d given\n%s'
                 % (sys.argv[0], required, len(argv), doc))
    return argv
