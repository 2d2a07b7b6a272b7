"""mxdelay's parameter server: the controller, its commands, and the native updater hook.

MXNet's native server runs in *sync mode*: for every key it sums the pushes until it holds
one from each of the N workers, then calls the updater once and acknowledges the N pushes.
mxdelay's worker (:class:`kvstore_ext.worker.dist_delay.DistDelay`) gives every chunk of every
tensor R *slot keys* and pushes round t into slot ``t mod R``, so the native sum of a slot
is exactly one round. This module handles the commands (:class:`kvstore_ext.protocol.commands.Command`,
on MXNet's command id 0; replies go into the requesting worker's segment of this server's
status key) and routes each completed round to :class:`kvstore_ext.server.rounds.RoundKeeper`,
which applies the optimizer once per chunk per round, in order (docs/design.md §3, §4).
A worker that never says hello (stock ``dist_sync`` without mxdelay) is served as MXNet's
own server would.
"""
import importlib
import json
import logging
import os
import pickle
import types

import numpy as np

import mxnet as mx
from mxnet.kvstore import KVStoreServer

from kvstore_ext import env
from kvstore_ext.checkpoint import files
from kvstore_ext.codecs import pulls
from kvstore_ext.protocol import commands, counter
from kvstore_ext.protocol.schedule import PullSchedule
from kvstore_ext.server import agreement, appliers, registry
# The servers build the workers' optimizer by its registered name: mxdelay's own included.
from kvstore_ext.optim import frozen_variance  # noqa: F401
from kvstore_ext.protocol.keys import KeyLayout
from kvstore_ext.optim.optimizers import (PER_STEP_FIELDS, UnknownOptimizerError,
                                          describe_optimizer, flatten_state, format_differences,
                                          optimizer_differences, whole_tensor_refusal)
from kvstore_ext.protocol.commands import Command, check_rank, field
from kvstore_ext.server.rounds import RoundKeeper

__all__ = ['DelayServer', 'serve', 'import_server_modules']

_LOG = logging.getLogger(__name__)

