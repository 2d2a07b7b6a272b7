"""What workers and mxdelay's servers say to each other: keys, commands and replies.

Keys
----
MXNet's native worker sends a key of fewer than ``MXNET_KVSTORE_BIGARRAY_BOUND`` elements to
server ``(key * 9973) % num_servers``. mxdelay chooses its integer keys so that this formula
lands every key on the server it wants:

- one *status* key per server (``status_key(s)``), a small array through which the server
  answers the hand-shake and the commands (text encoded as float32 byte values);
- ``R`` *slot* keys per tensor chunk (``slot_key(chunk, slot)``), all on the chunk's server.

Commands
--------
MXNet hands the Python controller only command id 0, with a NUL-free text body. Every mxdelay
command is ``'mxdelay:' + name + ' ' + json_body`` on id 0 (:func:`encode_command`); the
server dispatches on ``name`` (:class:`Command`). A reply is written into the requesting
worker's segment of the server's status key and read back with a pull; it carries the
command's sequence number, so that a worker never mistakes an older reply for the answer.
"""
import base64
import enum
import json
import pickle

import numpy as np

from mxdelay import env

__all__ = ['PROTOCOL_VERSION', 'MAGIC', 'Command', 'COMMAND_PREFIX', 'REPLY_LEN',
           'MIN_REPLY_LEN', 'bigarray_bound', 'reply_len', 'KeyLayout', 'encode_command',
           'decode_command', 'command_rank', 'encode_reply',
           'decode_reply', 'SEQ_MODULUS', 'FINISH_KEY',
           'pack_object', 'unpack_object', 'describe_optimizer', 'optimizer_differences',
           'format_differences', 'PER_STEP_FIELDS']

PROTOCOL_VERSION = 1
#: First two entries of every reply; a stock MXNet server leaves the status key at zero.
MAGIC = (7301.0, 1789.0)
COMMAND_PREFIX = 'mxdelay:'
#: Float32 entries per worker in a status key at most (2 magic, ok flag, sequence, length,
#: text); fewer with many workers, see :func:`reply_len`.
REPLY_LEN = 1 << 14
#: The fewest entries per worker: enough for the hand-shake and every command's reply.
MIN_REPLY_LEN = 1 << 10
_HEADER = 5
_MXNET_KEY_MULTIPLIER = 9973  # src/kvstore/kvstore_dist.h, EncodeDefaultKey
_MAX_KEY = (2 ** 31 - 1) // _MXNET_KEY_MULTIPLIER
#: Sequence numbers travel in one float32: exact below 2**24, compared modulo that.
SEQ_MODULUS = 1 << 24
#: ``param_index`` under which a worker registers the finish counter: a two-element key whose
#: round value is the sum of the workers' flags ``(finished, leaving)``, not an optimizer update.
FINISH_KEY = 'mxdelay:finish'


class Command(str, enum.Enum):
    """Controller commands, each with a JSON body (a dict)."""
    HELLO = 'hello'            # {rank, num_workers, slots, protocol, config}: first command
    REGISTER = 'register'      # {chunks: [[chunk_id, server, param_index, name, lr_mult, wd_mult, size]]}
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


def encode_reply(ok, payload, seq=0, length=REPLY_LEN):
    """Encode a reply to command number `seq` (`ok` flag, JSON-able `payload`) as `length`
    float32 entries."""
    data = json.dumps(payload).encode('utf-8')
    if len(data) > length - _HEADER:
        ok, data = False, json.dumps('reply of %d bytes is too long for the status key'
                                     % len(data)).encode('utf-8')
    out = np.zeros(length, dtype=np.float32)
    out[:_HEADER] = (MAGIC[0], MAGIC[1], 1.0 if ok else 0.0, seq % SEQ_MODULUS, len(data))
    out[_HEADER:_HEADER + len(data)] = np.frombuffer(data, dtype=np.uint8)
    return out


def decode_reply(segment):
    """Decode a reply segment; return ``(ok, payload, seq)``, or None if no mxdelay server
    wrote it (a stock MXNet server leaves the status key at zero)."""
    segment = np.asarray(segment)
    if tuple(segment[:2]) != MAGIC:
        return None
    length = int(segment[4])
    text = segment[_HEADER:_HEADER + length].astype(np.uint8).tobytes().decode('utf-8')
    return bool(segment[2]), json.loads(text), int(segment[3])


class KeyLayout(object):
    """The integer keys of a job with `num_servers` servers and `slots` slot keys per chunk.

    Parameters
    ----------
    num_servers : int
        Number of servers of the job.
    slots : int
        Slot keys per chunk (the slack plus one).
    """

    def __init__(self, num_servers, slots):
        if not 1 <= num_servers < _MXNET_KEY_MULTIPLIER:
            raise ValueError('num_servers=%d is outside 1..%d' % (num_servers, _MXNET_KEY_MULTIPLIER - 1))
        self.num_servers = num_servers
        self.slots = slots
        # residue[s]: the key residue modulo num_servers that MXNet sends to server s
        self._residue = [0] * num_servers
        for r in range(num_servers):
            self._residue[(r * _MXNET_KEY_MULTIPLIER) % num_servers] = r

    def _key(self, index, server):
        key = index * self.num_servers + self._residue[server]
        if key > _MAX_KEY:
            raise ValueError('key %d exceeds %d, the largest key MXNet places correctly (it '
                             'computes (key * 9973) %% num_servers in a C int): use fewer, '
                             'larger chunks (MXDELAY_CHUNK_SIZE) or a smaller slack' % (key, _MAX_KEY))
        return key

    def status_key(self, server):
        """Key of server `server`'s status array."""
        return self._key(0, server)

    def slot_key(self, chunk, slot, server):
        """Key of slot `slot` of chunk `chunk`, placed on server `server`."""
        return self._key(1 + chunk * self.slots + slot, server)

    def decode(self, key):
        """Return ``('status', None, None)`` or ``('slot', chunk, slot)`` for `key`."""
        index = key // self.num_servers
        if index == 0:
            return 'status', None, None
        chunk, slot = divmod(index - 1, self.slots)
        return 'slot', chunk, slot

    def server_of(self, key):
        """The server MXNet sends `key` to."""
        return (key * _MXNET_KEY_MULTIPLIER) % self.num_servers


