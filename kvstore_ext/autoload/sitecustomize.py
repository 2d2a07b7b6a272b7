"""Put first on a worker's PYTHONPATH by ``mxdelay-run`` (docs/design.md §7).

Python imports ``sitecustomize`` at start-up. This one imports :mod:`kvstore_ext`, which
imports no MXNet: it only arranges that ``'dist_delay'`` is registered when the script
imports MXNet, so a worker script that never imports mxdelay still gets mxdelay's store.
``sys.argv``, ``__main__``, signals and exit codes are untouched. Then it runs the
``sitecustomize`` that this one hides, if there is one further on ``sys.path``.
"""
import importlib.machinery
import importlib.util
import os
import sys


def _autoload():
    try:
        import kvstore_ext  # noqa: F401  pylint: disable=unused-import,import-outside-toplevel
    except ImportError as err:
        sys.stderr.write("mxdelay-run: warning: this Python cannot import mxdelay's kvstore_ext "
                         "(%s): 'dist_delay' is only mxdelay's store in scripts that import "
                         "mxdelay; run the worker with the Python mxdelay is installed in\n" % err)


def _run_hidden_sitecustomize():
    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec('sitecustomize', path)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


_autoload()
_run_hidden_sitecustomize()
