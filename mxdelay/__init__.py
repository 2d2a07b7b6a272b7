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
           'FrozenVarianceAdam',
           'timeline', 'local_rank', 'local_size', '__version__']
__version__ = '0.1.0'

_LAZY = {'DelayedTrainer': 'mxdelay.trainer', 'DelayedModule': 'mxdelay.module',
         'DistDelay': 'kvstore_ext.worker.dist_delay',
         'StepObserver': 'mxdelay.observer', 'ArgumentTypeError': 'kvstore_ext.checks',
         'FrozenVarianceAdam': 'kvstore_ext.optim.frozen_variance'}
_SUBMODULES = ('timeline', 'trace', 'trainer', 'rules', 'schedule', 'observer',
               'module')


def local_rank():
    """Return this worker's index among the workers on its host (0 when not launched).

    ``mxdelay-launch`` sets it (``MXDELAY_LOCAL_RANK``) for every worker: unlike
    ``trainer.rank % GPUS``, ``mx.gpu(mxdelay.local_rank() % GPUS)`` gives the workers of
    one host distinct GPUs whatever the number of workers per host.

    Returns
    -------
    int
        0 to ``local_size() - 1``.

    Raises
    ------
    ValueError
        If ``MXDELAY_LOCAL_RANK`` or ``MXDELAY_LOCAL_SIZE`` is not an integer, is below its
        minimum, or the rank is not below the size.
    """
    rank = _env().get_int('MXDELAY_LOCAL_RANK')
    size = local_size()
    rank = 0 if rank is None else rank
    if rank >= size:
        raise ValueError('environment variable MXDELAY_LOCAL_RANK=%d must be below '
                         'MXDELAY_LOCAL_SIZE=%d (it indexes the workers of one host); launch '
                         'with mxdelay-launch, which sets both, or unset both' % (rank, size))
    return rank


def local_size():
    """Return the number of workers on this worker's host (1 when not launched).

    Returns
    -------
    int
        ``MXDELAY_LOCAL_SIZE``, which ``mxdelay-launch`` sets, at least 1.

    Raises
    ------
    ValueError
        If ``MXDELAY_LOCAL_SIZE`` is not an integer >= 1.
    """
    size = _env().get_int('MXDELAY_LOCAL_SIZE')
    return 1 if size is None else size


def _env():
    return importlib.import_module('kvstore_ext.env')


def __getattr__(name):
    if name == 'env':  # the environment table (kvstore_ext.env), e.g. mxdelay.env.role()
        return importlib.import_module('kvstore_ext.env')
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module('mxdelay.' + name)
    raise AttributeError('module %r has no attribute %r' % (__name__, name))
