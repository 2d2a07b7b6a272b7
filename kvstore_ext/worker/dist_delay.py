"""The ``'dist_delay'`` kvstore: MXNet's native distributed store with exact rounds.

:class:`DistDelay` is MXNet's ``KVStoreBase`` face and no more: what Gluon's ``Trainer``,
``Module`` and a user calling the store need. The delayed update's own protocol belongs to
the store's parts, which a trainer gets through one attribute, :attr:`DistDelay.delayed`
(docs/design.md §2):

- ``settings`` (:mod:`kvstore_ext.worker.settings`): slack, chunk size, shared settings,
  compressed pulls;
- ``rounds`` (:mod:`kvstore_ext.worker.rounds`): the rounds, compressed pulls, gradient
  scaling, AMP's flags and overflows, what a push sent;
- ``uneven`` (:mod:`kvstore_ext.worker.uneven`): the finish vote of uneven data, and the
  rounds a leaving worker fills;
- ``state_fetch`` (:mod:`kvstore_ext.worker.statefetch`): the servers' optimizer state;
- ``checkpoint`` (:mod:`kvstore_ext.worker.store_checkpoint`): checkpoints saved and loaded
  in agreement, the residuals and pulled models;
- ``job`` (:mod:`kvstore_ext.worker.job`): barrier, vote, the servers' statistics;
- ``traffic`` (:mod:`kvstore_ext.worker.bytecount`): bytes per push and pull, chunks;
- ``aux`` (:mod:`kvstore_ext.worker.aux_states`): aux states averaged over the workers.

The face and its parts share one :class:`~kvstore_ext.worker.session.Session` (the native
store, the link to the servers, the placed tensors); :mod:`kvstore_ext.worker.placing`
places keys at :meth:`DistDelay.init`, choosing each key's kind once. A pull after round t
is ordered behind every earlier round (:meth:`DenseWire.pull
<kvstore_ext.worker.wires.base.DenseWire.pull>`), and the server applies rounds in order
(:mod:`kvstore_ext.server.rounds`), so it returns exactly the weights after round t.
"""
import collections
import logging

import mxnet as mx
from mxnet.kvstore import KVStoreBase

from kvstore_ext.checks import ArgumentTypeError, check_path, check_real
from kvstore_ext.protocol.commands import Command
from kvstore_ext.typenames import TYPE_STRING
from kvstore_ext.worker import gluon_sparse, hooks, module_path, placing
from kvstore_ext.worker.arguments import as_lists, listed
from kvstore_ext.worker.aux_states import Averaging
from kvstore_ext.worker.bytecount import ByteCount
from kvstore_ext.worker.channel import CommandChannel
from kvstore_ext.worker.job import Job
from kvstore_ext.worker.rounds import Rounds
from kvstore_ext.worker.session import Session
from kvstore_ext.worker.statefetch import StateFetch
from kvstore_ext.worker.store_checkpoint import StoreCheckpoint
from kvstore_ext.worker.store_errors import UnknownKeyError
from kvstore_ext.worker.uneven import UnevenData

__all__ = ['DistDelay', 'DelayedParts', 'UnknownKeyError']

_LOG = logging.getLogger(__name__)

