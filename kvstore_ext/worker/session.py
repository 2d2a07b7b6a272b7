"""What the parts of one worker's ``'dist_delay'`` store share: its :class:`Session`.

The store's face (:mod:`kvstore_ext.worker.dist_delay`) and its parts (the rounds, uneven
data, the state fetch, checkpoints, the job's collectives, byte accounting, aux states) all
work on one session: the native store, the link to the servers, the settings, the
optimizer, and the tensors placed at ``init`` with the key kinds and the finish counter
that the hand-shake and the first ``init`` make.

The hand-shake waits for the first ``init`` or command, so that a trainer can still
configure the slack and the shared settings after creating the store; it proves the
servers are mxdelay's and that the workers agree (docs/design.md §4.3), then makes the key
placement and the key kinds for the final slack and codec.
"""
import logging

from kvstore_ext import codecs, env
from kvstore_ext.optim.optimizers import describe_optimizer, whole_tensor_name
from kvstore_ext.protocol import commands
from kvstore_ext.protocol.keys import KeyLayout, pull_keys_per_chunk
from kvstore_ext.worker import autocodec, sparse, wires
from kvstore_ext.worker.arguments import as_lists
from kvstore_ext.worker.aux_states import AuxKeys
from kvstore_ext.worker.channel import ServerLink
from kvstore_ext.worker.layout import Placement
from kvstore_ext.worker.settings import StoreSettings
from kvstore_ext.worker.store_errors import StoreValueError, UnknownKeyError
from kvstore_ext.worker.wires.slots import SlotWire

__all__ = ['Session']

_LOG = logging.getLogger(__name__)


