"""What workers and mxdelay's servers say to each other (``kvstore_ext.protocol.commands``).

What is tested: commands (round trip of every :class:`Command`, NUL-free text, rejection
of unknown names, of text without the ``'mxdelay:'`` prefix, of bad JSON and of a stock
MXNet client's pickled optimizer), replies (round trip, an all-zero segment decodes to None
i.e. "not an mxdelay server", the length limit and the error reply that replaces a payload
that is too long), ``encode_optimizer``/``decode_optimizer`` of an ``mx.optimizer.SGD``
(registry name and JSON fields, no pickle; a pickle or another object is refused), and
:class:`KeyLayout`: for 1..7 servers and several slot counts every status and slot key
lands on the intended server by MXNet's placement formula ``(key * 9973) % num_servers``
(src/kvstore/kvstore_dist.h, ``EncodeDefaultKey``, evaluated with C ``int`` arithmetic)
and decodes back; all keys are distinct.

Tolerance: none; everything is exact (replies carry bytes as float32 values 0..255).
"""
import base64
import hashlib
import hmac
import json
import pickle

import numpy as np
import pytest

import mxdelay  # noqa: F401
import mxnet as mx
from mxnet import nd

from kvstore_ext.protocol import commands
from kvstore_ext.server.controller import DelayServer
from kvstore_ext.protocol.keys import KeyLayout
from kvstore_ext.protocol.commands import (SEQ_MODULUS, Command, COMMAND_PREFIX, MAGIC, REPLY_LEN,
                                  encode_command, decode_command, encode_reply, decode_reply,
                                  encode_optimizer, decode_optimizer)

INT_MAX = 2 ** 31 - 1


def mxnet_server_of(key, num_servers):
    """``int server = (key * 9973) % num_servers;`` with C's 32-bit int arithmetic."""
    assert 0 <= key <= INT_MAX, 'MXNet keys are C ints'
    product = (key * 9973) & 0xFFFFFFFF
    if product >= 2 ** 31:
        product -= 2 ** 32                     # signed overflow wraps on every platform here
    server = abs(product) % num_servers        # C's % truncates toward zero
    return -server if product < 0 else server


# -- commands ------------------------------------------------------------------------------
BODIES = {
    Command.HELLO: {'rank': 1, 'num_workers': 3, 'slots': 5, 'protocol': 1,
                    'config': {'delay': 4, 'local_rule': "MirrorRule(dc_lambda=0)"}},
    Command.REGISTER: {'chunks': [[0, 0, 'dense0_weight', 1.0, 1.0, 12], [1, 1, 'b', 2.0, 0.0, 3]]},
    Command.OPTIMIZER: {'rank': 0, 'optimizer': 'gASV...=='},
    Command.SET_HYPER: {'rank': 2, 'lr': 0.05, 'rescale_grad': 1.0 / 128},
    Command.SAVE: {'rank': 0, 'paths': ['/tmp/a b/ckpt.server0', 'c\u00e9.server1']},
    Command.LOAD: {'rank': 0, 'paths': ['x.server0'], 'check_only': True},
    Command.STATS: {'rank': 1},
    Command.VOTE: {'rank': 1, 'ballot': 3, 'error': 'ckpt.worker1 is truncated'},
    Command.TALLY: {'rank': 0, 'ballot': 3},
    Command.AUX: {'rank': 1, 'chunks': {'0': [0.25, -1.5e-8], '3': [7.0]}},
    Command.PROBE: {},   # what a server never decodes (commands.is_probe), as any command
    Command.SCHEDULE: {'rank': 0, 'delay': 4, 'synchronous_from': None},
}


def test_every_command_has_a_body_here():
    assert set(BODIES) == set(Command)


@pytest.mark.parametrize('command', list(Command), ids=lambda c: c.value)
def test_command_round_trip(command):
    body = BODIES[command]
    text = encode_command(command, body)
    assert isinstance(text, str)
    assert text.startswith(COMMAND_PREFIX + command.value + ' ')
    assert '\x00' not in text
    assert decode_command(text) == (command, body)
    # the server receives bytes
    assert decode_command(text.encode('utf-8')) == (command, body)
    # the name also works as a string
    assert encode_command(command.value, body) == text


