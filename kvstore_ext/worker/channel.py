"""A worker's connection to mxdelay's servers: hand-shake, commands, optimizer, votes.

Commands go out on MXNet's command id 0 (:mod:`kvstore_ext.protocol.commands`); each server writes
its reply into this worker's segment of its *status key*, which the worker pulls
(docs/design.md §4). The hand-shake is one round on the status keys: the servers answer it
when every worker has said hello, so it also proves that the servers are mxdelay's (a stock
MXNet server leaves the status key at zero).

:class:`DistDelay <kvstore_ext.worker.dist_delay.DistDelay>` talks to the servers only through its
:class:`ServerLink`, which makes a :class:`CommandChannel` at the hand-shake (tests give it a
fake one) and carries the optimizer.
"""
from mxnet import nd

from kvstore_ext import env
from kvstore_ext.protocol import commands
from kvstore_ext.optim.optimizers import (PER_STEP_FIELDS, describe_optimizer, format_differences,
                                          optimizer_differences)
from kvstore_ext.protocol.commands import Command

__all__ = ['CommandChannel', 'ServerLink', 'StockServerError', 'ordered_by_servers',
           'wait_for_issued_work']


class StockServerError(RuntimeError):
    """The job's servers are MXNet's stock servers, not mxdelay's."""


class CommandChannel(object):
    """Commands from one worker to every server of the job.

    Parameters
    ----------
    native : mxnet.kvstore.KVStore
        The worker's native distributed store.
    layout : kvstore_ext.protocol.keys.KeyLayout
        The job's keys (the status keys).
    """

    def __init__(self, native, layout):
        self._native = native
        self._num_servers = layout.num_servers
        self._keys = [layout.status_key(s) for s in range(layout.num_servers)]
        self._reply_len = commands.reply_len(native.num_workers)
        self._status = None      # this worker's copy of each server's status key
        self._seq = 0            # number of the last command, echoed by the replies
        self._ballot = 0         # number of the last agree() call
        self._key = env.job_key()   # every command carries its authenticator (§4.5)

    @property
    def rank(self):
        """This worker's rank (MXNet's)."""
        return self._native.rank

    def handshake(self, hello):
        """Say `hello` (a dict) to every server; return their replies' payloads.

        Raises
        ------
        StockServerError
            If a server is not mxdelay's.
        ValueError
            If a server refused the hand-shake (e.g. the workers disagree on a setting).
        """
        text = commands.encode_command(Command.HELLO, hello, self._key)
        self._native._send_command_to_servers(0, text)
        length = self._reply_len * self._native.num_workers
        self._native.init(self._keys, [nd.zeros(length) for _ in self._keys])
        # One round on the status keys: the server's updater answers it with the hand-shake.
        self._native.push(self._keys, [nd.zeros(length) for _ in self._keys])
        self._status = [nd.zeros(length) for _ in self._keys]
        self._native.pull(self._keys, out=self._status)
        payloads = []
        for server in range(self._num_servers):
            reply = self._read_reply(server)
            if reply is None:
                raise StockServerError(
                    "server %d of this job is not mxdelay's server: it runs MXNet's stock "
                    "server, which would train without mxdelay's rounds. In the training "
                    "script put `import mxdelay` before `import mxnet`, or launch through "
                    "the dispatcher: `mxdelay-launch -n N -s S mxdelay-run python train.py` "
                    "(or MXNet's tools/launch.py ... mxdelay-run python train.py). An "
                    "mxdelay server of an earlier version that refused this worker's "
                    "protocol looks the same (its log says so): install the same mxdelay "
                    "version everywhere." % server)
            ok, payload, _ = reply
            if not ok:
                raise ValueError('mxdelay server %d refused the hand-shake: %s'
                                 % (server, payload))
            payloads.append(payload)
        return payloads

    def _read_reply(self, server):
        rank = self.rank
        segment = slice(rank * self._reply_len, (rank + 1) * self._reply_len)
        return commands.decode_reply(self._status[server][segment].asnumpy())

    def command(self, command, body, refusal=RuntimeError):
        """Run `command` with `body` (a dict) on every server; return their replies' payloads.

        Raises
        ------
        RuntimeError
            If a server did not answer this command (its reply is an older one).
        `refusal`
            If a server refused the command (RuntimeError unless given).
        """
        self._seq += 1
        body = dict(body, rank=self.rank, seq=self._seq)
        text = commands.encode_command(command, body, self._key)
        self._native._send_command_to_servers(0, text)
        self._native.pull(self._keys, out=self._status)
        replies = []
        for server in range(self._num_servers):
            ok, payload, seq = self._read_reply(server)
            if seq != self._seq % commands.SEQ_MODULUS:
                raise RuntimeError('mxdelay server %d did not answer command %s (its last '
                                   'reply is to command %d, not %d); see its log'
                                   % (server, command.value, seq, self._seq))
            if not ok:
                raise refusal('mxdelay server %d: %s failed: %s'
                              % (server, command.value, payload))
            replies.append(payload)
        return replies

    def agree(self, error, barrier):
        """Collective: every worker's `error` (None or a message) to every worker.

        Parameters
        ----------
        error : str or None
            This worker's outcome.
        barrier : callable
            The workers' barrier, between the votes and the tally.

        Returns
        -------
        list of (int, str)
            ``(rank, message)`` of every worker that failed, the same on every worker.
        """
        return self.vote(error, barrier)[0]

    def vote(self, error, barrier, value=None):
        """:meth:`agree`, whose ballot also carries this worker's `value` (None, or a small
        JSON value: a decision); return the failures and ``{rank: value}`` of every worker
        that gave one, the same on every worker."""
        self._ballot += 1
        body = {'ballot': self._ballot, 'error': error}
        if value is not None:
            body['value'] = value
        self.command(Command.VOTE, body)
        barrier()
        tally = self.command(Command.TALLY, {'ballot': self._ballot})[0]
        failures = sorted((int(rank), message) for rank, message in tally['errors'].items())
        if tally.get('more') and failures:
            rank, message = failures[-1]
            failures[-1] = (rank, '%s (and %d more workers failed; their messages do not fit '
                                  'the reply)' % (message, tally['more']))
        return failures, {int(rank): v for rank, v in tally.get('values', {}).items()}


