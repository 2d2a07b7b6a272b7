"""The arguments of the store's calls: one key or a list of keys, and their values."""
import numpy as np
from mxnet import nd

from kvstore_ext.checks import ArgumentTypeError, check_int

__all__ = ['as_lists', 'listed', 'describe']


def as_lists(key, value, name='value', priority=0):
    """Return ``([keys], [values])`` of a call with one key or a list of keys, checked: a key
    is an int or str, a value an NDArray or a non-empty list of NDArrays (one per device)."""
    if type(priority) is not int:  # noqa: E721  (the common case, without the ABC check)
        check_int('priority', priority, fix='a higher priority is sent first; Gluon uses -index')
    if isinstance(key, (list, tuple)):
        if not isinstance(value, (list, tuple)) or len(value) != len(key):
            raise ValueError('with a list of %d keys, pass a list of as many values as %s, got '
                             '%s' % (len(key), name, describe(value)))
        keys, values = list(key), list(value)
    else:
        keys, values = [key], [value]
    for k, v in zip(keys, values):
        if isinstance(k, (bool, np.bool_)) or not isinstance(k, (int, np.integer, str)):
            raise ArgumentTypeError('key must be an int or a str (or a list of them), got %r '
                                    '(%s)' % (k, type(k).__name__))
        arrays = v if isinstance(v, (list, tuple)) else [v]
        if not arrays or not all(isinstance(a, nd.NDArray) for a in arrays):
            raise ArgumentTypeError('%s for key %r must be an NDArray or a non-empty list of '
                                    'NDArrays (one per device), got %s; convert with '
                                    'mx.nd.array(...)' % (name, k, describe(v)))
    return keys, values


def listed(value):
    """`value` as a list (one array per device)."""
    return value if isinstance(value, (list, tuple)) else [value]


def describe(value):
    """`value` in an error message: its type, or an NDArray's shape."""
    if isinstance(value, (list, tuple)):
        return '%s of %s' % (type(value).__name__,
                             sorted({type(v).__name__ for v in value}) or 'nothing')
    return '%.80r (%s)' % (value, type(value).__name__) if not isinstance(value, nd.NDArray) \
        else 'an NDArray of shape %s' % (value.shape,)