KEY = b'the job key'


@pytest.mark.parametrize('command', list(Command), ids=lambda c: c.value)
def test_an_authenticated_command_round_trips_and_carries_the_hmac_of_its_text(command):
    body = BODIES[command]
    text = encode_command(command, body, KEY)
    plain = encode_command(command, body)
    name, body_text = plain[len(COMMAND_PREFIX):].split(' ', 1)
    mac = hmac.new(KEY, (name + ' ' + body_text).encode('utf-8'), hashlib.sha256).hexdigest()
    assert text == '%s%s#%s %s' % (COMMAND_PREFIX, name, mac, body_text)
    assert '\x00' not in text
    assert decode_command(text, KEY) == (command, body)
    assert decode_command(text.encode('utf-8'), KEY) == (command, body)
    assert decode_command(text) == (command, body)        # a server without a key
    assert commands.command_rank(text) == commands.command_rank(plain)


@pytest.mark.parametrize('forge, pattern', [
    (lambda: encode_command(Command.SET_HYPER, {'rank': 0, 'lr': 0.1}),
     'carries no authenticator'),
    (lambda: encode_command(Command.SET_HYPER, {'rank': 0, 'lr': 0.1}, b'another key'),
     'does not match'),
    (lambda: encode_command(Command.SET_HYPER, {'rank': 0, 'lr': 0.1}, KEY).replace('0.1', '9.1'),
     'does not match'),
    (lambda: encode_command(Command.SET_HYPER, {'rank': 0, 'lr': 0.1}, KEY).replace(
        'set_hyper#', 'stats#'), 'does not match'),
    (lambda: encode_command(Command.STATS, {'rank': 0}, KEY)[:-1] + ', "rank": 1}',
     'does not match'),
], ids=['unsigned', 'other_key', 'body_changed', 'name_changed', 'field_added'])
def test_a_server_with_the_key_refuses_what_lacks_a_valid_authenticator(forge, pattern):
    with pytest.raises(commands.UnauthenticatedCommand, match=pattern) as caught:
        decode_command(forge(), KEY)
    assert isinstance(caught.value, ValueError)


def test_command_text_is_nul_free_even_when_the_body_has_nuls():
    body = {'rank': 0, 'paths': ['a\x00b'], 'note': '\x00'}
    text = encode_command(Command.SAVE, body)
    assert '\x00' not in text
    assert decode_command(text) == (Command.SAVE, body)


def test_encode_unknown_command():
    with pytest.raises(ValueError, match='bogus'):
        encode_command('bogus', {})


def test_decode_unknown_command_names_it():
    with pytest.raises(ValueError, match=r"unknown mxdelay command 'bogus'.*hello"):
        decode_command(COMMAND_PREFIX + 'bogus {}')


@pytest.mark.parametrize('text', ['hello {}', 'MXDELAY:hello {}', ' mxdelay:hello {}', ''])
def test_decode_without_prefix(text):
    with pytest.raises(ValueError, match='prefix'):
        decode_command(text)


@pytest.mark.parametrize('body', ['{not json', '', '{"rank": 1', "{'rank': 1}"])
def test_decode_bad_json(body):
    with pytest.raises(ValueError, match=r'stats.*JSON'):
        decode_command(COMMAND_PREFIX + 'stats ' + body)


def test_decode_stock_client_optimizer_is_not_a_command():
    # A stock 'dist_sync' worker sends a pickled optimizer on command id 0: bytes that are
    # not UTF-8. It must be told apart with a ValueError, not a UnicodeDecodeError.
    raw = pickle.dumps(mx.optimizer.SGD(learning_rate=0.1))
    with pytest.raises(ValueError, match='prefix'):
        decode_command(raw)


# -- replies --------------------------------------------------------------------------------
HEADER = 5   # 2 magic numbers, ok flag, sequence number, length (commands.py's REPLY_LEN note)
PAYLOADS = [None, 0, 1.5, 'text', '\u00e9\u4e2d', [1, 2, [3]],
            {'rounds': {'0': 17, '1': 16}, 'ok': True}]