#: Fields of :func:`describe_optimizer` that a trainer sets at every step, not at creation:
#: ``rescale_grad`` is 1/batch_size from the first step on, so a worker that has not stepped
#: yet (``trainer.join()`` first, with uneven data) legitimately still has its initial value,
#: and workers may use different batch sizes. Workers' optimizers are compared without them:
#: the servers apply worker 0's, and each worker scales its gradients relative to it
#: (``DistDelay.scale_gradients``).
PER_STEP_FIELDS = ('rescale_grad',)

#: Attributes of an optimizer or learning-rate scheduler that are bookkeeping, not
#: hyper-parameters: update counters and caches (they differ between a fresh optimizer and
#: a used one) and MXNet's kernel aggregation size (read from the environment; the arithmetic
#: is the same).
_NOT_HYPER_PARAMETERS = frozenset([
    'num_update', 'aggregate_num', 'allow_np_array', 'param_dict', 'idx2name',
    'param_idx2name', 'sym_info', 'lr_mult', 'wd_mult',
    'count', 'cur_step_ind',                       # lr schedulers' progress
    'last_lr', 'cur_lr', 'm_schedule', 'init_updates', 'lbmult', 'admult', 'cumgrads',
    'weight_previous'])                            # LARS, Nadam, LBSGD, DCASGD state


def _hyper_parameters(obj):
    """The JSON-able public attributes of `obj` that set its arithmetic."""
    out = {}
    for name, value in sorted(vars(obj).items()):
        if name.startswith('_') or name in _NOT_HYPER_PARAMETERS:
            continue
        if isinstance(value, np.generic):
            value = value.item()
        if isinstance(value, (list, tuple)):
            if not all(isinstance(v, (bool, int, float, str, type(None), np.generic))
                       for v in value):
                continue
            value = [v.item() if isinstance(v, np.generic) else v for v in value]
        elif not isinstance(value, (bool, int, float, str, type(None))):
            continue
        out[name] = value
    return out


def describe_optimizer(optimizer):
    """Return what decides `optimizer`'s update, as a JSON-able dict (None for None).

    Workers and servers compare these dicts, so that a server never applies another
    optimizer than the workers set: ``'type'`` (the class name), ``'learning_rate'``
    (without scheduler), ``'rescale_grad'``, ``'wd'``, ``'clip_gradient'``,
    ``'multi_precision'``, ``'begin_num_update'``, the optimizer's own hyper-parameters
    (``'momentum'``, ``'beta1'``, ...: every public attribute that is a number, a string, a
    bool, None or a list of those) and ``'lr_scheduler'`` (None, or the scheduler's class
    name and parameters). Update counters, per-parameter state and MXNet's aggregation size
    are left out: they are not chosen by the user.

    Parameters
    ----------
    optimizer : mxnet.optimizer.Optimizer or None

    Returns
    -------
    dict or None
        The same dict before and after a JSON round trip (lists, not tuples).
    """
    if optimizer is None:
        return None
    described = _hyper_parameters(optimizer)
    described['learning_rate'] = described.pop('lr', None)
    scheduler = getattr(optimizer, 'lr_scheduler', None)
    if scheduler is not None:
        described['lr_scheduler'] = dict(_hyper_parameters(scheduler),
                                         type=type(scheduler).__name__)
    described['type'] = type(optimizer).__name__
    return json.loads(json.dumps(described))


def optimizer_differences(first, second, ignore=()):
    """Return ``[(field, first's value, second's value)]`` where two descriptions differ.

    Parameters
    ----------
    first, second : dict or None
        Results of :func:`describe_optimizer`. A differing type is the only difference
        reported (the other fields of two types are not comparable); scheduler fields are
        named ``'lr_scheduler.<name>'``.
    ignore : sequence of str
        Top-level fields not to compare (e.g. :data:`PER_STEP_FIELDS`).
    """
    if first is None or second is None:
        return [] if first == second else [('optimizer', first, second)]
    if first.get('type') != second.get('type'):
        return [('type', first.get('type'), second.get('type'))]
    differences = []
    for name in sorted((set(first) | set(second)) - set(ignore)):
        mine, theirs = first.get(name), second.get(name)
        if name == 'lr_scheduler' and isinstance(mine, dict) and isinstance(theirs, dict):
            differences.extend(('lr_scheduler.' + field, a, b)
                               for field, a, b in optimizer_differences(mine, theirs))
        elif mine != theirs:
            differences.append((name, mine, theirs))
    return [('lr_scheduler' if field == 'lr_scheduler.type' else field, a, b)
            for field, a, b in differences]


def format_differences(differences, first_name, second_name):
    """Text naming each difference with both values, e.g.
    ``'momentum: worker 0 has 0.9, worker 1 has 0.5'``."""
    return '; '.join('%s: %s has %r, %s has %r' % (field, first_name, a, second_name, b)
                     for field, a, b in differences)