#: The parts of a store that only the delayed update uses (:attr:`DistDelay.delayed`).
DelayedParts = collections.namedtuple(
    'DelayedParts', ['settings', 'rounds', 'uneven', 'state_fetch', 'checkpoint', 'job',
                     'traffic', 'aux'])


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
    5. ``delayed.settings.set_pull_compression`` (the same on every worker, before the
       first :meth:`init`): the pulls of the rounds every worker pulls carry ``C(W - x̂)``,
       float16 or int8 (``delayed.rounds.pull_compressed``,
       :mod:`kvstore_ext.codecs.pulls`); :meth:`pull` stays exact.

    Configuration comes from ``MXDELAY_SLACK`` and ``MXDELAY_CHUNK_SIZE`` (README table) and
    can be changed with ``delayed.settings.configure`` before the first :meth:`init`.

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
        self._session = session = Session(native, channel_factory)
        self._updater = None       # Gluon's load_states reads kvstore._updater.optimizer
        self._rounds = Rounds(session)
        job = Job(session)
        self._parts = DelayedParts(
            settings=session.settings, rounds=self._rounds,
            uneven=UnevenData(session, self._rounds), state_fetch=StateFetch(session),
            checkpoint=StoreCheckpoint(session, job), job=job, traffic=ByteCount(session),
            aux=Averaging(session))

    @property
    def delayed(self):
        """The store's parts that the delayed update uses (:class:`DelayedParts`, fixed at
        creation): ``settings``, ``rounds``, ``uneven``, ``state_fetch``, ``checkpoint``,
        ``job``, ``traffic`` and ``aux`` (the module docstring says what each does)."""
        return self._parts

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
        return self._session.rank

    @property
    def num_workers(self):
        return self._session.num_workers

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
        session = self._session
        session.optimizer = optimizer
        self._updater = _OptimizerHolder(optimizer)
        if session.link.channel is not None:
            session.link.send_optimizer(optimizer)

    def set_learning_rate(self, lr):
        """Set the learning rate of the servers' optimizer (Gluon's trainer sets only its own).

        Raises
        ------
        TypeError, ValueError
            If `lr` is not a finite number >= 0.
        """
        lr = check_real('lr', lr, minimum=0, fix='e.g. set_learning_rate(0.01)')
        self._session.command(Command.SET_HYPER, {'lr': lr})

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
        on the servers (docs/design.md §2.14). Pulls are compressed only by
        ``delayed.settings.set_pull_compression``. Every worker must set the same, before
        the first :meth:`init` or command (Gluon's trainers call this when they create the
        store); compressed tensors must be float32.

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
        self._session.settings.set_compression(compression_params)

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
        placing.place(self._session, keys, values)

    def broadcast(self, key, value, out, priority=0):
        """Initialise `key` with rank 0's `value` and give that value to every worker in `out`.

        What the servers hold is rank 0's `value`, bit for bit (MXNet's init pushes rank
        0's), so the key's kind lets rank 0 copy it instead of pulling it back, and the other
        workers pull it once (with compressed pulls, that pull is also their initial x̂):
        docs/design.md §2.4.
        """
        as_lists(key, out, 'out', priority)  # check before anything is placed
        self.init(key, value)
        keys, outs = self._session.checked_lists(key, out, 'out', priority)
        _, values = as_lists(key, value)
        for k, v, o in zip(keys, values, outs):
            tensor = self._session.tensors[k]
            tensor.kind.initial_pull(tensor, listed(v)[0], listed(o), priority)

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
        keys, values = self._session.checked_lists(key, value, 'value', priority)
        for k, v in zip(keys, values):
            self._rounds.send_next(k, listed(v), None, priority, exchange=False)

    def pull(self, key, out=None, priority=0, ignore_sparse=True):
        """Pull into `out` the weights after this worker's last pushed round of `key`.

        After the push of round t this is exactly ``W_{t+1}``; before any push, the initial
        value. Returns at once: reading `out` waits for the pull (and therefore for every
        worker's push of round t), nothing else does.
        """
        if out is None:
            raise ArgumentTypeError('pull needs out=: the NDArray (or list of NDArrays, one '
                                    'per device) to receive the weights of key %r' % (key,))
        keys, outs = self._session.checked_lists(key, out, 'out', priority)
        for k, o in zip(keys, outs):
            tensor = self._session.tensors[k]
            tensor.kind.pull(tensor, listed(o), priority, ignore_sparse)

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
        session = self._session
        _, outs = session.checked_lists(key, out, 'out', priority)  # before the push is issued
        keys, values = session.checked_lists(key, value, 'value', priority)
        for k, v, o in zip(keys, values, outs):
            self._rounds.send_next(k, listed(v), listed(o), priority, exchange=True)

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
        keys, outs = self._session.checked_lists(key, out, 'out', priority)
        _, ids = as_lists(key, row_ids, 'row_ids', priority)
        for k, o, r in zip(keys, outs, ids):
            tensor = self._session.tensors[k]
            # Gluon pulls a row_sparse weight's rows inside autograd.record() (its forward
            # reads row_sparse_data): the store's own copies into `out` must not be recorded.
            with mx.autograd.pause():
                tensor.kind.row_sparse_pull(tensor, listed(o), listed(r), priority)

    def save_optimizer_states(self, fname, dump_optimizer=False):
        """Save the servers' weights, optimizer states and rounds, and this worker's rounds.

        Every worker must call it (it starts with a barrier so that no round is in flight).
        The servers write ``fname + '.server<i>'``; worker 0 writes `fname`, the index, with
        the save's id and the servers' files' sha256 (docs/design.md §6.2). A load looks for
        the servers' files next to the index it is given, so a checkpoint can be copied,
        moved or renamed as a whole. Every file is written atomically; none is a pickle.
        """
        self._parts.checkpoint.save(check_path('fname', fname))

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
        checkpoint = self._parts.checkpoint
        checkpoint.apply_states(checkpoint.check_states(check_path('fname', fname),
                                                        trusted=trusted))

    def close(self):
        """Leave the job: fill the other workers' remaining rounds with zero gradients (as
        if this worker had called ``delayed.uneven.finish_round`` until every worker
        finished), then release the native store (its destructor meets the other workers in
        a barrier, and rank 0's stops the servers). Called at exit
        (:mod:`kvstore_ext.worker.hooks`)."""
        if self._session.native is None:
            return
        try:
            self._parts.uneven.leave()
        except Exception:  # pylint: disable=broad-except
            _LOG.exception('dist_delay: worker %d could not fill the other workers\' rounds',
                           self.rank)
        self._session.close()


class _OptimizerHolder(object):
    """What Gluon's ``Trainer.load_states`` reads from a kvstore: ``_updater.optimizer``."""

    def __init__(self, optimizer):
        self.optimizer = optimizer


hooks.register_store_type(DistDelay)
gluon_sparse.accept_in_gluon(DistDelay)
module_path.refuse_local_update(DistDelay)
