"""mxdelay's parameter server: claim 4's server flow with exact rounds.

MXNet's native server runs in *sync mode*: for every key it sums the pushes until it holds
one from each of the N workers, then calls the updater once and acknowledges the N pushes.
mxdelay's worker (:class:`kvstore_ext.DistDelay`) gives every chunk of every tensor R
*slot keys* and pushes round t into slot ``t mod R``, so the native sum of a slot is exactly
one round (a worker's next push into a slot waits for the slot's previous round to be
acknowledged). This controller's updater turns slot completions back into one global update
per chunk per round:

- it keeps the authoritative weights ``W`` and the optimizer state of every chunk;
- when round t of chunk c completes (in slot ``t mod R``) it applies the optimizer once to
  ``W`` with the round's summed gradient and writes ``W_{t+1}`` into that slot's stored
  value, which the native server returns to every pull of the slot;
- rounds are applied in order: a round that completes before an earlier one (a worker's
  engine may send two pushes of different slots out of order) is held until the earlier
  rounds are applied, and the worker's pull waits for all earlier rounds (see
  ``DistDelay.pull``), so a pull after round t returns exactly ``W_{t+1}``.

Memory per chunk of n floats: the native server's R stored values and R merge buffers, the
authoritative weights, the optimizer state (n per momentum buffer), plus a copy of a round's
gradient while it waits for an earlier round: (2R + 1 + state) * n floats.

Commands (:class:`kvstore_ext.protocol.Command`) arrive on MXNet's command id 0; replies go
into the requesting worker's segment of this server's status key.
"""
import logging
import os
import pickle
import types

import mxnet as mx
from mxnet.kvstore import KVStoreServer

from mxdelay import env
from . import protocol
from .protocol import Command
from .state_files import atomic_write, read_pickle_state

__all__ = ['DelayServer', 'serve', 'SERVER_STATE_FORMAT']

_LOG = logging.getLogger(__name__)
SERVER_STATE_FORMAT = 'mxdelay-server-state'
_MAX_ERROR = 600   # characters of one worker's error message in a tally
_STATE_VERSION = 1