@pytest.mark.parametrize('ok', [True, False])
@pytest.mark.parametrize('payload', PAYLOADS, ids=range(len(PAYLOADS)))
@pytest.mark.parametrize('seq', [0, 1, 4097])
def test_reply_round_trip(ok, payload, seq):
    segment = encode_reply(ok, payload, seq)
    assert segment.dtype == np.float32 and segment.shape == (REPLY_LEN,)
    assert tuple(segment[:2]) == MAGIC
    assert decode_reply(segment) == (ok, payload, seq)


def test_reply_sequence_defaults_to_zero():
    assert decode_reply(encode_reply(True, 'x')) == (True, 'x', 0)


def test_reply_through_an_ndarray_segment_of_a_status_key():
    # Worker r reads segment r of a status array of num_workers * REPLY_LEN floats.
    status = np.concatenate([encode_reply(True, {'rank': r}, 10 + r) for r in range(3)])
    out = nd.array(status)
    for rank in range(3):
        segment = out[rank * REPLY_LEN:(rank + 1) * REPLY_LEN].asnumpy()
        assert decode_reply(segment) == (True, {'rank': rank}, 10 + rank)


def test_zero_segment_is_not_an_mxdelay_server():
    assert decode_reply(np.zeros(REPLY_LEN, np.float32)) is None
    # a stock server answers a push of zeros with the (zero) sum; any other numbers too
    assert decode_reply(np.full(REPLY_LEN, 3.0, np.float32)) is None
    half = np.zeros(REPLY_LEN, np.float32)
    half[0] = MAGIC[0]
    assert decode_reply(half) is None


def test_reply_length_limit():
    room = (REPLY_LEN - HEADER) * 3           # three bytes of text an entry
    assert commands.reply_capacity(REPLY_LEN) == room
    fits = 'a' * (room - 2)                   # json adds the two quotes
    assert decode_reply(encode_reply(True, fits, 3)) == (True, fits, 3)
    too_long = fits + 'a'
    ok, message, seq = decode_reply(encode_reply(True, too_long, 3))
    assert (ok, seq) == (False, 3)
    assert 'too long' in message and str(room + 1) in message


@pytest.mark.parametrize('size', [0, 1, 2, 3, 4, 5, 95])
def test_reply_text_of_every_length_survives_float32(size):
    # Three bytes an entry: lengths of every residue modulo 3, escapes (JSON is ASCII).
    text = ''.join(chr(c) for c in range(32, 32 + size)) + '\u00ff\u4e2d\U0001f600'
    assert decode_reply(encode_reply(True, text, 1, 512)) == (True, text, 1)


def test_a_long_error_message_is_cut_not_lost():
    message = 'chunk 7 of parameter dense0_weight is refused: ' + 'x' * 5000
    ok, got, _ = decode_reply(encode_reply(False, message, 2, commands.MIN_REPLY_LEN))
    assert ok is False and got.startswith('chunk 7 of parameter dense0_weight is refused: ')
    assert got.endswith('[cut]')


def test_too_long_dict_payload_becomes_an_error_reply():
    payload = {'chunks': list(range(REPLY_LEN))}
    ok, message, _ = decode_reply(encode_reply(True, payload))
    assert ok is False and isinstance(message, str) and 'too long' in message


def test_reply_sequence_survives_long_jobs():
    # One float32 carries the sequence number exactly modulo 2**24; workers compare modulo.
    for seq in (2 ** 24 + 1, 2 ** 24 + 3, 10 ** 8 + 1):
        assert decode_reply(encode_reply(True, None, seq))[2] == seq % SEQ_MODULUS
    assert SEQ_MODULUS == 2 ** 24


def test_command_rank():
    # the server reads rank and sequence number even from a command it cannot decode
    text = encode_command(Command.STATS, {'rank': 2, 'seq': 41})
    assert commands.command_rank(text.encode('utf-8')) == (2, 41)
    assert commands.command_rank(b'mxdelay:bogus {"rank": 1, "seq": 7}') == (1, 7)
    assert commands.command_rank(b'mxdelay:stats {"rank": 3}') == (3, 0)
    for unreadable in (b'mxdelay:stats {bad', b'mxdelay:stats [1]', b'mxdelay:stats {}',
                       pickle.dumps(mx.optimizer.SGD())):
        assert commands.command_rank(unreadable) == (None, 0)


