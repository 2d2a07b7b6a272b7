"""In-process stores of the fast tests: a ``DistDelay`` of one worker with no network
(:func:`offline_store` refuses every network use) or with servers that answer from this
process (:class:`FakeChannel`)."""
import pickle
import types

import numpy as np

import mxdelay  # noqa: F401  before mxnet, as the job scripts do
import mxnet as mx
from mxnet import nd

from kvstore_ext import protocol
from kvstore_ext.dist_delay import DistDelay
from kvstore_ext.optimizers import describe_optimizer, flatten_state
from kvstore_ext.protocol import Command
from kvstore_ext.rounds import is_plain_sgd, sgd_step

__all__ = ['OfflineNative', 'FakeChannel', 'WorkersNative', 'servers', 'started_store',
           'offline_store', 'FakeDistDelay', 'FakeDistDelayWithMultipliers']


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
            return {'optimizer': describe_optimizer(protocol.unpack_object(body['optimizer']))}
        return {}
    return FakeChannel(answer), sent


def started_store(answer=None):
    """A ``DistDelay`` of one worker after its hand-shake with a :class:`FakeChannel`;
    returns ``(store, channel)``."""
    channel = FakeChannel(answer)
    store = DistDelay(native=OfflineNative(), channel_factory=lambda native, layout: channel)
    store._ensure_started()
    return store, channel


def offline_store(placed=True):
    """A ``DistDelay`` with slack 1 and chunk size 1000 that fails the test on any network use
    (hand-shake, command, barrier); key 0 of shape (2, 3) is placed unless not `placed`
    (configure() works only before)."""
    from kvstore_ext.layout import Tensor  # pylint: disable=import-outside-toplevel
    store = DistDelay(native=OfflineNative(), channel_factory=_no_channel)
    store.configure(slack=1, chunk_size=1000)
    if placed:
        store._tensors[0] = Tensor(0, (2, 3), np.float32, [])
    return store


