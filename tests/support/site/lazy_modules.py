"""Import the modules of :data:`LAZY` on first use: :func:`install` puts in
``sys.modules`` the module object that their import would make, with its import attributes
(``__spec__``, ``__path__``, ``__file__``...), and runs its code into that same object at
the first access to any other attribute.

sitecustomize.py, next to this file, installs it in every role of a test job. ``import
mxnet`` imports ``requests`` (for ``mxnet.gluon.utils.download`` and ``mxnet.test_utils``),
and with it urllib3, http.client and ssl: 0.13 s of CPU in each of the ~1,000 processes of
the suite's jobs, none of which downloads anything. (``importlib.util.LazyLoader`` cannot
serve: the ``import`` statement reads ``__spec__``, which loads a LazyLoader module.)
"""
import importlib.machinery
import importlib.util
import sys
import types

#: The top-level modules imported on first use (their submodules are imported as usual).
LAZY = ('requests',)


class _Deferred(types.ModuleType):
    """A module whose code has not run yet: it runs at the first attribute it lacks."""

    def __getattr__(self, name):
        spec = self.__spec__
        self.__class__ = types.ModuleType
        try:
            spec.loader.exec_module(self)
        except BaseException:
            sys.modules.pop(spec.name, None)   # as a failed import leaves it
            raise
        return getattr(self, name)


def install():
    """Put a deferred module in ``sys.modules`` for each module of LAZY not imported yet."""
    for name in LAZY:
        if name in sys.modules:
            continue
        spec = importlib.machinery.PathFinder.find_spec(name)
        if spec is None or not hasattr(spec.loader, 'exec_module'):
            continue
        module = importlib.util.module_from_spec(spec)
        module.__class__ = _Deferred
        sys.modules[name] = module