class ServerLink(object):
    """A worker's connection to the servers: made idle, started by the hand-shake.

    Parameters
    ----------
    native : mxnet.kvstore.KVStore
        The worker's native distributed store.
    channel_factory : callable
        ``channel_factory(native, layout)`` makes the command channel at the hand-shake
        (:class:`CommandChannel`, or a test's fake).
    """

    def __init__(self, native, channel_factory):
        self._native = native
        self._channel_factory = channel_factory
        self.channel = None     # made at the hand-shake

    def start(self, layout, hello, codec):
        """Say `hello` to every server through a new channel for `layout`, with what the
        codec must tell the native servers before and its native store after; return the
        servers' replies (raise as :meth:`CommandChannel.handshake`)."""
        channel = self._channel_factory(self._native, layout)
        codec.prepare_servers(self._native, self._native.rank)
        replies = channel.handshake(hello)
        codec.configure_native(self._native)
        self.channel = channel
        return replies

    def command(self, command, body, refusal=RuntimeError):
        """Run `command` on every server after this worker's issued work (unless the servers
        order it themselves: :func:`ordered_by_servers`); return the replies (raise
        `refusal` if a server refuses)."""
        if not ordered_by_servers(command, body):
            wait_for_issued_work()
        return self.channel.command(command, body, refusal)

    def send_optimizer(self, optimizer):
        """Send `optimizer` to the servers; raise ValueError if they apply another one."""
        # Described before sending: the servers' reply describes what they will apply, and
        # that must be this worker's optimizer as it is now (compared only here: the
        # learning rate changes later through SET_HYPER, legitimately), except rescale_grad:
        # the servers apply the job's (Rounds.scale_gradients).
        mine = describe_optimizer(optimizer)
        # By registry name and fields (no pickle): the servers build it from MXNet's registry.
        replies = self.command(Command.OPTIMIZER,
                               {'optimizer': commands.encode_optimizer(optimizer)},
                               refusal=ValueError)
        for server, reply in enumerate(replies):
            differences = optimizer_differences(reply.get('optimizer'), mine, PER_STEP_FIELDS)
            if differences:
                raise ValueError(
                    'mxdelay server %d applies another optimizer than worker %d set: %s. A '
                    'server keeps the optimizer it has applied since the first round (a new '
                    'one would drop its state): set the optimizer before training starts, '
                    'change the learning rate with set_learning_rate, or restart the job'
                    % (server, self._native.rank, format_differences(
                        differences, 'the server', 'this worker')))

    def agree(self, error, barrier):
        """:meth:`CommandChannel.agree` after this worker's issued work."""
        return self.vote(error, barrier)[0]

    def vote(self, error, barrier, value=None):
        """:meth:`CommandChannel.vote` after this worker's issued work."""
        wait_for_issued_work()
        return self.channel.vote(error, barrier, value)

    def close(self):
        """Drop the native store and the channel (the worker leaves the job)."""
        self._native = self.channel = None


def ordered_by_servers(command, body):
    """Whether `command` may overtake this worker's issued pushes: only a save in the
    background that names its rounds (docs/design.md §6.4). Each server copies each chunk
    at the round the body names, when its earlier rounds are applied, and no chunk can
    apply that round first: it needs this worker's push of it, which this worker issues
    only after the reply, and which reaches a server behind the command (one connection
    from this worker to each server, in order; each server handles commands and rounds in
    the order they arrive, on one thread)."""
    return command == Command.SAVE and bool(body.get('background')) and 'rounds' in body


def wait_for_issued_work():
    """Wait for the pushes and pulls this worker issued.

    A command travels at once, from this thread (MXNet's SendCommandToServers), while the
    pushes and pulls issued before it may still wait in MXNet's engine (a push waits for
    backward to write its gradient): without this wait a command could overtake them,
    e.g. a new learning rate would reach a round pushed before set_learning_rate, and
    STATS would miss it. A push completes once its round is applied on the server, so
    after this every round this worker pushed is applied (which waits for the other
    workers' pushes of those rounds too: a command is a collective point in that sense)."""
    nd.waitall()
