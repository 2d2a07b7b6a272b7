"""What a ``'dist_delay'`` store is configured with before its hand-shake: the store's
``settings`` part (``DistDelay.delayed.settings``).

The slack and the chunk size (``MXDELAY_SLACK``, ``MXDELAY_CHUNK_SIZE``, or
:meth:`StoreSettings.configure`), the state keys per chunk, the settings every worker must
share (:meth:`StoreSettings.set_config`), the push codec (``set_gradient_compression``) and
the pull codec (:meth:`StoreSettings.set_pull_compression`). Each is validated when it is
set; the hand-shake (:mod:`kvstore_ext.worker.session`) sends them to the servers, which
refuse workers that differ (docs/design.md §4.3).
"""
import json

from kvstore_ext import codecs, env
from kvstore_ext.checks import ArgumentTypeError, check_int, check_rounds
from kvstore_ext.codecs import pulls
from kvstore_ext.protocol import commands
from kvstore_ext.protocol.schedule import PullSchedule

__all__ = ['StoreSettings']


class StoreSettings(object):
    """One store's configuration, fixed at its hand-shake.

    Parameters
    ----------
    started : callable
        ``started()``: whether the hand-shake has run (no codec may change then).
    placed : callable
        ``placed()``: whether a key has been placed (nothing may change then).

    Raises
    ------
    TypeError, ValueError
        If ``MXDELAY_SLACK`` or ``MXDELAY_CHUNK_SIZE`` is out of range (as :meth:`configure`).
    """

    def __init__(self, started, placed):
        self._started, self._placed = started, placed
        self._slack = None
        self._chunk_size = None
        self._state_keys = 0       # J: state keys per chunk (fetch_optimizer_states)
        self._shared = {}
        # The codec (docs/design.md §2.8): codecs.NONE, or set_gradient_compression's.
        self._codec = codecs.NONE
        # Compressed pulls (set_pull_compression, docs/design.md §2.12): the codec, or None.
        self._pull_codec = None
        # compression_params='auto' (docs/design.md §2.16): its Request until the hand-shake.
        self._auto = None
        self._schedule = None          # the trainer's PullSchedule (set_schedule)
        self.configure(slack=env.get_int('MXDELAY_SLACK'),
                       chunk_size=env.get_int('MXDELAY_CHUNK_SIZE'))

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
            J >= 0: arrays of a chunk's optimizer state that ``fetch_optimizer_states``
            (:mod:`kvstore_ext.worker.statefetch`) can fetch (default 0: none; every worker
            must set the same).

        Raises
        ------
        TypeError
            If a value is not an integer (:class:`mxdelay.ArgumentTypeError`).
        ValueError
            If a value is out of range, or if keys were already initialised.
        """
        if self._placed():
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

    @property
    def state_keys(self):
        """J, the state keys per chunk."""
        return self._state_keys

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
        self._shared.update(config)

    @property
    def shared(self):
        """A copy of the settings of :meth:`set_config`."""
        return dict(self._shared)

    def set_compression(self, compression_params):
        """The codec of ``DistDelay.set_gradient_compression`` (see there).

        Raises
        ------
        ValueError
            For bad parameters, or if the store has started.
        """
        if self._started() or self._placed():
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
        decoded values to its own x̂ (``pull_compressed`` of :mod:`kvstore_ext.worker.rounds`).
        What was not sent goes out with the next pull. ``DistDelay.pull`` stays exact. The
        pulled rounds are those of ``set_config(delay=k, warmup_steps=W)``: every round up
        to W, then every k-th. Every worker must set the same, before the first ``init`` or
        command.

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
        if self._started() or self._placed():
            raise ValueError('set_pull_compression must be called before the first init() '
                             '(and before any command), on every worker alike: this store '
                             "has started; pass pull_compression to the trainer")
        self._pull_codec = codec

    def set_auto_codec(self, request):
        """Let the hand-shake choose the push and pull codecs (``compression_params='auto'``,
        :mod:`kvstore_ext.worker.autocodec`): rank 0 measures and chooses, every worker uses
        its choice. Every worker must set it, before the first ``init`` or command.

        Parameters
        ----------
        request : kvstore_ext.worker.autocodec.Request

        Raises
        ------
        ValueError
            If the store has started, or a codec is set already.
        """
        if self._started() or self._placed():
            raise ValueError("compression_params='auto' must be set before the first init() "
                             '(and before any command), on every worker alike: this store '
                             'has started')
        if self.compression is not None or self._pull_codec is not None:
            raise ValueError("compression_params='auto' chooses the codecs itself, but this "
                             'store has compression_params=%r, pull_compression=%r; set '
                             'either auto or the codecs'
                             % (self._codec.describe(), self._pull_codec
                                and self._pull_codec.describe()))
        self._auto = request

    @property
    def auto_codec(self):
        """The :class:`kvstore_ext.worker.autocodec.Request` of ``'auto'`` until the
        hand-shake resolves it (:meth:`resolve_auto`), else None."""
        return self._auto

    def resolve_auto(self, compression_params, pull_compression):
        """The hand-shake's choice for ``'auto'``: set both codecs (each a dict or None)."""
        self._codec = codecs.parse(compression_params) or codecs.NONE
        self._pull_codec = pulls.parse(pull_compression)
        self._auto = None

    @property
    def codec(self):
        """The job's :class:`kvstore_ext.codecs.Codec`: ``codecs.NONE`` without compression."""
        return self._codec

    @property
    def compression(self):
        """The :class:`kvstore_ext.codecs.Codec` set by ``set_gradient_compression``, or
        None."""
        return None if self._codec is codecs.NONE else self._codec

    @property
    def pull_compression(self):
        """The :class:`kvstore_ext.codecs.pulls.PullCodec` of compressed pulls, or None."""
        return self._pull_codec

    @property
    def wire_dtype(self):
        """The dtype gradients are pushed in: 'float16' with fp16 compression, else None
        (each tensor's own)."""
        return self._codec.wire_dtype

    def set_schedule(self, schedule):
        """The trainer's :class:`~kvstore_ext.protocol.schedule.PullSchedule` (the same
        object, so that ``delay='auto'``'s decisions reach the compressed pulls too); its
        ``describe()`` becomes the shared ``delay`` and ``warmup_steps``."""
        self.set_config(**schedule.describe())
        self._schedule = schedule

    def pull_schedule(self):
        """The pulled rounds of compressed pulls (None without): :meth:`set_schedule`'s, or
        one from the shared settings.

        Raises
        ------
        ValueError
            If the settings lack the schedule.
        """
        if self._pull_codec is None:
            return None
        missing = [name for name in ('delay', 'warmup_steps') if name not in self._shared]
        if missing:
            raise ValueError(
                'pull_compression=%r needs the pull schedule, which the servers use to write '
                'each pulled round\'s payload, but set_config() has no %s: DelayedTrainer sets '
                'it; a bare dist_delay store must call set_config(delay=k, warmup_steps=W) '
                '(every round up to W is pulled, then every k-th) before its first init'
                % (self._pull_codec.describe(), ' and '.join(missing)))
        if self._schedule is not None:
            return self._schedule
        return PullSchedule(self._shared['delay'], self._shared['warmup_steps'])
