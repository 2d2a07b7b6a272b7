"""mxdelay's checkpoint files: their names, formats and version, written whole or not at all.

A checkpoint saved under the path ``fname`` (``DelayedTrainer.save_states``) is:

==========================  =======================  =======  ===============================
file                        written by               kind     holds
==========================  =======================  =======  ===============================
``fname``                   worker 0, last           JSON     :data:`TRAINER_INDEX`: workers,
                                                              step counter, the save id and
                                                              the sha256 of every other part
``fname.worker<i>``         worker i                 archive  :data:`WORKER`: its weights,
                                                              pre_weight, rule state, pulls
``fname.kvstore``           worker 0                 JSON     :data:`KVSTORE_INDEX`: layout,
                                                              rounds per key, rescale_grad,
                                                              the servers' sha256
``fname.kvstore.server<j>`` server j                 archive  :data:`SERVER`: weights,
                                                              optimizer state, rounds
==========================  =======================  =======  ===============================

(``DistDelay.save_optimizer_states(f)`` alone writes ``f`` and ``f.server<j>``.)

**Version 2** (:data:`VERSION`) holds no pickle. An *archive* is a NumPy ``.npz`` file
(uncompressed zip) whose entry ``header`` is a uint8 array of UTF-8 JSON:
``{"format": kind, "version": 2, "save_id": ..., "body": tree}``, and whose entries ``a0``,
``a1``, ... are the arrays the tree refers to (:func:`encode`): every entry is read with
``np.load(..., allow_pickle=False)``, and the header is checked (format, version, save id)
before any array is read. An optimizer is stored as its MXNet registry name and its fields
(:func:`kvstore_ext.optim.optimizers.optimizer_record`). Every part carries the save's id, and the
index lists every part's sha256, so that parts of two saves cannot be loaded together.

**Version 1** files (mxdelay before this format) are pickles: loading a pickle runs whatever
code it names, so they are read only with an explicit ``trusted=True``
(:func:`read_pickle`); otherwise they are refused before a byte of them is unpickled.

Loads are collective and two-phase (docs/design.md §6): every worker and server first
validates its own files and the workers agree (a vote through the servers); only if nobody
found a problem does anyone apply, so a bad file changes nothing anywhere. Files are written
atomically (:func:`atomic_write`): a reader sees the old file or the whole new one.
"""
import hashlib
import io
import json
import logging
import os
import pickle
import secrets
import zipfile

import numpy as np

__all__ = ['VERSION', 'LEGACY_VERSION', 'TRAINER_INDEX', 'WORKER', 'KVSTORE_INDEX', 'SERVER',
           'worker_file', 'kvstore_file', 'server_files', 'new_save_id', 'atomic_write',
           'file_sha256', 'write_json', 'write_archive', 'write_encoded', 'read_json',
           'read_archive', 'read_pickle', 'legacy_updater', 'encode', 'decode',
           'stale_temporaries']

_LOG = logging.getLogger(__name__)

#: The version mxdelay writes; files of another version are refused (version 1 only with
#: ``trusted=True``).
VERSION = 2
#: The pickled format of mxdelay before version 2.
LEGACY_VERSION = 1
#: Kinds of checkpoint file (their ``'format'`` entry) and how errors name them.
TRAINER_INDEX = 'mxdelay-trainer-state'
WORKER = 'mxdelay-worker-state'
KVSTORE_INDEX = 'mxdelay-kvstore-state'
SERVER = 'mxdelay-server-state'
_WHAT = {TRAINER_INDEX: 'trainer state', WORKER: 'worker state', KVSTORE_INDEX: 'kvstore state',
         SERVER: 'server state'}
_HEADER = 'header'
_ZIP_MAGIC = b'PK\x03\x04'
#: Pickle protocols 2 to 5 start with the PROTO opcode and the protocol number.
_PICKLE_MAGIC = tuple(b'\x80' + bytes([p]) for p in range(2, 6))


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


