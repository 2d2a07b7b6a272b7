"""mxdelay's parameter server: the controller, its commands, and the native updater hook.

MXNet's native server runs in *sync mode*: for every key it sums the pushes until it holds
one from each of the N workers, then calls the updater once and acknowledges the N pushes.
mxdelay's worker (:class:`kvstore_ext.dist_delay.DistDelay`) gives every chunk of every
tensor R *slot keys* and pushes round t into slot ``t mod R``, so the native sum of a slot
is exactly one round. This module handles the commands (:class:`kvstore_ext.protocol.Command`,
on MXNet's command id 0; replies go into the requesting worker's segment of this server's
status key) and routes each completed round to :class:`kvstore_ext.rounds.RoundKeeper`,
which applies the optimizer once per chunk per round, in order (docs/design.md §3, §4).
A worker that never says hello (stock ``dist_sync`` without mxdelay) is served as MXNet's
own server would.
"""
import logging
import os
import pickle
import types

import mxnet as mx
from mxnet.kvstore import KVStoreServer

from . import agreement, checkpoint, env, protocol, pull_codecs, registry
from .layout import KeyLayout
from .optimizers import (PER_STEP_FIELDS, describe_optimizer, format_differences,
                         optimizer_differences, whole_tensor_refusal)
from .protocol import Command
from .rounds import RoundKeeper