class DelayServer(KVStoreServer):
    """A ``KVStoreServer`` whose controller and updater implement mxdelay's server flow.

    Parameters
    ----------
    kvstore : mxnet.kvstore.KVStore
        The native distributed store of this server process (``mx.kv.create('dist')``).
    """

    def __init__(self, kvstore):
        super(DelayServer, self).__init__(kvstore)
        # ps-lite answers rank and group size only once the server runs (before: segfault).
        self._server_rank = None
        self._num_workers = None
        self._layout = None            # protocol.KeyLayout, from the hand-shake
        self._hellos = {}              # worker rank -> hello body
        self._status = None            # this server's status key (NDArray), from the hand-shake
        self._optimizer = None
        self._sent_optimizers = {}     # worker rank -> describe_optimizer of its last OPTIMIZER
        self._rescale_grad = None      # the job's rescale_grad: rank 0's at the hand-shake
        self._updater = None           # mx.optimizer.Updater over chunk ids
        self._chunks = {}              # chunk id -> registration dict
        self._counters = set()         # chunk ids of the finish counter (stores round sums)
        self._weights = {}             # chunk id -> authoritative weights W
        self._next_round = {}          # chunk id -> round whose completion is applied next
        self._slot_round = {}          # (chunk, slot) -> round of the slot's next completion
        self._held = {}                # chunk id -> {round: (gradient copy, stored)}
        self._stock_updater = None     # for stock MXNet workers that never say hello
        self._ballots = {}             # ballot -> {rank: error or None}
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
            if self._server_rank is None:
                self._server_rank = self.kvstore.rank
                self._num_workers = self.kvstore.num_workers
            if self._updater_not_installed():
                # The native server needs the updater before any round completes, and it can
                # only be installed once the server runs, i.e. from here (SPEC section 3).
                self.kvstore._set_updater(self._on_round)
            rank, seq = protocol.command_rank(cmd_body)
            try:
                if cmd_id != 0:
                    raise ValueError('command id %d is not mxdelay\'s (only id 0 reaches '
                                     'the controller)' % cmd_id)
                if not cmd_body.startswith(protocol.COMMAND_PREFIX.encode('ascii')):
                    self._on_stock_optimizer(cmd_body)
                    return
                command, body = protocol.decode_command(cmd_body)
                reply = self._handlers[command](body)
                if reply is not None:
                    self._reply(rank, True, reply, seq)
            except Exception as err:  # pylint: disable=broad-except
                # An exception must not escape into ctypes: log it and tell the worker.
                _LOG.error('server %d: command failed: %s', self._server_rank, err)
                if rank is not None and self._status is not None:
                    self._reply(rank, False, str(err), seq)
        return server_controller

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

    def _updater_not_installed(self):
        return self.kvstore._updater is None

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
        self._layout = protocol.KeyLayout(num_servers, int(body['slots']))
        self._hellos[int(body['rank'])] = body
        return None  # answered when the hand-shake round completes

    def _hello_reply(self):
        reference = self._hellos.get(0)
        if len(self._hellos) != self._num_workers or reference is None:
            return False, ('server %d heard hellos from workers %s, expected ranks 0..%d'
                           % (self._server_rank, sorted(self._hellos), self._num_workers - 1))
        for rank, hello in sorted(self._hellos.items()):
            for name in sorted(set(reference['config']) | set(hello['config'])):
                mine, theirs = reference['config'].get(name), hello['config'].get(name)
                if name == 'optimizer':
                    differences = protocol.optimizer_differences(mine, theirs,
                                                                 protocol.PER_STEP_FIELDS)
                    if differences:
                        return False, _optimizer_mismatch(
                            differences, 'worker 0%s' % _launcher_rank(reference),
                            'worker %d%s' % (rank, _launcher_rank(hello)))
                elif mine != theirs:
                    return False, ('workers disagree on %s: worker 0%s has %r, worker %d%s has '
                                   '%r; start every worker with the same settings'
                                   % (name, _launcher_rank(reference), mine, rank,
                                      _launcher_rank(hello), theirs))
        # One rescale_grad for the whole job, rank 0's (1/its first batch size): every worker
        # scales its own gradient relative to it (DistDelay.scale_gradients), so that workers
        # with other or changing batch sizes need no command and cannot rescale each other.
        optimizer = reference['config'].get('optimizer')
        self._rescale_grad = optimizer.get('rescale_grad') if optimizer else None
        return True, {'server': self._server_rank, 'protocol': protocol.PROTOCOL_VERSION,
                      'num_workers': self._num_workers, 'rescale_grad': self._rescale_grad}

    def _on_register(self, body):
        for chunk, server, param_index, name, lr_mult, wd_mult, size in body['chunks']:
            if server != self._server_rank:
                continue
            info = {'param_index': param_index, 'name': name, 'lr_mult': lr_mult,
                    'wd_mult': wd_mult, 'size': size}
            known = self._chunks.setdefault(chunk, info)
            if param_index == protocol.FINISH_KEY:
                self._counters.add(chunk)
            if known != info:
                raise ValueError('worker %s registers chunk %d as %r but another worker as %r: '
                                 'every worker must build the same model'
                                 % (body.get('rank'), chunk, info, known))
        self._attach_param_dict()
        return {'chunks': len(self._chunks)}

    def _attach_param_dict(self):
        # The optimizer keys its state by chunk id; lr_mult and wd_mult come from the worker's
        # Parameters (MXNet's stock server loses them: param_dict is not pickled).
        if self._optimizer is not None:
            self._optimizer.param_dict = {
                chunk: types.SimpleNamespace(lr_mult=info['lr_mult'], wd_mult=info['wd_mult'])
                for chunk, info in self._chunks.items()}

    def _on_optimizer(self, body):
        optimizer = protocol.unpack_object(body['optimizer'])
        if not isinstance(optimizer, mx.optimizer.Optimizer):
            raise TypeError('optimizer command carried a %s, not an mx.optimizer.Optimizer'
                            % type(optimizer).__name__)
        # One optimizer per job: a worker whose optimizer differs from another's is refused
        # (the hand-shake catches this already when the optimizer is set before it; this
        # catches an optimizer set later, e.g. on a bare kvstore).
        rank, described = int(body['rank']), protocol.describe_optimizer(optimizer)
        for other, theirs in sorted(self._sent_optimizers.items()):
            differences = protocol.optimizer_differences(theirs, described,
                                                         protocol.PER_STEP_FIELDS)
            if other != rank and differences:
                raise ValueError(_optimizer_mismatch(differences, 'worker %d' % other,
                                                     'worker %d' % rank))
        self._sent_optimizers[rank] = described
        # Every worker sends it (Gluon's set_optimizer): the first one installs it; later ones
        # replace it only until the first round, so that an optimizer changed before training
        # takes effect and one changed during training cannot drop the optimizer state.
        if self._optimizer is None or not self._weights:
            if self._optimizer is None:
                _LOG.info('server %d: optimizer %s installed', self._server_rank,
                          type(optimizer).__name__)
            self._optimizer = optimizer
            if self._rescale_grad is not None:
                optimizer.rescale_grad = self._rescale_grad  # the job's, whoever sent it
            self._install_updater()
        # The worker compares this with its own optimizer (DistDelay._send_optimizer).
        return {'optimizer': protocol.describe_optimizer(self._optimizer)}

    def _check_saved_optimizer(self, path, state, expected, warn):
        """Refuse a state whose optimizer is of another type than the workers' `expected`
        (a describe_optimizer dict, None: not checked); with `warn`, log the hyper-parameters
        that the load will change (the saved ones take effect, as in gluon.Trainer)."""
        if expected is None or state['updater'] is None:
            return
        try:
            saved = pickle.loads(state['updater'])
        except Exception as err:  # pylint: disable=broad-except
            raise ValueError('%s: the saved optimizer state cannot be read (%s: %s); it may be '
                             'truncated' % (path, type(err).__name__, err)) from None
        saved = saved[1] if isinstance(saved, tuple) and len(saved) == 2 else None
        if not isinstance(saved, mx.optimizer.Optimizer):
            return  # saved without the optimizer: the current one stays
        described = protocol.describe_optimizer(saved)
        if described['type'] != expected.get('type'):
            raise ValueError(
                '%s was saved with optimizer %s, but the trainer loading it uses %s: its state '
                '(e.g. momentum buffers) cannot drive %s. Create the trainer with the '
                'checkpoint\'s optimizer (%r) to resume from it, or start without loading it'
                % (path, described['type'], expected.get('type'), expected.get('type'),
                   described['type'].lower()))
        differences = protocol.optimizer_differences(expected, described)
        if warn and differences:
            _LOG.warning('server %d: loading %s sets the optimizer\'s %s', self._server_rank,
                         path, protocol.format_differences(differences, 'the trainer',
                                                           'the checkpoint'))

    def _install_updater(self, states=None):
        """Install an updater for the current optimizer, or for the one in saved `states`."""
        updater = mx.optimizer.get_updater(self._optimizer or mx.optimizer.SGD())
        if states is not None:
            updater.set_states(states)  # also restores the saved optimizer
        self._updater, self._optimizer = updater, updater.optimizer
        self._attach_param_dict()

    def _on_set_hyper(self, body):
        self._require_optimizer('change the optimizer')
        if 'lr' in body:
            self._optimizer.set_learning_rate(float(body['lr']))
        return {'lr': self._optimizer.learning_rate}

    def _require_optimizer(self, what):
        if self._optimizer is None:
            raise ValueError('cannot %s: no optimizer installed on server %d (call '
                             'set_optimizer first)' % (what, self._server_rank))

    def _on_vote(self, body):
        ballot = int(body['ballot'])
        self._ballots.setdefault(ballot, {})[int(body['rank'])] = body.get('error')
        for old in [b for b in self._ballots if b < ballot - 1]:
            del self._ballots[old]   # every worker has tallied those
        return {'ballot': ballot}

    def _on_tally(self, body):
        votes = self._ballots.get(int(body['ballot']), {})
        if len(votes) != self._num_workers:
            raise ValueError('ballot %s has votes from workers %s only'
                             % (body['ballot'], sorted(votes)))
        # Every failure's message, as long as the reply has room (many workers failing alike
        # would not fit): the rest are counted. Every worker reads the same reply.
        room = protocol.reply_len(self._num_workers) // 2
        errors, more = {}, 0
        for rank, error in sorted(votes.items()):
            if error and room > 0:
                errors[str(rank)] = error[:_MAX_ERROR]
                room -= len(errors[str(rank)].encode('utf-8')) + 32
            elif error:
                more += 1
        return {'errors': errors, 'more': more}

    def _on_stats(self, _):
        return {'server': self._server_rank,
                'chunks': {str(c): {'rounds': self._next_round.get(c, 0),
                                    'held': len(self._held.get(c, {}))}
                           for c in sorted(self._chunks) if c not in self._counters},
                'finish_rounds': {str(c): self._next_round.get(c, 0) for c in self._counters}}

    def _on_save(self, body):
        path = body['paths'][self._server_rank]
        if any(self._held.values()):
            raise ValueError('cannot save server %d while rounds are in flight; save after a '
                             'barrier' % self._server_rank)
        state = {
            'format': SERVER_STATE_FORMAT, 'version': _STATE_VERSION,
            'server': self._server_rank, 'num_workers': self._num_workers,
            'chunks': {c: dict(info, weight=self._weights[c].asnumpy() if c in self._weights
                               else None, next_round=self._next_round.get(c, 0))
                       for c, info in self._chunks.items()},
            'updater': self._updater.get_states(dump_optimizer=True) if self._updater else None,
        }
        atomic_write(path, pickle.dumps(state, protocol=4))
        return {'path': path, 'chunks': len(self._chunks)}

    def _on_load(self, body):
        path = body['paths'][self._server_rank]
        state = read_server_state(path)
        if state['server'] != self._server_rank:
            raise ValueError('%s holds the state of server %d, not of server %d'
                             % (path, state['server'], self._server_rank))
        if set(state['chunks']) != set(self._chunks):
            raise ValueError('%s holds chunks %s, this server has %s: the model differs from '
                             'the one that was saved' % (path, sorted(state['chunks']),
                                                         sorted(self._chunks)))
        for chunk, saved in state['chunks'].items():
            info = {k: saved[k] for k in ('param_index', 'name', 'lr_mult', 'wd_mult', 'size')}
            if info != self._chunks[chunk]:
                raise ValueError('%s: chunk %d was %r when saved, is %r now'
                                 % (path, chunk, info, self._chunks[chunk]))
        self._check_saved_optimizer(path, state, body.get('optimizer'),
                                    warn=not body.get('check_only'))
        if body.get('check_only'):
            return {'path': path, 'valid': True}
        # Validated: now replace the state.
        if state['updater'] is not None:
            self._install_updater(state['updater'])
            # The saved job's rescale_grad, which the workers also restore (apply_states).
            self._rescale_grad = self._optimizer.rescale_grad
        for chunk, saved in state['chunks'].items():
            if saved['weight'] is not None:
                self._weights[chunk] = mx.nd.array(saved['weight'], dtype=saved['weight'].dtype)
            self._next_round[chunk] = saved['next_round']
            self._held.pop(chunk, None)
            for slot in range(self._layout.slots):
                self._slot_round.pop((chunk, slot), None)
        return {'path': path, 'chunks': len(state['chunks'])}

    # -- updater: called by the native server when a key's round is complete ---------------
    def _on_round(self, key, merged, stored):
        # The native server frees the last push's memory once this returns and waits only on
        # `stored`; the sum into `merged` may still be reading that memory (a held round, or
        # the status key, never writes `stored`): finish it first.
        merged.wait_to_read()
        try:
            if self._layout is None:
                # No hand-shake: a stock 'dist_sync' worker; do what MXNet's server does.
                if self._stock_updater is None:
                    stored[:] = merged
                else:
                    self._stock_updater(key, merged, stored)
                return
            kind, chunk, slot = self._layout.decode(key)
            if kind == 'status':
                self._status = stored
                ok, payload = self._hello_reply()
                for rank in range(self._num_workers):
                    self._reply(rank, ok, payload)
                return
            self._on_chunk_round(chunk, slot, merged, stored)
        except Exception:  # pylint: disable=broad-except
            # Raising into ctypes would only print; a wrong server must stop the job.
            _LOG.exception('server %d: updater failed on key %d; stopping', self._server_rank, key)
            os._exit(3)

    def _on_chunk_round(self, chunk, slot, merged, stored):
        slots = self._layout.slots
        next_round = self._next_round.setdefault(chunk, 0)
        if chunk not in self._weights:
            # Every slot was initialised with the same initial value.
            self._weights[chunk] = stored.copy()
        rnd = self._slot_round.get((chunk, slot))
        if rnd is None:
            rnd = next_round + (slot - next_round) % slots
        self._slot_round[(chunk, slot)] = rnd + slots
        if rnd != next_round:
            self._held.setdefault(chunk, {})[rnd] = (merged.copy(), stored)
            _LOG.debug('server %d: chunk %d round %d completed before round %d; held',
                       self._server_rank, chunk, rnd, next_round)
            return
        self._apply(chunk, merged, stored)
        held = self._held.get(chunk, {})
        while self._next_round[chunk] in held:
            grad, later_stored = held.pop(self._next_round[chunk])
            self._apply(chunk, grad, later_stored)
            later_stored.wait_to_read()

    def _apply(self, chunk, grad, stored):
        weight = self._weights[chunk]
        # copyto, not `a[:] = b`: the same copy without Python's indexing machinery, which
        # cost a third of the server's updater time (profiled with py-spy).
        if self._updater is None or chunk in self._counters:
            grad.copyto(weight)  # the round's sum: MXNet's server without optimizer; the counter
        elif _is_plain_sgd(self._optimizer):
            self._sgd(chunk, grad, weight)
        else:
            self._updater(chunk, grad, weight)
        weight.copyto(stored)
        self._next_round[chunk] += 1

    def _sgd(self, chunk, grad, weight):
        # optimizer.SGD always takes MXNet's multi-tensor kernels, which are 3x slower on CPU
        # for one tensor than sgd_mom_update (6.3 ms vs 2.2 ms on 1.86M floats, measured);
        # with momentum both do the same arithmetic. The state lives in the updater, so that
        # saving and loading it is unchanged.
        opt, updater = self._optimizer, self._updater
        if chunk not in updater.states:
            updater.states[chunk] = opt.create_state(chunk, weight)
            updater.states_synced[chunk] = True
        opt._update_count(chunk)  # pylint: disable=protected-access
        kwargs = {'lr': opt._get_lr(chunk), 'wd': opt._get_wd(chunk),  # pylint: disable=protected-access
                  'rescale_grad': opt.rescale_grad}
        if opt.clip_gradient:
            kwargs['clip_gradient'] = opt.clip_gradient
        momentum = updater.states[chunk]
        if momentum is not None:
            mx.nd.sgd_mom_update(weight, grad, momentum, out=weight, momentum=opt.momentum,
                                 **kwargs)
        else:
            mx.nd.sgd_update(weight, grad, out=weight, **kwargs)