def new_save_id():
    """A fresh save id: 128 random bits as hex."""
    return secrets.token_hex(16)


# -- writing ---------------------------------------------------------------------------------
def _temporary_prefix(path):
    return '.%s.' % os.path.basename(path)


def stale_temporaries(path):
    """Temporary files of writes of `path` that did not finish (their process was killed):
    ``.<name>.<random>.tmp`` in `path`'s folder."""
    folder = os.path.dirname(os.path.abspath(path))
    prefix = _temporary_prefix(path)
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return sorted(os.path.join(folder, n) for n in names
                  if n.startswith(prefix) and n.endswith('.tmp'))


def _fsync_folder(folder):
    # The rename is durable only once the folder's entry is on disk.
    handle = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def atomic_write(path, write):
    """Write `path` atomically; return the sha256 (hex) of what was written.

    ``write(fileobj)`` writes the content (or `write` is bytes). The content goes to a
    temporary file ``.<name>.<random>.tmp`` in the same folder (created with mode 0666 minus
    the umask, as ``open`` would), is flushed to disk and renamed over `path`; then the
    folder is flushed, so the rename survives a crash. A reader sees the old file or the
    whole new one. Temporaries of `path` left by a killed earlier write are removed first,
    with a warning (only this process writes `path`, so none of them is in use); the
    temporary file is removed if this write fails.
    """
    folder = os.path.dirname(os.path.abspath(path))
    for stale in stale_temporaries(path):
        _LOG.warning('removing %s, a temporary file of a write of %s that did not finish '
                     '(a killed save)', stale, path)
        try:
            os.unlink(stale)
        except FileNotFoundError:
            pass
    tmp = os.path.join(folder, '%s%s.tmp' % (_temporary_prefix(path), secrets.token_hex(6)))
    handle = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(handle, 'w+b') as out:
            if isinstance(write, (bytes, bytearray)):
                out.write(write)
            else:
                write(out)
            out.flush()
            os.fsync(out.fileno())
            out.seek(0)
            digest = _sha256_of(out)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_folder(folder)
    return digest


def file_sha256(path):
    """The sha256 (hex) of the file `path`."""
    with open(path, 'rb') as src:
        return _sha256_of(src)


def _sha256_of(fileobj):
    digest = hashlib.sha256()
    for block in iter(lambda: fileobj.read(1 << 20), b''):
        digest.update(block)
    return digest.hexdigest()


def _stamped(kind, body):
    return dict(body, format=kind, version=VERSION)


def write_json(path, kind, body):
    """Write dict `body` as a JSON checkpoint file of `kind`, atomically; return its sha256."""
    return atomic_write(path, json.dumps(_stamped(kind, body)).encode('utf-8'))


def write_archive(path, kind, body, save_id):
    """Write `body` (see :func:`encode`) as an archive of `kind` stamped with `save_id`,
    atomically; return its sha256.

    Raises
    ------
    TypeError
        If `body` holds a value an archive cannot store (naming where it is).
    """
    arrays = []
    tree = encode(body, arrays)
    return write_encoded(path, kind, tree, arrays, save_id)


def write_encoded(path, kind, tree, arrays, save_id):
    """:func:`write_archive` of a body already encoded (``tree = encode(body, arrays)``):
    a copy taken now is written later, e.g. by a thread, without touching the original."""
    header = json.dumps({'format': kind, 'version': VERSION, 'save_id': save_id,
                         'body': tree}).encode('utf-8')
    entries = {'a%d' % i: a for i, a in enumerate(arrays)}
    entries[_HEADER] = np.frombuffer(header, dtype=np.uint8)
    return atomic_write(path, lambda out: np.savez(out, **entries))


# -- reading ---------------------------------------------------------------------------------
def _read_bytes(path, kind):
    try:
        with open(path, 'rb') as src:
            return src.read()
    except FileNotFoundError:
        raise ValueError('%s file %s does not exist' % (_WHAT[kind], path)) from None
    except OSError as err:
        raise ValueError('%s file %s cannot be read (%s)' % (_WHAT[kind], path, err)) from None