# -- objects -----------------------------------------------------------------------------
def test_encode_decode_sgd():
    opt = mx.optimizer.SGD(learning_rate=0.05, momentum=0.9, wd=1e-4, rescale_grad=1.0 / 128,
                           clip_gradient=5.0)
    opt.param_dict = {0: 'not sent'}
    encoded = encode_optimizer(opt)
    text = encode_command(Command.OPTIMIZER, {'optimizer': encoded})
    assert text.isascii() and '\x00' not in text
    # it travels inside a command, as JSON
    command, body = decode_command(text)
    assert command is Command.OPTIMIZER
    copy = decode_optimizer(body['optimizer'])
    assert type(copy) is mx.optimizer.SGD
    assert (copy.learning_rate, copy.momentum, copy.wd, copy.rescale_grad,
            copy.clip_gradient) == (0.05, 0.9, 1e-4, 1.0 / 128, 5.0)
    assert copy.param_dict == {}              # MXNet drops it; the server attaches its own
    # and it computes the same update, bit for bit
    rs = np.random.RandomState(0)
    w0, g = rs.randn(4, 3).astype(np.float32), rs.randn(4, 3).astype(np.float32) * 100
    results = []
    for o in (mx.optimizer.SGD(learning_rate=0.05, momentum=0.9, wd=1e-4,
                               rescale_grad=1.0 / 128, clip_gradient=5.0), copy):
        w = nd.array(w0)
        state = o.create_state(0, w)
        for _ in range(3):
            o.update(0, w, nd.array(g), state)
        results.append(w.asnumpy())
    np.testing.assert_array_equal(results[0], results[1])
    assert not np.array_equal(results[0], w0)


def test_decode_optimizer_refuses_what_is_no_optimizer():
    pickled = base64.b64encode(pickle.dumps(mx.optimizer.SGD())).decode('ascii')
    for bad, pattern in [
            (pickled, "field 'optimizer' must be"),                        # the old pickle
            ({'tree': {'a': 1}, 'arrays': []}, "field 'optimizer' must be"),
            ({'tree': {'$optimizer': {'name': 'nope', 'fields': {}}}, 'arrays': []},
             "optimizer 'nope' is not registered"),
            ({'tree': {'$optimizer': {'name': 'sgd', 'fields': {'x': {'$array': 0}}}},
              'arrays': [['|O', [1], [None]]]}, 'not a number type'),
            ({'tree': {'$optimizer': {'name': 'sgd', 'fields': {'x': {'$array': 3}}}},
              'arrays': []}, 'refers to array 3 of 0')]:
        with pytest.raises(ValueError, match=pattern):
            decode_optimizer(bad)


def test_an_optimizer_with_numpy_scalars_travels_exactly():
    opt = mx.optimizer.Adam(learning_rate=0.01)
    opt.beta1 = np.float32(0.8)
    copy = decode_optimizer(json.loads(json.dumps(encode_optimizer(opt))))
    assert type(copy.beta1) is np.float32 and copy.beta1 == np.float32(0.8)


# -- keys --------------------------------------------------------------------------------
@pytest.mark.parametrize('num_servers', range(1, 8))
@pytest.mark.parametrize('slots', [1, 2, 5, 9])
def test_key_layout_places_and_decodes(num_servers, slots):
    layout = KeyLayout(num_servers, slots)
    keys = set()
    for server in range(num_servers):
        key = layout.status_key(server)
        assert mxnet_server_of(key, num_servers) == server
        assert layout.server_of(key) == server
        assert layout.decode(key) == ('status', None, None)
        keys.add(key)
    num_chunks = 23
    for chunk in range(num_chunks):
        server = (chunk * 5 + 3) % num_servers   # chunks are placed on any server
        for slot in range(slots):
            key = layout.slot_key(chunk, slot, server)
            assert isinstance(key, int) and key >= 0
            assert mxnet_server_of(key, num_servers) == server, (chunk, slot, server)
            assert layout.server_of(key) == server
            assert layout.decode(key) == ('slot', chunk, slot)
            keys.add(key)
    assert len(keys) == num_servers + num_chunks * slots


