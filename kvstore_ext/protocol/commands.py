"""What workers and mxdelay's servers say to each other: commands and replies.

The keys they say it on are in :mod:`kvstore_ext.protocol.keys`. MXNet hands the Python
controller only command id 0, with a NUL-free text body. Every mxdelay command is
``'mxdelay:' + name + ' ' + json_body`` on id 0 (:func:`encode_command`); the server
dispatches on ``name`` (:class:`Command`). With the job's key (``MXDELAY_JOB_KEY``) the name
carries an authenticator, ``name + '#' + HMAC-SHA256(key, name + ' ' + json_body)``, and a
server that holds the key refuses a command without a valid one (docs/design.md §4.5). A
reply is written into the requesting worker's segment of the server's status key and read
back with a pull; it carries the command's sequence number, so that a worker never mistakes
an older reply for the answer (docs/design.md §4).
"""
import enum
import hashlib
import hmac
import json
import math
import os

import numpy as np

from kvstore_ext import env

__all__ = ['AUX_SETTINGS', 'PROTOCOL_VERSION', 'MAGIC', 'Command', 'COMMAND_PREFIX', 'REPLY_LEN',
           'MIN_REPLY_LEN', 'BYTES_PER_ENTRY', 'bigarray_bound', 'reply_len', 'reply_capacity',
           'encode_command', 'decode_command', 'UnauthenticatedCommand',
           'command_rank', 'encode_reply', 'decode_reply', 'SEQ_MODULUS', 'FINISH_KEY',
           'encode_optimizer', 'decode_optimizer', 'field', 'check_rank', 'check_paths',
           'probe_text', 'is_probe']

#: Checked at the hand-shake. 2: state keys (the hello's state_keys); 3: 3 reply bytes an
#: entry; 4: the finish counter's head has a third element, exchanged (whether the round
#: goes as pushpulls: a server of 3 would keep a stale sum there, one of 4 overwrites a
#: worker of 3's first overflow mark), synchronous rounds go as pushpulls, and REGISTER's
#: {'aux': True} and the AUX command exist; 5: the hello says the pull keys per chunk
#: (pull_keys, one with compressed pulls) instead of the push's dtype (wire, which meant R).
PROTOCOL_VERSION = 5
#: The registration of an aux chunk (docs/design.md §2.13): the workers push aux states
#: (BatchNorm's running mean and variance), which no optimizer may touch.
AUX_SETTINGS = {'aux': True}
#: First two entries of every reply; a stock MXNet server leaves the status key at zero.
MAGIC = (7301.0, 1789.0)
COMMAND_PREFIX = 'mxdelay:'
#: Float32 entries per worker in a status key at most (2 magic, ok flag, sequence, length,
#: text); fewer with many workers, see :func:`reply_len`.
REPLY_LEN = 1 << 14
#: The fewest entries per worker: 1521 bytes of text, enough for the hand-shake and every
#: command's reply but STATS of many chunks (an optimizer's description is about 250 bytes;
#: a tally and an error message are cut to fit). 1953 workers at MXNet's default bound.
MIN_REPLY_LEN = 1 << 9
#: Reply bytes per float32 entry: an integer below 2**24 is exact in float32.
BYTES_PER_ENTRY = 3
_HEADER = 5
#: Sequence numbers travel in one float32: exact below 2**24, compared modulo that.
SEQ_MODULUS = 1 << 24
#: ``param_index`` under which a worker registers the finish counter: a two-element key whose
#: round value is the sum of the workers' flags ``(finished, leaving)``, not an optimizer update.
FINISH_KEY = 'mxdelay:finish'