#: The most slots, state keys or pull keys per chunk a hello may ask for (MXDELAY_SLACK is
#: at most 256): a bound, so that a forged hello cannot make the layout absurd.
_MAX_KEYS_PER_CHUNK = 1024
#: The env variable that lets a server unpickle what a command brings (kvstore_ext.env).
_ALLOW_PICKLE = 'MXDELAY_ALLOW_PICKLE'


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
        self._server_rank = None
        self._num_workers = None
        self._layout = None            # layout.KeyLayout, from the hand-shake
        # Its slot count comes with the hand-shake; what an update that raises does is this
        # server's policy, chosen once (docs/design.md §3.2).
        self._rounds = RoundKeeper(updater_errors=appliers.UPDATER_ERRORS[
            env.get_choice('MXDELAY_UPDATER_ERRORS')]())
        self._hellos = {}              # worker rank -> hello body
        # A hello of another protocol version: what the hand-shake round tells every worker
        # (that worker's own command reply may find no status key to be written into yet).
        self._version_refusal = None
        self._status = None            # this server's status key (NDArray), from the hand-shake
        self._sent_optimizers = {}     # worker rank -> describe_optimizer of its last OPTIMIZER
        self._rescale_grad = None      # the job's rescale_grad: rank 0's at the hand-shake
        self._chunks = registry.ChunkRegistry()
        self._stock_updater = None     # for stock MXNet workers that never say hello
        self._ballots = agreement.Ballots()
        self._stock_refusal = None     # why a stock client's pickled optimizer was refused
        self._validated = None         # (LOAD body key, its validated file), until applied
        # The job's key: every command must carry its authenticator (docs/design.md §4.5).
        self._job_key = env.job_key()
        self._handlers = {
            Command.HELLO: self._on_hello,
            Command.REGISTER: self._on_register,
            Command.OPTIMIZER: self._on_optimizer,
            Command.SET_HYPER: self._on_set_hyper,
            Command.SAVE: self._on_save,
            Command.LOAD: self._on_load,
            Command.STATS: self._on_stats,
            Command.VOTE: self._on_vote,
            Command.TALLY: self._on_tally,
            Command.AUX: self._on_aux,
        }

    # -- controller ------------------------------------------------------------------------
    def _controller(self):
        def server_controller(cmd_id, cmd_body, _):
            self._start()
            rank, seq = commands.command_rank(cmd_body)
            if rank is not None and not 0 <= rank < self._num_workers:
                rank = None   # never write into another worker's reply segment, nor past them
            try:
                if cmd_id != 0:
                    raise ValueError('command id %d is not mxdelay\'s (only id 0 reaches '
                                     'the controller)' % cmd_id)
                if not cmd_body.startswith(commands.COMMAND_PREFIX.encode('ascii')):
                    self._on_stock_optimizer(cmd_body)
                    return
                reply = self.command(*commands.decode_command(cmd_body, self._job_key))
                if reply is not None:
                    self._reply(rank, True, reply, seq)
            except Exception as err:  # pylint: disable=broad-except
                # An exception must not escape into ctypes: log it and tell the worker.
                _LOG.error('server %d: command failed: %s', self._server_rank, err)
                if rank is not None and self._status is not None:
                    self._reply(rank, False, str(err), seq)
        return server_controller

    def _start(self):
        if self._server_rank is None:
            self._server_rank = self.kvstore.rank
            self._num_workers = self.kvstore.num_workers
            if self._job_key is None:
                _LOG.warning('server %d: MXDELAY_JOB_KEY is not set: mxdelay commands are '
                             'not authenticated (any process that reaches this port can send '
                             'them); mxdelay-launch sets a key per job', self._server_rank)
        if self.kvstore._updater is None:  # pylint: disable=protected-access
            # The native server needs the updater before any round completes, and it can
            # only be installed once the server runs, i.e. from here (docs/design.md §9).
            self.kvstore._set_updater(self._on_round)  # pylint: disable=protected-access

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
            The command's refusal, which the controller sends to the worker as an error reply.
        """
        self._start()
        command = commands.Command(command)
        if not isinstance(body, dict):
            raise ValueError('command %s: its body must be a JSON object, got %.60r'
                             % (command.value, body))
        if command != Command.HELLO:   # the hello checks its own (protocol version first)
            # Required where per-rank state is kept (the hello, votes, optimizers); where
            # present, always a rank of this job.
            check_rank(body, self._num_workers,
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
        if self._layout is None and self._version_refusal is not None \
                and key // self._layout_servers() == 0 \
                and stored.size == commands.reply_len(self._num_workers) * self._num_workers:
            # The hand-shake round of workers of another protocol version (their hello set
            # up no layout): refuse them, rather than answer them as a stock server would.
            self._status = stored
            for rank in range(self._num_workers):
                self._reply(rank, False, self._version_refusal)
            return
        if self._layout is None:
            # No hand-shake: a stock 'dist_sync' worker; do what MXNet's server does.
            if self._stock_refusal is not None:
                # Its optimizer was refused: applying its gradients as weights (MXNet's
                # server without an updater) would train silently wrong; stop the job.
                raise RuntimeError(self._stock_refusal)
            if self._stock_updater is None:
                merged.copyto(stored)  # MXNet's CopyFromTo, row_sparse too
            else:
                self._stock_updater(key, merged, stored)
            return
        kind, local, slot = self._layout.decode(key)
        if kind == 'status':
            self._status = stored
            ok, payload = self.handshake_reply()
            for rank in range(self._num_workers):
                self._reply(rank, ok, payload)
            return
        if local >= self._chunks.local_count():
            raise RuntimeError('key %d is chunk %d of server %d, which registered %d chunks'
                               % (key, local, self._server_rank, self._chunks.local_count()))
        chunk = self._chunks.chunk_at(local)
        if kind == 'state':
            self._rounds.copy_state(chunk, slot, stored)
            return
        if kind == 'pull':
            # The workers' round of zeros at init (kvstore_ext.codecs.fp16.push_handle_round):
            # keep the stored array, leave its value (W_0), write W into it from now on.
            self._rounds.set_pull_store(chunk, slot, stored)
            return
        if kind == 'model':
            # The workers' round of zeros at init (pulled_model.PullModelDense.after_init):
            # the compressed pulls' payloads go into this stored array.
            self._rounds.set_model_store(chunk, stored)
            return
        if self._layout.pull_keys and not self._chunks.reads_slot_keys(chunk) \
                and not self._rounds.has_pull_store(chunk, slot):
            raise RuntimeError('chunk %d slot %d completed a round before its pull key '
                               'was set up' % (chunk, slot))
        self._rounds.on_round(chunk, slot, merged, stored)

    def stats(self):
        """The ``stats`` reply: rounds applied, held (and skipped, under AMP) per chunk."""
        return self.command(Command.STATS, {})

    @property
    def optimizer(self):
        """The optimizer this server applies (None before one is installed)."""
        return self._rounds.optimizer

    @property
    def updater(self):
        """The ``mx.optimizer.Updater`` holding the optimizer state by chunk id (or None)."""
        return self._rounds.updater

    def applied_rounds(self, chunk):
        """The number of `chunk`'s rounds applied (the next round's number)."""
        return self._rounds.applied_rounds(chunk)

    def weight(self, chunk):
        """`chunk`'s authoritative weights W (an NDArray to read; None before its first
        round)."""
        return self._rounds.weight(chunk)

    def pulled_model(self, chunk):
        """`chunk`'s pulled model x̂ of compressed pulls (numpy, to read; None without)."""
        return self._rounds.model(chunk)

    def _on_stock_optimizer(self, cmd_body):
        # A stock MXNet worker ('dist_sync' without mxdelay) sends a pickled optimizer; serve
        # it exactly as MXNet's server would, but only when this server's environment opts
        # in: unpickling runs whatever code the bytes name, and any peer can send them.
        if not env.get_bool(_ALLOW_PICKLE):
            self._stock_refusal = (
                'server %s refused a command that is not mxdelay\'s (%.40r...): a stock MXNet '
                'worker\'s pickled optimizer (a stock dist_sync script with an optimizer on '
                'the kvstore), which an mxdelay server unpickles only with %s=1 in its '
                'environment (unpickling runs code: set it only on a trusted network), or '
                'use kvstore=\'dist_delay\'' % (self._server_rank, cmd_body[:40], _ALLOW_PICKLE))
            raise ValueError(self._stock_refusal)
        try:
            optimizer = pickle.loads(cmd_body)
        except Exception:  # pylint: disable=broad-except
            raise ValueError('unknown command %.60r: neither an mxdelay command nor a pickled '
                             'optimizer' % (cmd_body,)) from None
        if not isinstance(optimizer, mx.optimizer.Optimizer):
            raise ValueError('a stock command carried a %s, not an mx.optimizer.Optimizer'
                             % type(optimizer).__name__)
        self._stock_updater = mx.optimizer.get_updater(optimizer)
        _LOG.info('server %d: stock MXNet client; optimizer %s installed', self._server_rank,
                  type(optimizer).__name__)

    def _reply(self, rank, ok, payload, seq=0):
        length = commands.reply_len(self._num_workers)
        segment = self._status[rank * length:(rank + 1) * length]
        segment[:] = commands.encode_reply(ok, payload, seq, length)
        # The worker pulls right after the command returns; the native pull copies the
        # stored bytes without waiting on the engine.
        segment.wait_to_read()

    def _on_hello(self, body):
        if body.get('protocol') != commands.PROTOCOL_VERSION:
            self._version_refusal = (
                'worker %.20r speaks protocol %.20r, server %s speaks %d: install the same '
                'mxdelay version everywhere' % (body.get('rank'), body.get('protocol'),
                                                self._server_rank, commands.PROTOCOL_VERSION))
            raise ValueError(self._version_refusal)
        rank = self._check_hello(body)
        num_servers = env.get_int('DMLC_NUM_SERVER') or 1
        if self._layout is None:
            slots = body['slots']
            # float16 pushes: R pull keys per chunk, which hold W (docs/design.md §2.11)
            self._layout = KeyLayout(num_servers, slots, body.get('state_keys', 0),
                                     pull_keys=slots if body.get('wire') else 0,
                                     model_keys=body.get('model_keys', 0))
            self._rounds.set_slots(self._layout.slots)
        self._hellos[rank] = body
        return None  # answered when the hand-shake round completes

    def _check_hello(self, body):
        """The hello's rank, once every field is checked: one hello per rank (ps-lite does
        not tell the controller who sent a command, docs/design.md §4.1)."""
        rank = check_rank(body, self._num_workers)
        if rank in self._hellos:
            raise ValueError('worker rank %d said hello twice: a second process claims rank %d '
                             '(only one hello per rank is taken)' % (rank, rank))
        if field(body, 'num_workers', int, optional=True,
                 default=self._num_workers) != self._num_workers:
            raise ValueError('command field \'num_workers\' is %d, this job has %d workers'
                             % (body['num_workers'], self._num_workers))
        field(body, 'slots', int, minimum=1, maximum=_MAX_KEYS_PER_CHUNK)
        field(body, 'state_keys', int, minimum=0, maximum=_MAX_KEYS_PER_CHUNK, optional=True)
        field(body, 'model_keys', int, minimum=0, maximum=1, optional=True)
        field(body, 'wire', str, optional=True)
        field(body, 'launcher_rank', str, optional=True)
        config = field(body, 'config', dict)
        field(config, 'optimizer', dict, optional=True)
        return rank

    def handshake_reply(self):
        """``(ok, payload)``: what the hand-shake round answers every worker now (§4.3); on
        success it fixes the job's rescale_grad and AMP's skipping of overflowed rounds."""
        refusal = self._version_refusal or agreement.hello_refusal(
            self._hellos, self._num_workers, self._server_rank)
        if refusal is not None:
            return False, refusal
        reference = self._hellos[0]
        # One rescale_grad for the whole job, rank 0's (1/its first batch size): every worker
        # scales its own gradient relative to it (DistDelay.scale_gradients), so that workers
        # with other or changing batch sizes need no command and cannot rescale each other.
        optimizer = reference['config'].get('optimizer')
        self._rescale_grad = optimizer.get('rescale_grad') if optimizer else None
        # DelayedTrainer with AMP divides an overflowed round's pushes by 0: skip such
        # rounds (docs/design.md §11). Off otherwise: stock dist_sync applies them.
        self._rounds.set_skip_nonfinite(reference['config'].get('amp'))
        # Compressed pulls (docs/design.md §2.12): the servers write each pulled round's
        # payload when they apply it, so they must know which rounds are pulled.
        pull_setting = reference['config'].get('pull_compression')
        if pull_setting is not None:
            config = reference['config']
            self._rounds.set_pull_model(pulls.parse(pull_setting), PullSchedule(
                config['delay'], config['warmup_steps']))
        return True, {'server': self._server_rank, 'protocol': commands.PROTOCOL_VERSION,
                      'num_workers': self._num_workers, 'rescale_grad': self._rescale_grad}

    def _on_register(self, body):
        # Every server hears every chunk, so each knows whole tensors: refuse an optimizer
        # that needs whole-tensor norms for a tensor split into chunks, before anything of
        # this registration is kept (docs/design.md §3.4).
        self._chunks.add(
            registry.parse_entries(_checked_entries(field(body, 'chunks', list))),
            self._server_rank, body.get('rank'),
            lambda tensors: self._check_whole_tensor(self._rounds.optimizer, tensors),
            lambda chunk, info: self._rounds.register(
                chunk, info['lr_mult'], info['wd_mult'],
                counter=info['param_index'] == commands.FINISH_KEY, codec=info['codec'],
                name=info['name']))
        return {'chunks': len(self._chunks)}

    def _on_optimizer(self, body):
        # The optimizer by registry name and fields, built without pickle.
        try:
            optimizer = commands.decode_optimizer(field(body, 'optimizer', dict))
        except UnknownOptimizerError as err:
            raise ValueError(
                'server %s does not know %s %r: it is not registered in the server, which '
                'runs none of the training script; name the module that registers it in '
                'MXDELAY_SERVER_IMPORTS in the servers\' environment'
                % (self._server_rank, err.kind, err.name)) from None
        # One optimizer per job: a worker whose optimizer differs from another's is refused
        # (the hand-shake catches this already when the optimizer is set before it; this
        # catches an optimizer set later, e.g. on a bare kvstore).
        self._check_whole_tensor(optimizer, self._chunks.tensors())
        rank, described = body['rank'], describe_optimizer(optimizer)
        for other, theirs in sorted(self._sent_optimizers.items()):
            differences = optimizer_differences(theirs, described, PER_STEP_FIELDS)
            if other != rank and differences:
                raise ValueError(agreement.optimizer_mismatch(differences, 'worker %d' % other,
                                                     'worker %d' % rank))
        self._sent_optimizers[rank] = described
        # Every worker sends it (Gluon's set_optimizer): the first one installs it; later ones
        # replace it only until the first round, so that an optimizer changed before training
        # takes effect and one changed during training cannot drop the optimizer state.
        rounds = self._rounds
        if rounds.optimizer is None or not rounds.started:
            if rounds.optimizer is None:
                _LOG.info('server %d: optimizer %s installed', self._server_rank,
                          type(optimizer).__name__)
            if self._rescale_grad is not None:
                optimizer.rescale_grad = self._rescale_grad  # the job's, whoever sent it
            rounds.install(optimizer)
        # The worker compares this with its own optimizer (DistDelay._send_optimizer).
        return {'optimizer': describe_optimizer(rounds.optimizer)}

    def _check_whole_tensor(self, optimizer, tensors):
        hello = self._hellos.get(0) or next(iter(self._hellos.values()), {})
        refusal = whole_tensor_refusal(optimizer, tensors,
                                       hello.get('config', {}).get('chunk_size'),
                                       commands.bigarray_bound())
        if refusal is not None:
            raise ValueError(refusal)

    def _check_saved_optimizer(self, path, saved, expected, warn):
        """Refuse a checkpoint whose optimizer `saved` is of another type than the workers'
        `expected`; with `warn`, log the hyper-parameters that the load will change."""
        differences = agreement.saved_optimizer_differences(path, saved, expected)
        if warn and differences:
            _LOG.warning('server %d: loading %s sets the optimizer\'s %s', self._server_rank,
                         path, format_differences(differences, 'the trainer', 'the checkpoint'))

    def _on_set_hyper(self, body):
        rounds = self._rounds
        if rounds.optimizer is None:
            raise ValueError('cannot change the optimizer: no optimizer installed on server %d '
                             '(call set_optimizer first)' % self._server_rank)
        lr = field(body, 'lr', float, minimum=0, finite=True, optional=True)
        if lr is not None:
            rounds.optimizer.set_learning_rate(float(lr))
        return {'lr': rounds.optimizer.learning_rate}

    def _on_vote(self, body):
        field(body, 'ballot', int, minimum=1)
        field(body, 'error', str, optional=True)
        return self._ballots.vote(body)

    def _on_tally(self, body):
        field(body, 'ballot', int, minimum=1)
        return self._ballots.tally(body, self._num_workers)

    def _on_aux(self, body):
        # A worker's aux states for the aux chunks' next round, whose pushes are zeros
        # (quantized pushes, docs/design.md §2.13); every server hears all, keeps its own.
        rank = check_rank(body, self._num_workers)
        chunks = field(body, 'chunks', dict)
        taken = {}
        for text, values in chunks.items():
            chunk = int(text) if isinstance(text, str) and text.isdigit() else None
            if chunk is None or not isinstance(values, list) or not all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
                raise ValueError('command aux: chunks must map chunk ids to lists of numbers, '
                                 'got %.60r: %.60r' % (text, values))
            if chunk not in self._chunks:
                continue   # another server's
            if not self._chunks.is_aux(chunk) or len(values) != self._chunks.size(chunk):
                raise ValueError('command aux: chunk %d is not an aux chunk of %d elements '
                                 '(got %d values)' % (chunk, self._chunks.size(chunk),
                                                      len(values)))
            taken[chunk] = np.array(values, dtype=np.float32)
        for chunk, values in taken.items():
            self._rounds.set_aux_values(chunk, rank, values, self._num_workers)
        return {'chunks': len(taken)}

    def _on_stats(self, _):
        rounds = self._rounds
        counters = [c for c in self._chunks.ids() if self._chunks.is_counter(c)]
        return {'server': self._server_rank,
                'chunks': {str(c): dict({'rounds': rounds.applied_rounds(c),
                                         'held': rounds.held_rounds(c)},
                                        **({'skipped': rounds.skipped_rounds(c)}
                                           if rounds.skips_nonfinite else {}))
                           for c in self._chunks.ids() if c not in counters},
                'finish_rounds': {str(c): rounds.applied_rounds(c) for c in counters}}

    def _on_save(self, body):
        path = commands.check_paths(body, self._server_rank, self._layout_servers())
        field(body, 'save_id', str, optional=True)
        rounds = self._rounds
        if rounds.in_flight():
            raise ValueError('cannot save server %d while rounds are in flight; save after a '
                             'barrier' % self._server_rank)
        updater = rounds.updater
        digest = files.write_archive(path, files.SERVER, {
            'server': self._server_rank, 'num_workers': self._num_workers,
            'chunks': self._chunks.saved(rounds.chunk_state),
            # What Updater.get_states(dump_optimizer=True) pickles, as arrays and fields.
            'updater': None if updater is None else {'states': updater.states,
                                                     'optimizer': updater.optimizer},
        }, body.get('save_id'))
        return {'path': path, 'chunks': len(self._chunks), 'sha256': digest}

    def _layout_servers(self):
        if self._layout is not None:
            return self._layout.num_servers
        return env.get_int('DMLC_NUM_SERVER') or 1

    def _load_request(self, body):
        """LOAD's `body`, every field checked; return this server's path."""
        path = commands.check_paths(body, self._server_rank, self._layout_servers())
        version = field(body, 'version', int, optional=True, default=files.VERSION)
        if version not in (files.VERSION, files.LEGACY_VERSION):
            raise ValueError('command field \'version\' must be %d or %d, got %r'
                             % (files.VERSION, files.LEGACY_VERSION, version))
        for name in ('trusted', 'check_only'):
            field(body, name, bool, optional=True)
        field(body, 'optimizer', dict, optional=True)
        field(body, 'save_id', str, optional=True)
        digests = field(body, 'sha256', list, optional=True, default=[])
        if not all(isinstance(d, str) for d in digests):
            raise ValueError('command field \'sha256\' must list strings, got %.120r'
                             % (digests,))
        rounds = field(body, 'rounds', dict, optional=True, default={})
        for key, value in rounds.items():
            field(rounds, key, int, minimum=0)
        field(body, 'finish_rounds', int, minimum=0, optional=True)
        return path

    def _read_saved(self, path, body):
        """Server file `path` of a LOAD (`body`), validated as far as this file alone can be:
        ``(state, states, optimizer)`` with the updater's saved states and optimizer (None
        when saved without)."""
        rank = self._server_rank
        if body.get('version', files.VERSION) == files.LEGACY_VERSION:
            # A pickle: only when the user asked for it (load_states(..., trusted=True)) and
            # this server's own environment allows it (a command alone may not make a
            # server unpickle a file: any peer can send one).
            if body.get('trusted') is not True:
                raise ValueError('%s would be a version-1 (pickled) server state, which is read '
                                 'only with trusted=True' % path)
            if not env.get_bool(_ALLOW_PICKLE):
                raise ValueError('%s would be a version-1 (pickled) server state: server %d '
                                 'reads one only with %s=1 in its environment, besides '
                                 'trusted=True (unpickling runs code). Start the job with '
                                 '%s=1 (mxdelay-launch passes the environment on) to convert '
                                 'a checkpoint you trust' % (path, rank, _ALLOW_PICKLE,
                                                            _ALLOW_PICKLE))
            state = files.read_pickle(path, files.SERVER)
            states, optimizer = files.legacy_updater(path, state.get('updater'))
        else:
            digests = body.get('sha256')
            state = files.read_archive(
                path, files.SERVER, body.get('save_id'),
                digests[rank] if isinstance(digests, list) and len(digests) > rank else None)
            saved = state.get('updater')
            if saved is not None and (not isinstance(saved, dict)
                                      or set(saved) != {'states', 'optimizer'}):
                raise ValueError('%s: field \'updater\' is not {states, optimizer}' % path)
            states, optimizer = (None, None) if saved is None else (saved['states'],
                                                                   saved['optimizer'])
        if state.get('server') != rank:
            raise ValueError('%s holds the state of server %r, not of server %d'
                             % (path, state.get('server'), rank))
        if not isinstance(state.get('chunks'), dict):
            raise ValueError('%s: field \'chunks\' is missing or not a dict' % path)
        return state, states, optimizer

    def _check_saved_rounds(self, path, chunks, body):
        # The kvstore index (the workers' round counters) and this file must be of one save.
        if 'rounds' not in body:
            return
        for chunk, saved in sorted(chunks.items()):
            index = saved['param_index']
            expected = (body.get('finish_rounds') if index == commands.FINISH_KEY
                        else body['rounds'].get(str(index)))
            if expected != saved['next_round']:
                raise ValueError('%s: chunk %d (parameter %r) was saved at round %s, but the '
                                 'kvstore index says round %s: the files are of different saves'
                                 % (path, chunk, saved.get('name'), saved['next_round'],
                                    expected))

    def _check_saved_arrays(self, path, chunks, states, optimizer):
        """Every field the apply uses, checked before anything changes: each chunk's weight
        (size as registered, a float dtype, the dtype this server holds), rounds and storage
        type; the optimizer; the updater's states (known chunks, arrays of the weight's
        shape)."""
        rounds = self._rounds
        for chunk, saved in sorted(chunks.items()):
            where = '%s: chunk %d' % (path, chunk)
            weight = saved.get('weight')
            if weight is not None:
                if not isinstance(weight, np.ndarray) or weight.dtype.kind != 'f':
                    raise ValueError('%s: field \'weight\' is %s, not a float array'
                                     % (where, type(weight).__name__ if not isinstance(
                                         weight, np.ndarray) else weight.dtype))
                # check_saved has compared the saved size with the registered one
                if weight.size != saved['size']:
                    raise ValueError('%s: field \'weight\' has %d elements, the registered '
                                     'chunk %d' % (where, weight.size, saved['size']))
                held = rounds.weight(chunk)
                if held is not None and (np.dtype(held.dtype) != weight.dtype
                                         or tuple(held.shape) != weight.shape):
                    raise ValueError('%s: field \'weight\' is %s %s, this server holds %s %s '
                                     '(no silent cast)' % (where, weight.dtype, weight.shape,
                                                           np.dtype(held.dtype), held.shape))
            for name in ('next_round', 'skipped'):
                value = saved.get(name, 0)
                if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                    raise ValueError('%s: field %r must be an integer >= 0, got %.60r'
                                     % (where, name, value))
            if saved.get('stype', 'default') not in ('default', 'row_sparse'):
                raise ValueError('%s: field \'stype\' is %.60r' % (where, saved.get('stype')))
        if optimizer is not None and not isinstance(optimizer, mx.optimizer.Optimizer):
            raise ValueError('%s: the saved optimizer is a %s, not an mx.optimizer.Optimizer'
                             % (path, type(optimizer).__name__))
        if states is None:
            return
        if not isinstance(states, dict):
            raise ValueError('%s: the updater\'s states are a %s, not a dict by chunk'
                             % (path, type(states).__name__))
        for chunk, state in sorted(states.items(), key=lambda item: str(item[0])):
            if chunk not in chunks:
                raise ValueError('%s: the updater holds a state of chunk %r, which the file '
                                 'does not hold' % (path, chunk))
            weight = chunks[chunk].get('weight')
            try:
                arrays = flatten_state(state)
            except TypeError as err:
                raise ValueError('%s: chunk %d\'s optimizer state: %s' % (path, chunk, err)) \
                    from None
            for array in arrays:
                if weight is not None and tuple(array.shape) != weight.shape:
                    raise ValueError('%s: chunk %d\'s optimizer state has an array of shape %s, '
                                     'its weight %s' % (path, chunk, tuple(array.shape),
                                                        weight.shape))

    def _upgrade_saved_counter(self, path, chunks):
        # A file of mxdelay before the counter's exchanged element (kvstore_ext.worker.finish).
        for chunk, saved in chunks.items():
            if chunk in self._chunks and self._chunks.is_counter(chunk) \
                    and isinstance(saved, dict):
                chunks[chunk] = counter.upgrade_saved(saved, self._chunks.size(chunk))
                if chunks[chunk] is not saved:
                    _LOG.info('%s: the finish counter of %d elements (saved before its '
                              'exchanged element) converted to %d', path, saved['size'],
                              chunks[chunk]['size'])

    def _validate_load(self, path, body):
        """LOAD's check phase: read `path` and validate every field, changing nothing."""
        try:
            state, states, optimizer = self._read_saved(path, body)
            self._upgrade_saved_counter(path, state['chunks'])
            self._chunks.check_saved(path, state['chunks'])
            self._check_saved_rounds(path, state['chunks'], body)
            self._check_saved_arrays(path, state['chunks'], states, optimizer)
            self._check_saved_optimizer(path, optimizer, body.get('optimizer'),
                                        warn=not body.get('check_only'))
        except ValueError:
            raise
        except Exception as err:  # pylint: disable=broad-except
            # Any failure of the check phase is a refusal naming the file (the workers turn
            # it into the collective ValueError), never an error that skips the vote.
            raise ValueError('%s cannot be loaded (%s: %s)' % (path, type(err).__name__, err)) \
                from None
        return state, states, optimizer

    def _on_load(self, body):
        path = self._load_request(body)
        rounds = self._rounds
        # The apply takes the very objects its check validated (not the file read again),
        # when the bodies name the same files of the same save.
        key = json.dumps({k: v for k, v in body.items()
                          if k not in ('check_only', 'optimizer', 'seq', 'rank')},
                         sort_keys=True)
        if body.get('check_only'):
            self._validated = (key, self._validate_load(path, body))
            return {'path': path, 'valid': True}
        validated, self._validated = self._validated, None
        if validated is not None and validated[0] == key:
            state, states, optimizer = validated[1]
            self._check_saved_optimizer(path, optimizer, body.get('optimizer'), warn=True)
        else:
            state, states, optimizer = self._validate_load(path, body)
        # Validated: now replace the state.
        if states is not None:
            # As Updater.set_states: the saved optimizer (if saved) and its states.
            rounds.install(optimizer or rounds.optimizer)
            rounds.updater.states = states
            rounds.updater.states_synced = dict.fromkeys(states, False)
            # The saved job's rescale_grad, which the workers also restore (apply_states).
            self._rescale_grad = rounds.optimizer.rescale_grad
        for chunk, saved in state['chunks'].items():
            rounds.restore_chunk(chunk, saved['weight'], saved['next_round'],
                                 saved.get('skipped', 0), saved.get('stype', 'default'),
                                 saved.get('model'))
        return {'path': path, 'chunks': len(state['chunks'])}

    # -- updater: called by the native server when a key's round is complete ---------------
    def _on_round(self, key, merged, stored):
        try:
            self.complete_round(key, merged, stored)
        except Exception:  # pylint: disable=broad-except
            # Raising into ctypes would only print; a wrong server must stop the job.
            _LOG.exception('server %d: updater failed on key %d; stopping', self._server_rank, key)
            os._exit(3)


def _checked_entries(entries):
    """REGISTER's `entries`, each field's type and range checked (before
    :func:`registry.parse_entries` reads them): ``[chunk_id, server, param_index, name,
    lr_mult, wd_mult, size(, codec)]``."""
    for entry in entries:
        if not isinstance(entry, list) or len(entry) not in (7, 8):
            continue   # parse_entries refuses it, with the form expected
        body = dict(zip(('chunk_id', 'server', 'param_index', 'name', 'lr_mult', 'wd_mult',
                         'size'), entry))
        field(body, 'chunk_id', int, minimum=0)
        field(body, 'server', int, minimum=0)
        # The store's key: an int, or a str as MXNet allows (Module's parameter names, the
        # finish counter's commands.FINISH_KEY).
        if not isinstance(body['param_index'], str):
            field(body, 'param_index', int, minimum=0)
        field(body, 'name', str)
        for name in ('lr_mult', 'wd_mult'):
            field(body, name, float, finite=True)
        field(body, 'size', int, minimum=1)   # the codec: parse_entries checks it
    return entries


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
    _LOG.info('mxdelay server %s stopped', 'with no worker' if server._server_rank is None
              else server._server_rank)
