"""Checkpoint files: written atomically, read back with errors that say what is wrong.

Every state file of mxdelay (a trainer's index and worker files, a kvstore's index, a
server's state) is a dict with a ``'format'`` entry naming its kind; a file of another kind,
a truncated or an empty one is refused with ``ValueError`` before anything uses it.
"""
import json
import os
import pickle
import tempfile

__all__ = ['atomic_write', 'read_json_state', 'read_pickle_state']


def atomic_write(path, data):
    """Write bytes `data` to `path` atomically: a temporary file in the same folder, then rename.

    A reader sees the old file or the whole new one, never a part; the temporary file is
    removed if writing fails.
    """
    folder = os.path.dirname(os.path.abspath(path))
    handle, tmp = tempfile.mkstemp(dir=folder, prefix='.%s.' % os.path.basename(path),
                                   suffix='.tmp')
    try:
        with os.fdopen(handle, 'wb') as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _check_format(state, path, file_format, what):
    if not isinstance(state, dict) or state.get('format') != file_format:
        raise ValueError('%s is not an mxdelay %s file' % (path, what))
    return state


def read_json_state(path, file_format, what):
    """Read a JSON state file of kind `file_format` (`what` names it in errors)."""
    try:
        with open(path, 'rb') as src:
            state = json.loads(src.read().decode('utf-8'))
    except FileNotFoundError:
        raise ValueError('%s file %s does not exist' % (what, path)) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError('%s is not an mxdelay %s file (%s); it may be truncated or from '
                         'another program' % (path, what, err)) from None
    return _check_format(state, path, file_format, what)


def read_pickle_state(path, file_format, what):
    """Read a pickled state file of kind `file_format` (`what` names it in errors)."""
    try:
        with open(path, 'rb') as src:
            state = pickle.load(src)
    except FileNotFoundError:
        raise ValueError('%s file %s does not exist' % (what, path)) from None
    except Exception as err:  # truncated or foreign bytes raise many kinds of errors
        raise ValueError('%s is not a readable mxdelay %s (%s: %s); it may be truncated or '
                         'from another program' % (path, what, type(err).__name__, err)) \
            from None
    return _check_format(state, path, file_format, what)