__all__ = ['DelayServer', 'serve']

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
        self._server_rank = None
        self._num_workers = None
        self._layout = None            # layout.KeyLayout, from the hand-shake
        self._rounds = RoundKeeper()   # its slot count comes with the hand-shake
        self._hellos = {}              # worker rank -> hello body
        self._status = None            # this server's status key (NDArray), from the hand-shake
        self._sent_optimizers = {}     # worker rank -> describe_optimizer of its last OPTIMIZER
        self._rescale_grad = None      # the job's rescale_grad: rank 0's at the hand-shake
        self._chunks = registry.ChunkRegistry()
        self._stock_updater = None     # for stock MXNet workers that never say hello
        self._ballots = agreement.Ballots()
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
        }

    # -- controller ------------------------------------------------------------------------
    def _controller(self):
        def server_controller(cmd_id, cmd_body, _):
            self._start()
            rank, seq = protocol.command_rank(cmd_body)
            try:
                if cmd_id != 0:
                    raise ValueError('command id %d is not mxdelay\'s (only id 0 reaches '
                                     'the controller)' % cmd_id)
                if not cmd_body.startswith(protocol.COMMAND_PREFIX.encode('ascii')):
                    self._on_stock_optimizer(cmd_body)
                    return
                reply = self.command(*protocol.decode_command(cmd_body))
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
        command : protocol.Command or str
        body : dict
            The command's JSON body (docs/design.md §4.1).

        Raises
        ------
        ValueError, TypeError
            The command's refusal, which the controller sends to the worker as an error reply.
        """
        self._start()
        return self._handlers[protocol.Command(command)](body)

    def complete_round(self, key, merged, stored):
        """What the native server's updater call does when `key`'s round completes with sum
        `merged` into `stored`, raising what fails (the updater ends the process instead)."""
        # The native server frees the last push's memory once the updater returns and waits
        # only on `stored`; the sum into `merged` may still be reading that memory (a held
        # round, or the status key, never writes `stored`): finish it first.
        merged.wait_to_read()
        if self._layout is None:
            # No hand-shake: a stock 'dist_sync' worker; do what MXNet's server does.
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
            # The workers' round of zeros at init (kvstore_ext.wire.push_handle_round):
            # keep the stored array, leave its value (W_0), write W into it from now on.
            self._rounds.set_pull_store(chunk, slot, stored)
            return
        if kind == 'model':
            # The workers' round of zeros at init (pull_codecs.PullModelDense.after_init):
            # the compressed pulls' payloads go into this stored array.
            self._rounds.set_model_store(chunk, stored)
            return
        if self._layout.pull_keys and not self._chunks.is_counter(chunk) \
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
        # it exactly as MXNet's server would, so `import mxdelay` breaks no stock script.
        try:
            optimizer = pickle.loads(cmd_body)
        except Exception:  # pylint: disable=broad-except
            raise ValueError('unknown command %.60r: neither an mxdelay command nor a pickled '
                             'optimizer' % (cmd_body,)) from None
        self._stock_updater = mx.optimizer.get_updater(optimizer)
        _LOG.info('server %d: stock MXNet client; optimizer %s installed', self._server_rank,
                  type(optimizer).__name__)

    def _reply(self, rank, ok, payload, seq=0):
        length = protocol.reply_len(self._num_workers)
        segment = self._status[rank * length:(rank + 1) * length]
        segment[:] = protocol.encode_reply(ok, payload, seq, length)
        # The worker pulls right after the command returns; the native pull copies the
        # stored bytes without waiting on the engine.
        segment.wait_to_read()

    def _on_hello(self, body):
        if body.get('protocol') != protocol.PROTOCOL_VERSION:
            raise ValueError('worker speaks protocol %s, this server %d: install the same '
                             'mxdelay version everywhere' % (body.get('protocol'),
                                                             protocol.PROTOCOL_VERSION))
        num_servers = env.get_int('DMLC_NUM_SERVER') or 1
        if self._layout is None:
            slots = int(body['slots'])
            # float16 pushes: R pull keys per chunk, which hold W (docs/design.md §2.11)
            self._layout = KeyLayout(num_servers, slots, int(body.get('state_keys', 0)),
                                     pull_keys=slots if body.get('wire') else 0,
                                     model_keys=int(body.get('model_keys', 0)))
            self._rounds.set_slots(self._layout.slots)
        self._hellos[int(body['rank'])] = body
        return None  # answered when the hand-shake round completes

    def handshake_reply(self):
        """``(ok, payload)``: what the hand-shake round answers every worker now (§4.3); on
        success it fixes the job's rescale_grad and AMP's skipping of overflowed rounds."""
        refusal = agreement.hello_refusal(self._hellos, self._num_workers, self._server_rank)
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
        pulls = reference['config'].get('pull_compression')
        if pulls is not None:
            config = reference['config']
            self._rounds.set_pull_model(pull_codecs.parse(pulls), pull_codecs.PullSchedule(
                config['delay'], config['warmup_steps']))
        return True, {'server': self._server_rank, 'protocol': protocol.PROTOCOL_VERSION,
                      'num_workers': self._num_workers, 'rescale_grad': self._rescale_grad}

    def _on_register(self, body):
        # Every server hears every chunk, so each knows whole tensors: refuse an optimizer
        # that needs whole-tensor norms for a tensor split into chunks, before anything of
        # this registration is kept (docs/design.md §3.4).
        self._chunks.add(
            registry.parse_entries(body['chunks']), self._server_rank, body.get('rank'),
            lambda tensors: self._check_whole_tensor(self._rounds.optimizer, tensors),
            lambda chunk, info: self._rounds.register(
                chunk, info['lr_mult'], info['wd_mult'],
                counter=info['param_index'] == protocol.FINISH_KEY, codec=info['codec']))
        return {'chunks': len(self._chunks)}

    def _on_optimizer(self, body):
        optimizer = protocol.unpack_object(body['optimizer'])
        if not isinstance(optimizer, mx.optimizer.Optimizer):
            raise TypeError('optimizer command carried a %s, not an mx.optimizer.Optimizer'
                            % type(optimizer).__name__)
        # One optimizer per job: a worker whose optimizer differs from another's is refused
        # (the hand-shake catches this already when the optimizer is set before it; this
        # catches an optimizer set later, e.g. on a bare kvstore).
        self._check_whole_tensor(optimizer, self._chunks.tensors())
        rank, described = int(body['rank']), describe_optimizer(optimizer)
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
                                       protocol.bigarray_bound())
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
        if 'lr' in body:
            rounds.optimizer.set_learning_rate(float(body['lr']))
        return {'lr': rounds.optimizer.learning_rate}

    def _on_vote(self, body):
        return self._ballots.vote(body)

    def _on_tally(self, body):
        return self._ballots.tally(body, self._num_workers)

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
        path = body['paths'][self._server_rank]
        rounds = self._rounds
        if rounds.in_flight():
            raise ValueError('cannot save server %d while rounds are in flight; save after a '
                             'barrier' % self._server_rank)
        updater = rounds.updater
        digest = checkpoint.write_archive(path, checkpoint.SERVER, {
            'server': self._server_rank, 'num_workers': self._num_workers,
            'chunks': self._chunks.saved(rounds.chunk_state),
            # What Updater.get_states(dump_optimizer=True) pickles, as arrays and fields.
            'updater': None if updater is None else {'states': updater.states,
                                                     'optimizer': updater.optimizer},
        }, body.get('save_id'))
        return {'path': path, 'chunks': len(self._chunks), 'sha256': digest}

    def _read_saved(self, path, body):
        """Server file `path` of a LOAD (`body`), validated as far as this file alone can be:
        ``(state, states, optimizer)`` with the updater's saved states and optimizer (None
        when saved without)."""
        rank = self._server_rank
        if body.get('version', checkpoint.VERSION) == checkpoint.LEGACY_VERSION:
            # A pickle: only when the user asked for it (load_states(..., trusted=True)).
            if body.get('trusted') is not True:
                raise ValueError('%s would be a version-1 (pickled) server state, which is read '
                                 'only with trusted=True' % path)
            state = checkpoint.read_pickle(path, checkpoint.SERVER)
            states, optimizer = checkpoint.legacy_updater(path, state['updater'])
        else:
            digests = body.get('sha256')
            state = checkpoint.read_archive(
                path, checkpoint.SERVER, body.get('save_id'),
                digests[rank] if isinstance(digests, list) and len(digests) > rank else None)
            saved = state.get('updater')
            states, optimizer = (None, None) if saved is None else (saved['states'],
                                                                   saved['optimizer'])
        if state['server'] != rank:
            raise ValueError('%s holds the state of server %d, not of server %d'
                             % (path, state['server'], rank))
        return state, states, optimizer

    def _check_saved_rounds(self, path, chunks, body):
        # The kvstore index (the workers' round counters) and this file must be of one save.
        if 'rounds' not in body:
            return
        for chunk, saved in sorted(chunks.items()):
            index = saved['param_index']
            expected = (body.get('finish_rounds') if index == protocol.FINISH_KEY
                        else body['rounds'].get(str(index)))
            if expected != saved['next_round']:
                raise ValueError('%s: chunk %d (parameter %r) was saved at round %s, but the '
                                 'kvstore index says round %s: the files are of different saves'
                                 % (path, chunk, saved.get('name'), saved['next_round'],
                                    expected))

    def _on_load(self, body):
        path = body['paths'][self._server_rank]
        rounds = self._rounds
        state, states, optimizer = self._read_saved(path, body)
        self._chunks.check_saved(path, state['chunks'])
        self._check_saved_rounds(path, state['chunks'], body)
        self._check_saved_optimizer(path, optimizer, body.get('optimizer'),
                                    warn=not body.get('check_only'))
        if body.get('check_only'):
            return {'path': path, 'valid': True}
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


def serve():
    """Run mxdelay's server in this process until the workers stop it.

    Called in a process whose ``DMLC_ROLE`` is 'server' (by ``mxdelay-run`` or by
    ``import mxdelay``). Returns when rank 0's kvstore is destroyed at the end of the job.
    """
    logging.basicConfig(level=env.log_level(),  # ValueError for a name that is no level
                        format='%(asctime)s %(levelname)s %(name)s: %(message)s')
    kvstore = mx.kv.create('dist')
    server = DelayServer(kvstore)
    _LOG.info('mxdelay server starting (%s servers, %s workers)', env.get('DMLC_NUM_SERVER'),
              env.get('DMLC_NUM_WORKER'))
    server.run()
    _LOG.info('mxdelay server %s stopped', 'with no worker' if server._server_rank is None
              else server._server_rank)
