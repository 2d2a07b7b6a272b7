"""What workers and mxdelay's servers say to each other: commands and replies.

The keys they say it on are in :mod:`kvstore_ext.layout`. MXNet hands the Python controller only command id 0, with a NUL-free text body. Every mxdelay
command is ``'mxdelay:' + name + ' ' + json_body`` on id 0 (:func:`encode_command`); the
server dispatches on ``name`` (:class:`Command`). A reply is written into the requesting
worker's segment of the server's status key and read back with a pull; it carries the
command's sequence number, so that a worker never mistakes an older reply for the answer
(docs/design.md §4).
"""
import base64
import enum
import json
import pickle

import numpy as np

from . import env

__all__ = ['PROTOCOL_VERSION', 'MAGIC', 'Command', 'COMMAND_PREFIX', 'REPLY_LEN',
           'MIN_REPLY_LEN', 'BYTES_PER_ENTRY', 'bigarray_bound', 'reply_len', 'reply_capacity',
           'encode_command', 'decode_command',
           'command_rank', 'encode_reply', 'decode_reply', 'SEQ_MODULUS', 'FINISH_KEY',
           'pack_object', 'unpack_object']

PROTOCOL_VERSION = 3  # 2: state keys (the hello's state_keys); 3: 3 reply bytes an entry
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
    #                            settings, {} or {'sum_scale': s} (kvstore_ext.appliers);
    #                            an entry of 7 (no codec) means {}
    OPTIMIZER = 'optimizer'    # {rank, optimizer: pack_object(Optimizer)}: reply describes
    #                            the installed optimizer (describe_optimizer)
    SET_HYPER = 'set_hyper'    # {rank, lr}: change the servers' learning rate
    SAVE = 'save'              # {rank, paths}: server i writes paths[i] (weights, optimizer, rounds)
    LOAD = 'load'              # {rank, paths, check_only?, optimizer?}: server i validates
    #                            paths[i] (its saved optimizer against `optimizer`, a
    #                            describe_optimizer dict), then restores it
    STATS = 'stats'            # {rank}: reply with per-chunk rounds and pending counts
    VOTE = 'vote'              # {rank, ballot, error}: one worker's outcome of a collective step
    TALLY = 'tally'            # {rank, ballot}: reply with the ballot's errors by rank


def encode_command(command, body):
    """Return the NUL-free text of `command` with JSON `body`, for command id 0."""
    return '%s%s %s' % (COMMAND_PREFIX, Command(command).value, json.dumps(body))


def decode_command(text):
    """Parse a command body; return ``(Command, dict)``.

    Raises
    ------
    ValueError
        If `text` is not an mxdelay command (wrong prefix, unknown name or bad JSON).
    """
    if isinstance(text, bytes):
        text = text.decode('utf-8', 'replace')
    if not text.startswith(COMMAND_PREFIX):
        raise ValueError('not an mxdelay command (no %r prefix): %.60r' % (COMMAND_PREFIX, text))
    name, _, body = text[len(COMMAND_PREFIX):].partition(' ')
    try:
        command = Command(name)
    except ValueError:
        raise ValueError('unknown mxdelay command %r; known: %s'
                         % (name, ', '.join(c.value for c in Command))) from None
    try:
        return command, json.loads(body)
    except json.JSONDecodeError as err:
        raise ValueError('command %s has a malformed JSON body: %s' % (name, err)) from None


def command_rank(text):
    """Best-effort ``(rank, seq)`` of the command `text` (rank None if unreadable), so that
    even a malformed or unknown command gets an error reply."""
    if isinstance(text, bytes):
        text = text.decode('utf-8', 'replace')
    try:
        body = json.loads(text.partition(' ')[2])
        return int(body['rank']), int(body.get('seq', 0))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None, 0


def pack_object(obj):
    """Pickle `obj` into NUL-free ASCII text (base64) for a command body."""
    return base64.b64encode(pickle.dumps(obj, protocol=4)).decode('ascii')


def unpack_object(text):
    """Inverse of :func:`pack_object`."""
    return pickle.loads(base64.b64decode(text.encode('ascii')))


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
