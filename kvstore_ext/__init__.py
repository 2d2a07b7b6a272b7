"""The MXNet side of mxdelay: the ``'dist_delay'`` kvstore type and mxdelay's server.

This package imports nothing from :mod:`mxdelay`, and importing it loads no MXNet. Importing
it (:mod:`kvstore_ext.bootstrap`):

- arranges MXNet's import: once MXNet is imported, ``'dist_delay'`` is registered in its
  ``KVStoreBase`` registry (:mod:`kvstore_ext.worker.dist_delay`);
- in a scheduler process, runs the scheduler; in a server process, runs mxdelay's server
  (:mod:`kvstore_ext.server.controller`); neither returns.
"""
from kvstore_ext import bootstrap as _bootstrap

__all__ = ['DistDelay', 'DelayServer']

_bootstrap.prepare()
_bootstrap.dispatch_role()


def __getattr__(name):
    # Lazy: the classes import MXNet, which the launcher and the role dispatch must not.
    if name == 'DistDelay':
        from kvstore_ext.worker.dist_delay import (DistDelay)  # pylint: disable=import-outside-toplevel
        return DistDelay
    if name == 'DelayServer':
        from kvstore_ext.server.controller import (DelayServer)  # pylint: disable=import-outside-toplevel
        return DelayServer
    raise AttributeError('module %r has no attribute %r' % (__name__, name))
