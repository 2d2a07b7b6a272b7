"""Keep mxdelay out of a stock job's process: after :func:`refuse_mxdelay`, importing
``mxdelay`` or ``kvstore_ext`` (or a submodule) raises ImportError. Scripts of stock jobs
call it before they import MXNet; it imports nothing but the standard library."""
import importlib.abc
import sys

__all__ = ['FORBIDDEN', 'refuse_mxdelay']

FORBIDDEN = ('mxdelay', 'kvstore_ext')


class _Refuse(importlib.abc.MetaPathFinder):
    """Make ``import mxdelay`` (or kvstore_ext, or a submodule) fail in this process."""

    def find_spec(self, fullname, path=None, target=None):  # pylint: disable=unused-argument
        if fullname.split('.')[0] in FORBIDDEN:
            raise ImportError('%s must not be imported in a stock job' % fullname)
        return None


def refuse_mxdelay():
    """Install the refusal (first on ``sys.meta_path``)."""
    sys.meta_path.insert(0, _Refuse())
