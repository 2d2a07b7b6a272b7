"""mxdelay's parameter server: the controller, its commands, and the native updater hook.

MXNet's native server runs in *sync mode*: for every key it sums the pushes until it holds
one from each of the N workers, then calls the updater once and acknowledges the N pushes.
mxdelay's worker (:class:`kvstore_ext.worker.dist_delay.DistDelay`) gives every chunk of every
tensor R *slot keys* and pushes round t into slot ``t mod R``, so the native sum of a slot
is exactly one round. This module is the controller: it looks each command
(:class:`kvstore_ext.protocol.commands.Command`, on MXNet's command id 0) up in one table of
handlers, each in the module of its concern, and writes the reply into the requesting
worker's segment of this server's status key; it hands each completed round to the handler
of its key's kind (:mod:`kvstore_ext.server.key_rounds`), a slot's to
:class:`kvstore_ext.server.rounds.RoundKeeper`, which applies the optimizer once per chunk per
round, in order (docs/design.md §3, §4). A worker that never says hello (stock ``dist_sync``
without mxdelay) is served as MXNet's own server would (:mod:`kvstore_ext.server.stock`).
"""
import importlib
import logging
import os
import types

import mxnet as mx
from mxnet.kvstore import KVStoreServer

from kvstore_ext import env
from kvstore_ext.codecs import kernels
from kvstore_ext.protocol import commands
from kvstore_ext.protocol.commands import Command, check_rank, field
from kvstore_ext.server import agreement, appliers, registry, rounds
from kvstore_ext.server.checkpoint import ServerCheckpoint
from kvstore_ext.server.handshake import Handshake
from kvstore_ext.server.job import Job
from kvstore_ext.server.key_rounds import KeyRounds
from kvstore_ext.server.optimizer import OptimizerCommands
from kvstore_ext.server.stock import StockClient
# The servers build the workers' optimizer by its registered name: mxdelay's own included.
from kvstore_ext.optim import frozen_variance  # noqa: F401

__all__ = ['DelayServer', 'serve', 'import_server_modules']

_LOG = logging.getLogger(__name__)