class Command(str, enum.Enum):
    """Controller commands, each with a JSON body (a dict)."""
    HELLO = 'hello'            # {rank, num_workers, slots, protocol, config}: first command
    REGISTER = 'register'      # {rank, chunks: [[chunk_id, server, param_index, name,
    #                            lr_mult, wd_mult, size, codec]]}: codec is a dict of codec
    #                            settings, {}, {'sum_scale': s} or {'aux': True}
    #                            (kvstore_ext.server.appliers); an entry of 7 (no codec) means {}
    OPTIMIZER = 'optimizer'    # {rank, optimizer: encode_optimizer(Optimizer)}: registry
    #                            name and fields as JSON, no pickle; reply describes the
    #                            installed optimizer (describe_optimizer)
    SET_HYPER = 'set_hyper'    # {rank, lr}: change the servers' learning rate
    SAVE = 'save'              # {rank, paths, save_id?, background?, rounds?,
    #                            finish_rounds?}: server i writes paths[i] (weights,
    #                            optimizer, rounds); with background, a thread writes it,
    #                            then its sha256 beside it, each chunk copied at its round
    LOAD = 'load'              # {rank, paths, check_only?, optimizer?}: server i validates
    #                            paths[i] (its saved optimizer against `optimizer`, a
    #                            describe_optimizer dict), then restores it
    STATS = 'stats'            # {rank}: reply with per-chunk rounds and pending counts
    VOTE = 'vote'              # {rank, ballot, error}: one worker's outcome of a collective step
    TALLY = 'tally'            # {rank, ballot}: reply with the ballot's errors by rank
    PROBE = 'probe'            # any bytes, unread: the servers answer it at once, before the
    #                            hand-shake too (no reply text, no authenticator: it does
    #                            nothing); rank 0 times it for compression_params='auto'
    AUX = 'aux'                # {rank, chunks: {chunk_id: [float32 values]}}: this worker's
    #                            aux states for the aux chunks' next round, when pushes are
    #                            quantized ('2bit'; docs/design.md §2.13)
    SCHEDULE = 'schedule'      # {rank, delay, synchronous_from}: delay='auto''s decisions
    #                            (PullSchedule.amend), from worker 0 before its push of the
    #                            first round they change (docs/design.md §1.2)


class UnauthenticatedCommand(ValueError):
    """A command without a valid authenticator, on a server that holds the job's key."""


def _authenticator(key, signed):
    return hmac.new(key, signed.encode('utf-8'), hashlib.sha256).hexdigest()


def encode_command(command, body, key=None):
    """Return the NUL-free text of `command` with JSON `body`, for command id 0; with the
    job's `key` (bytes), authenticated (``name#HMAC-SHA256(key, name + ' ' + JSON)``)."""
    name = Command(command).value
    text = json.dumps(body)
    if key is None:
        return '%s%s %s' % (COMMAND_PREFIX, name, text)
    return '%s%s#%s %s' % (COMMAND_PREFIX, name, _authenticator(key, name + ' ' + text), text)


def decode_command(text, key=None):
    """Parse a command body; return ``(Command, dict)``. With the job's `key` (bytes) the
    command must carry a valid authenticator of its name and body; without a key any
    authenticator is ignored (a job without keys).

    Raises
    ------
    UnauthenticatedCommand
        (a ``ValueError``) If `key` is given and the command carries no authenticator, or
        one that does not match (another key, or a text changed on the way).
    ValueError
        If `text` is not an mxdelay command (wrong prefix, unknown name or bad JSON).
    """
    if isinstance(text, bytes):
        text = text.decode('utf-8', 'replace')
    if not text.startswith(COMMAND_PREFIX):
        raise ValueError('not an mxdelay command (no %r prefix): %.60r' % (COMMAND_PREFIX, text))
    head, _, body = text[len(COMMAND_PREFIX):].partition(' ')
    name, marked, mac = head.partition('#')
    # An unknown name first: it runs nothing, and says what a worker of another version
    # sent (the authenticator is checked before anything is run).
    try:
        command = Command(name)
    except ValueError:
        raise ValueError('unknown mxdelay command %r; known: %s'
                         % (name, ', '.join(c.value for c in Command))) from None
    if key is not None:
        if not marked:
            raise UnauthenticatedCommand(
                'command %.40r carries no authenticator, but this server holds the job\'s key '
                '(MXDELAY_JOB_KEY): refused. Give every process of the job the same '
                'MXDELAY_JOB_KEY (mxdelay-launch does)' % (name,))
        if not hmac.compare_digest(mac, _authenticator(key, name + ' ' + body)):
            raise UnauthenticatedCommand(
                'command %.40r carries an authenticator that does not match its text: refused '
                '(sent with another MXDELAY_JOB_KEY, or changed on the way)' % (name,))
    try:
        return command, json.loads(body)
    except json.JSONDecodeError as err:
        raise ValueError('command %s has a malformed JSON body: %s' % (name, err)) from None


