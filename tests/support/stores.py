"""Stores of the fast tests that stop above the servers: a ``DistDelay`` of one worker with
no network (:func:`offline_store` refuses every network use) or with a command channel
that answers from this process (:class:`FakeChannel`). A ``DistDelay`` that trains, with
mxdelay's real servers in process, is :func:`support.native.delay_store`."""
import numpy as np

import mxdelay  # noqa: F401  before mxnet, as the job scripts do
from kvstore_ext.protocol import commands
from kvstore_ext.worker.dist_delay import DistDelay
from kvstore_ext.optim.optimizers import describe_optimizer
from kvstore_ext.protocol.commands import Command

__all__ = ['OfflineNative', 'FakeChannel', 'WorkersNative', 'servers', 'started_store',
           'offline_store']


class OfflineNative(object):
    """A native store of one worker with no network: a barrier fails the test."""
    rank = 0
    num_workers = 1

    def _barrier(self):
        raise AssertionError('a barrier was entered')


def _no_channel(native, layout):
    raise AssertionError('the hand-shake was started')


class FakeChannel(object):
    """A command channel to servers that answer every command with ``answer(command, body)``
    (default: an empty reply); the commands sent are recorded in :attr:`sent`."""

    def __init__(self, answer=None):
        self.answer = answer or (lambda command, body: {})
        self.sent = []
        self.hello = None

    def handshake(self, hello):
        self.hello = hello
        return [{'rescale_grad': None}]

    def command(self, command, body, refusal=RuntimeError):
        self.sent.append(command)
        return [self.answer(command, body)]


class WorkersNative(OfflineNative):
    """A native store of `num_workers` workers that accepts init and pull (and does nothing);
    a barrier fails the test."""

    def __init__(self, num_workers):
        self.num_workers = num_workers

    def init(self, keys, values):
        pass

    def pull(self, keys, out=None, priority=0):
        pass


def servers():
    """A FakeChannel that answers OPTIMIZER as a server would; returns (channel, sent), sent:
    [(command, body)]."""
    sent = []

    def answer(command, body):
        sent.append((command, body))
        if command == Command.OPTIMIZER:
            return {'optimizer': describe_optimizer(commands.decode_optimizer(body['optimizer']))}
        return {}
    return FakeChannel(answer), sent


def started_store(answer=None):
    """A ``DistDelay`` of one worker after its hand-shake with a :class:`FakeChannel`;
    returns ``(store, channel)``."""
    channel = FakeChannel(answer)
    store = DistDelay(native=OfflineNative(), channel_factory=lambda native, layout: channel)
    store._session.ensure_started()  # pylint: disable=protected-access
    return store, channel


def offline_store(placed=True):
    """A ``DistDelay`` with slack 1 and chunk size 1000 that fails the test on any network use
    (hand-shake, command, barrier); key 0 of shape (2, 3) is placed unless not `placed`
    (settings.configure() works only before)."""
    from kvstore_ext.worker.layout import Tensor  # pylint: disable=import-outside-toplevel
    store = DistDelay(native=OfflineNative(), channel_factory=_no_channel)
    store.delayed.settings.configure(slack=1, chunk_size=1000)
    if placed:
        store._session.tensors[0] = Tensor(0, (2, 3), np.float32, [])  # pylint: disable=W0212
    return store