def _note_temporaries(path):
    for stale in stale_temporaries(path):
        _LOG.warning('ignoring %s, a temporary file of a save of %s that did not finish',
                     stale, path)


def _legacy_hint(path, what):
    return ('%s is an mxdelay %s file of version 1, a pickle: loading a pickle runs whatever '
            'code it names, so mxdelay loads version 1 only when asked to. If you trust '
            'whoever wrote this checkpoint, load it with load_states(fname, trusted=True) '
            '(DistDelay.load_optimizer_states(fname, trusted=True)), then save it again to '
            'convert it to version %d' % (path, what, VERSION))


def _check_version(state, path, kind, versions):
    what = _WHAT[kind]
    if not isinstance(state, dict) or state.get('format') != kind:
        raise ValueError('%s is not an mxdelay %s file' % (path, what))
    version = state.get('version')
    if version not in versions:
        if version == LEGACY_VERSION:
            raise ValueError(_legacy_hint(path, what))
        raise ValueError('%s is an mxdelay %s file of version %r; this mxdelay reads version '
                         '%d' % (path, what, version, VERSION))
    return state


def _check_digest(path, what, data, sha256):
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise ValueError('%s differs from the %s file that was saved with this checkpoint '
                         '(its sha256 is not the one the index lists): it was changed or '
                         'replaced after the save' % (path, what))


def read_json(path, kind, sha256=None, trusted=False):
    """Read a JSON checkpoint file of `kind`; raise ValueError saying what is wrong with it.

    Parameters
    ----------
    sha256 : str, optional
        The file's sha256 as its index lists it; checked after the format and version.
    trusted : bool
        Accept version 1 (whose other parts are pickles) too.
    """
    data = _read_bytes(path, kind)
    _note_temporaries(path)
    try:
        state = json.loads(data.decode('utf-8'))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError('%s is not an mxdelay %s file (%s); it may be truncated or from '
                         'another program' % (path, _WHAT[kind], err)) from None
    _check_version(state, path, kind, (VERSION, LEGACY_VERSION) if trusted else (VERSION,))
    _check_digest(path, _WHAT[kind], data, sha256)
    return state


def read_archive(path, kind, save_id=None, sha256=None):
    """Read a version-2 archive of `kind` (:func:`write_archive`) and return its body.

    The checks come in this order, each before anything further is read: the file is a zip
    (a pickle is refused unread), its header's format and version, its save id against
    `save_id`, its sha256 against `sha256`; only then are its arrays read, each with
    ``allow_pickle=False``.

    Raises
    ------
    ValueError
        Saying what is wrong, naming `path`.
    """
    what = _WHAT[kind]
    data = _read_bytes(path, kind)
    _note_temporaries(path)
    if data.startswith(_PICKLE_MAGIC):
        raise ValueError('%s is not an mxdelay %s file of version %d: it is a pickle, which '
                         'mxdelay does not load unless asked to (loading a pickle runs '
                         'whatever code it names). If it is a version-1 checkpoint you trust, '
                         'load it with trusted=True' % (path, what, VERSION))
    if not data.startswith(_ZIP_MAGIC):
        raise ValueError('%s is not an mxdelay %s file' % (path, what))
    try:
        archive = np.load(io.BytesIO(data), allow_pickle=False)
        header = archive[_HEADER]
        if header.dtype != np.uint8 or header.ndim != 1:
            raise ValueError('its header is a %s array of shape %s, not uint8 text'
                             % (header.dtype, header.shape))
        state = json.loads(header.tobytes().decode('utf-8'))
    except (ValueError, KeyError, OSError, EOFError, zipfile.BadZipFile,
            UnicodeDecodeError) as err:
        raise ValueError('%s is not a readable mxdelay %s (%s: %s); it may be truncated or '
                         'from another program' % (path, what, type(err).__name__, err)) \
            from None
    _check_version(state, path, kind, (VERSION,))
    if save_id is not None and state.get('save_id') != save_id:
        raise ValueError('%s belongs to save %s, but its index to save %s: a later save to the '
                         'same name did not finish (it was killed midway) and replaced some '
                         'of the parts. This checkpoint cannot be resumed; resume from an '
                         'earlier one' % (path, state.get('save_id'), save_id))
    _check_digest(path, what, data, sha256)
    names = set(archive.files)

    def load_array(index):
        name = 'a%d' % index
        if name not in names:
            raise ValueError('it refers to array %d, which it does not hold' % index)
        return archive[name]

    try:
        return decode(state.get('body'), load_array)
    except (ValueError, KeyError, TypeError, OSError, EOFError, zipfile.BadZipFile) as err:
        raise ValueError('%s is not a readable mxdelay %s (%s: %s); it may be damaged or '
                         'from another program' % (path, what, type(err).__name__, err)) \
            from None


