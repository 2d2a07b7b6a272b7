"""mxdelay: k-step delayed update and layer-wise pipelining for MXNet's parameter server.

Import it *before* ``mxnet`` in scripts that a DMLC launcher runs: in a scheduler or server
process the import becomes that role (mxdelay's server for servers) and never returns; in a
worker, ``'dist_delay'`` names mxdelay's kvstore as soon as MXNet is imported. Importing
``mxdelay`` itself loads no MXNet (the launcher imports it); :class:`DelayedTrainer` and
the other classes load it when first used.
"""
import importlib

import kvstore_ext  # noqa: F401  prepares MXNet's import; runs the scheduler and server roles

__all__ = ['DelayedTrainer', 'DelayedModule', 'DistDelay', 'StepObserver', 'ArgumentTypeError',
           'timeline', '__version__']
__version__ = '0.1.0'

_LAZY = {'DelayedTrainer': 'mxdelay.trainer', 'DelayedModule': 'mxdelay.module',
         'DistDelay': 'kvstore_ext.dist_delay',
         'StepObserver': 'mxdelay.observer', 'ArgumentTypeError': 'kvstore_ext.checks'}
_SUBMODULES = ('timeline', 'trace', 'trainer', 'rules', 'schedule', 'observer',
               'module')


def __getattr__(name):
    if name == 'env':  # the environment table (kvstore_ext.env), e.g. mxdelay.env.role()
        return importlib.import_module('kvstore_ext.env')
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module('mxdelay.' + name)
    raise AttributeError('module %r has no attribute %r' % (__name__, name))
