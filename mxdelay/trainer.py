"""``DelayedTrainer``: a ``gluon.Trainer`` with the k-step delayed update (CN112463189B).

The algorithm is docs/design.md §1. This module is the Gluon adapter: the trainer's
arguments, checked at construction, Gluon's seams, and public methods that ask the mode
chosen when the kvstore is created: :class:`PassThrough` (``gluon.Trainer`` itself) or the
delayed update (:class:`mxdelay.delayed.DelayedUpdate`), which owns its state and asks
for what it needs of Gluon's private state through :class:`mxdelay.gluon_state.GluonState`.
"""
import logging

from mxnet import gluon

from kvstore_ext import codecs
from kvstore_ext.codecs import pulls
from kvstore_ext.optim import frozen_variance  # noqa: F401  registers 'frozenvarianceadam' by name
from kvstore_ext.checks import ArgumentTypeError, check_bool, check_path, check_real
from kvstore_ext.worker.dist_delay import DistDelay
from . import arguments, autosave, param_state
from .delayed import DelayedUpdate
from .gluon_state import GluonState
from .observer import StepObserver
from .passthrough import PassThrough
from .rules import create_rule

__all__ = ['DelayedTrainer']

_LOG = logging.getLogger(__name__)


class DelayedTrainer(gluon.Trainer):
    """Applies an optimizer on a set of Parameters with the k-step delayed update.

    A drop-in replacement for :class:`mxnet.gluon.Trainer` in distributed training with
    ``kvstore='dist_delay'``. It differs from ``gluon.Trainer`` in that:

    1. After ``warmup_steps`` synchronous steps and a switch step, a worker pulls the
       global weights only every ``delay`` steps; in between it pushes its gradient every
       step (every gradient enters the global model exactly once, in its own round) and
       advances its own weights with ``local_rule``. The pulled weights are applied at the
       next step and waited for only there.
    2. The servers run the optimizer once per round on the sum of all workers' gradients
       (as ``dist_sync``); ``set_learning_rate`` reaches them. Each worker's gradient is
       scaled by its own ``1/batch_size``: workers may use different batch sizes, and a
       batch size may change between steps (e.g. a smaller last batch).
    3. ``save_states`` and ``load_states`` are collective (every worker calls them) and
       restore everything needed to continue bit for bit: the step counter, each worker's
       weights, ``pre_weight`` and rule state, and the servers' weights and optimizer state.
    4. With a non-distributed kvstore (``'local'``, ``'device'``, None) it is exactly
       ``gluon.Trainer`` and warns once (logging) that ``delay`` has no effect.
    5. Sparse parameters (a dense weight with ``grad_stype='row_sparse'``, or a row_sparse
       weight) get lazy local updates: only the rows of the worker's gradient change. Each
       worker keeps a row_sparse weight's rows in a dense copy, which pulls replace and
       ``row_sparse_data(ids)`` reads (docs/design.md §1.4, §2.10).

    Parameters
    ----------
    params : ParameterDict or list of Parameter
        The parameters to optimize.
    optimizer : str or Optimizer
        The servers' optimizer (e.g. ``'sgd'``).
    optimizer_params : dict, optional
        Arguments of the optimizer, e.g. ``{'learning_rate': 0.1, 'momentum': 0.9}``.
    kvstore : str or KVStore, default 'dist_delay'
        ``'dist_delay'`` (or an instance of it) for distributed training; a
        non-distributed type trains as ``gluon.Trainer``.
    compression_params : dict, optional
        Gradient compression as in ``gluon.Trainer``: MXNet's ``{'type': '2bit',
        'threshold': 0.5}`` (each worker sends its quantized gradient and keeps the error in a
        residual), or ``{'type': 'fp16'}`` (float16 pushes, half the bytes; the servers sum
        them in float32 and keep float32 weights, which the pulls return; float32 parameters
        only), or ``{'type': 'int8' | 'int4' | 'ternary', 'block_size': 256}`` (8, 4 or 1.6
        bits a value plus a float32 scale per block, with error feedback; float32 dense
        parameters, no AMP; docs/design.md §2.14). In the delayed phase the local rule steps with what the worker sent. Checked
        at construction. ``'auto'``: the first step chooses the push and the pull codec
        (pull_compression must then be None or ``'auto'``) among none, ``'fp16'``,
        ``'fp16'`` + int8 pulls and ``'ternary'`` + int8 pulls, as far as docs/tuning.md's
        accuracy rows support them for the optimizer, from the link to the servers (probed)
        and the codecs' CPU for this model, estimated per step; a codec only where it beats
        none clearly. Worker 0 chooses for the job and logs, at INFO, its estimates and the
        arguments that pin its choice (docs/design.md §2.16, docs/tuning.md).
    update_on_kvstore : bool or None, default None
        Must not be False with ``'dist_delay'``: the servers own the global update.
    delay : int or 'auto', default 4
        k: pull the global weights every k steps in the delayed phase. ``'auto'``: worker 0
        measures the warm-up's steady steps (from step 3) and, at the switch, the job takes
        k=4 if it is estimated faster than the warm-up's step, or stays synchronous; over two
        periods (at least 8 steps) after a settling one it compares the delayed steps with
        the warm-up's (both by wall clock), and if they are more than 15% slower
        (``autodelay.FALLBACK_MARGIN``) it runs synchronously for the rest of the job. Every choice is logged (INFO) with the arguments that pin it (e.g. ``delay=4,
        slack=4``); :mod:`mxdelay.autodelay` and docs/design.md §1.2. Needs
        ``warmup_steps >= 5``.
    warmup_steps : int, default 200
        W: synchronous steps before the switch.
    local_lr : float, optional
        Learning rate of the local rule; default: the optimizer's. It follows the
        optimizer's schedule by the same factor.
    local_rule : str or LocalRule, default 'mirror'
        ``'mirror'``, ``'sgd'``, ``'dc'``, ``'dc_adaptive'``, ``'drift'`` or a
        :class:`mxdelay.rules.LocalRule` (see :mod:`mxdelay.rules`).
    dc_lambda : float, optional
        Delay-compensation weight added to a built-in rule (default: the rule's own, 0 for
        ``'mirror'`` and ``'sgd'``, 0.04 for ``'dc'`` and ``'dc_adaptive'``).
    slack : int, optional
        Rounds a worker may run ahead of the slowest worker (default and minimum: delay;
        with ``delay='auto'``: 4).
    pull_compression : dict, optional
        Compress the pulls of the warm-up, the switch and every period's end:
        ``{'type': 'fp16'}`` (2 bytes a value) or ``{'type': 'int8', 'block_size': 256}``
        (a level per value and a float32 scale per block, about 1 byte a value). The
        servers send the compressed difference between ``W`` and the model they last sent;
        every worker then holds the same pulled model, which lags ``W`` by what was not sent
        yet (it goes out with the next pull). ``sync_weights`` and checkpoints stay exact.
        With any compression_params (float16 pushes too); not with AMP or row_sparse
        parameters (docs/design.md §2.12). ``'auto'`` (or None) with
        ``compression_params='auto'``: chosen with it.
    checkpoint_dir, checkpoint_every, keep_checkpoints : str, int, int, optional
        Save checkpoints every N steps, resume from the newest (:mod:`mxdelay.autosave`).

    Raises
    ------
    TypeError
        For an argument of the wrong type (:class:`mxdelay.ArgumentTypeError`, also a
        ``ValueError``), with its value and the fix.
    ValueError
        For an argument out of range, with its value and the fix.

    Examples
    --------
    >>> trainer = mxdelay.DelayedTrainer(net.collect_params(), 'sgd',
    ...                                  {'learning_rate': 0.05, 'momentum': 0.9},
    ...                                  kvstore='dist_delay', delay=4, warmup_steps=200)
    >>> with autograd.record():
    ...     loss = loss_fn(net(x), y)
    >>> loss.backward()
    >>> trainer.step(batch_size)
    """

    def __init__(self, params, optimizer, optimizer_params=None, kvstore='dist_delay',
                 compression_params=None, update_on_kvstore=None, delay=4, warmup_steps=200,
                 local_lr=None, local_rule='mirror', dc_lambda=None, slack=None,
                 pull_compression=None, checkpoint_dir=None, checkpoint_every=None,
                 keep_checkpoints=None):
        schedule, slack = arguments.check_schedule(delay, warmup_steps, slack)
        delay = schedule.describe()['delay']
        if local_lr is not None:
            check_real('local_lr', local_lr, minimum=0,
                       fix="or None for the optimizer's learning rate")
        dist_delay = arguments.check_kvstore(kvstore, update_on_kvstore)
        auto_codec = arguments.check_auto_codec(compression_params, pull_compression)
        if auto_codec:   # the hand-shake chooses both (docs/design.md §2.16)
            compression_params = pull_compression = None
        # Compression is validated here, at construction; once the store exists, its own
        # parsed codec (kvstore.delayed.settings.compression) is the one the trainer asks.
        compressed = codecs.parse(compression_params) if dist_delay else None
        if compressed is not None:
            # Before Gluon ties a row_sparse Parameter to this trainer.
            arguments.refuse_compressed_sparse_grads(_stypes(params), compressed)
        pull_codec = pulls.parse(pull_compression)   # checks it
        if pull_codec is not None:
            arguments.refuse_compressed_pulls(_stypes(params), pull_codec)
        registration_order = arguments.parameter_names(params)  # before Gluon sorts them
        rule = create_rule(local_rule, dc_lambda)
        local_lr = None if local_lr is None else float(local_lr)
        super(DelayedTrainer, self).__init__(params, optimizer, optimizer_params, kvstore,
                                             compression_params, update_on_kvstore)
        if dist_delay:
            rule.check_optimizer(self._optimizer)
        # Each parameter's variants, chosen once: its weight's and its gradient's storage.
        states = [param_state.create(i, p, p._stype != 'default', p._grad_stype != 'default')
                  for i, p in enumerate(self._params)]
        if compressed is not None:
            for s in states:
                if s.trained:
                    compressed.check_dtype('parameter %s' % s.param.name, s.param.dtype)
        self._autosave = autosave.create(self, self._mode, self._params, dist_delay,
                                         checkpoint_dir, checkpoint_every, keep_checkpoints)
        # The delayed update: the mode of 'dist_delay', which owns its state from here on.
        # compression_params='auto' keeps the codecs of the checkpoint it will resume from.
        self._delayed = DelayedUpdate(GluonState(self), schedule, states, registration_order, rule,
                                      local_lr, slack, pull_codec,
                                      self._autosave.resumed_codecs
                                      if auto_codec and dist_delay else None)
        # MXDELAY_TIMELINE: record the first steps without code changes (it sets the observer).
        from .timeline import record_from_env  # pylint: disable=import-outside-toplevel
        self._timeline = record_from_env(self)
        _LOG.info('DelayedTrainer: delay=%r warmup_steps=%d local_rule=%r local_lr=%s slack=%d',
                  delay, warmup_steps, rule, 'optimizer lr' if local_lr is None else local_lr,
                  slack)

    def set_observer(self, observer):
        """Send this trainer's events (gradient written, push acknowledged, pull received,
        pull applied) to `observer`, a :class:`mxdelay.observer.StepObserver`; None: to
        nobody (the default).

        Raises
        ------
        TypeError
            If `observer` is neither None nor a StepObserver.
        """
        if observer is not None and not isinstance(observer, StepObserver):
            raise ArgumentTypeError('observer must be an mxdelay.observer.StepObserver or None, '
                                    'got %r (%s)' % (observer, type(observer).__name__))
        self._delayed.observer = observer or StepObserver()

    def priority_order(self):
        """Parameter names from the highest push/pull priority to the lowest (forward order).

        Known after the first step; before it, registration order.
        """
        return self._delayed.order.names()

    # -- the mode ---------------------------------------------------------------------------
    def _init_kvstore(self):
        # The mode is chosen here, once:
        # - a non-distributed kvstore: PassThrough, every step is gluon.Trainer's;
        # - 'dist_delay': the delayed update (mxdelay.delayed), connected to the store.
        super(DelayedTrainer, self)._init_kvstore()
        kvstore = self._kvstore
        if not self._distributed:
            # A warning when the user asked for delayed updates they will not get.
            delay = self._delayed.schedule.describe()['delay']
            _LOG.log(logging.WARNING if delay != 1 else logging.INFO,
                     'DelayedTrainer: kvstore %r is not distributed: training exactly as '
                     'gluon.Trainer; delay=%r has no effect',
                     getattr(kvstore, 'type', kvstore), delay)
            self._kv_mode = self._pass_through()
            return
        # Chosen before the checks below: a store that fails them never trains pass-through.
        self._kv_mode = self._delayed
        if not isinstance(kvstore, DistDelay):
            raise ValueError("DelayedTrainer needs kvstore='dist_delay' for distributed training, "
                             'got %r; pass kvstore=\'dist_delay\' (and launch with mxdelay-launch '
                             '... mxdelay-run)' % kvstore.type)
        if not self._update_on_kvstore:
            raise ValueError('update_on_kvstore is False (set by the environment variable '
                             'MXNET_UPDATE_ON_KVSTORE=0?), but with \'dist_delay\' the servers '
                             'apply the optimizer: unset MXNET_UPDATE_ON_KVSTORE')
        self._delayed.connect(kvstore, kvstore.delayed)

    def _reset_kvstore(self):
        # Gluon's: no kvstore (yet, or again). Until it is created, the calls that do not
        # create it (set_learning_rate, keys_per_step) have nobody else to tell.
        super(DelayedTrainer, self)._reset_kvstore()
        self._kv_mode = self._pass_through()

    def _pass_through(self):
        # gluon.Trainer's methods through the class hierarchy (mxdelay.passthrough).
        base = super(DelayedTrainer, self)
        return PassThrough(base, base._row_sparse_pull)

    def _mode(self):
        """The mode chosen when the kvstore was created; creates the kvstore if needed."""
        if not self._kv_initialized:
            self._init_kvstore()
        return self._kv_mode

    # -- gluon.Trainer's seams ----------------------------------------------------------------
    def _init_params(self):
        pending = list(self._params_to_init)
        super(DelayedTrainer, self)._init_params()
        self._kv_mode.params_initialized([self._param2idx[p.name] for p in pending
                                          if p not in self._params_to_init])

    def _row_sparse_pull(self, parameter, out, row_id, full_idx=False):
        return self._mode().row_sparse_pull(parameter, out, row_id, full_idx)

    def _push_all(self):
        """Push this worker's gradients of the step (a seam: a subclass may wait first)."""
        self._delayed.push_all()

    # -- public API ---------------------------------------------------------------------------
    def set_learning_rate(self, lr):
        """Set the learning rate of the optimizer, on the servers too.

        Parameters
        ----------
        lr : float
            The new learning rate.
        """
        check_real('lr', lr, minimum=0, fix='e.g. trainer.set_learning_rate(0.01)')
        super(DelayedTrainer, self).set_learning_rate(lr)
        self._kv_mode.set_learning_rate(lr)

    def step(self, batch_size, ignore_stale_grad=False):
        """Make one step: push this worker's gradients and advance its weights.

        Parameters
        ----------
        batch_size : int
            Batch size of this worker's data; gradients are normalised by 1/batch_size.
            It may change between steps.
        ignore_stale_grad : bool, default False
            As in ``gluon.Trainer``: do not raise for Parameters whose gradient is stale
            (their gradient is still pushed: every worker contributes to every round).

        Raises
        ------
        TypeError
            If `batch_size` is not a number.
        ValueError
            If `batch_size` is not finite and > 0.
        """
        arguments.check_batch_size(batch_size)
        if not self._autosave.before_step():   # saves if due; True: resumed now, drop this step
            self._mode().step(batch_size, ignore_stale_grad)

    def join(self):
        """End this worker's epoch: take part in the other workers' remaining rounds with zero
        gradients until every worker has called ``join``.

        With uneven data (workers with different numbers of batches) call it on every worker
        after its last batch of an epoch (and before any collective call such as
        :meth:`save_states`, which calls it itself). It returns on every worker after the same
        round, so the step counters stay equal. A round in which a worker had no data is a
        round in which its gradient is zero: the servers apply the optimizer to the sum of the
        gradients of the workers that had data (each scaled by 1/its batch size), so such a
        round moves the weights less, while momentum, weight decay and the learning-rate
        schedule advance as in any round. The round in which the last worker calls ``join``
        is not pushed at all. A worker in its delayed phase also makes its local update
        (with a zero gradient) and its pulls in these rounds, exactly as in a step.

        Without ``join`` a worker whose script ends first fills the others' rounds with zero
        gradients at exit (same arithmetic); ``join`` is needed only where the workers must
        meet, e.g. at the end of an epoch before evaluation or a checkpoint.

        Returns
        -------
        int
            The number of rounds this worker filled with zero gradients.
        """
        # A periodic checkpoint due while this worker fills rounds is saved there too.
        return self._mode().join(self._autosave.before_round)

    def sync_weights(self, aux_states=False):
        """Make every worker's parameters the servers' global weights; collective.

        In the delayed phase each worker trains its own weights ``w'`` (the global weights of
        its last pull plus its local steps since), so they differ between workers and from
        the servers' ``W``. Call this on every worker where the *global* model is wanted:
        before evaluating or saving the final model, or before a worker-0-only evaluation.
        It first meets the other workers (:meth:`join`: uneven data is fine), then replaces
        every trained parameter, on every device, by ``W`` after all rounds pushed so far.
        Training may go on afterwards: the schedule continues unchanged, and the next local
        steps start from ``W``. With a non-distributed kvstore it does nothing.

        Parameters
        ----------
        aux_states : bool, default False
            Also replace the aux states (Parameters with ``differentiable=False``:
            BatchNorm's running mean and variance), which each worker computes from its own
            data and no server holds, by their mean over the workers, on every device: each
            worker sends the mean of its devices' copies once and receives the sum
            (docs/design.md §2.13; with ``'2bit'`` compression, whose native store
            quantizes every push, the values go to the servers in a command). Frozen weights
            (``grad_req='null'``) are left as they are.

        Raises
        ------
        TypeError
            If `aux_states` is not a bool.
        """
        aux_states = check_bool('aux_states', aux_states, 'e.g. sync_weights(aux_states=True)')
        return self._mode().sync_weights(aux_states)

    def allreduce_grads(self):
        """Not available with ``'dist_delay'``; raises ValueError saying what to do instead.

        ``gluon.Trainer`` offers ``allreduce_grads()`` and ``update()`` only with
        ``update_on_kvstore=False`` (to clip by the global norm of the summed gradient, say);
        on ``'dist_delay'`` the servers apply the optimizer to each round's sum, and a worker
        never holds that sum. Without a distributed kvstore it is ``gluon.Trainer``'s.
        """
        return self._mode().allreduce_grads()

    def update(self, batch_size, ignore_stale_grad=False):
        """Not available with ``'dist_delay'``; see :meth:`allreduce_grads`."""
        return self._mode().update(batch_size, ignore_stale_grad)

    @property
    def rank(self):
        """This worker's rank (0 without a distributed kvstore); creates the kvstore if needed,
        so that a script can shard its data before the first step."""
        return self._mode().rank

    @property
    def num_workers(self):
        """Number of workers (1 without a distributed kvstore)."""
        return self._mode().num_workers

    @property
    def keys_per_step(self):
        """Push operations a step issues (chunks of all trained parameters); for
        :func:`mxdelay.timeline.summarize`."""
        return self._kv_mode.keys_per_step()

    @property
    def codecs(self):
        """The push and pull codecs this job runs, as the arguments that pin them:
        ``{'compression_params': dict or None, 'pull_compression': dict or None}``; with
        ``compression_params='auto'`` what the first step chose (None before it). None
        without ``'dist_delay'``."""
        return self._mode().codecs()

    def round_bytes(self):
        """Bytes a step's pushes and a pull carry (:func:`mxdelay.traffic.round_bytes`:
        as configured and with each compression); None without a distributed kvstore."""
        return self._mode().round_bytes()

    @property
    def resumed_step(self):
        """The step resumed at from checkpoint_dir (0: none; the first read resumes)."""
        return self._autosave.resumed_step

    @property
    def schedule(self):
        """The :class:`mxdelay.schedule.DelaySchedule` (its ``step`` is the step counter)."""
        return self._delayed.schedule

    def save_states(self, fname):
        """Save everything needed to resume; collective: every worker calls it.

        Worker i writes ``fname + '.worker<i>'`` (its weights, ``pre_weight``, rule state and
        any pulled weights not applied yet), the servers write ``fname + '.kvstore.server<j>'``,
        and worker 0 writes ``fname + '.kvstore'`` and, last, `fname`, the index, which lists
        every other part's sha256. Every file is written atomically, holds no pickle, and
        carries the save's id (docs/design.md §6).

        Parameters
        ----------
        fname : str or os.PathLike
            Path of the index file.
        """
        fname = check_path('fname', fname)
        return self._mode().save_states(fname)

    def load_states(self, fname, trusted=False):
        """Restore what :meth:`save_states` saved; collective: every worker calls it.

        Everything is validated before anything changes: a missing, truncated or foreign
        file, or parts of different saves, raise ``ValueError`` and leave this trainer and
        the servers as they were.

        Parameters
        ----------
        fname : str or os.PathLike
            Path of the index file written by :meth:`save_states`.
        trusted : bool
            Also load a version-1 checkpoint (written by mxdelay before pickle-free
            checkpoints), whose worker and server files are pickles: loading a pickle runs
            whatever code it names, so pass True only for a checkpoint whose writer you
            trust. Version-2 checkpoints never unpickle anything.
        """
        fname = check_path('fname', fname)
        return self._mode().load_states(fname, check_bool('trusted', trusted))


def _stypes(params):
    """``(param, stype, grad_stype)`` of each of `params` (non-Parameters: 'default', left
    to gluon.Trainer's own check)."""
    return [(p, getattr(p, '_stype', 'default'), getattr(p, '_grad_stype', 'default'))
            for p in (params.values() if hasattr(params, 'values') else params)]
