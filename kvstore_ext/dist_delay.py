"""The ``'dist_delay'`` kvstore: MXNet's native distributed store with exact rounds.

:class:`DistDelay` is the ``KVStoreBase`` face; its parts (docs/design.md §2):

- :mod:`kvstore_ext.layout`: keys, chunks and the slot buffers. Every chunk of every tensor
  has R = slack + 1 keys on one server and round t goes to slot ``t mod R``: the native
  server's sum of a slot is exactly one round, a worker runs at most ``slack`` rounds ahead
  of the slowest, and each slot has its own send buffer (so a gradient is never held by a
  pending push, and a pull never lands in a gradient).
- :mod:`kvstore_ext.channel`: hand-shake and commands to the servers.
- :mod:`kvstore_ext.finish`: the finish counter of uneven data.
- :mod:`kvstore_ext.hooks`: the registry entry and the worker's exit.

A pull after round t is ordered behind every earlier round (:meth:`DistDelay.pull_tensor`),
and the server applies rounds in order (:mod:`kvstore_ext.rounds`), so it returns exactly
the weights after round t.
"""
import json
import logging
import sys

import numpy as np
import mxnet as mx
from mxnet import nd
from mxnet.kvstore import KVStoreBase

from . import checkpoint, compression, env, gluon_sparse, hooks, protocol, sparse, wire
from .channel import CommandChannel
from .checks import (ArgumentTypeError, check_bool, check_int, check_optional_text,
                     check_path, check_real, check_rounds)
from .finish import FinishCounter, counter_size
from .layout import KeyLayout, Placement
from .optimizers import PER_STEP_FIELDS, describe_optimizer, format_differences, \
    optimizer_differences
from .protocol import Command
from .typenames import TYPE_STRING

