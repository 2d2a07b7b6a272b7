"""Which kvstore type strings exist: mxdelay's, MXNet's, and the misspellings in between.

One place decides it (the ``mx.kv.create`` check and ``DelayedTrainer`` both ask here), and
registers ``'dist_delay'`` with MXNet. Imports nothing (MXNet's module is passed in): it is
used before and while MXNet is imported.
"""
import difflib

__all__ = ['STORE_TYPE', 'TYPE_STRING', 'NATIVE_DIST_TYPES', 'check_kvstore_type',
           'register_store_type']

#: The type string of mxdelay's store.
STORE_TYPE = 'dist_delay'
#: What the store's ``type`` property says: MXNet's Module gives an optimizer dist_sync's
#: rescale_grad only for types containing 'dist' and '_sync' (docs/design.md §9).
TYPE_STRING = 'dist_sync_delay'
#: The distributed types MXNet 1.9's C++ store knows (src/kvstore/kvstore.cc); it accepts
#: any other name containing 'dist' too, as a native store whose mode depends on substrings.
NATIVE_DIST_TYPES = ('dist', 'dist_sync', 'dist_async', 'dist_sync_device',
                     'dist_async_device', 'dist_device_sync', 'dist_device_async')


def check_kvstore_type(name, registered=()):
    """Return the lower-cased kvstore type `name`, or raise if it is a misspelt distributed type.

    MXNet creates its native synchronous store for any unregistered name containing
    'dist': ``'dist_dealy'`` would train without mxdelay's rounds and say nothing.

    Parameters
    ----------
    name : str
        A kvstore type string.
    registered : collection of str
        Other registered type names (MXNet's ``KVStoreBase.kv_registry``), accepted too.

    Raises
    ------
    ValueError
        If `name` contains 'dist' but is neither ``'dist_delay'``, a registered type, nor one
        of :data:`NATIVE_DIST_TYPES`; the message suggests the closest name.
    """
    lowered = name.lower()
    if ('dist' in lowered and lowered not in registered and lowered not in NATIVE_DIST_TYPES
            and lowered != STORE_TYPE):
        close = difflib.get_close_matches(lowered, [STORE_TYPE] + list(NATIVE_DIST_TYPES), n=1)
        raise ValueError('kvstore type %r is unknown: MXNet would silently create its native '
                         'dist_sync store for it; %s (MXNet\'s distributed types: %s; mxdelay: '
                         '%s)' % (name, 'did you mean %r?' % close[0] if close else
                                  'check the spelling', ', '.join(NATIVE_DIST_TYPES), STORE_TYPE))
    return lowered


def register_store_type(mxnet, create, replace=True):
    """Register ``'dist_delay'`` (and :data:`TYPE_STRING`) in the loaded `mxnet` module's
    kvstore registry and make ``mx.kv.create`` refuse misspelt distributed types
    (:func:`check_kvstore_type`).

    Parameters
    ----------
    mxnet : module
        The ``mxnet`` module, loaded.
    create : callable
        What ``mx.kv.create('dist_delay')`` calls: the store class, or a function that
        imports and creates it.
    replace : bool, default True
        Replace an existing registration (False: only register if there is none).
    """
    kvstore = mxnet.kvstore
    registry = kvstore.KVStoreBase.kv_registry
    if replace or STORE_TYPE not in registry:
        registry[STORE_TYPE] = create
        # mx.kv.create(store.type) must give mxdelay's store again, not MXNet's native one.
        registry[TYPE_STRING] = create
    original = kvstore.create
    if getattr(original, 'mxdelay_checked', False):
        return

    def checked_create(name='local'):
        if isinstance(name, str):
            check_kvstore_type(name, registry)
        return original(name)
    checked_create.mxdelay_checked = True
    checked_create.__doc__ = original.__doc__
    kvstore.create = checked_create  # mx.kv is the same module