def read_pickle(path, kind):
    """Read a version-1 (pickled) checkpoint file of `kind`: only for ``trusted=True`` loads,
    since unpickling runs whatever code the file names. Raise ValueError saying what is
    wrong."""
    _note_temporaries(path)
    try:
        with open(path, 'rb') as src:
            state = pickle.load(src)
    except FileNotFoundError:
        raise ValueError('%s file %s does not exist' % (_WHAT[kind], path)) from None
    except Exception as err:  # truncated or foreign bytes raise many kinds of errors
        raise ValueError('%s is not a readable mxdelay %s (%s: %s); it may be truncated or '
                         'from another program' % (path, _WHAT[kind], type(err).__name__, err)) \
            from None
    return _check_version(state, path, kind, (LEGACY_VERSION,))


def legacy_updater(path, blob):
    """``(states, optimizer)`` of a version-1 server file's ``updater`` entry: the bytes of
    ``Updater.get_states(dump_optimizer=True)`` (a pickle inside the trusted pickle), or
    None; the optimizer is None when it was saved without one.

    Raises
    ------
    ValueError
        If the bytes cannot be read.
    """
    if blob is None:
        return None, None
    try:
        saved = pickle.loads(blob)
    except Exception as err:  # pylint: disable=broad-except
        raise ValueError('%s: the saved optimizer state cannot be read (%s: %s); it may be '
                         'truncated' % (path, type(err).__name__, err)) from None
    if isinstance(saved, tuple) and len(saved) == 2:
        return saved
    return saved, None


# -- the archive's tree ----------------------------------------------------------------------
_MARKERS = ('$tuple', '$dict', '$array', '$scalar', '$nd', '$rsp', '$optimizer')


