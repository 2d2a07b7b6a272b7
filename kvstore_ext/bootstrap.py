"""What runs before MXNet is imported: the version check, MXNet's import, the role dispatch.

MXNet's launchers run one command for the scheduler, the servers and the workers, and
``import mxnet`` in a server process starts MXNet's *stock* server and exits. mxdelay needs
its own server, so a process decides its role before MXNet is imported
(docs/design.md §7):

- ``import kvstore_ext`` (and so ``import mxdelay``) calls :func:`prepare` and
  :func:`dispatch_role`: in a scheduler process it becomes the scheduler, in a server
  process mxdelay's server (the script's own code never runs there); on a worker it returns.
- :func:`prepare` does not import MXNet. It installs a one-shot hook on ``import mxnet``
  that checks MXNet's version, gives MXNet mxdelay's defaults (:mod:`kvstore_ext.env`),
  hides the server role from MXNet while it is imported in mxdelay's server, and registers
  the kvstore type ``'dist_delay'`` as soon as MXNet is loaded. So ``'dist_delay'`` means
  mxdelay's store whatever the import order, and a process that never imports MXNet (the
  launcher, ``mxdelay-run`` on a worker) never loads it.
- ``mxdelay-run CMD...`` (:func:`run_role`): scheduler and server as above; a worker
  ``exec``\\ s CMD with :data:`AUTOLOAD_DIR` in front of ``PYTHONPATH``, whose
  ``sitecustomize`` imports this package at interpreter start, so that a worker script that
  never imports mxdelay still gets mxdelay's store for ``'dist_delay'``.

This module imports neither MXNet nor :mod:`mxdelay`.
"""
import ctypes
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import re
import sys

from kvstore_ext import env
from kvstore_ext.typenames import register_store_type

__all__ = ['REQUIRED_MXNET', 'AUTOLOAD_DIR', 'prepare', 'dispatch_role', 'run_role',
           'check_mxnet_version', 'installed_mxnet_version']

_LOG = logging.getLogger(__name__)

#: The MXNet release mxdelay is built against (it overrides private seams of gluon.Trainer
#: and of the kvstore server, which change between releases). Any build of it: the CPU
#: wheel ``mxnet`` or a CUDA build such as ``mxnet-cu112``.
REQUIRED_MXNET = '1.9.1'
#: The folder whose ``sitecustomize.py`` ``mxdelay-run`` puts first on a worker's PYTHONPATH.
AUTOLOAD_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'autoload')


def installed_mxnet_version():
    """Return the version of the MXNet that ``import mxnet`` loads (or has loaded), or None.

    Read from ``mxnet.__version__`` if MXNet is loaded, else from the package's
    ``libinfo.py`` without importing it; so every build reports the same way, whatever its
    distribution's name.
    """
    module = sys.modules.get('mxnet')
    if getattr(module, '__version__', None):
        return module.__version__
    spec = getattr(module, '__spec__', None) or importlib.machinery.PathFinder.find_spec('mxnet')
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        try:
            with open(os.path.join(folder, 'libinfo.py'), encoding='utf-8') as src:
                found = re.search(r'''^__version__\s*=\s*['"]([^'"]+)['"]''', src.read(), re.M)
        except OSError:
            continue
        if found:
            return found.group(1)
    return None


def check_mxnet_version(version=None):
    """Raise ImportError, saying what to install, unless MXNet `version` is 1.9.1.

    Parameters
    ----------
    version : str, optional
        Default: :func:`installed_mxnet_version`.
    """
    version = installed_mxnet_version() if version is None else version
    if version != REQUIRED_MXNET:
        raise ImportError(
            'mxdelay needs MXNet %s (it overrides private seams of gluon.Trainer and of the '
            'kvstore server, which change between releases); found %s. Install one build of '
            "it: pip install 'mxnet==%s' 'numpy<1.24' (CPU), or the CUDA build that matches "
            "your CUDA, e.g. pip install 'mxnet-cu112==%s' 'numpy<1.24'"
            % (REQUIRED_MXNET, 'MXNet ' + version if version else 'no MXNet', REQUIRED_MXNET,
               REQUIRED_MXNET))


class _MXNetImportHook(importlib.abc.MetaPathFinder):
    """Finds ``mxnet`` like the other finders, and wraps its loading (see :func:`prepare`)."""

    def __init__(self):
        self._searching = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != 'mxnet' or self._searching:
            return None
        self._searching = True
        try:
            spec = importlib.util.find_spec('mxnet')
        finally:
            self._searching = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, 'exec_module'):
            return None
        _remove_hook()  # one-shot: MXNet is imported once per process
        load = spec.loader.exec_module

        def exec_module(module):
            check_mxnet_version()
            env.set_mxnet_defaults()
            _load_with_role_hidden(load, module)
            register_store_type(module, _create_dist_delay, replace=False)
        spec.loader.exec_module = exec_module
        return spec


def _load_with_role_hidden(load, module):
    # `import mxnet` starts MXNet's stock server (and exits) when DMLC_ROLE is 'server': it
    # asks ps-lite for the role through getenv at that moment. mxdelay's server
    # (kvstore_ext.server.controller) imports MXNet as a worker would, then runs its own server.
    role = os.environ.get('DMLC_ROLE')
    if env.role() != 'server':
        load(module)
        return
    os.environ['DMLC_ROLE'] = 'worker'
    try:
        load(module)
    finally:
        os.environ['DMLC_ROLE'] = role


