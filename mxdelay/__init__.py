"""mxdelay: k-step delayed update and layer-wise pipelining for MXNet's parameter server.

Import this module *before* ``mxnet`` in scripts that a DMLC launcher runs: in a scheduler
or server process the import becomes that role (mxdelay's server for servers) and never
returns; in a worker it registers the kvstore type ``'dist_delay'``.
"""
from . import env
from .roles import dispatch_on_import

__all__ = ['DelayedTrainer', 'DistDelay', '__version__']
__version__ = '0.1.0'

_REQUIRED_MXNET = '1.9.1'


def _check_mxnet_version():
    try:
        from importlib.metadata import version, PackageNotFoundError
        installed = version('mxnet')
    except PackageNotFoundError:
        installed = None
    if installed != _REQUIRED_MXNET:
        raise ImportError(
            'mxdelay needs mxnet==%s (it overrides private seams of gluon.Trainer and the '
            'kvstore server that change between versions); found %s. Install it with: '
            "pip install mxnet==%s 'numpy<1.24'"
            % (_REQUIRED_MXNET, installed or 'no mxnet', _REQUIRED_MXNET))


_check_mxnet_version()
#: Whether mxdelay was imported before MXNet (so its MXNet defaults took effect).
IMPORTED_BEFORE_MXNET = env.set_mxnet_defaults()
if IMPORTED_BEFORE_MXNET:
    dispatch_on_import()

# pylint: disable=wrong-import-position
from kvstore_ext.dist_delay import DistDelay  # noqa: E402  registers 'dist_delay'
from .trainer import DelayedTrainer  # noqa: E402
from . import timeline  # noqa: E402,F401
