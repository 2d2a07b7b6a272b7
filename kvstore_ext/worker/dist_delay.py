"""The ``'dist_delay'`` kvstore: MXNet's native distributed store with exact rounds.

:class:`DistDelay` is the ``KVStoreBase`` face and the trainer's extension surface; its parts
(docs/design.md §2):

- :mod:`kvstore_ext.worker.layout`: keys, chunks and the slot buffers. Every chunk of every tensor
  has R = slack + 1 keys on one server and round t goes to slot ``t mod R``: the native
  server's sum of a slot is exactly one round, a worker runs at most ``slack`` rounds ahead
  of the slowest, and each slot has its own send buffer (so a gradient is never held by a
  pending push, and a pull never lands in a gradient).
- the key kinds, one data path each, chosen at ``init``: the wire of the codec's dense keys
  with its pull strategy (:mod:`kvstore_ext.worker.wires`), :mod:`kvstore_ext.worker.sparse`
  and :mod:`kvstore_ext.worker.aux_states` (aux states, averaged by :meth:`DistDelay.average`);
- the codec, chosen by ``set_gradient_compression`` (:mod:`kvstore_ext.codecs`);
- :mod:`kvstore_ext.worker.channel`: the connection to the servers (hand-shake, commands, the
  optimizer, votes);
- :mod:`kvstore_ext.worker.statefetch`: the optimizer-state fetch;
- :mod:`kvstore_ext.worker.store_checkpoint`: checkpoints, saved and loaded in agreement;
- :mod:`kvstore_ext.worker.finish`: the finish counter of uneven data and AMP's flags;
- :mod:`kvstore_ext.worker.hooks`, :mod:`kvstore_ext.worker.gluon_sparse`, :mod:`kvstore_ext.worker.module_path`:
  the registry entry, the worker's exit, and what Gluon and Module need.

A pull after round t is ordered behind every earlier round (:meth:`DenseWire.pull
<kvstore_ext.worker.wires.base.DenseWire.pull>`), and the server applies rounds in order
(:mod:`kvstore_ext.server.rounds`), so it returns exactly the weights after round t.
"""
import json
import logging

import numpy as np
import mxnet as mx
from mxnet import nd
from mxnet.kvstore import KVStoreBase

from kvstore_ext import codecs, env
from kvstore_ext.codecs import pulls
from kvstore_ext.protocol.schedule import PullSchedule
from kvstore_ext.protocol import commands
from kvstore_ext.worker import gluon_sparse, hooks, module_path, sparse, store_checkpoint, wires
from kvstore_ext.worker.aux_states import AuxKeys, is_aux
from kvstore_ext.worker.arguments import as_lists, describe
from kvstore_ext.worker.channel import CommandChannel, ServerLink
from kvstore_ext.checks import (ArgumentTypeError, check_bool, check_int, check_optional_text,
                                check_path, check_real, check_rounds)
from kvstore_ext.worker.finite import ALL_FINITE
from kvstore_ext.protocol.counter import counter_size
from kvstore_ext.worker.finish import FinishCounter
from kvstore_ext.protocol.keys import KeyLayout
from kvstore_ext.worker.layout import Placement
from kvstore_ext.optim.optimizers import describe_optimizer, whole_tensor_name
from kvstore_ext.protocol.commands import Command
from kvstore_ext.worker.statefetch import StateFetch
from kvstore_ext.worker.wires.slots import SlotWire
from kvstore_ext.worker.store_errors import StoreValueError, UnknownKeyError
from kvstore_ext.typenames import TYPE_STRING

__all__ = ['DistDelay', 'UnknownKeyError']

_LOG = logging.getLogger(__name__)