class FakeDistDelay(DistDelay):
    """``DistDelay`` with the job replaced by this process: one worker, one server.

    The "server" keeps the weights and applies the optimizer with MXNet's updater to each
    pushed gradient at once (with one worker a round is one push), as mxdelay's server does
    (``kvstore_ext/server.py``: ``mx.optimizer.get_updater`` on an unpickled copy of the
    worker's optimizer; without an optimizer it stores the pushed sum, as MXNet's server
    does). A pull returns the weights after the last pushed round. Pushes and pulls are
    recorded per key.
    """

    def __init__(self):
        super(FakeDistDelay, self).__init__(native=OfflineNative(), channel_factory=_no_channel)
        self.server_optimizer = self.server_updater = None
        self.store = {}
        self.log = []          # ('push' | 'pull', key)
        self.priorities = []   # (key, priority) of every push, in issue order
        self._rescale_grad = self._job_rescale_grad = None

    @property
    def rank(self):
        return 0

    @property
    def num_workers(self):
        return 1

    def set_optimizer(self, optimizer):
        super(FakeDistDelay, self).set_optimizer(optimizer)  # no hand-shake: nothing sent
        self.server_optimizer = pickle.loads(pickle.dumps(optimizer))
        self.server_updater = mx.optimizer.get_updater(self.server_optimizer)

    def _server_optimizer(self, what):
        if self.server_optimizer is None:   # mxdelay's server refuses, the worker raises
            raise RuntimeError('mxdelay server 0: set_hyper failed: cannot %s: no optimizer '
                               'installed on server 0 (call set_optimizer first)' % what)
        return self.server_optimizer

    def set_learning_rate(self, lr):
        self._server_optimizer('change the optimizer').set_learning_rate(lr)

    def init(self, key, value):
        assert key not in self.store
        if self._job_rescale_grad is None and self.server_optimizer is not None:
            # The hand-shake (at the first init): the job's rescale_grad is this worker's.
            self._job_rescale_grad = self._rescale_grad or self.server_optimizer.rescale_grad
            self.server_optimizer.rescale_grad = self._job_rescale_grad
        self.store[key] = value.copyto(mx.cpu())
        self._tensors[key] = None

    def broadcast(self, key, value, out, priority=0):
        self.init(key, value)
        self.log.append(('broadcast', key))
        for o in (out if isinstance(out, (list, tuple)) else [out]):
            self.store[key].copyto(o)

    def push(self, key, value, priority=0):
        assert not isinstance(value, (list, tuple)), 'the trainer sums devices itself'
        self.log.append(('push', key))
        self.priorities.append((key, priority))
        grad = value.copyto(mx.cpu())
        factor = self._gradient_factor()   # as DistDelay scales a push
        if factor is not None:
            grad = nd._internal._mul_scalar(grad, scalar=factor)
        if self.server_updater is None:
            self.store[key][:] = grad
        elif not is_plain_sgd(self.server_optimizer):
            self.server_updater(key, grad, self.store[key])
        else:
            # mxdelay's server applies plain SGD with the single-tensor kernels.
            sgd_step(self.server_optimizer, self.server_updater, key, grad, self.store[key])

    def send_buffer(self, key):
        return self.store[key]

    def pull(self, key, out=None, priority=0, ignore_sparse=True):
        self.log.append(('pull', key))
        for o in (out if isinstance(out, (list, tuple)) else [out]):
            self.store[key].copyto(o)

    def fetch_optimizer_states(self, states):
        # The server's updater keys its state by parameter index here (by chunk id in a job);
        # array j of flatten_state, as mxdelay's server writes it into state key j.
        for key, arrays in states.items():
            assert len(arrays) <= self._state_keys, 'configure(state_keys=...) too small'
            served = flatten_state(self.server_updater.states[key])
            for j, array in enumerate(arrays):
                served[j].copyto(array)
        self.log.append(('fetch_states', tuple(sorted(states))))

    def barrier(self):
        pass

    def finish_round(self, leaving=False):
        self.log.append(('finish', None))
        return True   # one worker: when it has finished, every worker has

    def save_optimizer_states(self, fname, dump_optimizer=False):
        with open(fname, 'wb') as out:
            pickle.dump({'store': {k: v.asnumpy() for k, v in self.store.items()},
                         'updater': self.server_updater.get_states(dump_optimizer=True)}, out)

    def check_states(self, fname, error=None):
        # One worker: the "agreement" is this worker's own verdict.
        if error is not None:
            raise ValueError('cannot load %s, nothing was changed: worker 0: %s' % (fname, error))
        try:
            with open(fname, 'rb') as src:
                return pickle.load(src)
        except Exception as err:  # pylint: disable=broad-except
            raise ValueError('cannot load %s: %s' % (fname, err)) from None

    def apply_states(self, state):
        for key, value in state['store'].items():
            self.store[key][:] = value
        self.server_updater.set_states(state['updater'])
        self.server_optimizer = self.server_updater.optimizer
        self._job_rescale_grad = self.server_optimizer.rescale_grad


class FakeDistDelayWithMultipliers(FakeDistDelay):
    """FakeDistDelay whose server applies the Parameters' multipliers, as mxdelay's does.

    The worker side is DistDelay's own (``_mults`` reads each key's Parameter from the
    optimizer's ``param_dict``; its values travel in the REGISTER command); the server side
    is ``DelayServer._attach_param_dict``: a ``param_dict`` of the server's optimizer keyed
    like its updater, holding only the two multipliers (the optimizer it received was
    unpickled, which empties ``param_dict``).
    """

    def init(self, key, value):
        super(FakeDistDelayWithMultipliers, self).init(key, value)
        lr_mult, wd_mult, _ = self._mults(key)
        self.server_optimizer.param_dict[key] = types.SimpleNamespace(lr_mult=lr_mult,
                                                                      wd_mult=wd_mult)