class DelayServer(KVStoreServer):
    """A ``KVStoreServer`` whose controller and updater implement mxdelay's server flow.

    MXNet runs it through the face of every ``KVStoreServer``: ``_controller()`` returns the
    function ``(cmd_id, cmd_body, _)`` MXNet calls for each command, which on its first call
    installs the updater with ``kvstore._set_updater`` (docs/design.md §3.1).

    The extension and test surface, which runs the same code without network:
    :meth:`offline` (a server on a stand-in store), :meth:`command` (one command, as the
    controller runs it), :meth:`handshake_reply`, :meth:`complete_round` (one key's round, as
    the updater runs it), and the read-only :meth:`stats`, :attr:`optimizer`,
    :attr:`updater`, :meth:`applied_rounds` and :meth:`weight`.

    Parameters
    ----------
    kvstore : mxnet.kvstore.KVStore
        The native distributed store of this server process (``mx.kv.create('dist')``), or a
        stand-in with ``handle``, ``rank``, ``num_workers``, ``_updater`` and ``_set_updater``.
    """

    def __init__(self, kvstore):
        super(DelayServer, self).__init__(kvstore)
        # ps-lite answers rank and group size only once the server runs (before: segfault).
        job = self._job = Job()
        # Its slot count comes with the hand-shake; what an update that raises does is this
        # server's policy, chosen once (docs/design.md §3.2).
        self._rounds = rounds.RoundKeeper(updater_errors=appliers.UPDATER_ERRORS[
            env.get_choice('MXDELAY_UPDATER_ERRORS')]())
        self._chunks = registry.ChunkRegistry()
        self._handshake = Handshake(job, self._rounds, self._start_key_rounds)
        self._stock = StockClient(job)
        # A round before any hello: a stock worker's, or a refused hand-shake's.
        self._complete_round = self._round_without_layout
        # The job's key: every command must carry its authenticator (docs/design.md §4.5).
        self._job_key = env.job_key()
        ballots = agreement.Ballots()
        optimizer = OptimizerCommands(job, self._chunks, self._rounds,
                                      self._handshake.chunk_size)
        checkpoint = ServerCheckpoint(job, self._chunks, self._rounds,
                                      self._handshake.num_servers)
        self._handlers = {
            Command.HELLO: self._handshake.hello,
            Command.REGISTER: optimizer.register,
            Command.OPTIMIZER: optimizer.optimizer,
            Command.SET_HYPER: lambda body: _both(optimizer.set_hyper, checkpoint.set_hyper,
                                                  body),
            Command.SAVE: checkpoint.save,
            Command.LOAD: checkpoint.load,
            Command.STATS: lambda body: rounds.stats(self._rounds, self._chunks,
                                                     job.server_rank),
            Command.VOTE: ballots.vote,
            Command.TALLY: lambda body: ballots.tally(body, job.num_workers),
            Command.AUX: lambda body: self._rounds.aux.command(body, self._chunks,
                                                               job.num_workers),
            Command.SCHEDULE: self._rounds.models.amend_schedule,
        }

    # -- controller ------------------------------------------------------------------------
    def _controller(self):
        def server_controller(cmd_id, cmd_body, _):
            if cmd_id == 0 and commands.is_probe(cmd_body):
                return   # answered unread, before the hand-shake too (docs/design.md §2.16)
            self._start()
            rank, seq = commands.command_rank(cmd_body)
            if rank is not None and not 0 <= rank < self._job.num_workers:
                rank = None   # never write into another worker's reply segment, nor past them
            try:
                if cmd_id != 0:
                    raise ValueError('command id %d is not mxdelay\'s (only id 0 reaches '
                                     'the controller)' % cmd_id)
                if not cmd_body.startswith(commands.COMMAND_PREFIX.encode('ascii')):
                    self._stock.command(cmd_body)
                    return
                reply = self.command(*commands.decode_command(cmd_body, self._job_key))
                if reply is not None:
                    self._job.reply(rank, True, reply, seq)
            except Exception as err:  # pylint: disable=broad-except
                # An exception must not escape into ctypes: log it and tell the worker.
                _LOG.error('server %d: command failed: %s', self._job.server_rank, err)
                if rank is not None and self._job.status is not None:
                    self._job.reply(rank, False, str(err), seq)
        return server_controller

    def _start(self):
        job = self._job
        if job.server_rank is None:
            job.server_rank = self.kvstore.rank
            job.num_workers = self.kvstore.num_workers
            if self._job_key is None:
                _LOG.warning('server %d: MXDELAY_JOB_KEY is not set: mxdelay commands are '
                             'not authenticated (any process that reaches this port can send '
                             'them); mxdelay-launch sets a key per job', job.server_rank)
        if self.kvstore._updater is None:  # pylint: disable=protected-access
            # The native server needs the updater before any round completes, and it can
            # only be installed once the server runs, i.e. from here (docs/design.md §9).
            self.kvstore._set_updater(self._on_round)  # pylint: disable=protected-access

    def _start_key_rounds(self, layout):
        # The first hello fixed the layout: from now on every round goes by its key's kind.
        self._complete_round = KeyRounds(layout, self._chunks, self._rounds, self._job,
                                         self._handshake.status_round).complete_round

    # -- the extension and test surface -----------------------------------------------------
    @classmethod
    def offline(cls, rank=0, num_workers=1):
        """A server without network, as server `rank` of a job of `num_workers` workers: its
        commands run through :meth:`command`, its rounds through :meth:`complete_round`."""
        return cls(types.SimpleNamespace(handle=None, rank=rank, num_workers=num_workers,
                                         _updater=None, _set_updater=lambda updater: None))

    def command(self, command, body):
        """Run one command as the controller does, and return its reply (None: answered
        later, as ``hello`` is by the hand-shake round). (Not ``handle``: that is the
        ``KVStoreServer``'s native handle.)

        Parameters
        ----------
        command : commands.Command or str
        body : dict
            The command's JSON body (docs/design.md §4.1).

        Raises
        ------
        ValueError, TypeError
            The command's refusal, which the controller sends to the worker as an error reply
            (an unknown command's included: the controller logs it as an error).
        """
        self._start()
        command = commands.Command(command)
        if not isinstance(body, dict):
            raise ValueError('command %s: its body must be a JSON object, got %.60r'
                             % (command.value, body))
        if command != Command.HELLO:   # the hello checks its own (protocol version first)
            # Required where per-rank state is kept (the hello, votes, optimizers); where
            # present, always a rank of this job.
            check_rank(body, self._job.num_workers,
                       optional=command not in (Command.VOTE, Command.OPTIMIZER))
        field(body, 'seq', int, minimum=0, optional=True)
        return self._handlers[command](body)

    def complete_round(self, key, merged, stored):
        """What the native server's updater call does when `key`'s round completes with sum
        `merged` into `stored`, raising what fails (the updater ends the process instead)."""
        # The native server frees the last push's memory once the updater returns and waits
        # only on `stored`; the sum into `merged` may still be reading that memory (a held
        # round, or the status key, never writes `stored`): finish it first.
        merged.wait_to_read()
        self._complete_round(key, merged, stored)

    def _round_without_layout(self, key, merged, stored):
        # No hand-shake: a stock 'dist_sync' worker; do what MXNet's server does. Unless it
        # is the hand-shake round of workers of another protocol version: refuse them.
        if not self._handshake.refused_round(key, stored):
            self._stock.complete_round(key, merged, stored)

    def handshake_reply(self):
        """``(ok, payload)``: what the hand-shake round answers every worker now (§4.3); on
        success it fixes the job's rescale_grad and AMP's skipping of overflowed rounds."""
        return self._handshake.reply()

    def stats(self):
        """The ``stats`` reply: rounds applied, held (and skipped, under AMP) per chunk."""
        return self.command(Command.STATS, {})

    @property
    def optimizer(self):
        """The optimizer this server applies (None before one is installed)."""
        return self._rounds.updates.optimizer

    @property
    def updater(self):
        """The ``mx.optimizer.Updater`` holding the optimizer state by chunk id (or None)."""
        return self._rounds.updates.updater

    def applied_rounds(self, chunk):
        """The number of `chunk`'s rounds applied (the next round's number)."""
        return self._rounds.applied_rounds(chunk)

    def weight(self, chunk):
        """`chunk`'s authoritative weights W (an NDArray to read; None before its first
        round)."""
        return self._rounds.weight(chunk)

    def pulled_model(self, chunk):
        """`chunk`'s pulled model x̂ of compressed pulls (numpy, to read; None without)."""
        return self._rounds.models.model(chunk)

    # -- updater: called by the native server when a key's round is complete ---------------
    def _on_round(self, key, merged, stored):
        try:
            self.complete_round(key, merged, stored)
        except Exception:  # pylint: disable=broad-except
            # Raising into ctypes would only print; a wrong server must stop the job.
            _LOG.exception('server %d: updater failed on key %d; stopping',
                           self._job.server_rank, key)
            os._exit(3)


