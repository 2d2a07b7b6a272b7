"""The MXNet side of mxdelay: the ``'dist_delay'`` kvstore type and mxdelay's server.

Importing this package registers ``'dist_delay'`` in MXNet's ``KVStoreBase`` registry. In
a server process it imports MXNet without letting ``import mxnet`` start MXNet's stock
server (see :func:`_import_mxnet_in_server`), so that :func:`kvstore_ext.server.serve` can
run mxdelay's server instead.
"""
import os
import sys

from mxdelay import env as _env

__all__ = ['DistDelay']


def _import_mxnet_in_server():
    # `import mxnet` starts MXNet's stock server (and exits) when DMLC_ROLE is 'server';
    # it asks ps-lite for the role through getenv at that moment, so hide the role.
    role = os.environ['DMLC_ROLE']
    os.environ['DMLC_ROLE'] = 'worker'
    try:
        import mxnet  # noqa: F401  pylint: disable=unused-import,import-outside-toplevel
    finally:
        os.environ['DMLC_ROLE'] = role


if 'mxnet' not in sys.modules and _env.role() == 'server':
    _import_mxnet_in_server()

from .dist_delay import DistDelay  # noqa: E402  pylint: disable=wrong-import-position
