"""What the server's optimizer updates, and with what: ``REGISTER``, ``OPTIMIZER``, ``SET_HYPER``.

``REGISTER`` brings the chunks with their Parameters' multipliers and names (which the
optimizer reads), ``OPTIMIZER`` the optimizer by registry name and fields (no pickle),
``SET_HYPER`` a new learning rate (docs/design.md §3.4). Every server hears every chunk, so
each can refuse an optimizer that needs whole-tensor norms for a tensor split into chunks,
whichever of the two arrives last.
"""
import logging

from kvstore_ext.optim.optimizers import (PER_STEP_FIELDS, UnknownOptimizerError,
                                          describe_optimizer, optimizer_differences,
                                          whole_tensor_refusal)
from kvstore_ext.protocol import commands
from kvstore_ext.protocol.commands import field
from kvstore_ext.server import agreement, registry

__all__ = ['OptimizerCommands']

_LOG = logging.getLogger(__name__)


class OptimizerCommands(object):
    """A server's ``REGISTER``, ``OPTIMIZER`` and ``SET_HYPER``.

    Parameters
    ----------
    job : kvstore_ext.server.job.Job
    chunks : kvstore_ext.server.registry.ChunkRegistry
    rounds : kvstore_ext.server.rounds.RoundKeeper
        Its ``updates`` take the chunks and the optimizer.
    chunk_size : callable
        ``chunk_size()``: the workers' chunk size, from their hellos (None before any).
    """

    def __init__(self, job, chunks, rounds, chunk_size):
        self._job = job
        self._chunks = chunks
        self._rounds = rounds
        self._chunk_size = chunk_size
        self._sent = {}                # worker rank -> describe_optimizer of its last OPTIMIZER

    def register(self, body):
        """The ``register`` command: keep this server's chunks of a worker's entries."""
        # Every server hears every chunk, so each knows whole tensors: refuse an optimizer
        # that needs whole-tensor norms for a tensor split into chunks, before anything of
        # this registration is kept (docs/design.md §3.4).
        updates = self._rounds.updates
        self._chunks.add(
            registry.parse_entries(field(body, 'chunks', list)),
            self._job.server_rank, body.get('rank'),
            lambda tensors: self._check_whole_tensor(updates.optimizer, tensors),
            lambda chunk, info: updates.register(
                chunk, info['lr_mult'], info['wd_mult'],
                counter=info['param_index'] == commands.FINISH_KEY, codec=info['codec'],
                name=info['name']))
        return {'chunks': len(self._chunks)}

    def optimizer(self, body):
        """The ``optimizer`` command: install the workers' optimizer (the first time, or
        again before the first round); reply with the installed one's description."""
        # The optimizer by registry name and fields, built without pickle.
        try:
            optimizer = commands.decode_optimizer(field(body, 'optimizer', dict))
        except UnknownOptimizerError as err:
            raise ValueError(
                'server %s does not know %s %r: it is not registered in the server, which '
                'runs none of the training script; name the module that registers it in '
                'MXDELAY_SERVER_IMPORTS in the servers\' environment'
                % (self._job.server_rank, err.kind, err.name)) from None
        # One optimizer per job: a worker whose optimizer differs from another's is refused
        # (the hand-shake catches this already when the optimizer is set before it; this
        # catches an optimizer set later, e.g. on a bare kvstore).
        self._check_whole_tensor(optimizer, self._chunks.tensors())
        rank, described = body['rank'], describe_optimizer(optimizer)
        for other, theirs in sorted(self._sent.items()):
            differences = optimizer_differences(theirs, described, PER_STEP_FIELDS)
            if other != rank and differences:
                raise ValueError(agreement.optimizer_mismatch(differences, 'worker %d' % other,
                                                              'worker %d' % rank))
        self._sent[rank] = described
        # Every worker sends it (Gluon's set_optimizer): the first one installs it; later ones
        # replace it only until the first round, so that an optimizer changed before training
        # takes effect and one changed during training cannot drop the optimizer state.
        updates = self._rounds.updates
        if updates.optimizer is None or not self._rounds.started:
            if updates.optimizer is None:
                _LOG.info('server %d: optimizer %s installed', self._job.server_rank,
                          type(optimizer).__name__)
            if self._job.rescale_grad is not None:
                optimizer.rescale_grad = self._job.rescale_grad  # the job's, whoever sent it
            updates.install(optimizer)
        # The worker compares this with its own optimizer (DistDelay._send_optimizer).
        return {'optimizer': describe_optimizer(updates.optimizer)}

    def set_hyper(self, body):
        """The ``set_hyper`` command: the learning rate from now on."""
        optimizer = self._rounds.updates.optimizer
        if optimizer is None:
            raise ValueError('cannot change the optimizer: no optimizer installed on server %d '
                             '(call set_optimizer first)' % self._job.server_rank)
        lr = field(body, 'lr', float, minimum=0, finite=True, optional=True)
        if lr is not None:
            optimizer.set_learning_rate(float(lr))
        return {'lr': optimizer.learning_rate}

    def _check_whole_tensor(self, optimizer, tensors):
        refusal = whole_tensor_refusal(optimizer, tensors, self._chunk_size(),
                                       commands.bigarray_bound())
        if refusal is not None:
            raise ValueError(refusal)