def _both(handler, follower, body):
    # `handler`'s reply to `body`, once `follower` has taken the same command.
    reply = handler(body)
    follower(body)
    return reply


def import_server_modules():
    """Import the modules of ``MXDELAY_SERVER_IMPORTS`` (user-defined optimizers register
    themselves with MXNet there: a server runs none of the training script).

    Raises
    ------
    ImportError
        Naming the module and the fix, if one cannot be imported (before the server joins
        the job: the launcher then stops it).
    """
    for name in env.get_list('MXDELAY_SERVER_IMPORTS'):
        try:
            importlib.import_module(name)
        except ImportError as err:
            raise ImportError('MXDELAY_SERVER_IMPORTS names module %r, which this server cannot '
                              'import (%s); put its folder on the servers\' PYTHONPATH'
                              % (name, err)) from err
        _LOG.info('imported %s (MXDELAY_SERVER_IMPORTS)', name)


def serve():
    """Run mxdelay's server in this process until the workers stop it.

    Called in a process whose ``DMLC_ROLE`` is 'server' (by ``mxdelay-run`` or by
    ``import mxdelay``). Returns when rank 0's kvstore is destroyed at the end of the job.
    """
    logging.basicConfig(level=env.log_level(),  # ValueError for a name that is no level
                        format='%(asctime)s %(levelname)s %(name)s: %(message)s')
    import_server_modules()
    kvstore = mx.kv.create('dist')
    server = DelayServer(kvstore)
    _LOG.info('mxdelay server starting (%s servers, %s workers)', env.get('DMLC_NUM_SERVER'),
              env.get('DMLC_NUM_WORKER'))
    server.run()
    rank = server._job.server_rank  # pylint: disable=protected-access
    calls = kernels.compiled_calls()
    _LOG.info('mxdelay server %s stopped; compiled codec kernels: %s',
              'with no worker' if rank is None else rank,
              ', '.join('%s %d' % call for call in sorted(calls.items())) or 'none called')
