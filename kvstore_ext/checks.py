"""Argument checks shared by mxdelay's public functions: one wording, one place.

Every check raises early, naming the argument, the value received and the fix:

- a value of the wrong type raises :class:`ArgumentTypeError` (``mxdelay.ArgumentTypeError``),
  a ``TypeError`` that is also a ``ValueError`` (mxdelay 0.1 raised ``ValueError`` for
  these; code catching that keeps working);
- a value of the right type outside its range raises ``ValueError``.

``bool`` is refused where a number is expected (``True`` is an ``int`` to Python, but
``delay=True`` is a mistake); numpy scalars are accepted as numbers. This module imports
no MXNet (only numpy) and nothing of :mod:`mxdelay`, so that any module may use it.
"""
import math
import numbers
import os

import numpy as np

__all__ = ['ArgumentTypeError', 'MAX_ROUNDS', 'check_int', 'check_rounds', 'check_real',
           'check_bool', 'check_path', 'check_optional_text']

#: The largest slack of a ``'dist_delay'`` store, and so the largest delay k of a trainer
#: (its slack is at least k). Why 256: a worker keeps slack + 1 send buffers of the whole
#: model, each server about 2 (slack + 1) copies of its share (docs/design.md §2.3, §3.5),
#: and MXNet's key cap leaves a job about 215329 / (slack + 1) chunks (§2.6). At 256 that
#: is 257 copies of the model on every worker and about 837 chunks (418 with float16
#: pushes), about what a large model's tensors take; larger values would fail only later,
#: at ``init`` or out of memory.
MAX_ROUNDS = 256


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type (a ``TypeError``, and a ``ValueError`` for
    compatibility with mxdelay 0.1)."""


def _suffix(fix):
    return '; %s' % fix if fix else ''


def _type_name(value):
    return type(value).__name__


def check_int(name, value, minimum=None, fix=''):
    """Return `value` as an ``int`` if it is an integer >= `minimum`.

    Parameters
    ----------
    name : str
        The argument's name, for the message.
    value : object
        The value received.
    minimum : int, optional
        The smallest valid value.
    fix : str, optional
        What the user should do instead, appended to the message.

    Raises
    ------
    ArgumentTypeError
        If `value` is not an integer (``bool`` and floats such as ``3.0`` included).
    ValueError
        If `value` is below `minimum`.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError('%s must be an integer%s, got %r (%s)%s' % (
            name, '' if minimum is None else ' >= %d' % minimum, value, _type_name(value),
            _suffix(fix)))
    if minimum is not None and value < minimum:
        raise ValueError('%s must be an integer >= %d, got %r%s'
                         % (name, minimum, value, _suffix(fix)))
    return int(value)


def check_rounds(name, value, fix=''):
    """Return `value` as an ``int`` if it is a slack or a delay in ``1 .. MAX_ROUNDS``.

    Raises
    ------
    ArgumentTypeError
        If `value` is not an integer.
    ValueError
        If `value` is below 1, or above :data:`MAX_ROUNDS` (naming the bound and why).
    """
    value = check_int(name, value, 1, fix)
    if value > MAX_ROUNDS:
        raise ValueError(
            '%s must be at most %d, got %d: every worker keeps slack + 1 copies of the model '
            '(the slack is at least the delay) and each server about twice that many of its '
            "share, and MXNet's keys leave a job about 215329 / (slack + 1) chunks "
            '(docs/design.md §2.3, §2.6, §3.5); use %s <= %d' % (name, MAX_ROUNDS, value, name,
                                                                  MAX_ROUNDS))
    return value


def check_real(name, value, minimum=None, maximum=None, min_inclusive=True,
               max_inclusive=True, fix=''):
    """Return `value` as a ``float`` if it is a finite real number in the given range.

    Parameters
    ----------
    name : str
        The argument's name, for the message.
    value : object
        The value received.
    minimum, maximum : float, optional
        Bounds of the valid range.
    min_inclusive, max_inclusive : bool, default True
        Whether the bounds themselves are valid.
    fix : str, optional
        What the user should do instead, appended to the message.

    Raises
    ------
    ArgumentTypeError
        If `value` is not a real number (``bool`` and strings included).
    ValueError
        If `value` is NaN, infinite or out of range.
    """
    bounds = []
    if minimum is not None:
        bounds.append('%s %g' % ('>=' if min_inclusive else '>', minimum))
    if maximum is not None:
        bounds.append('%s %g' % ('<=' if max_inclusive else '<', maximum))
    wanted = 'a finite number%s' % (' ' + ' and '.join(bounds) if bounds else '')
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError('%s must be %s, got %r (%s)%s'
                                % (name, wanted, value, _type_name(value), _suffix(fix)))
    number = float(value)
    if (not math.isfinite(number)
            or (minimum is not None and (number < minimum or
                                         (number == minimum and not min_inclusive)))
            or (maximum is not None and (number > maximum or
                                         (number == maximum and not max_inclusive)))):
        raise ValueError('%s must be %s, got %r%s' % (name, wanted, value, _suffix(fix)))
    return number


def check_bool(name, value, fix=''):
    """Return `value` as a ``bool`` if it is one (Python's or numpy's).

    Raises
    ------
    ArgumentTypeError
        For anything else: ``adaptive='no'`` would be true.
    """
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise ArgumentTypeError('%s must be True or False, got %r (%s)%s'
                            % (name, value, _type_name(value), _suffix(fix)))


def check_path(name, value):
    """Return `value` as a ``str`` path if it is a non-empty ``str`` or ``os.PathLike``.

    Raises
    ------
    ArgumentTypeError
        For another type (bytes included: mxdelay appends suffixes to the path as text).
    ValueError
        For an empty path.
    """
    path = value
    if isinstance(value, os.PathLike):
        path = os.fspath(value)
    if not isinstance(path, str):
        raise ArgumentTypeError('%s must be a file path (str or os.PathLike), got %r (%s); '
                                'pass e.g. %s=\'checkpoints/model.states\''
                                % (name, value, _type_name(value), name))
    if not path:
        raise ValueError("%s must be a file path, got an empty string; pass e.g. "
                         "%s='checkpoints/model.states'" % (name, name))
    return path


def check_optional_text(name, value, fix=''):
    """Return `value` if it is None or a ``str``.

    Raises
    ------
    ArgumentTypeError
        For anything else.
    """
    if value is None or isinstance(value, str):
        return value
    raise ArgumentTypeError('%s must be None or a str, got %r (%s)%s'
                            % (name, value, _type_name(value), _suffix(fix)))
