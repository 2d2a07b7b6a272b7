"""Refuse ``mx.mod.Module``'s local-update path on a ``'dist_delay'`` store.

With ``update_on_kvstore=False`` (``MXNET_UPDATE_ON_KVSTORE=0``) Module's own updater would
apply ``1.0/batch_size`` (there is no '_sync' in the type it tests then) to the round's sum
that the store pulls, and the servers' optimizer would not run (docs/design.md §1.7). MXNet
1.9.1's ``Module.init_optimizer`` hands its choice to ``mxnet.model._initialize_kvstore``
(its ``update_on_kvstore`` argument) before the first ``init``: the name that
``mxnet.module.module`` imported is replaced *in that module only* by one that refuses the
local path for a given store class, as :mod:`kvstore_ext.worker.gluon_sparse` does for Gluon.
Gluon's trainers, which may update locally on ``'dist_delay'`` (the servers then only sum),
and every other caller keep MXNet's function.
"""
import logging

from mxnet import model as _model
from mxnet.module import module as _module

__all__ = ['refuse_local_update']

_LOG = logging.getLogger(__name__)


def refuse_local_update(store_class):
    """Make ``Module.init_optimizer`` raise ValueError when it would update locally with a
    `store_class` kvstore. Idempotent; does nothing (with a warning) if Module does not
    look as in MXNet 1.9.1."""
    current = getattr(_module, '_initialize_kvstore', None)
    if getattr(current, 'mxdelay_refuses', None) is store_class:
        return
    if current is not _model._initialize_kvstore:  # pylint: disable=protected-access
        _LOG.warning("mxnet.module does not look like MXNet 1.9.1's: Module's "
                     "update_on_kvstore=False is not refused on 'dist_delay'")
        return

    def initialize_kvstore(kvstore, param_arrays, arg_params, param_names, update_on_kvstore):
        if isinstance(kvstore, store_class) and not update_on_kvstore:
            raise ValueError("mx.mod.Module with kvstore='dist_delay' must update on the "
                             'kvstore (the servers apply the optimizer), but '
                             'update_on_kvstore is False: unset MXNET_UPDATE_ON_KVSTORE')
        return current(kvstore=kvstore, param_arrays=param_arrays, arg_params=arg_params,
                       param_names=param_names, update_on_kvstore=update_on_kvstore)

    initialize_kvstore.mxdelay_refuses = store_class
    _module._initialize_kvstore = initialize_kvstore  # pylint: disable=protected-access