def _optimizer_mismatch(differences, first_name, second_name):
    return ('workers disagree on the optimizer: %s. Every worker must create the same '
            'optimizer (type and hyper-parameters): the servers apply one optimizer to the '
            'sum of all workers\' gradients' % protocol.format_differences(
                differences, first_name, second_name))


def _launcher_rank(hello):
    rank = hello.get('launcher_rank')
    return '' if rank is None else " (mxdelay-launch's worker %s)" % rank


def _is_plain_sgd(optimizer):
    return type(optimizer) is mx.optimizer.SGD and not optimizer.multi_precision  # noqa: E721


def read_server_state(path):
    """Read and validate a server state file; raise ValueError saying what is wrong."""
    state = read_pickle_state(path, SERVER_STATE_FORMAT, 'server state')
    if state.get('version') != _STATE_VERSION:
        raise ValueError('%s has state version %r; this mxdelay reads version %d'
                         % (path, state.get('version'), _STATE_VERSION))
    return state


def serve():
    """Run mxdelay's server in this process until the workers stop it.

    Called in a process whose ``DMLC_ROLE`` is 'server' (by ``mxdelay-run`` or by
    ``import mxdelay``). Returns when rank 0's kvstore is destroyed at the end of the job.
    """
    level = getattr(logging, env.get('MXDELAY_LOG_LEVEL').upper(), logging.INFO)
    logging.basicConfig(level=level, format='%(asctime)s %(levelname)s %(name)s: %(message)s')
    kvstore = mx.kv.create('dist')
    server = DelayServer(kvstore)
    _LOG.info('mxdelay server starting (%s servers, %s workers)', env.get('DMLC_NUM_SERVER'),
              env.get('DMLC_NUM_WORKER'))
    server.run()
    _LOG.info('mxdelay server %s stopped', 'with no worker' if server._server_rank is None
              else server._server_rank)