class Session(object):
    """One worker's session in the job, shared by the store's face and parts.

    Parameters
    ----------
    native : mxnet.kvstore.KVStore
        The native distributed store.
    channel_factory : callable
        ``channel_factory(native, layout)`` makes the command channel at the hand-shake.

    Attributes
    ----------
    native : mxnet.kvstore.KVStore or None
        None once the store is closed.
    link : kvstore_ext.worker.channel.ServerLink
        The connection to the servers.
    settings : kvstore_ext.worker.settings.StoreSettings
    num_servers : int
    optimizer : mxnet.optimizer.Optimizer or None
        ``set_optimizer``'s.
    tensors : dict
        key -> its :class:`kvstore_ext.worker.layout.Tensor`, placed at ``init``.
    stateful : dict
        key -> its tensor's codec, where that keeps state (residuals).
    placement : kvstore_ext.worker.layout.Placement or None
        Made at the hand-shake, as are the key kinds ``dense`` (the codec's wire),
        ``rows`` (row_sparse keys), ``aux`` (aux states) and ``counter_keys`` (the finish
        counter's).
    finish : kvstore_ext.worker.finish.FinishCounter or None
        Placed at the first ``init``.
    job_rescale_grad : float or None
        The ``rescale_grad`` the servers apply (rank 0's at the hand-shake, or a loaded
        checkpoint's).
    """

    def __init__(self, native, channel_factory):
        self.native = native
        self.link = ServerLink(native, channel_factory)
        self.num_servers = env.get_int('DMLC_NUM_SERVER') or 1
        self.optimizer = None
        self.tensors = {}
        self.stateful = {}
        self.settings = StoreSettings(started=lambda: self.link.channel is not None,
                                      placed=lambda: bool(self.tensors))
        self.placement = self.dense = self.rows = self.aux = self.counter_keys = None
        self.finish = None
        self.job_rescale_grad = None

    @property
    def rank(self):
        return self.native.rank

    @property
    def num_workers(self):
        return self.native.num_workers

    def ensure_started(self):
        """Run the hand-shake (and send the optimizer) unless it has run."""
        if self.link.channel is None:
            self._handshake()
            if self.optimizer is not None:
                self.link.send_optimizer(self.optimizer)

    def _layout(self):
        settings = self.settings
        slots = settings.slack + 1
        schedule = settings.pull_schedule()
        return KeyLayout(self.num_servers, slots, settings.state_keys,
                         pull_keys=pull_keys_per_chunk(slots, settings.codec.pull_keys,
                                                       bool(schedule)),
                         model_keys=1 if schedule else 0)

    def _choose_codecs(self):
        """compression_params='auto' on rank 0: measure, choose and take the codecs."""
        described = describe_optimizer(self.optimizer)
        chosen = autocodec.choose(
            self.settings.auto_codec, described and described['type'].lower(),
            self.num_workers, self.num_servers, self.settings.chunk_size,
            lambda nbytes: self.native._send_command_to_servers(  # pylint: disable=W0212
                0, commands.probe_text(nbytes)))
        self.settings.resolve_auto(chosen.push, chosen.pull)

    def _handshake(self):
        """Prove the servers are mxdelay's and the workers agree; prepare the key placement."""
        settings = self.settings
        auto = settings.auto_codec is not None
        if auto and self.rank == 0:
            self._choose_codecs()
        slots = settings.slack + 1
        codec = settings.codec
        schedule = settings.pull_schedule()
        layout = self._layout()
        pull_codec = settings.pull_compression
        hello = {'rank': self.rank, 'num_workers': self.num_workers, 'slots': slots,
                 'state_keys': settings.state_keys,
                 'pull_keys': layout.pull_keys, 'model_keys': layout.model_keys,
                 'launcher_rank': env.get('MXDELAY_RANK'),
                 'protocol': commands.PROTOCOL_VERSION,
                 # The optimizer's description too: workers that set different optimizers
                 # fail here, all of them, naming both (the servers apply one optimizer).
                 'config': dict(settings.shared, slack=settings.slack,
                                chunk_size=settings.chunk_size,
                                state_keys=settings.state_keys,
                                optimizer=describe_optimizer(self.optimizer),
                                compression=codec.describe(),
                                **({'pull_compression': pull_codec.describe()}
                                   if schedule else {}),
                                # 'auto': the servers take rank 0's layout and codecs, and
                                # give them to the other workers in the reply.
                                **({'auto_codec': True} if auto else {}))}
        replies = self.link.start(layout, hello, codec)
        if settings.auto_codec is not None:   # not rank 0: its choice, from the reply
            chosen = replies[0].get('codec')
            if not isinstance(chosen, dict):
                raise RuntimeError("compression_params='auto': mxdelay server 0 did not give "
                                   "worker 0's choice of codecs in the hand-shake (an older "
                                   'mxdelay server?); install the same mxdelay everywhere')
            settings.resolve_auto(chosen.get('compression'), chosen.get('pull_compression'))
            codec, pull_codec, schedule = (settings.codec, settings.pull_compression,
                                           settings.pull_schedule())
            codec.configure_native(self.native)
            layout = self._layout()
        self.job_rescale_grad = replies[0].get('rescale_grad')  # the same on every server
        # LAMB, LARS, LBSGD read norms of whole tensors: each is kept in one chunk below
        # MXNet's bound, as dist_sync keeps it in one key (the servers refuse a split one).
        whole = self.optimizer is not None and whole_tensor_name(self.optimizer) is not None
        self.placement = Placement(layout, settings.chunk_size,
                                   commands.bigarray_bound() if whole else None)
        self.dense = wires.dense_keys(codec, self.native, slots, pull_codec, schedule)
        self.rows = sparse.RowSparseKeys(self.native, slots, codec)
        self.aux = AuxKeys(self.native, slots)
        self.counter_keys = SlotWire(self.native, slots, codecs.NONE)
        _LOG.info('dist_delay: worker %d of %d, %d mxdelay server(s), slack %d, chunk size %d',
                  self.rank, self.num_workers, self.num_servers, settings.slack,
                  settings.chunk_size)

    def command(self, command, body, refusal=RuntimeError):
        """Run `command` on every server; return the servers' replies (raise `refusal` if a
        server refuses)."""
        self.ensure_started()
        return self.link.command(command, body, refusal)

    def tensor(self, key):
        """The tensor of `key`.

        Raises
        ------
        KeyError
            If `key` was not initialised (:class:`UnknownKeyError`, also an ``MXNetError``).
        """
        try:
            return self.tensors[key]
        except KeyError:
            raise UnknownKeyError('key %r was not initialised on the dist_delay kvstore; call '
                                  'init or broadcast first' % (key,)) from None

    def checked_lists(self, key, value, name, priority):
        """:func:`kvstore_ext.worker.arguments.as_lists`, and each value's size against its
        initialised key (before anything is issued: a list of keys is pushed whole or not at
        all); outs (`name` ``'out'``) must have the key's shape, as MXNet's pulls require
        (its pushes take any shape of the key's size)."""
        keys, values = as_lists(key, value, name, priority)
        for k, v in zip(keys, values):
            tensor = self.tensor(k)
            for array in (v if isinstance(v, (list, tuple)) else [v]):
                tensor.views_of(array, name)
                if name == 'out' and tuple(array.shape) != tuple(tensor.shape):
                    raise StoreValueError('out for key %r has shape %s, but the key was '
                                          'initialised with shape %s; pull into arrays of '
                                          'the initialised shape'
                                          % (k, array.shape, tensor.shape))
        return keys, values

    def close(self):
        """Drop every reference to the native store, so that the caller's ``gc.collect()``
        runs its destructor now, before MXNet's engine shuts down."""
        self.native = None
        self.link.close()
        for kind in (self.dense, self.rows, self.aux, self.counter_keys):
            if kind is not None:
                kind.close()