@pytest.mark.parametrize('num_servers', [2, 3, 4, 7])
def test_every_chunk_and_slot_on_every_server_is_distinct(num_servers):
    layout = KeyLayout(num_servers, 4)
    keys = [layout.slot_key(c, s, srv) for c in range(10) for s in range(4)
            for srv in range(num_servers)]
    keys += [layout.status_key(srv) for srv in range(num_servers)]
    assert len(set(keys)) == len(keys)


@pytest.mark.parametrize('bad', [0, -1, 9973])
def test_key_layout_rejects_server_counts(bad):
    with pytest.raises(ValueError, match=r'num_servers=%d' % bad):
        KeyLayout(bad, 2)


def test_large_layouts_stay_within_mxnets_int_formula():
    num_servers, slots = 6, 9                  # slack 8 (delay 8); one chunk per small tensor
    layout = KeyLayout(num_servers, slots)
    for chunk in (0, 1000, 3999):
        for server in range(num_servers):
            try:
                key = layout.slot_key(chunk, slots - 1, server)
            except ValueError:
                continue                       # refusing the layout is a fine answer
            assert mxnet_server_of(key, num_servers) == server, (chunk, server, key)


def test_int_formula_helper_matches_python_below_overflow():
    # guard for the helper above: below INT_MAX / 9973 it is Python's formula
    for key in (0, 1, 9972, 215329):
        for servers in range(1, 8):
            assert mxnet_server_of(key, servers) == (key * 9973) % servers
    assert mxnet_server_of(215330, 6) != (215330 * 9973) % 6   # overflow changes the answer


def test_protocol_constants():
    assert commands.PROTOCOL_VERSION >= 1
    assert all(m != 0 for m in MAGIC)
    # the reply bytes are stored as float32 values: the length must be exactly representable
    assert float(np.float32(REPLY_LEN)) == REPLY_LEN
    assert json.loads(json.dumps(list(MAGIC))) == list(MAGIC)



# -- status keys with many workers ---------------------------------------------------------------
@pytest.mark.parametrize('num_workers,bound,expected', [
    (1, 10 ** 6, REPLY_LEN), (61, 10 ** 6, REPLY_LEN),     # 61 * 16384 < 1e6
    (62, 10 ** 6, 16129), (500, 10 ** 6, 1999), (1000, 10 ** 6, 999), (1953, 10 ** 6, 512),
    (1000, 10 ** 7, 9999)])
def test_status_keys_stay_below_the_bigarray_bound(num_workers, bound, expected):
    # A status key of num_workers segments at or above MXNet's bound would be split over the
    # servers (each holding a slice): from 62 workers on, the segments shrink instead.
    length = commands.reply_len(num_workers, bound)
    assert length == expected
    assert num_workers * length < bound
    segment = encode_reply(True, {'server': 0, 'workers': num_workers}, 7, length)
    assert segment.shape == (length,)
    assert decode_reply(segment) == (True, {'server': 0, 'workers': num_workers}, 7)


def test_too_many_workers_for_the_bound_names_the_fix():
    # From 1954 workers at MXNet's default bound (docs/limits.md's size limits).
    with pytest.raises(ValueError, match=r'1954 workers need status keys of 1000448 floats, '
                                         r'above MXNET_KVSTORE_BIGARRAY_BOUND=1000000: set '
                                         r'MXNET_KVSTORE_BIGARRAY_BOUND to at least 1000449'):
        commands.reply_len(1954, 10 ** 6)


def test_a_tally_of_many_long_errors_fits_its_reply():
    # 500 workers fail alike with long messages: the tally lists as many as fit and counts
    # the rest; the reply decodes (an over-long one would turn into an error reply).
    server = DelayServer.offline(rank=0, num_workers=500)     # commands only, no network
    for rank in range(500):
        server.command(Command.VOTE, {'rank': rank, 'ballot': 1,
                                      'error': 'broken file %d ' % rank + 'x' * 900})
    tally = server.command(Command.TALLY, {'rank': 0, 'ballot': 1})
    length = commands.reply_len(500)
    ok, payload, _ = decode_reply(encode_reply(True, tally, 3, length))
    assert ok and payload == tally
    assert 0 < len(tally['errors']) < 500 and len(tally['errors']) + tally['more'] == 500
    assert tally['errors']['0'].startswith('broken file 0 ') and len(tally['errors']['0']) == 600
