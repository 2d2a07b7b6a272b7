"""A worker of tests/test_commands_safety.py: sends forged commands to the job's mxdelay
servers, as a process of the job could (signed with the job's key when it has one),
then trains one more round.

Usage: ``mxdelay-launch -n 2 -s 1 python forged_commands_job.py OUT_DIR [keyed]``. Worker 0 sends
each forged command of :data:`FORGED` (raw text on command id 0, as MXNet's
``_send_command_to_servers`` sends it) and reads its own reply segment; it also sends a
pickled object (a "bomb" whose unpickling would create ``OUT_DIR/marker``) as a stock
MXNet worker sends its optimizer. Then both workers push and pull one round and ask the
servers for STATS: the servers must still be up and correct. Writes ``OUT_DIR/worker<rank>.json``:
``{'replies': {case: [ok, payload, seq] or None}, 'pulled': [...], 'stats': {...}}``.

With ``keyed`` (the job runs with ``MXDELAY_JOB_KEY``), worker 0 sends instead well-formed
commands that a process without the key could send (:func:`unauthenticated`): without an
authenticator, with one of another key, and a valid command whose body was changed.
"""
import mxdelay  # noqa: F401  before mxnet: the scheduler and servers become mxdelay's

import json
import os
import pickle
import sys

import mxnet as mx
from mxnet import nd

from kvstore_ext.protocol import commands


class Bomb(object):
    """Unpickling it creates the file `marker`."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, 'w'))


def forged(rank, out_dir):
    """case -> command text; seq 1000 + i, so that each reply is known to answer its case."""
    outside = os.path.join(out_dir, 'outside')
    cases = {
        'nan_lr': ('set_hyper', {'lr': float('nan')}),
        'inf_lr': ('set_hyper', {'lr': float('inf')}),
        'negative_lr': ('set_hyper', {'lr': -0.1}),
        'string_lr': ('set_hyper', {'lr': '0.1'}),
        'save_outside': ('save', {'paths': [outside]}),
        'save_other_server': ('save', {'paths': [outside + '.server1']}),
        'save_relative': ('save', {'paths': ['ckpt.server0']}),
        'load_outside': ('load', {'paths': ['/etc/passwd']}),
        'load_pickle_trusted': ('load', {'paths': [outside + '.server0'], 'version': 1,
                                         'trusted': True}),
        'pickled_optimizer_body': ('optimizer', {'optimizer': 'gASVAAAAAAAAAAB9lC4='}),
        'hello_slots_0': ('hello', {'protocol': commands.PROTOCOL_VERSION, 'slots': 0,
                                    'config': {}}),
        'hello_again': ('hello', {'protocol': commands.PROTOCOL_VERSION, 'slots': 2,
                                  'config': {}}),
        'vote_bad_ballot': ('vote', {'ballot': -3, 'error': None}),
        'register_bad_size': ('register', {'chunks': [[0, 0, 0, 'w', 1.0, 1.0, -5]]}),
    }
    # Signed with the job's key, as a process of the job could: the fields are checked too.
    key = os.environ['MXDELAY_JOB_KEY'].encode() if os.environ.get('MXDELAY_JOB_KEY') else None
    texts = {}
    for i, (case, (name, body)) in enumerate(sorted(cases.items())):
        texts[case] = commands.encode_command(name, dict(body, rank=rank, seq=1000 + i), key)
    # Claimed ranks that are not this job's: no reply segment may be written for them.
    for claimed in (-1, 2, 10 ** 6):
        texts['rank_%d' % claimed] = commands.encode_command(
            'stats', {'rank': claimed, 'seq': 2000}, key)
    return texts


def unauthenticated(rank, key):
    """case -> command text: valid commands (lr 0.25) that a process without `key` sends."""
    body = {'lr': 0.25, 'rank': rank}
    signed = commands.encode_command(commands.Command.SET_HYPER, dict(body, seq=3002), key)
    return {
        'no_key': commands.encode_command(commands.Command.SET_HYPER, dict(body, seq=3000)),
        'other_key': commands.encode_command(commands.Command.SET_HYPER, dict(body, seq=3001),
                                             b'not this job\'s key'),
        'body_changed': signed.replace('"lr": 0.25', '"lr": 0.75'),
    }


def main():
    out_dir = sys.argv[1]
    keyed = sys.argv[2:] == ['keyed']
    kv = mx.kv.create('dist_delay')
    kv.init(3, nd.zeros(4))
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.5))
    kv.delayed.job.barrier()
    replies = {}
    if kv.rank == 0:
        native, channel = kv._session.native, kv._session.link.channel  # pylint: disable=W0212
        # A pickled object where a stock MXNet worker's optimizer would come.
        native._send_command_to_servers(  # pylint: disable=protected-access
            0, pickle.dumps(Bomb(os.path.join(out_dir, 'marker')), 0).decode('ascii'))
        texts = unauthenticated(kv.rank, os.environ['MXDELAY_JOB_KEY'].encode()) if keyed \
            else forged(kv.rank, out_dir)
        for case in sorted(texts, key=lambda c: (c.startswith('rank_'), c)):  # ranks last
            text = texts[case]
            native._send_command_to_servers(0, text)  # pylint: disable=protected-access
            native.pull(channel._keys[0], out=channel._status[0])  # pylint: disable=W0212
            replies[case] = channel._read_reply(0)  # pylint: disable=protected-access
    kv.delayed.job.barrier()
    kv.push(3, nd.ones(4) * (kv.rank + 1))
    out = nd.zeros(4)
    kv.pull(3, out=out)
    stats = kv.delayed.job.server_stats()
    with open(os.path.join(out_dir, 'worker%d.json' % kv.rank), 'w') as dst:
        json.dump({'replies': replies, 'pulled': out.asnumpy().tolist(), 'stats': stats,
                   'lr': kv._session.command(commands.Command.SET_HYPER, {})[0]['lr']}, dst)  # noqa


if __name__ == '__main__':
    main()