def encode(value, arrays, where='body'):
    """`value` as a JSON tree whose arrays are appended to `arrays` (referred to by number).

    Stored as they are: None, bools, ints, floats, strings, lists, and dicts with string keys.
    Marked (``{"$<kind>": ...}``): tuples, dicts with other keys (or keys starting with
    ``$``), numpy arrays (not of dtype object) and scalars, NDArrays (dense or row_sparse),
    and MXNet optimizers (:func:`kvstore_ext.optim.optimizers.optimizer_record`).

    Raises
    ------
    TypeError
        For any other value, naming where it is (`where`: the path so far).
    """
    import mxnet as mx  # pylint: disable=import-outside-toplevel
    from kvstore_ext.optim.optimizers import (optimizer_record)  # pylint: disable=import-outside-toplevel

    def array(a):
        if a.dtype.hasobject:
            raise TypeError('%s is an array of Python objects, which a checkpoint does not '
                            'store' % where)
        arrays.append(np.asarray(a, order='C'))  # not ascontiguousarray: 0-d stays 0-d
        return len(arrays) - 1

    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, np.generic):
        return {'$scalar': array(np.asarray(value))}
    if isinstance(value, np.ndarray):
        return {'$array': array(value)}
    if isinstance(value, mx.nd.NDArray):
        if value.stype == 'row_sparse':
            return {'$rsp': [array(value.data.asnumpy()), array(value.indices.asnumpy())],
                    'shape': list(value.shape)}
        if value.stype != 'default':
            raise TypeError('%s is a %s NDArray, which a checkpoint does not store'
                            % (where, value.stype))
        return {'$nd': array(value.asnumpy())}
    if isinstance(value, mx.optimizer.Optimizer):
        return {'$optimizer': encode(optimizer_record(value), arrays, where + '.optimizer')}
    if isinstance(value, list):
        return [encode(v, arrays, '%s[%d]' % (where, i)) for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {'$tuple': [encode(v, arrays, '%s[%d]' % (where, i)) for i, v in enumerate(value)]}
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith('$') for k in value):
            return {k: encode(v, arrays, '%s.%s' % (where, k)) for k, v in value.items()}
        return {'$dict': [[encode(k, arrays, where + ' (a key)'),
                           encode(v, arrays, '%s[%r]' % (where, k))] for k, v in value.items()]}
    raise TypeError('%s is a %s, which a checkpoint does not store (it holds numbers, strings, '
                    'lists, tuples, dicts, arrays and optimizers)' % (where, type(value).__name__))


def decode(tree, load_array):
    """The value :func:`encode` encoded as `tree`; ``load_array(i)`` reads array i.

    Raises
    ------
    ValueError
        For a tree :func:`encode` cannot have written.
    """
    import mxnet as mx  # pylint: disable=import-outside-toplevel
    from kvstore_ext.optim.optimizers import (build_optimizer)  # pylint: disable=import-outside-toplevel

    def index(i):
        if not isinstance(i, int) or isinstance(i, bool) or i < 0:
            raise ValueError('array reference %.60r is not a number' % (i,))
        return load_array(i)

    if tree is None or isinstance(tree, (bool, int, float, str)):
        return tree
    if isinstance(tree, list):
        return [decode(t, load_array) for t in tree]
    if not isinstance(tree, dict):
        raise ValueError('%.60r is no part of a checkpoint' % (tree,))
    marked = [k for k in tree if k.startswith('$')]
    if not marked:
        return {k: decode(v, load_array) for k, v in tree.items()}
    kind = marked[0]
    expected = {kind, 'shape'} if kind == '$rsp' else {kind}
    if kind not in _MARKERS or set(tree) != expected:
        raise ValueError('%.80r is no part of a checkpoint' % (tree,))
    body = tree[kind]
    if kind == '$tuple':
        return tuple(decode(t, load_array) for t in _list(body))
    if kind == '$dict':
        pairs = [_list(p) for p in _list(body)]
        if any(len(p) != 2 for p in pairs):
            raise ValueError('a dict entry is not a [key, value] pair')
        return {_hashable(decode(k, load_array)): decode(v, load_array) for k, v in pairs}
    if kind == '$array':
        return index(body)
    if kind == '$scalar':
        scalar = index(body)
        if scalar.ndim != 0:
            raise ValueError('a scalar has shape %s' % (scalar.shape,))
        return scalar[()]
    if kind == '$nd':
        value = index(body)
        return mx.nd.array(value, dtype=value.dtype)
    if kind == '$rsp':
        data, indices = (index(i) for i in _list(body))
        shape = tuple(_list(tree['shape']))
        return mx.nd.sparse.row_sparse_array((data, indices), shape=shape, dtype=data.dtype)
    return build_optimizer(decode(body, load_array))


def _list(value):
    if not isinstance(value, list):
        raise ValueError('%.60r is not a list' % (value,))
    return value


def _hashable(key):
    try:
        hash(key)
    except TypeError:
        raise ValueError('a dict key %.60r is not hashable' % (key,)) from None
    return key
