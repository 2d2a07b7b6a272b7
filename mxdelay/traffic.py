"""Bytes per step: what a step's pushes and a pull carry, as configured and with each
compression (for the timeline's summary, the step log and the estimate of
:mod:`mxdelay.estimate`).

Counted from the kvstore's keys by its traffic part
(:meth:`kvstore_ext.worker.bytecount.ByteCount.payload_bytes`): the values of each chunk as
they travel, i.e. its dtype's bytes per element, float16's 2 (``'fp16'`` pushes), MXNet's
2bit packing of 16 values into a float32, the blockwise codecs' payload row and its row id
(``'int8'``, ``'int4'``, ``'ternary'`` at the default block of 256 values,
:meth:`kvstore_ext.codecs.blockwise.Blockwise.push_bytes`, on the chunks they would have), or
a compressed pull's payload (:func:`kvstore_ext.codecs.pulls.payload_bytes`). Not counted:
ps-lite's headers (keys and lengths of each message), the store's per-round flag (a few
elements), and row_sparse keys, whose messages carry the rows of each step (their number is
given). Measured on the wire, headers included, the real MLP job's bytes are within 1% of
this count (docs/benchmarks/bytes/wire).
A step pushes every trained parameter once; a pull brings every one once (warm-up and
switch: every step; delayed phase: every k-th step).
"""
from kvstore_ext import codecs
from kvstore_ext.codecs import pulls

__all__ = ['settings', 'round_bytes']


def settings():
    """``[(name, codec, pull_codec)]``: the settings the estimate compares, each alone: no
    compression, every push codec of the registry that has default settings
    (:func:`kvstore_ext.codecs.defaults`: 2bit's threshold does not change its bytes; the
    blockwise codecs at their default block size), then every pull codec at its defaults.
    ``codecs.NONE`` and False: uncompressed."""
    return ([('no compression', codecs.NONE, False)]
            + [('%s pushes' % name, codec, False) for name, codec in codecs.defaults().items()]
            + [('%s pulls' % name, codecs.NONE, pulls.parse({'type': name}))
               for name in pulls.known_types()])


def round_bytes(traffic, store_settings, keys):
    """The bytes of one push and one pull of `keys` of a store, as configured and per setting.

    Parameters
    ----------
    traffic : kvstore_ext.worker.bytecount.ByteCount
        The store's traffic part (``DistDelay.delayed.traffic``).
    store_settings : kvstore_ext.worker.settings.StoreSettings
        The store's settings part.
    keys : list
        The trained parameters' keys.

    Returns
    -------
    dict
        ``push`` and ``pull`` (bytes, as configured), ``compression`` and
        ``pull_compression`` (the settings, as in the hand-shake; None: none),
        ``row_sparse_keys`` (keys not counted) and ``settings``: ``{name: [push, pull]}``
        for each of :func:`settings`.
    """
    counted = [traffic.payload_bytes(k) for k in keys]
    dense = [k for k, sizes in zip(keys, counted) if sizes is not None]
    compared = {}
    for name, codec, pull_codec in settings():
        pairs = [traffic.payload_bytes(k, codec, pull_codec) for k in dense]
        compared[name] = [sum(p for p, _ in pairs), sum(q for _, q in pairs)]
    compression, pull_compression = store_settings.compression, store_settings.pull_compression
    return {'push': sum(sizes[0] for sizes in counted if sizes is not None),
            'pull': sum(sizes[1] for sizes in counted if sizes is not None),
            'compression': compression.describe() if compression else None,
            'pull_compression': pull_compression.describe() if pull_compression else None,
            'row_sparse_keys': len(keys) - len(dense), 'settings': compared}