__all__ = ['DistDelay']

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
       float32 pulls, :mod:`kvstore_ext.wire`).

    Configuration comes from ``MXDELAY_SLACK`` and ``MXDELAY_CHUNK_SIZE`` (README table) and
    can be changed with :meth:`configure` before the first :meth:`init`.

    Parameters
    ----------
    native : mxnet.kvstore.KVStore, optional
        The native distributed store to build on; default (what ``mx.kv.create`` does): a
        new ``'dist_sync'`` store, with the worker's exit hooks (:mod:`kvstore_ext.hooks`).
    channel_factory : callable, optional
        ``channel_factory(native, layout)`` makes the command channel at the hand-shake;
        default :class:`kvstore_ext.channel.CommandChannel` (tests pass a fake).

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
        self._channel_factory = channel_factory
        self._channel = None       # made at the hand-shake
        self._num_servers = env.get_int('DMLC_NUM_SERVER') or 1
        self._slack = None
        self._chunk_size = None
        self._state_keys = 0       # J: state keys per chunk (fetch_optimizer_states)
        self._state_keys_made = set()   # state keys initialised on the servers
        self.configure(slack=env.get_int('MXDELAY_SLACK'),
                       chunk_size=env.get_int('MXDELAY_CHUNK_SIZE'))
        self._tensors = {}
        self._placement = None     # made at the hand-shake, when the slack is final
        self._optimizer = None
        self._updater = None       # Gluon's load_states reads kvstore._updater.optimizer
        self._config = {}
        self._finish = None        # the FinishCounter, placed at the first init
        # Gradient scaling (scale_gradients): this worker's rescale_grad, and the job's one
        # that the servers apply (rank 0's at the hand-shake).
        self._rescale_grad = None
        self._job_rescale_grad = None
        # Gradient compression (docs/design.md §2.8): the setting, one residual per key,
        # and the scaling factor of each key's last push (sent_gradient undoes it).
        self._compression = None
        self._residuals = {}
        self._last_factor = {}
        self._sent = {}            # key -> sent_gradient's array where it cannot be the buffer
        self._finite = {}          # {round: its all-finite flag} (set_finite_flag)

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
            if chunk_size >= protocol.bigarray_bound():
                raise ValueError('chunk_size must be an integer in [1, %d) (MXNet splits '
                                 'larger keys across servers by itself, '
                                 'MXNET_KVSTORE_BIGARRAY_BOUND), got %r'
                                 % (protocol.bigarray_bound(), chunk_size))
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
        layout = KeyLayout(self._num_servers, slots, self._state_keys,
                           pull_keys=slots if self.wire_dtype else 0)
        channel = self._channel_factory(self._native, layout)
        if self.wire_dtype and self.rank == 0:
            # Before any key exists: the servers then sum float16 keys in float32 (§2.11).
            wire.enable_float32_sums(self._native)
        hello = {'rank': self.rank, 'num_workers': self.num_workers, 'slots': slots,
                 'state_keys': self._state_keys, 'wire': self.wire_dtype,
                 'launcher_rank': env.get('MXDELAY_RANK'),
                 'protocol': protocol.PROTOCOL_VERSION,
                 # The optimizer's description too: workers that set different optimizers
                 # fail here, all of them, naming both (the servers apply one optimizer).
                 'config': dict(self._config, slack=self._slack, chunk_size=self._chunk_size,
                                state_keys=self._state_keys,
                                optimizer=describe_optimizer(self._optimizer),
                                compression=self._compression and self._compression.describe())}
        replies = channel.handshake(hello)
        if self._compression is not None and self._compression.native_params() is not None:
            # After the hand-shake, which pushed the status keys uncompressed (and refused
            # workers that disagree before any compressed push could reach a server that was
            # never told), before the first init. Rank 0 sends it to the servers and waits
            # for them; the other workers push only after the init's barrier, behind it.
            self._native.set_gradient_compression(self._compression.native_params())
        self._job_rescale_grad = replies[0].get('rescale_grad')  # the same on every server
        self._channel = channel
        self._placement = Placement(layout, self._chunk_size)
        _LOG.info('dist_delay: worker %d of %d, %d mxdelay server(s), slack %d, chunk size %d',
                  self.rank, self.num_workers, self._num_servers, self._slack, self._chunk_size)

    def _command(self, command, body, refusal=RuntimeError):
        """Run `command` on every server; return the servers' replies (raise `refusal` if a
        server refuses)."""
        self._ensure_started()
        _wait_for_issued_work()
        return self._channel.command(command, body, refusal)

    def _ensure_started(self):
        # The hand-shake waits for the first init or command, so that a trainer can still
        # configure the slack and the shared settings after creating the store.
        if self._channel is None:
            self._handshake()
            if self._optimizer is not None:
                self._send_optimizer()

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
        if self._channel is not None:
            self._send_optimizer()

    def _send_optimizer(self):
        # Described before sending: the servers' reply describes what they will apply, and
        # that must be this worker's optimizer as it is now (compared only here: the
        # learning rate changes later through SET_HYPER, legitimately), except rescale_grad:
        # the servers apply the job's (see scale_gradients).
        mine = describe_optimizer(self._optimizer)
        replies = self._command(Command.OPTIMIZER,
                                {'optimizer': protocol.pack_object(self._optimizer)},
                                refusal=ValueError)
        for server, reply in enumerate(replies):
            differences = optimizer_differences(reply.get('optimizer'), mine, PER_STEP_FIELDS)
            if differences:
                raise ValueError(
                    'mxdelay server %d applies another optimizer than worker %d set: %s. A '
                    'server keeps the optimizer it has applied since the first round (a new '
                    'one would drop its state): set the optimizer before training starts, '
                    'change the learning rate with set_learning_rate, or restart the job'
                    % (server, self.rank, format_differences(
                        differences, 'the server', 'this worker')))

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
        state in float32; pulls return float32 weights (docs/design.md §2.11). Pulls are never
        compressed. Every worker must set the same, before the first :meth:`init` or command
        (Gluon's trainers call this when they create the store); compressed tensors must be
        float32.

        Parameters
        ----------
        compression_params : dict
            E.g. ``{'type': '2bit', 'threshold': 0.5}`` (threshold default 0.5) or
            ``{'type': 'fp16'}``.

        Raises
        ------
        ValueError
            For bad parameters (for '2bit' MXNet's message; also ``mxnet.base.MXNetError``),
            or if the store has started (stock MXNet accepts that silently; its residuals
            would start late and a key split over the servers would break).
        """
        if self._channel is not None or self._tensors:
            raise ValueError('set_gradient_compression must be called before the first init() '
                             '(and before any command, e.g. set_learning_rate), on every '
                             'worker alike: this store has started; call it right after '
                             "mx.kv.create('dist_delay'), or pass compression_params to the "
                             'trainer')
        self._compression = compression.parse(compression_params)

    @property
    def compression(self):
        """The :class:`kvstore_ext.compression.Compression` in use, or None."""
        return self._compression

    @property
    def wire_dtype(self):
        """The dtype gradients are pushed in: 'float16' with fp16 compression, else None
        (each tensor's own)."""
        return self._compression.wire_dtype if self._compression is not None else None

    def _check_compressible(self, keys, values):
        if self._compression is None:
            return
        for k, v in zip(keys, values):
            v = v[0] if isinstance(v, (list, tuple)) else v
            self._compression.check_dtype('key %r' % (k,), v.dtype)

    def init(self, key, value):
        """Place `key` (int or list of ints) on the servers with initial `value`.

        Raises
        ------
        TypeError
            If a key is not an int or str, or a value not an NDArray.
        ValueError
            If a key is already initialised or given twice (nothing is placed then).
        """
        keys, values = _as_lists(key, value)
        _refuse_module_local_update()
        for k in keys:
            if k in self._tensors or keys.count(k) > 1:
                raise ValueError('key %r is already initialised or given twice; initialise '
                                 'each key once' % (k,))
        self._check_compressible(keys, values)
        self._ensure_started()
        native_keys, native_values, chunks_msg, placed = [], [], [], []
        for k, v in zip(keys, values):
            v = v[0] if isinstance(v, (list, tuple)) else v
            if sparse.is_row_sparse(v, self._param_of(k)):  # chunks of rows, docs/design.md §2.10
                if self.wire_dtype:
                    raise ValueError("key %r is row_sparse: compression_params={'type': 'fp16'} "
                                     'pushes dense float32 gradients only; remove the '
                                     'compression or use a dense parameter' % (k,))
                tensor = self._tensors[k] = sparse.place_rows(self._placement, k, v.shape,
                                                              v.dtype, v.stype)
                chunk_values = sparse.init_values(tensor, v)
                for chunk, chunk_value in zip(tensor.chunks, chunk_values):
                    native_keys.extend(chunk.keys)
                    native_values.extend([chunk_value] * len(chunk.keys))
            else:
                tensor = self._place(k, v)
                placed.append(tensor)
                flat = v.reshape(-1)
                chunk_values = [flat[c.start:c.stop] for c in tensor.chunks]
                for chunk, chunk_value in zip(tensor.chunks, chunk_values):
                    native_keys.extend(chunk.keys)
                    if self.wire_dtype:
                        # float16 slot keys (their value is never read: pulls read the pull
                        # keys, which start at the tensor's float32 value).
                        zeros = nd.zeros(chunk.stop - chunk.start, dtype=self.wire_dtype)
                        native_values.extend([zeros] * len(chunk.keys))
                        native_keys.extend(chunk.pull_keys)
                    native_values.extend([chunk_value] * len(chunk.pull_keys))
            for chunk, chunk_value in zip(tensor.chunks, chunk_values):
                lr_mult, wd_mult, name = self._mults(k)
                chunks_msg.append([chunk.chunk_id, chunk.server,
                                   int(k) if isinstance(k, (int, np.integer))
                                   else str(k), name, lr_mult, wd_mult,
                                   int(np.prod(chunk_value.shape))])
        if self._finish is None:
            # The counter is placed with the first keys, in the same collective init, so that
            # its chunk id and server are the same on every worker.
            value = nd.zeros(counter_size(self._slack + 1))
            counter = self._placement.place(protocol.FINISH_KEY, value.shape, value.dtype)
            chunk = counter.chunks[0]
            native_keys.extend(chunk.keys)
            native_values.extend([value] * len(chunk.keys))
            chunks_msg.append([chunk.chunk_id, chunk.server, protocol.FINISH_KEY,
                               protocol.FINISH_KEY, 1.0, 1.0, value.size])
            counter.make_buffers(self._slack + 1, mx.cpu())
            self._finish = FinishCounter(counter, self, self.num_workers,
                                         self._compression.flag_unit if self._compression
                                         else 1.0)
        self._command(Command.REGISTER, {'chunks': chunks_msg})
        self._native.init(native_keys, native_values)
        if self.wire_dtype:
            for tensor in placed:
                tensor.make_pull_buffers(self._slack + 1)
            wire.push_handle_round(self._native, placed)

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

    def _place(self, key, value):
        tensor = self._placement.place(key, value.shape, value.dtype, self.wire_dtype)
        self._tensors[key] = tensor
        if self._compression is not None:
            residual = self._compression.make_residual(tensor.size)
            if residual is not None:
                self._residuals[key] = residual
        return tensor

    def broadcast(self, key, value, out, priority=0):
        """Initialise `key` with rank 0's `value` and pull it into `out` on every worker."""
        _as_lists(key, out, 'out', priority)  # check before anything is placed
        self.init(key, value)
        self.pull(key, out=out, priority=priority)

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
            If a key was not initialised.
        """
        keys, values = self._checked_lists(key, value, 'value', priority)
        for k, v in zip(keys, values):
            self._push_one(k, v if isinstance(v, (list, tuple)) else [v], priority)

    def _push_one(self, key, grads, priority):
        tensor = self._tensor(key)
        finite = self._finite.get(tensor.next_round)
        if self._finish is not None:
            self._finish.flag_round(tensor.next_round, finite)  # once per round: "I have data"
        self.push_tensor(tensor, grads, priority, self._gradient_factor(), finite)

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
        """
        if not isinstance(flag, nd.NDArray) or flag.size != 1:
            raise ArgumentTypeError('flag must be a one-element NDArray (1: all finite, 0: '
                                    'overflow), got %s' % _describe(flag))
        self._finite = {self._finish.flagged_rounds if self._finish else 0: flag}

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

    def push_tensor(self, tensor, grads, priority, factor=None, finite=None):
        """Push round ``tensor.next_round`` of `tensor`: the sum of `grads` (one array per
        device), times `factor` if given, copied into the round's slot buffer, divided by the
        one-element NDArray `finite` if given (see :meth:`set_finite_flag`)."""
        if isinstance(tensor, sparse.SparseTensor):
            return sparse.push(self, tensor, grads, priority, factor)
        slots = self._slack + 1
        slot = tensor.next_round % slots
        if tensor.buffers is None:
            tensor.make_buffers(slots, mx.cpu() if grads[0].context.device_type == 'cpu'
                                else mx.cpu_pinned())
        buf = tensor.buffers[slot]
        if tensor.wire:
            wire.order_push(tensor, slot)
        if len(grads) == 1:
            source = tensor.views_of(grads[0])[2]
        else:
            # Sum on the first device (a GPU stays a GPU), then one copy to the buffer.
            first = grads[0].context
            source = nd.add_n(*[tensor.views_of(g)[2].as_in_context(first) for g in grads])
        residual = self._residuals.get(tensor.key)
        if residual is not None and factor is None and source.context == buf.context:
            # The gradient is quantized straight into the buffer: no copy first (§2.8).
            self._compression.quantize(buf, residual, source)
        else:
            if tensor.wire:
                wire.fill_send_buffer(source, buf, factor)
            elif factor is None:
                source.copyto(buf)
            elif source.context == buf.context:
                nd._internal._mul_scalar(source, scalar=factor, out=buf)  # in the copy's pass
            else:
                (source * factor).copyto(buf)  # scaled on the device, then one copy
            if residual is not None:
                # One residual per tensor, quantized in the buffer (as MXNet's worker does in
                # its CPU send buffer); the native store's own quantization of these values is
                # then lossless and its per-slot residuals stay 0 (docs/design.md §2.8).
                self._compression.quantize(buf, residual)
        if self._compression is not None:
            self._last_factor[tensor.key] = factor
        if finite is not None:
            _divide_by_flag(buf, finite)
        self._native.push([c.keys[slot] for c in tensor.chunks], tensor.chunk_views[slot],
                          priority=priority)
        tensor.next_round += 1

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
            self._pull_one(k, o if isinstance(o, (list, tuple)) else [o], priority, ignore_sparse)

    def _pull_one(self, key, outs, priority, ignore_sparse=True):
        tensor = self._tensor(key)
        if isinstance(tensor, sparse.SparseTensor):
            return sparse.pull_dense(self, tensor, outs, priority, ignore_sparse)
        self.pull_tensor(tensor, outs, priority)

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
        _, ids = _as_lists(key, row_ids, 'row_ids', priority)
        for k, o, r in zip(keys, outs, ids):
            tensor = self._tensor(k)
            if not isinstance(tensor, sparse.SparseTensor):
                raise ArgumentTypeError('row_sparse_pull of key %r, which was initialised '
                                        'dense; use pull, or init the key with a row_sparse '
                                        'value' % (k,))
            # Gluon pulls a row_sparse weight's rows inside autograd.record() (its forward
            # reads row_sparse_data): the store's own copies into `out` must not be recorded.
            with mx.autograd.pause():
                sparse.row_sparse_pull(self, tensor, o if isinstance(o, (list, tuple)) else [o],
                                       r if isinstance(r, (list, tuple)) else [r], priority)

    def pull_tensor(self, tensor, outs, priority):
        """Pull into `outs` the weights of `tensor` after this worker's last pushed round."""
        last = tensor.next_round - 1
        slot = max(last, 0) % (self._slack + 1)
        if last >= 0:
            self._order_after_earlier_rounds(tensor, last)
        per_chunk = list(zip(*[tensor.views_of(o)[1] for o in outs]))
        self._native.pull([c.pull_keys[slot] for c in tensor.chunks],
                          out=[list(views) for views in per_chunk], priority=priority)
        tensor.last_pulled = last
        if last < 0:
            # Before the first push the native store pulls into a buffer of its own, which no
            # later push waits for: without this wait the request could reach the server after
            # this worker's round 0 completed, and return W_1 instead of the initial value.
            for out in outs:
                out.wait_to_read()

    def _order_after_earlier_rounds(self, tensor, last):
        """Queue the pull of round `last` behind the completion of every earlier round.

        A one-element write on another slot's buffer runs only after that slot's push is
        acknowledged (its round complete); the following write on this slot's buffer then
        orders the pull (which writes the same buffer) after it. Rounds up to the previous
        pull are covered by that pull (touching its slot waits for it), rounds more than a
        slack back by the reuse of their slot. The touched elements hold pushed data that is
        no longer needed, and the pull overwrites this slot's buffer.
        """
        slots = self._slack + 1
        earlier = range(max(tensor.last_pulled, last - slots + 1, 0), last)
        if tensor.wire:
            wire.order_pull(tensor, earlier, last)  # the pull lands in a buffer of its own
            return
        target = tensor.heads[last % slots]
        for rnd in earlier:
            head = tensor.heads[rnd % slots]
            nd._internal._plus_scalar(head, scalar=0.0, out=head)
            nd.elemwise_add(target, head, out=target)

    def pushpull(self, key, value, out=None, priority=0):
        """Push a round of `value` and pull the weights after it into `out` (or `value`)."""
        if out is not None:
            self._checked_lists(key, out, 'out', priority)  # before the push is issued
        self.push(key, value, priority)
        self.pull(key, out=value if out is None else out, priority=priority)

    def _checked_lists(self, key, value, name, priority):
        """:func:`_as_lists`, and each value's size against its initialised key (before
        anything is issued: a list of keys is pushed whole or not at all)."""
        keys, values = _as_lists(key, value, name, priority)
        for k, v in zip(keys, values):
            tensor = self._tensor(k)
            for array in (v if isinstance(v, (list, tuple)) else [v]):
                tensor.views_of(array, name)
        return keys, values

    def _tensor(self, key):
        try:
            return self._tensors[key]
        except KeyError:
            raise KeyError('key %r was not initialised on the dist_delay kvstore; call init '
                           'or broadcast first' % (key,)) from None

    # -- optimizer state ---------------------------------------------------------------------
    def fetch_optimizer_states(self, states):
        """Fill arrays with the servers' optimizer state of their keys; collective.

        Every worker calls it at the same point (a trainer: at its switch step), with the
        same keys. For each key, ``states[key][j]`` (an array of the key's shape) receives
        array j of the servers' optimizer state of that key
        (:func:`kvstore_ext.optimizers.flatten_state` of ``Updater.states``, chunk by chunk),
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
            If a key was not initialised.
        """
        self._ensure_started()
        plan = []
        for key in sorted(states, key=str):
            tensor = self._tensor(key)
            arrays = list(states[key])
            if len(arrays) > self._state_keys:
                raise ValueError('fetch_optimizer_states: key %r asks for %d state arrays, but '
                                 'the store was configured with state_keys=%d'
                                 % (key, len(arrays), self._state_keys))
            for j, array in enumerate(arrays):
                if array.size != tensor.size:
                    raise ValueError('fetch_optimizer_states: state array %d of key %r has %d '
                                     'elements, the key %d' % (j, key, array.size, tensor.size))
                plan.append((tensor, j, array))
        if not plan:
            return
        # Every round pushed so far is applied on the servers (a push completes when its
        # round is applied), and this worker pushes no later round before the pulls below
        # have returned: the state is exactly the one after this worker's last round.
        nd.waitall()
        keys, buffers, views = [], [], []
        layout = self._placement.layout
        for tensor, j, array in plan:
            buf = nd.zeros(tensor.size, ctx=mx.cpu(), dtype=array.dtype)
            # A row_sparse tensor's chunks are ranges of rows (§2.10).
            unit = tensor.row_size if isinstance(tensor, sparse.SparseTensor) else 1
            for chunk in tensor.chunks:
                keys.append(layout.state_key(chunk.local, j, chunk.server))
                views.append(buf[chunk.start * unit:chunk.stop * unit])
            buffers.append(buf)
        new = [(k, v) for k, v in zip(keys, views) if k not in self._state_keys_made]
        if new:   # collective: a barrier of all workers (every worker fetches alike)
            self._native.init([k for k, _ in new], [v for _, v in new])
            self._state_keys_made.update(k for k, _ in new)
        self._native.push(keys, views)
        # Into the pushed buffers: MXNet's engine runs the pull after the push is
        # acknowledged, i.e. after the server wrote the state (docs/design.md §2.4).
        self._native.pull(keys, out=views)
        for (tensor, j, array), buf in zip(plan, buffers):
            buf.reshape(array.shape).copyto(array)
        for _, _, array in plan:
            array.wait_to_read()

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
        rank 0's stops the servers). Called at exit (:mod:`kvstore_ext.hooks`)."""
        if self._native is None:
            return
        try:
            self._fill_remaining_rounds()
        except Exception:  # pylint: disable=broad-except
            _LOG.exception('dist_delay: worker %d could not fill the other workers\' rounds',
                           self.rank)
        # Drop every reference to the native store, so that the caller's gc.collect() runs
        # its destructor now, before MXNet's engine shuts down.
        self._native = self._channel = None

    def _fill_remaining_rounds(self):
        if self._finish is None or self._finish.all_finished:
            return
        padded = 0
        while not self.finish_round(leaving=True):
            for tensor in self._tensors.values():
                # a tensor pushed in every round so far gets this round too
                if tensor.next_round == self._finish.flagged_rounds - 1:
                    self.push_tensor(tensor, [tensor.zeros()], 0)
            padded += 1
        if padded:
            _LOG.info('dist_delay: worker %d had no data for the last %d rounds of the other '
                      'workers and pushed zero gradients in them', self.rank, padded)

    # -- rounds, state ---------------------------------------------------------------------
    def num_chunks(self, key):
        """Number of native keys (chunks) of `key`: push operations per round."""
        return len(self._tensor(key).chunks)

    def send_buffer(self, key):
        """The buffer that this worker's last push of `key` sends from (held by the push until
        its round is acknowledged; for :mod:`mxdelay.timeline`). For a row_sparse key: the
        gradient handed to the native store, held until the store has copied it."""
        tensor = self._tensor(key)
        if isinstance(tensor, sparse.SparseTensor):
            return tensor.sent
        return tensor.buffers[(tensor.next_round - 1) % (self._slack + 1)]

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
        source = self.send_buffer(key).reshape(grad.shape)
        factor = self._last_factor.get(key)
        if factor is None and source.dtype == grad.dtype and source.context == grad.context:
            return source
        if self.wire_dtype and (factor is not None or source.context != grad.context):
            # float16(factor * g) was sent, and the rule reads g rounded on its own (§1.4);
            # or `grad` is on a GPU (MXNet copies across devices only within one dtype).
            return grad.astype(self.wire_dtype).astype(grad.dtype)
        out = self._sent.get(key)
        if out is None:
            out = self._sent[key] = nd.zeros(grad.shape, ctx=grad.context, dtype=grad.dtype)
        source.copyto(out)   # to the gradient's device; float16 to float32 is exact
        if factor is not None:
            nd._internal._div_scalar(out, scalar=factor, out=out)
        return out

    def residuals(self):
        """This worker's compression residuals: {key: numpy array} (empty without)."""
        return {k: r.asnumpy() for k, r in self._residuals.items()}

    def set_residuals(self, residuals):
        """Restore what :meth:`residuals` returned (a checkpoint's), before pushing again.

        Raises
        ------
        ValueError
            If the keys or sizes differ from this store's residuals.
        """
        if set(residuals) != set(self._residuals):
            raise ValueError('compression residuals for keys %s, this store has %s: saved with '
                             'another compression setting or model'
                             % (sorted(residuals, key=str), sorted(self._residuals, key=str)))
        for key, value in residuals.items():
            if np.size(value) != self._residuals[key].size:
                raise ValueError('compression residual of key %r has %d elements, the key %d'
                                 % (key, np.size(value), self._residuals[key].size))
        for key, value in residuals.items():
            self._residuals[key][:] = np.asarray(value, dtype=np.float32).reshape(-1)

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
        _wait_for_issued_work()
        return self._channel.agree(error, self.barrier)

    def save_optimizer_states(self, fname, dump_optimizer=False):
        """Save the servers' weights, optimizer states and rounds, and this worker's rounds.

        Every worker must call it (it starts with a barrier so that no round is in flight).
        The servers write ``fname + '.server<i>'``; worker 0 writes `fname`, the index. A load
        looks for the servers' files next to the index it is given, so a checkpoint can be
        copied, moved or renamed as a whole. Every file is written atomically.
        """
        fname = check_path('fname', fname)
        nd.waitall()
        self.barrier()
        if self.rank == 0:
            self._command(Command.SAVE, {'paths': checkpoint.server_files(fname,
                                                                          self._num_servers)})
            checkpoint.write_json(fname, checkpoint.KVSTORE_INDEX, {
                'num_servers': self._num_servers, 'slack': self._slack,
                'chunk_size': self._chunk_size,
                'rounds': {str(k): t.next_round for k, t in self._tensors.items()},
                'finish_rounds': self._finish.tensor.next_round if self._finish else 0,
                'rescale_grad': self._job_rescale_grad})
        self.barrier()

    def load_optimizer_states(self, fname):
        """Restore what :meth:`save_optimizer_states` saved (every worker calls it).

        Raises
        ------
        ValueError
            On every worker, if any file is missing, truncated or foreign, or was saved by a
            different job layout; nothing changes then, on the workers or the servers.
        TypeError
            If `fname` is not a path.
        """
        self.apply_states(self.check_states(check_path('fname', fname)))

    def check_states(self, fname, error=None):
        """Collective first half of a load: validate everything, agree, change nothing.

        Parameters
        ----------
        fname : str
            The index file written by :meth:`save_optimizer_states`.
        error : str, optional
            A failure the caller found in its own files, to be agreed on as well.

        Returns
        -------
        dict
            The validated state, for :meth:`apply_states`.
        """
        fname = check_path('fname', fname)
        check_optional_text('error', error, 'pass None, or a message saying what failed')
        nd.waitall()
        state = None
        try:
            state = checkpoint.read_json(fname, checkpoint.KVSTORE_INDEX)
            for name, expected in (('num_servers', self._num_servers), ('slack', self._slack),
                                   ('chunk_size', self._chunk_size)):
                if state[name] != expected:
                    raise ValueError('%s was saved with %s=%r but this job has %s=%r; start '
                                     'the job with the same setting'
                                     % (fname, name, state[name], name, expected))
            if set(state['rounds']) != {str(k) for k in self._tensors}:
                raise ValueError('%s holds keys %s, this kvstore has %s: the model differs'
                                 % (fname, sorted(state['rounds']),
                                    sorted(str(k) for k in self._tensors)))
            state['servers'] = checkpoint.server_files(fname, self._num_servers)
            if self.rank == 0:
                # Every server validates its file before any server changes.
                self._command(Command.LOAD, {'paths': state['servers'], 'check_only': True,
                                             'optimizer': describe_optimizer(self._optimizer)})
        except (ValueError, RuntimeError) as err:
            error = error or str(err)
        failures = self.agree(error)
        if failures:
            raise ValueError('cannot load %s, nothing was changed: %s' % (fname, '; '.join(
                'worker %d: %s' % failure for failure in failures)))
        return state

    def apply_states(self, state):
        """Collective second half of a load: servers and round counters take `state`."""
        if not isinstance(state, dict) or 'servers' not in state or 'rounds' not in state:
            raise ArgumentTypeError('state must be the dict that check_states returned, got '
                                    '%.80r (%s)' % (state, type(state).__name__))
        if self.rank == 0:
            self._command(Command.LOAD, {'paths': state['servers'],
                                         'optimizer': describe_optimizer(self._optimizer)})
        self.barrier()
        for key, tensor in self._tensors.items():
            tensor.next_round = state['rounds'][str(key)]
        if self._finish is not None:
            self._finish.restore(state['finish_rounds'],
                                 max([t.next_round for t in self._tensors.values()] + [0]))
        # The servers apply the saved job's rescale_grad from now on (its optimizer).
        self._job_rescale_grad = state['rescale_grad']



def _as_lists(key, value, name='value', priority=0):
    """Return ``([keys], [values])`` of a call with one key or a list of keys, checked: a key
    is an int or str, a value an NDArray or a non-empty list of NDArrays (one per device)."""
    if type(priority) is not int:  # noqa: E721  (the common case, without the ABC check)
        check_int('priority', priority, fix='a higher priority is sent first; Gluon uses -index')
    if isinstance(key, (list, tuple)):
        if not isinstance(value, (list, tuple)) or len(value) != len(key):
            raise ValueError('with a list of %d keys, pass a list of as many values as %s, got '
                             '%s' % (len(key), name, _describe(value)))
        keys, values = list(key), list(value)
    else:
        keys, values = [key], [value]
    for k, v in zip(keys, values):
        if isinstance(k, (bool, np.bool_)) or not isinstance(k, (int, np.integer, str)):
            raise ArgumentTypeError('key must be an int or a str (or a list of them), got %r '
                                    '(%s)' % (k, type(k).__name__))
        arrays = v if isinstance(v, (list, tuple)) else [v]
        if not arrays or not all(isinstance(a, nd.NDArray) for a in arrays):
            raise ArgumentTypeError('%s for key %r must be an NDArray or a non-empty list of '
                                    'NDArrays (one per device), got %s; convert with '
                                    'mx.nd.array(...)' % (name, k, _describe(v)))
    return keys, values


def _describe(value):
    if isinstance(value, (list, tuple)):
        return '%s of %s' % (type(value).__name__,
                             sorted({type(v).__name__ for v in value}) or 'nothing')
    return '%.80r (%s)' % (value, type(value).__name__) if not isinstance(value, nd.NDArray) \
        else 'an NDArray of shape %s' % (value.shape,)


def _divide_by_flag(buf, finite):
    # In place, after the copy: x / 1 is x bit for bit; x / 0 is inf or nan for every x
    # (docs/design.md §11). The push waits in MXNet's engine for the flag, i.e. for the end
    # of backward.
    nd.broadcast_div(buf, finite.as_in_context(buf.context), out=buf)


def _wait_for_issued_work():
    # A command travels at once, from this thread (MXNet's SendCommandToServers), while the
    # pushes and pulls issued before it may still wait in MXNet's engine (a push waits for
    # backward to write its gradient): without this wait a command could overtake them,
    # e.g. a new learning rate would reach a round pushed before set_learning_rate, and
    # STATS would miss it. A push completes once its round is applied on the server, so
    # after this every round this worker pushed is applied (which waits for the other
    # workers' pushes of those rounds too: a command is a collective point in that sense).
    nd.waitall()


def _refuse_module_local_update():
    """Refuse ``Module``'s ``update_on_kvstore=False`` path (``MXNET_UPDATE_ON_KVSTORE=0``):
    its own updater would apply ``1.0/batch_size`` (no '_sync' in the type) to the round's
    sum, which :func:`_module_rescale` never sees. Recognised by the caller chain
    ``Module.init_optimizer`` -> ``mxnet.model._initialize_kvstore`` -> ``init``."""
    try:
        caller = sys._getframe(2)  # pylint: disable=protected-access
    except ValueError:  # init called from the outermost frame: not Module
        return
    if (caller.f_code is mx.model._initialize_kvstore.__code__  # pylint: disable=protected-access
            and not caller.f_locals.get('update_on_kvstore', True)
            and caller.f_back is not None
            and caller.f_back.f_code is mx.mod.Module.init_optimizer.__code__):
        raise ValueError("mx.mod.Module with kvstore='dist_delay' must update on the kvstore "
                         '(the servers apply the optimizer), but update_on_kvstore is False: '
                         'unset MXNET_UPDATE_ON_KVSTORE')


class _OptimizerHolder(object):
    """What Gluon's ``Trainer.load_states`` reads from a kvstore: ``_updater.optimizer``."""

    def __init__(self, optimizer):
        self.optimizer = optimizer


hooks.register_store_type(DistDelay)
gluon_sparse.accept_in_gluon(DistDelay)