_PROBE_HEAD = '%s%s ' % (COMMAND_PREFIX, Command.PROBE.value)


def probe_text(nbytes):
    """The text of a PROBE command of `nbytes` bytes (NUL-free, as command id 0 needs)."""
    return _PROBE_HEAD + 'x' * max(nbytes - len(_PROBE_HEAD), 0)


def is_probe(text):
    """Whether the command text `text` (bytes) is a PROBE: the servers answer it unread."""
    return text.startswith(_PROBE_HEAD.encode('ascii'))


def command_rank(text):
    """Best-effort ``(rank, seq)`` of the command `text` (rank None if unreadable), so that
    even a malformed or unknown command gets an error reply."""
    if isinstance(text, bytes):
        text = text.decode('utf-8', 'replace')
    try:
        body = json.loads(text.partition(' ')[2])
        rank, seq = body['rank'], body.get('seq', 0)
        # Only an integer names a reply segment (not '0', 0.0 or true).
        if type(rank) is not int:  # pylint: disable=unidiomatic-typecheck
            return None, 0
        return rank, seq if type(seq) is int else 0  # pylint: disable=unidiomatic-typecheck
    except (ValueError, KeyError, TypeError, AttributeError):
        return None, 0


def encode_optimizer(optimizer):
    """`optimizer` as a JSON-able dict for the OPTIMIZER command: its MXNet registry name and
    fields, as a checkpoint holds it (:func:`kvstore_ext.optim.optimizers.optimizer_record` through
    :func:`kvstore_ext.checkpoint.files.encode`), with its few arrays (numpy scalars, say) inline
    as ``[dtype, shape, values]``. No pickle: the server rebuilds it from the registry
    (:func:`decode_optimizer`).

    Raises
    ------
    ValueError
        If the optimizer's class is not registered with MXNet under its name (the message
        names the fix), as for a checkpoint.
    """
    from kvstore_ext.checkpoint import files  # pylint: disable=import-outside-toplevel
    arrays = []
    tree = files.encode(optimizer, arrays, 'optimizer')
    return {'tree': tree, 'arrays': [[a.dtype.str, list(a.shape), a.ravel().tolist()]
                                     for a in arrays]}


def decode_optimizer(encoded):
    """The optimizer that :func:`encode_optimizer` encoded, built from MXNet's registry.

    Raises
    ------
    ValueError
        If `encoded` is not such a dict (a pickle, another object, a bad array), or names an
        optimizer this process does not know.
    """
    from kvstore_ext.checkpoint import files  # pylint: disable=import-outside-toplevel
    import mxnet as mx  # pylint: disable=import-outside-toplevel
    if not isinstance(encoded, dict) or set(encoded) != {'tree', 'arrays'} \
            or not isinstance(encoded['arrays'], list) \
            or not isinstance(encoded['tree'], dict) or set(encoded['tree']) != {'$optimizer'}:
        raise ValueError("field 'optimizer' must be {'tree': {'$optimizer': ...}, 'arrays': "
                         "[...]} (an optimizer by registry name and fields, as "
                         "encode_optimizer makes it), got %.80r" % (encoded,))
    arrays = encoded['arrays']

    def load_array(index):
        if index >= len(arrays):
            raise ValueError('it refers to array %d of %d' % (index, len(arrays)))
        entry = arrays[index]
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)
                and isinstance(entry[1], list) and isinstance(entry[2], list)):
            raise ValueError('array %d is not [dtype, shape, values]: %.60r' % (index, entry))
        dtype = np.dtype(entry[0])
        if dtype.hasobject or dtype.kind not in 'biuf':
            raise ValueError('array %d has dtype %s, not a number type' % (index, dtype))
        return np.array(entry[2], dtype=dtype).reshape(
            [field({'shape': n}, 'shape', int, minimum=0) for n in entry[1]])

    try:
        optimizer = files.decode(encoded['tree'], load_array)
    except (TypeError, KeyError, AttributeError, IndexError) as err:
        raise ValueError("field 'optimizer' cannot be rebuilt (%s: %s)"
                         % (type(err).__name__, err)) from None
    if not isinstance(optimizer, mx.optimizer.Optimizer):
        raise ValueError("field 'optimizer' holds a %s, not an mx.optimizer.Optimizer"
                         % type(optimizer).__name__)
    return optimizer


