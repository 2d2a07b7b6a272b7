"""Let Gluon's row_sparse paths accept a ``'dist_delay'`` store (docs/design.md §2.10).

MXNet 1.9.1's ``gluon.Trainer`` refuses any store but its native ``KVStore`` class where
parameters are sparse: ``model._create_sparse_kvstore`` raises ``TypeError`` for a store
object (a row_sparse weight) and ``Trainer._init_kvstore`` tests ``isinstance(kvstore,
KVStore)`` (a dense weight with row_sparse gradients). Around those checks Gluon calls only
what ``DistDelay`` implements: ``init``, ``broadcast``, ``push``, ``pull(...,
ignore_sparse=True)``, ``row_sparse_pull``, ``set_optimizer``, ``type``, and the optimizer
states' save and load.

So the two names Gluon's trainer module looks up are replaced *in that module only*: its
``KVStore`` by a class whose ``isinstance`` also accepts the given store class, and its
``_create_sparse_kvstore`` by one that also accepts such a store object. ``mxnet.kvstore``
and every other module keep MXNet's own; DistDelay is not made a (virtual) subclass of the
native class, whose other methods use a native handle it does not have.
"""
import logging

from mxnet import kvstore as _kvstore
from mxnet import model as _model
from mxnet.gluon import trainer as _trainer

__all__ = ['accept_in_gluon']

_LOG = logging.getLogger(__name__)


def accept_in_gluon(store_class):
    """Make ``gluon.Trainer``'s sparse paths accept `store_class` objects. Idempotent.

    Does nothing (with a warning) if Gluon's trainer module does not look as in MXNet 1.9.1.
    """
    native = _kvstore.KVStore
    current = getattr(_trainer, 'KVStore', None)
    if getattr(current, 'mxdelay_accepts', None) is store_class:
        return
    if current is not native or getattr(_trainer, '_create_sparse_kvstore', None) \
            is not _model._create_sparse_kvstore:  # pylint: disable=protected-access
        _LOG.warning('gluon.trainer does not look like MXNet 1.9.1\'s: sparse parameters on '
                     "'dist_delay' stay refused by Gluon")
        return

    class _Meta(type):
        def __instancecheck__(cls, obj):
            return isinstance(obj, (native, store_class))

        def __subclasscheck__(cls, sub):
            return issubclass(sub, (native, store_class))

    # Gluon's trainer module uses the name only in isinstance (checked for MXNet 1.9.1).
    accepting = _Meta('KVStore', (object,), {'mxdelay_accepts': store_class,
                                             '__doc__': native.__doc__})
    stock_create = _model._create_sparse_kvstore  # pylint: disable=protected-access

    def create_sparse_kvstore(kvstore):
        # MXNet's, for a store object of store_class too: it always updates on the store.
        if isinstance(kvstore, store_class):
            return kvstore, True
        return stock_create(kvstore)

    _trainer.KVStore = accepting
    _trainer._create_sparse_kvstore = create_sparse_kvstore  # pylint: disable=protected-access
