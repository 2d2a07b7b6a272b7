"""mxdelay's checkpoint files: their names, formats and version, written whole or not at all.

A checkpoint saved under the path ``fname`` (``DelayedTrainer.save_states``) is:

==========================  =======================  =======  ===============================
file                        written by               kind     holds
==========================  =======================  =======  ===============================
``fname``                   worker 0                 JSON     :data:`TRAINER_INDEX`: workers,
                                                              step counter, kvstore index name
``fname.worker<i>``         worker i                 pickle   :data:`WORKER`: its weights,
                                                              pre_weight, rule state, pulls
``fname.kvstore``           worker 0                 JSON     :data:`KVSTORE_INDEX`: layout,
                                                              rounds per key, rescale_grad
``fname.kvstore.server<j>`` server j                 pickle   :data:`SERVER`: weights,
                                                              optimizer state, rounds
==========================  =======================  =======  ===============================

(``DistDelay.save_optimizer_states(f)`` alone writes ``f`` and ``f.server<j>``.) Every
file is a dict with ``'format'`` (its kind) and ``'version'`` (:data:`VERSION`), both
checked on every load before anything else is read. Loads are collective and two-phase
(docs/design.md §6): every worker and server first validates its own files and the workers
agree (a vote through the servers); only if nobody found a problem does anyone apply, so a
bad file changes nothing anywhere. Files are written atomically (:func:`atomic_write`):
a reader sees the old file or the whole new one.
"""
import json
import os
import pickle
import tempfile

__all__ = ['VERSION', 'TRAINER_INDEX', 'WORKER', 'KVSTORE_INDEX', 'SERVER', 'worker_file',
           'kvstore_file', 'server_files', 'atomic_write', 'write_json', 'write_pickle',
           'read_json', 'read_pickle']

#: The version of every mxdelay checkpoint file; a file of another version is refused.
VERSION = 1
#: Kinds of checkpoint file (their ``'format'`` entry) and how errors name them.
TRAINER_INDEX = 'mxdelay-trainer-state'
WORKER = 'mxdelay-worker-state'
KVSTORE_INDEX = 'mxdelay-kvstore-state'
SERVER = 'mxdelay-server-state'
_WHAT = {TRAINER_INDEX: 'trainer state', WORKER: 'worker state', KVSTORE_INDEX: 'kvstore state',
         SERVER: 'server state'}


def worker_file(fname, rank):
    """Worker `rank`'s file of the trainer checkpoint `fname`."""
    return '%s.worker%d' % (fname, rank)


def kvstore_file(fname):
    """The kvstore index of the trainer checkpoint `fname`."""
    return fname + '.kvstore'


def server_files(kvstore_index, num_servers):
    """The servers' files of the kvstore index `kvstore_index` (absolute: servers may run in
    another working directory; derived from the index's path, so a checkpoint can be copied,
    moved or renamed as a whole)."""
    return ['%s.server%d' % (os.path.abspath(kvstore_index), s) for s in range(num_servers)]


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


def _stamped(kind, body):
    return dict(body, format=kind, version=VERSION)


def write_json(path, kind, body):
    """Write dict `body` as a JSON checkpoint file of `kind`, atomically."""
    atomic_write(path, json.dumps(_stamped(kind, body)).encode('utf-8'))


def write_pickle(path, kind, body):
    """Write dict `body` as a pickled checkpoint file of `kind`, atomically."""
    atomic_write(path, pickle.dumps(_stamped(kind, body), protocol=4))


def _checked(state, path, kind):
    what = _WHAT[kind]
    if not isinstance(state, dict) or state.get('format') != kind:
        raise ValueError('%s is not an mxdelay %s file' % (path, what))
    if state.get('version') != VERSION:
        raise ValueError('%s is an mxdelay %s file of version %r; this mxdelay reads version '
                         '%d' % (path, what, state.get('version'), VERSION))
    return state


def read_json(path, kind):
    """Read a JSON checkpoint file of `kind`; raise ValueError saying what is wrong with it."""
    try:
        with open(path, 'rb') as src:
            state = json.loads(src.read().decode('utf-8'))
    except FileNotFoundError:
        raise ValueError('%s file %s does not exist' % (_WHAT[kind], path)) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError('%s is not an mxdelay %s file (%s); it may be truncated or from '
                         'another program' % (path, _WHAT[kind], err)) from None
    return _checked(state, path, kind)


def read_pickle(path, kind):
    """Read a pickled checkpoint file of `kind`; raise ValueError saying what is wrong."""
    try:
        with open(path, 'rb') as src:
            state = pickle.load(src)
    except FileNotFoundError:
        raise ValueError('%s file %s does not exist' % (_WHAT[kind], path)) from None
    except Exception as err:  # truncated or foreign bytes raise many kinds of errors
        raise ValueError('%s is not a readable mxdelay %s (%s: %s); it may be truncated or '
                         'from another program' % (path, _WHAT[kind], type(err).__name__, err)) \
            from None
    return _checked(state, path, kind)