_KIND_NAMES = {int: 'an integer', float: 'a number', str: 'a string', bool: 'true or false',
               list: 'a list', dict: 'a JSON object'}


def field(body, name, kind, minimum=None, maximum=None, optional=False, default=None,
          finite=False):
    """Command field `name` of `body`, checked: of type `kind` (int: not a bool; float: an
    int or a float), within ``[minimum, maximum]``, finite if `finite`.

    Raises
    ------
    ValueError
        Naming the field, what it must be and the value received; also for a missing
        field unless `optional` (then `default`).
    """
    if not isinstance(body, dict):
        raise ValueError('a command body must be a JSON object, got %.60r' % (body,))
    if name not in body or (optional and body[name] is None):
        if optional:
            return default
        raise ValueError('command field %r is missing' % name)
    value = body[name]
    if kind is float:
        good = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif kind is int:
        good = isinstance(value, int) and not isinstance(value, bool)
    else:
        good = isinstance(value, kind)
    bad = None
    if not good:
        bad = 'must be %s' % _KIND_NAMES.get(kind, kind.__name__)
    elif finite and not math.isfinite(value):
        bad = 'must be finite'
    elif minimum is not None and not value >= minimum:   # not >=: NaN fails it
        bad = 'must be >= %s' % minimum
    elif maximum is not None and not value <= maximum:
        bad = 'must be <= %s' % maximum
    if bad is not None:
        raise ValueError('command field %r %s, got %.60r' % (name, bad, value))
    return value


def check_rank(body, num_workers, optional=False):
    """The sender's claimed ``rank`` of `body`, checked to be a worker rank of this job.

    MXNet hands a server's controller the command's head and body only (no sender id), so
    the rank is the one the body claims; it is checked against the job's range here, and
    against what that rank already did by the commands that keep per-rank state (one hello,
    one vote per ballot). See docs/design.md §4.1.
    """
    return field(body, 'rank', int, minimum=0, maximum=num_workers - 1, optional=optional)


def check_paths(body, server_rank, num_servers):
    """SAVE's and LOAD's ``paths``: one per server, all ``<index>.server<j>`` of one kvstore
    index path; return this server's. A server reads and writes only its own file of a
    checkpoint, never a path a command names freely (docs/design.md §4.1)."""
    paths = field(body, 'paths', list)
    if len(paths) != num_servers or not all(isinstance(p, str) for p in paths):
        raise ValueError('command field \'paths\' must list %d paths (one per server), got '
                         '%.120r' % (num_servers, paths))
    suffix = '.server%d' % server_rank
    mine = paths[server_rank]
    index = mine[:-len(suffix)] if mine.endswith(suffix) else ''
    if (not index or '\0' in mine or index.endswith(os.sep) or not os.path.isabs(mine)
            or paths != ['%s.server%d' % (index, j) for j in range(num_servers)]):
        raise ValueError('command field \'paths\' must be <index>.server0 .. <index>.server%d '
                         'of one absolute checkpoint index path (this server reads and writes '
                         'only its own file %r of a checkpoint), got %.200r'
                         % (num_servers - 1, '<index>' + suffix, paths))
    return mine