class DistDelay(KVStoreBase):
    """Distributed kvstore with exact rounds, slack and chunking (type ``'dist_delay'``).

    Create it with ``mx.kv.create('dist_delay')`` or pass ``kvstore='dist_delay'`` to a
    Gluon trainer; stock ``gluon.Trainer`` then trains exactly like ``'dist_sync'``.
    Differences from ``'dist_sync'``:

    1. The servers must be mxdelay's (``mxdelay-run`` or ``import mxdelay`` before
       ``import mxnet``); creation fails with instructions otherwise.
    2. A worker may push up to ``slack`` rounds ahead of the slowest worker without waiting;
       a pull after round t still returns exactly the weights after round t.
    3. ``lr_mult`` and ``wd_mult`` of Gluon Parameters apply on the servers, and
       :meth:`set_learning_rate`, :meth:`save_optimizer_states` and
       :meth:`load_optimizer_states` reach the servers.
    4. :meth:`set_gradient_compression` (before the first :meth:`init` or command, the same
       on every worker, checked at the hand-shake): MXNet's ``'2bit'`` with one residual
       per tensor, or ``{'type': 'fp16'}`` (float16 pushes summed in float32 on the servers,
       float32 pulls, :mod:`kvstore_ext.codecs.fp16`).
    5. :meth:`set_pull_compression` (the same on every worker, before the first :meth:`init`):
       the pulls of the rounds every worker pulls carry ``C(W - x̂)``, float16 or int8
       (:meth:`pull_compressed`, :mod:`kvstore_ext.codecs.pulls`); :meth:`pull` stays exact.

    Configuration comes from ``MXDELAY_SLACK`` and ``MXDELAY_CHUNK_SIZE`` (README table) and
    can be changed with :meth:`configure` before the first :meth:`init`.

    Parameters
    ----------
    native : mxnet.kvstore.KVStore, optional
        The native distributed store to build on; default (what ``mx.kv.create`` does): a
        new ``'dist_sync'`` store, with the worker's exit hooks (:mod:`kvstore_ext.worker.hooks`).
    channel_factory : callable, optional
        ``channel_factory(native, layout)`` makes the command channel at the hand-shake;
        default :class:`kvstore_ext.worker.channel.CommandChannel` (tests pass a fake).

    Raises
    ------
    RuntimeError
        If the job's servers are not mxdelay's.
    ValueError
        If the workers' settings disagree (both values are named).
    """

    def __init__(self, native=None, channel_factory=CommandChannel):
        if native is None:
            native = mx.kv.create('dist_sync')  # rank 0 switches the servers to sync mode
            hooks.install_worker_exit(self)
        self._native = native
        self._link = ServerLink(native, channel_factory)
        self._num_servers = env.get_int('DMLC_NUM_SERVER') or 1
        self._slack = None
        self._chunk_size = None
        self._state_keys = 0       # J: state keys per chunk (fetch_optimizer_states)
        self.configure(slack=env.get_int('MXDELAY_SLACK'),
                       chunk_size=env.get_int('MXDELAY_CHUNK_SIZE'))
        self._tensors = {}
        # Made at the hand-shake, when the slack and the codec are final: the placement, the
        # key kinds (dense keys of the codec, row_sparse keys, aux keys, the finish
        # counter's) and the state keys.
        self._placement = self._dense = self._rows = self._aux = self._counter_keys = None
        self._fetch = None
        self._optimizer = None
        self._updater = None       # Gluon's load_states reads kvstore._updater.optimizer
        self._config = {}
        self._finish = None        # the FinishCounter, placed at the first init
        # Gradient scaling (scale_gradients): this worker's rescale_grad, and the job's one
        # that the servers apply (rank 0's at the hand-shake).
        self._rescale_grad = None
        self._job_rescale_grad = None
        # The codec (docs/design.md §2.8): codecs.NONE, or set_gradient_compression's.
        self._codec = codecs.NONE
        self._stateful = {}        # key -> its TensorCodec, where that keeps state (residuals)
        # Compressed pulls (set_pull_compression, docs/design.md §2.12): the codec, or None.
        self._pull_codec = None
        self._finite = {}          # {round: its all-finite flag's object} (set_finite_flag)
        # Whether this worker's last push or pushpull of a key that can be exchanged was a
        # pushpull: how a round whose first key cannot be exchanged is flagged (_next_round).
        self._asked_exchange = False

    # -- configuration and hand-shake ------------------------------------------------------
    def configure(self, slack=None, chunk_size=None, state_keys=None):
        """Set the slack (rounds a worker may run ahead), the chunk size (elements) and the
        number of state keys per chunk.

        Parameters
        ----------
        slack : int, optional
            1 to ``checks.MAX_ROUNDS`` (256). A worker's push of round t waits only for
            round ``t - slack - 1``.
        chunk_size : int, optional
            Largest number of elements per key, at least 1 and below MXNet's
            ``MXNET_KVSTORE_BIGARRAY_BOUND`` (1e6), so that MXNet never splits a key.
        state_keys : int, optional
            J >= 0: arrays of a chunk's optimizer state that :meth:`fetch_optimizer_states`
            can fetch (default 0: none; every worker must set the same).

        Raises
        ------
        TypeError
            If a value is not an integer (:class:`mxdelay.ArgumentTypeError`).
        ValueError
            If a value is out of range, or if keys were already initialised.
        """
        if getattr(self, '_tensors', None):
            raise ValueError('configure() must be called before the first init(); keys '
                             'were already placed with slack=%d' % self._slack)
        if slack is not None:
            slack = check_rounds('slack', slack, 'it is the number of rounds a worker may run '
                                 'ahead of the slowest')
        if chunk_size is not None:
            chunk_size = check_int('chunk_size', chunk_size, 1, 'it is the largest number of '
                                   'elements per key')
            if chunk_size >= commands.bigarray_bound():
                raise ValueError('chunk_size must be an integer in [1, %d) (MXNet splits '
                                 'larger keys across servers by itself, '
                                 'MXNET_KVSTORE_BIGARRAY_BOUND), got %r'
                                 % (commands.bigarray_bound(), chunk_size))
        if state_keys is not None:
            state_keys = check_int('state_keys', state_keys, 0, 'it is the number of optimizer '
                                   'state arrays per chunk that can be fetched')
        if slack is not None:
            self._slack = slack
        if chunk_size is not None:
            self._chunk_size = chunk_size
        if state_keys is not None:
            self._state_keys = state_keys

    @property
    def slack(self):
        """Rounds a worker may run ahead of the slowest worker."""
        return self._slack

    @property
    def chunk_size(self):
        """Largest number of elements in one key."""
        return self._chunk_size

    def set_config(self, **config):
        """Record settings that every worker must share; checked by the hand-shake.

        Raises
        ------
        TypeError
            If a value cannot travel to the servers as JSON (str, number, bool, None, and
            lists and dicts of those).
        """
        for name, value in config.items():
            try:
                json.dumps(value)
            except (TypeError, ValueError):
                raise ArgumentTypeError('set_config: %s=%r (%s) is not JSON-able; pass a str, '
                                        'number, bool or None (e.g. repr(value))'
                                        % (name, value, type(value).__name__)) from None
        self._config.update(config)

    def _handshake(self):
        """Prove the servers are mxdelay's and the workers agree; prepare the key placement."""
        slots = self._slack + 1
        codec = self._codec
        schedule = self._pull_schedule()
        layout = KeyLayout(self._num_servers, slots, self._state_keys,
                           pull_keys=slots if codec.pull_keys else 0,
                           model_keys=1 if schedule else 0)
        hello = {'rank': self.rank, 'num_workers': self.num_workers, 'slots': slots,
                 'state_keys': self._state_keys, 'wire': self.wire_dtype,
                 'model_keys': layout.model_keys,
                 'launcher_rank': env.get('MXDELAY_RANK'),
                 'protocol': commands.PROTOCOL_VERSION,
                 # The optimizer's description too: workers that set different optimizers
                 # fail here, all of them, naming both (the servers apply one optimizer).
                 'config': dict(self._config, slack=self._slack, chunk_size=self._chunk_size,
                                state_keys=self._state_keys,
                                optimizer=describe_optimizer(self._optimizer),
                                compression=codec.describe(),
                                **({'pull_compression': self._pull_codec.describe()}
                                   if schedule else {}))}
        replies = self._link.start(layout, hello, codec)
        self._job_rescale_grad = replies[0].get('rescale_grad')  # the same on every server
        # LAMB, LARS, LBSGD read norms of whole tensors: each is kept in one chunk below
        # MXNet's bound, as dist_sync keeps it in one key (the servers refuse a split one).
        whole = self._optimizer is not None and whole_tensor_name(self._optimizer) is not None
        self._placement = Placement(layout, self._chunk_size,
                                    commands.bigarray_bound() if whole else None)
        self._dense = wires.dense_keys(codec, self._native, slots, self._pull_codec, schedule)
        self._rows = sparse.RowSparseKeys(self._native, slots, codec)
        self._aux = AuxKeys(self._native, slots)
        self._counter_keys = SlotWire(self._native, slots, codecs.NONE)
        self._fetch = StateFetch(layout)
        _LOG.info('dist_delay: worker %d of %d, %d mxdelay server(s), slack %d, chunk size %d',
                  self.rank, self.num_workers, self._num_servers, self._slack, self._chunk_size)

    def _pull_schedule(self):
        """The pulled rounds of compressed pulls (None without), from the shared settings.

        Raises
        ------
        ValueError
            If the settings lack the schedule.
        """
        if self._pull_codec is None:
            return None
        missing = [name for name in ('delay', 'warmup_steps') if name not in self._config]
        if missing:
            raise ValueError(
                'pull_compression=%r needs the pull schedule, which the servers use to write '
                'each pulled round\'s payload, but set_config() has no %s: DelayedTrainer sets '
                'it; a bare dist_delay store must call set_config(delay=k, warmup_steps=W) '
                '(every round up to W is pulled, then every k-th) before its first init'
                % (self._pull_codec.describe(), ' and '.join(missing)))
        return PullSchedule(self._config['delay'], self._config['warmup_steps'])

    def _command(self, command, body, refusal=RuntimeError):
        """Run `command` on every server; return the servers' replies (raise `refusal` if a
        server refuses)."""
        self._ensure_started()
        return self._link.command(command, body, refusal)

    def _ensure_started(self):
        # The hand-shake waits for the first init or command, so that a trainer can still
        # configure the slack and the shared settings after creating the store.
        if self._link.channel is None:
            self._handshake()
            if self._optimizer is not None:
                self._link.send_optimizer(self._optimizer)

    @property
    def _channel(self):
        """The command channel (None before the hand-shake and after :meth:`close`)."""
        return self._link.channel

    # -- KVStoreBase -----------------------------------------------------------------------
    @property
    def type(self):
        """``'dist_sync_delay'``: created as ``'dist_delay'``, described as a synchronous
        store. MXNet 1.9.1's ``Module.init_optimizer`` tests this string for ``'dist'`` and
        ``'_sync'`` to give the optimizer dist_sync's ``rescale_grad`` (``1/(batch*N)``, an
        explicit value kept); the rounds are synchronous, so that is the right answer
        (docs/design.md §9). Gluon tests it for ``'dist'`` and ``'async'`` only."""
        return TYPE_STRING

    @property
    def rank(self):
        return self._native.rank

    @property
    def num_workers(self):
        return self._native.num_workers

    @staticmethod
    def is_capable(capability):
        if not isinstance(capability, str):
            raise ArgumentTypeError("capability must be a str such as 'optimizer', got %r (%s)"
                                    % (capability, type(capability).__name__))
        if capability.lower() == KVStoreBase.OPTIMIZER:
            return True
        raise ValueError('Unknown capability: {}'.format(capability))

    def set_optimizer(self, optimizer):
        """Send `optimizer` to the servers, which apply it once per round (claim 4).

        Every worker must set the same optimizer (type and hyper-parameters). It is sent at
        the hand-shake (the first :meth:`init` or command) or at once if that has happened.

        Raises
        ------
        TypeError
            If `optimizer` is not an ``mx.optimizer.Optimizer``.
        ValueError
            If another worker set a different optimizer, or if the servers apply another
            optimizer than this one (e.g. set after training started): both are named.
        """
        if not isinstance(optimizer, mx.optimizer.Optimizer):
            raise ArgumentTypeError("optimizer must be an mx.optimizer.Optimizer, got %r (%s); "
                                    "create one with mx.optimizer.create('sgd', ...)"
                                    % (optimizer, type(optimizer).__name__))
        self._optimizer = optimizer
        self._updater = _OptimizerHolder(optimizer)
        if self._link.channel is not None:
            self._link.send_optimizer(optimizer)

    def set_learning_rate(self, lr):
        """Set the learning rate of the servers' optimizer (Gluon's trainer sets only its own).

        Raises
        ------
        TypeError, ValueError
            If `lr` is not a finite number >= 0.
        """
        lr = check_real('lr', lr, minimum=0, fix='e.g. set_learning_rate(0.01)')
        self._command(Command.SET_HYPER, {'lr': lr})

    def set_gradient_compression(self, compression_params):
        """Compress this worker's pushes: MXNet's ``'2bit'`` as ``'dist_sync'`` does it, or
        float16 pushes (``{'type': 'fp16'}``, mxdelay's own).

        ``'2bit'``: each key keeps one residual on this worker: a push adds the gradient to
        it, sends ``+t``, ``0`` or ``-t`` per value and keeps the rest (docs/design.md §2.8).
        ``'fp16'``: each worker casts its gradient to float16 in the copy into its send
        buffer; the servers sum every round in float32 and keep the weights and the optimizer
        state in float32; pulls return float32 weights (docs/design.md §2.11). ``'int8'``,
        ``'int4'``, ``'ternary'``: blockwise quantization with error feedback, a scale per
        block and worker, one row per worker on the wire, decoded and summed in rank order
        on the servers (docs/design.md §2.14). Pulls are compressed
        only by :meth:`set_pull_compression`. Every worker must set the same, before the first :meth:`init` or command
        (Gluon's trainers call this when they create the store); compressed tensors must be
        float32.

        Parameters
        ----------
        compression_params : dict
            E.g. ``{'type': '2bit', 'threshold': 0.5}`` (threshold default 0.5),
            ``{'type': 'fp16'}`` or ``{'type': 'ternary', 'block_size': 256}`` (also
            ``'int8'``, ``'int4'``; block size default 256).

        Raises
        ------
        ValueError
            For bad parameters (for '2bit' MXNet's message; also ``mxnet.base.MXNetError``),
            or if the store has started (stock MXNet accepts that silently; its residuals
            would start late and a key split over the servers would break).
        """
        if self._link.channel is not None or self._tensors:
            raise ValueError('set_gradient_compression must be called before the first init() '
                             '(and before any command, e.g. set_learning_rate), on every '
                             'worker alike: this store has started; call it right after '
                             "mx.kv.create('dist_delay'), or pass compression_params to the "
                             'trainer')
        self._codec = codecs.parse(compression_params) or codecs.NONE

    def set_pull_compression(self, pull_compression):
        """Compress the pulls of the rounds every worker pulls (docs/design.md §2.12).

        The servers keep, per chunk, the model they last sent, x̂, and at a pulled round send
        ``C(W - x̂)`` (``'fp16'``: float16, 2 bytes a value; ``'int8'``: a level per value
        and a float32 scale per block, about 1 byte a value); every worker adds the same
        decoded values to its own x̂ (:meth:`pull_compressed`). What was not sent goes out
        with the next pull. :meth:`pull` stays exact. The pulled rounds are those of
        ``set_config(delay=k, warmup_steps=W)``: every round up to W, then every k-th.
        Every worker must set the same, before the first :meth:`init` or command.

        Parameters
        ----------
        pull_compression : dict or None
            ``{'type': 'fp16'}`` or ``{'type': 'int8', 'block_size': 256}``.

        Raises
        ------
        ValueError
            For bad parameters, or if the store has started.
        """
        codec = pulls.parse(pull_compression)
        if self._link.channel is not None or self._tensors:
            raise ValueError('set_pull_compression must be called before the first init() '
                             '(and before any command), on every worker alike: this store '
                             "has started; pass pull_compression to the trainer")
        self._pull_codec = codec

    @property
    def pull_compression(self):
        """The :class:`kvstore_ext.codecs.pulls.PullCodec` of compressed pulls, or None."""
        return self._pull_codec

    @property
    def compression(self):
        """The :class:`kvstore_ext.codecs.Codec` set by :meth:`set_gradient_compression`,
        or None."""
        return None if self._codec is codecs.NONE else self._codec

    @property
    def wire_dtype(self):
        """The dtype gradients are pushed in: 'float16' with fp16 compression, else None
        (each tensor's own)."""
        return self._codec.wire_dtype

    def _check_compressible(self, keys, values):
        for k, v in zip(keys, values):
            v = v[0] if isinstance(v, (list, tuple)) else v
            self._codec.check_dtype('key %r' % (k,), v.dtype)

    def init(self, key, value):
        """Place `key` (int or list of ints) on the servers with initial `value`.

        Raises
        ------
        TypeError
            If a key is not an int or str, or a value not an NDArray.
        ValueError
            If a key is already initialised or given twice (nothing is placed then;
            :class:`~kvstore_ext.worker.store_errors.StoreValueError`, also an ``MXNetError``).
        """
        keys, values = as_lists(key, value)
        for k in keys:
            if k in self._tensors or keys.count(k) > 1:
                raise StoreValueError('key %r is already initialised or given twice; '
                                      'initialise each key once' % (k,))
        self._check_compressible(keys, values)
        self._ensure_started()
        native_keys, native_values, entries, placed = [], [], [], {}
        for k, v in zip(keys, values):
            v = v[0] if isinstance(v, (list, tuple)) else v
            # The key's kind, once (chunks of rows: docs/design.md §2.10; aux states: §2.13).
            param = self._param_of(k)
            if sparse.is_row_sparse(v, param):
                kind = self._rows
            else:
                kind = self._aux if is_aux(param) else self._dense
            if kind is self._rows and self._pull_codec is not None:
                raise ValueError('key %r is row_sparse, which pull_compression=%r does not '
                                 'support (its pulls bring the rows asked for, not a model '
                                 'every worker holds); use dense keys or no pull_compression'
                                 % (k, self._pull_codec.describe()))
            tensor = self._tensors[k] = kind.place(self._placement, k, v)
            if tensor.codec.state_size():
                self._stateful[k] = tensor.codec
            placed.setdefault(kind, []).append(tensor)
            entries.extend(self._init_entries(tensor, v, native_keys, native_values))
        if self._finish is None:
            # The counter is placed with the first keys, in the same collective init, so that
            # its chunk id and server are the same on every worker.
            value = nd.zeros(counter_size(self._slack + 1))
            counter = self._counter_keys.place(self._placement, commands.FINISH_KEY, value)
            entries.extend(self._init_entries(counter, value, native_keys, native_values))
            counter.make_buffers(self._slack + 1, mx.cpu())
            self._finish = FinishCounter(counter, self._counter_keys, self.num_workers,
                                         self._codec.flag_unit)
        self._command(Command.REGISTER, {'chunks': entries})
        self._native.init(native_keys, native_values)
        for kind, tensors in placed.items():
            kind.after_init(tensors)

    def _init_entries(self, tensor, value, native_keys, native_values):
        """Add `tensor`'s native keys and initial values to the lists; return its REGISTER
        entries: ``[chunk id, server, index, name, lr_mult, wd_mult, size]``, and its kind's
        server settings (the codec's) as an eighth element where there are any."""
        keys, values, sizes = tensor.kind.init_entries(tensor, value)
        native_keys.extend(keys)
        native_values.extend(values)
        lr_mult, wd_mult, name = self._mults(tensor.key)
        index = int(tensor.key) if isinstance(tensor.key, (int, np.integer)) else str(tensor.key)
        settings = tensor.kind.server_settings()
        return [[chunk.chunk_id, chunk.server, index, name, lr_mult, wd_mult, size]
                + ([settings] if settings else []) for chunk, size in zip(tensor.chunks, sizes)]

    def _param_of(self, key):
        # Gluon's Parameter of `key` (Gluon sets the optimizer before init), or None.
        return self._optimizer.param_dict.get(key) if self._optimizer is not None else None

    def _mults(self, key):
        optimizer = self._optimizer
        param = self._param_of(key)
        if param is not None:  # Gluon: Parameters by key
            return float(param.lr_mult), float(param.wd_mult), param.name
        if optimizer is not None and isinstance(key, str) and key in optimizer.idx2name.values():
            # Module: the keys are the parameters' names, the optimizer's multipliers are by
            # name (Variables' lr_mult/wd_mult attributes; wd_mult 0 for names not ending in
            # _weight or _gamma) and MXNet's server finds them through idx2name.
            return (float(optimizer.lr_mult.get(key, 1.0)),
                    float(optimizer.wd_mult.get(key, 1.0)), key)
        return 1.0, 1.0, str(key)

    def broadcast(self, key, value, out, priority=0):
        """Initialise `key` with rank 0's `value` and give that value to every worker in `out`.

        What the servers hold is rank 0's `value`, bit for bit (MXNet's init pushes rank
        0's), so the key's kind lets rank 0 copy it instead of pulling it back, and the other
        workers pull it once (with compressed pulls, that pull is also their initial x̂):
        docs/design.md §2.4.
        """
        as_lists(key, out, 'out', priority)  # check before anything is placed
        self.init(key, value)
        keys, outs = self._checked_lists(key, out, 'out', priority)
        _, values = as_lists(key, value)
        for k, v, o in zip(keys, values, outs):
            tensor = self._tensors[k]
            tensor.kind.initial_pull(tensor, _listed(v)[0], _listed(o), priority)

    def push(self, key, value, priority=0):
        """Push this worker's next round of `key`: the sum of `value` over its devices.

        Returns at once; the push runs in MXNet's engine and waits only for the slot's
        previous round (``slack`` rounds back).

        Raises
        ------
        TypeError
            If a key is not an int or str, a value not an NDArray (or a list of them, one
            per device), or `priority` not an int.
        ValueError
            If a value has another number of elements than its key's initial value.
        KeyError
            If a key was not initialised (:class:`UnknownKeyError`, also an ``MXNetError``).
        """
        keys, values = self._checked_lists(key, value, 'value', priority)
        for k, v in zip(keys, values):
            tensor, finite = self._next_round(k, False)
            self._send(tensor, _listed(v), None, priority, self._gradient_factor(), finite)

    def _next_round(self, key, exchange):
        """`key`'s tensor and the all-finite flag of its next round, flagged on the finish
        counter ("this worker has data", once per round) before the round's first push.
        `exchange`: whether the caller asks for a pushpull (:meth:`pushpull`), which flags
        the round as exchanged if this is its first key, and any later round whose first key
        cannot be exchanged (row_sparse, or with a codec).

        Raises
        ------
        ValueError
            If `key` holds aux states (:meth:`average` them).
        """
        tensor = self._tensors[key]
        if not tensor.kind.trained:
            raise ValueError('key %r holds aux states (a Parameter with differentiable=False, '
                             'e.g. BatchNorm\'s running mean), which are averaged, not pushed: '
                             'use average(), or trainer.sync_weights(aux_states=True)' % (key,))
        if tensor.kind.exchanges:
            self._asked_exchange = exchange
        finite = self._finite.get(tensor.next_round, ALL_FINITE)
        if self._finish is not None:
            self._finish.flag_round(tensor.next_round, finite, self._asked_exchange)
        return tensor, finite

    def _send(self, tensor, grads, outs, priority, factor=None, finite=ALL_FINITE):
        """Send round ``tensor.next_round`` of `tensor` (the sum of `grads`, times `factor`,
        divided by the all-finite flag `finite`) and, if `outs` is given, pull the weights
        after it into `outs`.

        MXNet's server answers only the pushpulls of a round that has one and leaves its
        plain pushes unanswered for ever (``ApplyUpdates`` of kvstore_dist_server.h), so
        every worker sends a round alike, as this worker's round is flagged
        (:attr:`FinishCounter.exchanged`, also after a vote, docs/design.md §5): keys that
        can be exchanged go as one pushpull per chunk (without `outs` into an array of the
        tensor's own, whose weights nobody reads) or else as a push and a pull.
        """
        tensor.kind.send(tensor, grads, outs, priority, factor, finite, self._finish.exchanged)

    def set_finite_flag(self, flag):
        """Mark this worker's next round with its all-finite flag (AMP, docs/design.md §11).

        Every push of the round is divided by `flag`: unchanged for 1 (exact), inf or nan
        everywhere for 0, so that the servers skip the round on every chunk; the finish
        counter carries the flag to every worker (:meth:`overflows`). Call it before the
        round's first push.

        Parameters
        ----------
        flag : NDArray
            One element, 1 if every gradient of the round is finite, else 0 (e.g. from
            ``nd.multi_all_finite``, still being computed in MXNet's engine).

        Raises
        ------
        ValueError
            If the codec's pushes cannot carry the flag (one row per worker: the blockwise
            codecs; the trainers refuse AMP with any compression when they create the store).
        """
        if not isinstance(flag, nd.NDArray) or flag.size != 1:
            raise ArgumentTypeError('flag must be a one-element NDArray (1: all finite, 0: '
                                    'overflow), got %s' % describe(flag))
        self._finite = {self._finish.flagged_rounds if self._finish else 0:
                        wires.finite_flag(self._codec, flag)}

    def pull_overflows(self):
        """Issue a pull of the overflow marks of the last R rounds this worker pushed;
        returns at once (:meth:`overflows` waits for it)."""
        self._finish.pull_marks()

    def overflows(self, rounds):
        """How many workers overflowed (:meth:`set_finite_flag` 0) in each of `rounds`:
        rounds at most ``slack`` before the one of the last :meth:`pull_overflows`, which
        this waits for."""
        return self._finish.overflows(rounds)

    def scale_gradients(self, rescale_grad):
        """Scale this worker's gradients by its own `rescale_grad` (1/its batch size).

        The servers apply one ``rescale_grad`` to the sum of a round's gradients: the job's,
        worker 0's at the hand-shake. A worker whose ``rescale_grad`` differs (another batch
        size, a smaller last batch, or a worker that has not stepped yet) multiplies its
        pushes by ``rescale_grad / job's``, so that each gradient is scaled by its own batch
        size, without a command and without changing the other workers' scaling. With the
        same value (the common case) gradients are pushed unchanged.

        Parameters
        ----------
        rescale_grad : float
            This worker's ``rescale_grad`` for the following pushes.
        """
        self._rescale_grad = check_real('rescale_grad', rescale_grad, minimum=0,
                                        min_inclusive=False, fix='pass 1/batch_size')

    def _gradient_factor(self):
        if self._rescale_grad is None or not self._job_rescale_grad:
            return None
        factor = self._rescale_grad / self._job_rescale_grad
        return None if factor == 1.0 else factor

    def pull(self, key, out=None, priority=0, ignore_sparse=True):
        """Pull into `out` the weights after this worker's last pushed round of `key`.

        After the push of round t this is exactly ``W_{t+1}``; before any push, the initial
        value. Returns at once: reading `out` waits for the pull (and therefore for every
        worker's push of round t), nothing else does.
        """
        if out is None:
            raise ArgumentTypeError('pull needs out=: the NDArray (or list of NDArrays, one '
                                    'per device) to receive the weights of key %r' % (key,))
        keys, outs = self._checked_lists(key, out, 'out', priority)
        for k, o in zip(keys, outs):
            tensor = self._tensors[k]
            tensor.kind.pull(tensor, _listed(o), priority, ignore_sparse)

    def pull_compressed(self, key, out=None, priority=0):
        """Pull the weights after this worker's last pushed round t, compressed, into `out`.

        Round t must be one that every worker pulls (:meth:`set_pull_compression`); `out`
        then holds this worker's x̂ after round t: the same bits on every worker, and W up to
        what the compression has not sent yet (docs/design.md §2.12). Without
        pull_compression this is :meth:`pull`.

        Raises
        ------
        ValueError
            If round t is not pulled by every worker, or this worker skipped an earlier
            pulled round.
        """
        if out is None:
            raise ArgumentTypeError('pull_compressed needs out=: the NDArray (or list of '
                                    'NDArrays) to receive the weights of key %r' % (key,))
        keys, outs = self._checked_lists(key, out, 'out', priority)
        for k, o in zip(keys, outs):
            tensor = self._tensors[k]
            tensor.kind.pull_compressed(tensor, _listed(o), priority)

    def average(self, key, value, priority=0):
        """Replace aux states `value` by their mean over the workers; collective.

        Every worker calls it at the same point, with the same keys: for each key it pushes
        its own value (the mean over its devices when `value` lists one array per device) in
        a round of the key's own, pulls the round's sum and writes ``sum / float32(N)`` into
        every array (docs/design.md §2.13). Not compressed; not a training round (the finish
        counter and the other keys' rounds are untouched). Returns when `value` is written.

        Parameters
        ----------
        key : int or str, or list of them
            Keys initialised for Parameters with ``differentiable=False`` (their optimizer's
            ``param_dict`` says so when the key is placed).
        value : NDArray, or list of them (one per device; a list per key)

        Where MXNet's native store quantizes every push (``'2bit'``), the values go to the
        servers in one command (JSON), and the rounds push zeros, which survive that exactly.

        Raises
        ------
        ValueError
            If a key is not an aux key.
        """
        keys, values = self._checked_lists(key, value, 'value', priority)
        for k in keys:
            if self._tensors[k].kind is not self._aux:
                raise ValueError('key %r does not hold aux states: average() takes the keys of '
                                 'Parameters with differentiable=False (BatchNorm\'s running '
                                 'mean and variance), placed as such at init' % (k,))
        tensors = [self._tensors[k] for k in keys]
        arrays = [_listed(v) for v in values]
        mine = [self._aux.contribution(copies) for copies in arrays]
        if self._codec.exact_pushes:
            pushed = mine
        else:
            self._command(Command.AUX, {'chunks': self._aux.command_body(tensors, mine)},
                          refusal=ValueError)
            pushed = [tensor.zeros() for tensor in tensors]
        self._aux.average(tensors, arrays, pushed, self.num_workers, priority)

    def pulled_models(self):
        """This worker's pulled models of compressed pulls: {key: (numpy x̂, the round it
        was last pulled at)} (empty without)."""
        if self._pull_codec is None:
            return {}
        return {k: t.pull_state.state() for k, t in self._tensors.items()
                if t.pull_state is not None}

    def set_pulled_models(self, models):
        """Restore what :meth:`pulled_models` returned (a checkpoint's).

        Raises
        ------
        ValueError
            If the keys differ from this store's.
        """
        mine = self.pulled_models()
        if set(models) != set(mine):
            raise ValueError('pulled models of keys %s, this store has %s: saved with another '
                             'pull_compression or model' % (sorted(models, key=str),
                                                            sorted(mine, key=str)))
        for key, state in models.items():
            self._tensors[key].pull_state.load(key, state)

    def row_sparse_pull(self, key, out=None, priority=0, row_ids=None):
        """Pull rows `row_ids` of row_sparse `key` after this worker's last pushed round.

        As MXNet's ``KVStore.row_sparse_pull``: each out (a ``RowSparseNDArray``, or a list,
        one per device) then holds exactly the rows asked for; ids may repeat, be unsorted
        or empty. After the push of round t these are rows of ``W_{t+1}`` (docs/design.md
        §2.10).

        Parameters
        ----------
        key : int or str, or list of them
        out : RowSparseNDArray, or list of them (one per device; a list per key)
        priority : int
        row_ids : NDArray or list of NDArray
            One int array per out, or one for all outs of a key.

        Raises
        ------
        TypeError
            If an out is not row_sparse, or the key was initialised dense.
        ValueError
            If the numbers of outs and row_ids differ.
        """
        if out is None or row_ids is None:
            raise ArgumentTypeError('row_sparse_pull needs out= (RowSparseNDArrays) and '
                                    'row_ids= (int NDArrays) for key %r' % (key,))
        keys, outs = self._checked_lists(key, out, 'out', priority)
        _, ids = as_lists(key, row_ids, 'row_ids', priority)
        for k, o, r in zip(keys, outs, ids):
            tensor = self._tensors[k]
            # Gluon pulls a row_sparse weight's rows inside autograd.record() (its forward
            # reads row_sparse_data): the store's own copies into `out` must not be recorded.
            with mx.autograd.pause():
                tensor.kind.row_sparse_pull(tensor, _listed(o), _listed(r), priority)

    def pushpull(self, key, value, out=None, priority=0):
        """Push a round of `value` and pull the weights after it into `out` (or `value`).

        The same as :meth:`push` then :meth:`pull`, but without compression each chunk's
        round and weights travel in one request (MXNet's ``pushpull``): the weights of a
        chunk come back as soon as its round is applied, while the pushes of other keys
        still arrive (docs/design.md §8). The round is sent once this worker's earlier rounds
        of the key are acknowledged.
        """
        if out is None:
            out = value
        _, outs = self._checked_lists(key, out, 'out', priority)  # before the push is issued
        keys, values = self._checked_lists(key, value, 'value', priority)
        for k, v, o in zip(keys, values, outs):
            tensor, finite = self._next_round(k, True)
            self._send(tensor, _listed(v), _listed(o), priority, self._gradient_factor(), finite)

    def _checked_lists(self, key, value, name, priority):
        """:func:`kvstore_ext.worker.arguments.as_lists`, and each value's size against its
        initialised key (before anything is issued: a list of keys is pushed whole or not at
        all); outs (`name` ``'out'``) must have the key's shape, as MXNet's pulls require
        (its pushes take any shape of the key's size)."""
        keys, values = as_lists(key, value, name, priority)
        for k, v in zip(keys, values):
            tensor = self._tensor(k)
            for array in (v if isinstance(v, (list, tuple)) else [v]):
                tensor.views_of(array, name)
                if name == 'out' and tuple(array.shape) != tuple(tensor.shape):
                    raise StoreValueError('out for key %r has shape %s, but the key was '
                                          'initialised with shape %s; pull into arrays of '
                                          'the initialised shape'
                                          % (k, array.shape, tensor.shape))
        return keys, values

    def _tensor(self, key):
        try:
            return self._tensors[key]
        except KeyError:
            raise UnknownKeyError('key %r was not initialised on the dist_delay kvstore; call init '
                           'or broadcast first' % (key,)) from None

    # -- optimizer state ---------------------------------------------------------------------
    def fetch_optimizer_states(self, states):
        """Fill arrays with the servers' optimizer state of their keys; collective.

        Every worker calls it at the same point (a trainer: at its switch step), with the
        same keys. For each key, ``states[key][j]`` (an array of the key's shape) receives
        array j of the servers' optimizer state of that key
        (:func:`kvstore_ext.optim.optimizers.flatten_state` of ``Updater.states``, chunk by chunk),
        as it is after every round this worker has pushed (docs/design.md §2.9). It waits
        for those rounds, then initialises the chunks' state keys, pushes one round of
        zeros into them (the server writes the state into the keys' stored values in that
        round) and pulls them; it returns when the arrays are filled.

        Parameters
        ----------
        states : dict
            key -> list of at most J (``configure(state_keys=J)``) NDArrays.

        Raises
        ------
        ValueError
            If a key has more arrays than J, or an array another number of elements than
            its key.
        KeyError
            If a key was not initialised (:class:`UnknownKeyError`).
        """
        self._ensure_started()
        self._fetch.fetch(self._native, self._fetch.plan(states, self._tensor))

    # -- uneven data -----------------------------------------------------------------------
    def finish_round(self, leaving=False):
        """Vote that this worker has no data for its next round; wait for every worker's vote.

        Every worker pushes a flag on the finish counter in every round: ``(0, 0)`` with its
        first push of a round (automatically), ``(1, leaving)`` here. The round's sum reaches
        every worker identically (rounds are exact), so all workers that call this see the
        same first round in which every worker has finished, and stop there together.

        Parameters
        ----------
        leaving : bool, default False
            True when this worker's script is ending (called at exit).

        Returns
        -------
        bool
            True if every worker has finished in this round: no round is pushed; False if some
            worker still has data: the caller must push this round (zero gradients) and vote
            again.
        """
        if self._finish is None:
            return True  # nothing was ever initialised: there are no rounds to fill
        return self._finish.vote(check_bool('leaving', leaving))

    def close(self):
        """Leave the job: fill the other workers' remaining rounds with zero gradients (as
        if this worker had called :meth:`finish_round` until every worker finished), then
        release the native store (its destructor meets the other workers in a barrier, and
        rank 0's stops the servers). Called at exit (:mod:`kvstore_ext.worker.hooks`)."""
        if self._native is None:
            return
        try:
            self._fill_remaining_rounds()
        except Exception:  # pylint: disable=broad-except
            _LOG.exception('dist_delay: worker %d could not fill the other workers\' rounds',
                           self.rank)
        # Drop every reference to the native store, so that the caller's gc.collect() runs
        # its destructor now, before MXNet's engine shuts down.
        self._native = None
        self._link.close()
        for kind in (self._dense, self._rows, self._aux, self._counter_keys):
            if kind is not None:
                kind.close()

    def _fill_remaining_rounds(self):
        if self._finish is None or self._finish.all_finished:
            return
        padded = 0
        while not self.finish_round(leaving=True):
            for tensor in self._tensors.values():
                # a tensor pushed in every round so far gets this round too
                if tensor.kind.trained and \
                        tensor.next_round == self._finish.flagged_rounds - 1:
                    # as the workers with data send the round (_send)
                    self._send(tensor, [tensor.zeros()], None, 0)
            padded += 1
        if padded:
            _LOG.info('dist_delay: worker %d had no data for the last %d rounds of the other '
                      'workers and pushed zero gradients in them', self.rank, padded)

    # -- rounds, state ---------------------------------------------------------------------
    def num_chunks(self, key):
        """Number of native keys (chunks) of `key`: push operations per round."""
        return len(self._tensor(key).chunks)

    def payload_bytes(self, key, codec=None, pull_codec=None):
        """``(push, pull)``: bytes of the values one push and one pull of `key` carry.

        Parameters
        ----------
        key : int or str
        codec : kvstore_ext.codecs.Codec, optional
            The push codec to count with (default: this store's; ``codecs.NONE``: the
            tensor's dtype). Another codec than this store's is counted on the chunks it
            would have (``Codec.chunk_limit``: a blockwise codec's may be smaller), and so
            is `pull_codec` with it.
        pull_codec : kvstore_ext.codecs.pulls.PullCodec or False, optional
            The pull codec to count with (default: this store's; False: exact pulls, the
            tensor's dtype).

        Returns
        -------
        tuple of int, or None
            None for a row_sparse key, whose pushes and pulls carry the rows of the step.
            ps-lite's headers (keys, lengths) are not counted.
        """
        tensor = self._tensor(key)
        if tensor.kind is self._rows:
            return None
        codec = self._codec if codec is None else codec
        pull_codec = self._pull_codec if pull_codec is None else (pull_codec or None)
        if codec is self._codec:
            sizes = [chunk.stop - chunk.start for chunk in tensor.chunks]
        else:   # the chunks `codec` would have: a blockwise codec's may be smaller
            sizes = [stop - start for start, stop in self._placement.spans(
                tensor.size, codec.chunk_limit(self.num_workers))]
        return (sum(codec.push_bytes(n, tensor.dtype) for n in sizes),
                np.dtype(tensor.dtype).itemsize * tensor.size if pull_codec is None
                else pulls.bytes_per_pull(pull_codec, sizes))

    def send_buffer(self, key):
        """The buffer that this worker's last push of `key` sends from (held by the push until
        its round is acknowledged; for :mod:`mxdelay.timeline`). For a row_sparse key: the
        gradient handed to the native store, held until the store has copied it."""
        tensor = self._tensor(key)
        return tensor.kind.send_buffer(tensor)

    def sent_gradient(self, key, grad):
        """What this worker's last push of `key` sent, in the units of its gradient `grad`
        (the array it pushed), shaped and placed like it: the quantized values divided by the
        push's batch-size factor, if any; with float16 pushes ``float32(float16(grad))``. With
        compression this is the ``g`` of the local rule (docs/design.md §1.4).

        Where the send buffer holds exactly that (2bit, no factor, on `grad`'s device) the
        result is the buffer itself, reshaped: read it before the key's next push into the
        same slot (R rounds later), never write it. Otherwise it is an array of this store's
        own, rewritten by the next call for `key`: the send buffer cast back to float32, not
        a second cast of `grad` (a float32-to-float16 cast costs several copies, docs/design.md
        §2.11)."""
        return self._tensor(key).codec.sent(self.send_buffer(key).reshape(grad.shape), grad)

    def residuals(self):
        """This worker's compression residuals: {key: numpy array} (empty without)."""
        return {k: codec.state() for k, codec in self._stateful.items()}

    def set_residuals(self, residuals):
        """Restore what :meth:`residuals` returned (a checkpoint's), before pushing again.

        Raises
        ------
        ValueError
            If the keys or sizes differ from this store's residuals.
        """
        mine = self._stateful
        if set(residuals) != set(mine):
            raise ValueError('compression residuals for keys %s, this store has %s: saved with '
                             'another compression setting or model'
                             % (sorted(residuals, key=str), sorted(mine, key=str)))
        for key, value in residuals.items():
            if np.size(value) != mine[key].state_size():
                raise ValueError('compression residual of key %r has %d elements, the key %d'
                                 % (key, np.size(value), mine[key].state_size()))
        for key, value in residuals.items():
            mine[key].load_state(value)

    def rounds(self, key):
        """Number of rounds of `key` this worker has pushed."""
        return self._tensor(key).next_round

    def server_stats(self):
        """Per-server, per-chunk count of applied rounds (and rounds held out of order)."""
        return self._command(Command.STATS, {})

    def barrier(self):
        """Wait for every worker (MXNet's worker barrier)."""
        if self._finish is not None:
            self._finish.check_no_worker_left()  # a worker that left never arrives
        self._native._barrier()

    def agree(self, error=None):
        """Collective: tell every worker whether any worker failed a step.

        Every worker calls it with its own `error` (None or a message); each one gets the
        same list of ``(rank, message)`` of the workers that failed, so that all raise (or
        all go on) together instead of one raising while the others wait in a barrier.
        """
        check_optional_text('error', error, 'pass None, or a message saying what failed')
        self._ensure_started()
        return self._link.agree(error, self.barrier)

    def save_optimizer_states(self, fname, dump_optimizer=False):
        """Save the servers' weights, optimizer states and rounds, and this worker's rounds.

        Every worker must call it (it starts with a barrier so that no round is in flight).
        The servers write ``fname + '.server<i>'``; worker 0 writes `fname`, the index, with
        the save's id and the servers' files' sha256 (docs/design.md §6.2). A load looks for
        the servers' files next to the index it is given, so a checkpoint can be copied,
        moved or renamed as a whole. Every file is written atomically; none is a pickle.
        """
        store_checkpoint.save(self, check_path('fname', fname))

    def load_optimizer_states(self, fname, trusted=False):
        """Restore what :meth:`save_optimizer_states` saved (every worker calls it).

        Parameters
        ----------
        fname : str
            The index file written by :meth:`save_optimizer_states`.
        trusted : bool
            Also load a version-1 checkpoint (mxdelay before pickle-free checkpoints), whose
            server files are pickles: loading a pickle runs whatever code it names, so pass
            True only for a checkpoint whose writer you trust.

        Raises
        ------
        ValueError
            On every worker, if any file is missing, truncated or foreign, or was saved by a
            different job layout; nothing changes then, on the workers or the servers.
        TypeError
            If `fname` is not a path.
        """
        self.apply_states(self.check_states(check_path('fname', fname), trusted=trusted))

    def check_states(self, fname, error=None, trusted=False, part_of=None):
        """Collective first half of a load: validate everything, agree, change nothing.

        Parameters
        ----------
        fname : str
            The index file written by :meth:`save_optimizer_states`.
        error : str, optional
            A failure the caller found in its own files, to be agreed on as well.
        trusted : bool
            As in :meth:`load_optimizer_states`.
        part_of : dict, optional
            ``{'save_id', 'sha256'}`` that a trainer checkpoint's index lists for `fname`.

        Returns
        -------
        dict
            The validated state, for :meth:`apply_states`.
        """
        fname = check_path('fname', fname)
        check_optional_text('error', error, 'pass None, or a message saying what failed')
        check_bool('trusted', trusted)
        return store_checkpoint.check(self, fname, error, trusted, part_of)

    def apply_states(self, state):
        """Collective second half of a load: servers and round counters take `state`."""
        store_checkpoint.apply(self, state)

    def _job_index(self):
        """What a checkpoint's index records of this worker's job (:mod:`kvstore_ext.worker.store_checkpoint`)."""
        return {'num_servers': self._num_servers, 'slack': self._slack,
                'chunk_size': self._chunk_size,
                'rounds': {str(k): t.next_round for k, t in self._tensors.items()},
                'finish_rounds': self._finish.tensor.next_round if self._finish else 0,
                'rescale_grad': self._job_rescale_grad}

    def _restore_job_index(self, state):
        """Take the round counters and the job's rescale_grad of a checkpoint's index."""
        for key, tensor in self._tensors.items():
            tensor.next_round = state['rounds'][str(key)]
        if self._finish is not None:
            self._finish.restore(state['finish_rounds'],
                                 max([t.next_round for t in self._tensors.values()
                                      if t.kind.trained] + [0]))
        # The servers apply the saved job's rescale_grad from now on (its optimizer).
        self._job_rescale_grad = state['rescale_grad']



def _listed(value):
    """`value` as a list (one array per device)."""
    return value if isinstance(value, (list, tuple)) else [value]


class _OptimizerHolder(object):
    """What Gluon's ``Trainer.load_states`` reads from a kvstore: ``_updater.optimizer``."""

    def __init__(self, optimizer):
        self.optimizer = optimizer


hooks.register_store_type(DistDelay)
gluon_sparse.accept_in_gluon(DistDelay)
module_path.refuse_local_update(DistDelay)