def _create_dist_delay():
    # The registry's stand-in until kvstore_ext.worker.dist_delay is imported: importing it from
    # the import hook could re-enter a kvstore_ext module that is importing MXNet.
    from kvstore_ext.worker.dist_delay import DistDelay  # pylint: disable=import-outside-toplevel
    return DistDelay()


def _remove_hook():
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _MXNetImportHook)]


def prepare():
    """Prepare this process's ``import mxnet`` (idempotent; imports no MXNet).

    If MXNet is not loaded yet, install the hook described in the module docstring;
    otherwise check its version and register ``'dist_delay'`` now (MXNet's defaults from
    :mod:`kvstore_ext.env` are too late then: MXNet read its variables at import).

    Raises
    ------
    ImportError
        If MXNet is loaded and is not release 1.9.1.
    """
    if 'mxnet' in sys.modules:
        check_mxnet_version()
        register_store_type(sys.modules['mxnet'], _create_dist_delay, replace=False)
        if not env.mxnet_defaults_applied():
            _LOG.info('mxnet was imported before mxdelay: MXNet keeps its own defaults for %s '
                      '(import mxdelay first to get mxdelay\'s)', ', '.join(env.MXNET_DEFAULTS))
        return
    if not any(isinstance(f, _MXNetImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _MXNetImportHook())


def dispatch_role():
    """Become the scheduler or mxdelay's server if this process has that DMLC role.

    Does not return in a scheduler or server process; does nothing on a worker or outside
    a distributed job. If MXNet was imported first in a server process, MXNet's stock server
    has already run (and exited); workers detect that at the hand-shake and say how to
    launch correctly.

    Raises
    ------
    ValueError
        If ``DMLC_ROLE`` is set to something else than 'scheduler', 'server', 'worker'.
    """
    role = env.role()
    if role == 'scheduler':
        run_scheduler()
        sys.exit(0)
    elif role == 'server':
        from kvstore_ext.server.controller import serve  # pylint: disable=import-outside-toplevel
        serve()
        sys.exit(0)
    elif role not in ('worker', None):
        raise ValueError("DMLC_ROLE=%r is not a role; expected 'scheduler', 'server' or 'worker' "
                         '(launch with mxdelay-launch or MXNet tools/launch.py)' % role)


def run_scheduler():
    """Run this job's ps-lite scheduler, as ``import mxnet`` does in a scheduler process,
    without MXNet's Python package.

    ``import mxnet`` (1.9.1's ``mxnet.kvstore.kvstore_server``) creates a ``'dist'`` store
    and runs it as a server (``MXKVStoreCreate``, ``MXKVStoreRunServer``): in a scheduler
    that runs the rendezvous until every node has finished, then finalises ps-lite. The same
    calls are made here through ctypes on the library that ``import mxnet`` would load
    (``mxnet/libinfo.py``'s ``find_lib_path``), after the version check and mxdelay's MXNet
    defaults: the scheduler then costs 0.15 s of CPU instead of the 1 s that importing
    MXNet's Python package takes (a scheduler never receives a command, so its controller
    does nothing).

    Raises
    ------
    ImportError
        If MXNet is missing or is not release 1.9.1.
    RuntimeError
        If the library reports an error (its message).
    """
    check_mxnet_version()
    env.set_mxnet_defaults()
    lib = ctypes.CDLL(_libinfo().find_lib_path()[0], ctypes.RTLD_LOCAL)
    lib.MXGetLastError.restype = ctypes.c_char_p

    def check(status):
        if status != 0:
            message = lib.MXGetLastError().decode('utf-8', 'replace')
            raise RuntimeError('MXNet scheduler: %s' % message)
    handle = ctypes.c_void_p()
    check(lib.MXKVStoreCreate(b'dist', ctypes.byref(handle)))
    controller = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(
        lambda command, body, _: None)
    check(lib.MXKVStoreRunServer(handle, controller, None))
    # What `import mxnet`'s process does next, at exit: free the store, shut the engine down.
    check(lib.MXKVStoreFree(handle))
    check(lib.MXNotifyShutdown())


def _libinfo():
    # mxnet/libinfo.py on its own (it imports os, platform and logging only): importing it
    # as mxnet.libinfo would import the whole package.
    spec = importlib.machinery.PathFinder.find_spec('mxnet')
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, 'libinfo.py')
        if os.path.exists(path):
            info = importlib.util.spec_from_file_location('_mxdelay_mxnet_libinfo', path)
            module = importlib.util.module_from_spec(info)
            info.loader.exec_module(module)
            return module
    raise ImportError('MXNet has no libinfo.py in %s' % list(spec.submodule_search_locations))


def worker_environment(environ=None):
    """The environment ``mxdelay-run`` gives a worker's command: `environ` (default: this
    process's) with :data:`AUTOLOAD_DIR` first on ``PYTHONPATH``."""
    environ = dict(os.environ if environ is None else environ)
    paths = [p for p in environ.get('PYTHONPATH', '').split(os.pathsep) if p]
    environ['PYTHONPATH'] = os.pathsep.join([AUTOLOAD_DIR] + [p for p in paths
                                                                if p != AUTOLOAD_DIR])
    return environ


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
    dispatch_role()
    if not command:
        raise ValueError('mxdelay-run needs the worker command, e.g. '
                         '"mxdelay-run python train.py"; got none')
    os.execvpe(command[0], command, worker_environment())