def bigarray_bound():
    """MXNet's ``MXNET_KVSTORE_BIGARRAY_BOUND``: a key of this many elements or more is split
    over all servers, so every mxdelay key stays below it."""
    return env.get_int('MXNET_KVSTORE_BIGARRAY_BOUND')


def reply_len(num_workers, bound=None):
    """Float32 entries per worker in a status key of `num_workers` segments: at most
    :data:`REPLY_LEN`, and few enough that the key stays below MXNet's big-array bound (a
    larger key would be split over the servers, and each server would hold only a slice).

    Raises
    ------
    ValueError
        If even :data:`MIN_REPLY_LEN` entries per worker would reach the bound.
    """
    bound = bigarray_bound() if bound is None else bound
    length = min(REPLY_LEN, (bound - 1) // max(num_workers, 1))
    if length < MIN_REPLY_LEN:
        raise ValueError('%d workers need status keys of %d floats, above '
                         'MXNET_KVSTORE_BIGARRAY_BOUND=%d: set MXNET_KVSTORE_BIGARRAY_BOUND to '
                         'at least %d on every worker and server'
                         % (num_workers, num_workers * MIN_REPLY_LEN, bound,
                            num_workers * MIN_REPLY_LEN + 1))
    return length


def reply_capacity(length):
    """Bytes of reply text that a segment of `length` float32 entries carries: 3 a entry
    after the header (:func:`encode_reply`)."""
    return (length - _HEADER) * BYTES_PER_ENTRY


def encode_reply(ok, payload, seq=0, length=REPLY_LEN):
    """Encode a reply to command number `seq` (`ok` flag, JSON-able `payload`) as `length`
    float32 entries.

    The JSON text's bytes travel three to an entry, as the integer ``b0*65536 + b1*256 + b2``
    (below 2**24, so exact in float32). A payload that does not fit becomes an error reply;
    an error message that does not fit is cut (its start says what failed).
    """
    room = reply_capacity(length)
    data = json.dumps(payload).encode('utf-8')
    if len(data) > room and not ok and isinstance(payload, str):
        data = json.dumps(payload.encode('utf-8')[:room // 2].decode('utf-8', 'ignore')
                          + ' [cut]').encode('utf-8')
    if len(data) > room:
        ok, data = False, json.dumps('reply of %d bytes is too long for the status key '
                                     '(%d bytes)' % (len(data), room)).encode('utf-8')
    out = np.zeros(length, dtype=np.float32)
    out[:_HEADER] = (MAGIC[0], MAGIC[1], 1.0 if ok else 0.0, seq % SEQ_MODULUS, len(data))
    triples = np.frombuffer(data + b'\0' * (-len(data) % BYTES_PER_ENTRY),
                            dtype=np.uint8).reshape(-1, BYTES_PER_ENTRY).astype(np.uint32)
    out[_HEADER:_HEADER + len(triples)] = ((triples[:, 0] << 16) | (triples[:, 1] << 8)
                                           | triples[:, 2])
    return out


def decode_reply(segment):
    """Decode a reply segment; return ``(ok, payload, seq)``, or None if no mxdelay server
    wrote it (a stock MXNet server leaves the status key at zero)."""
    segment = np.asarray(segment)
    if tuple(segment[:2]) != MAGIC:
        return None
    length = int(segment[4])
    entries = segment[_HEADER:_HEADER + -(-length // BYTES_PER_ENTRY)].astype(np.uint32)
    raw = np.stack([entries >> 16, (entries >> 8) & 0xFF, entries & 0xFF], axis=1)
    text = raw.astype(np.uint8).tobytes()[:length].decode('utf-8')
    return bool(segment[2]), json.loads(text), int(segment[3])
