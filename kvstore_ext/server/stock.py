"""Stock MXNet workers on mxdelay's servers: served as MXNet's own server serves them.

A worker that never says hello (a stock ``gluon.Trainer`` on ``dist_sync``) sends MXNet's
own command, a pickled optimizer, and its rounds are plain sums (docs/design.md §3.3).
Unpickling runs whatever code the bytes name and any peer can send them, so a server does
it only when its own environment opts in (:data:`kvstore_ext.server.job.ALLOW_PICKLE`).
"""
import logging
import pickle

import mxnet as mx

from kvstore_ext import env
from kvstore_ext.server.job import ALLOW_PICKLE

__all__ = ['StockClient']

_LOG = logging.getLogger(__name__)


class StockClient(object):
    """What a server does for workers without mxdelay.

    Parameters
    ----------
    job : kvstore_ext.server.job.Job
    """

    def __init__(self, job):
        self._job = job
        self._updater = None           # from the stock worker's pickled optimizer
        self._refusal = None           # why a stock client's pickled optimizer was refused

    def command(self, body):
        """A command that is not mxdelay's, `body` (bytes): a stock worker's pickled
        optimizer, installed as MXNet's server would if the environment allows it.

        Raises
        ------
        ValueError
            Without the opt-in (the first round then stops the server with that reason), or
            if `body` is no pickled optimizer.
        """
        if not env.get_bool(ALLOW_PICKLE):
            self._refusal = (
                'server %s refused a command that is not mxdelay\'s (%.40r...): a stock MXNet '
                'worker\'s pickled optimizer (a stock dist_sync script with an optimizer on '
                'the kvstore), which an mxdelay server unpickles only with %s=1 in its '
                'environment (unpickling runs code: set it only on a trusted network), or '
                'use kvstore=\'dist_delay\'' % (self._job.server_rank, body[:40],
                                                ALLOW_PICKLE))
            raise ValueError(self._refusal)
        try:
            optimizer = pickle.loads(body)
        except Exception:  # pylint: disable=broad-except
            raise ValueError('unknown command %.60r: neither an mxdelay command nor a pickled '
                             'optimizer' % (body,)) from None
        if not isinstance(optimizer, mx.optimizer.Optimizer):
            raise ValueError('a stock command carried a %s, not an mx.optimizer.Optimizer'
                             % type(optimizer).__name__)
        self._updater = mx.optimizer.get_updater(optimizer)
        _LOG.info('server %d: stock MXNet client; optimizer %s installed',
                  self._job.server_rank, type(optimizer).__name__)

    def complete_round(self, key, merged, stored):
        """`key`'s round with sum `merged` into `stored`, as MXNet's server does it.

        Raises
        ------
        RuntimeError
            If the client's optimizer was refused: applying its gradients as weights (MXNet's
            server without an updater) would train silently wrong; the job must stop.
        """
        if self._refusal is not None:
            raise RuntimeError(self._refusal)
        if self._updater is None:
            merged.copyto(stored)  # MXNet's CopyFromTo, row_sparse too
        else:
            self._updater(key, merged, stored)
