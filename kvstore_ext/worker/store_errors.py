"""The errors of store calls that MXNet's own kvstore rejects: ``mx.MXNetError`` as MXNet
raises, each also the Python type a user expects of it.

MXNet 1.9.1's ``'dist_sync'`` rejects these calls with an ``MXNetError`` (its C++ checks):
a key never initialised, a key initialised twice, ``pull(ignore_sparse=False)``, an out of
another size, ``row_sparse_pull`` of a dense key or into a dense out; and its server dies on
a dense push to a row_sparse key, which ``'dist_delay'`` refuses on the worker.
tests/test_error_types.py makes each call on a stock job and on a ``'dist_delay'`` one.
"""
from mxnet.base import MXNetError

from kvstore_ext.checks import ArgumentTypeError

__all__ = ['UnknownKeyError', 'StoreValueError', 'StoreTypeError']


class UnknownKeyError(MXNetError, KeyError):
    """A key that was never initialised: an ``MXNetError``, and a ``KeyError``."""


class StoreValueError(MXNetError, ValueError):
    """A key or an array that MXNet's kvstore refuses for the call: an ``MXNetError``, and a
    ``ValueError``."""


class StoreTypeError(MXNetError, ArgumentTypeError):
    """An array of the wrong storage type for the key or the call: an ``MXNetError``, and an
    :class:`~kvstore_ext.checks.ArgumentTypeError` (a ``TypeError`` and a ``ValueError``)."""
