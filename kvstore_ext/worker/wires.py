"""How a codec's pushes travel: the data path of its dense keys, chosen by ``Codec.wire``.

A codec says how its pushes travel (:attr:`kvstore_ext.codecs.Codec.wire`); the worker picks
the data path of its dense keys here, once, at the hand-shake:

- ``'slots'``: :class:`kvstore_ext.worker.dense.DenseKeys` (pushes and pulls on the slot keys);
- ``'pull_keys'``: :class:`kvstore_ext.worker.float16_keys.PullKeyDense` (float16 slot keys,
  float32 pull keys);
- ``'rows'``: :class:`kvstore_ext.worker.row_keys.PayloadDense` (one row per worker);

each with compressed pulls mixed in where ``pull_compression`` is set
(:class:`kvstore_ext.worker.pulled_model.PulledModel`).
"""
from kvstore_ext.worker.dense import DenseKeys
from kvstore_ext.worker.float16_keys import PullKeyDense, PullKeyModelDense
from kvstore_ext.worker.pulled_model import PullModelDense
from kvstore_ext.worker.row_keys import PayloadDense, PayloadModelDense

__all__ = ['dense_keys']

#: Codec.wire -> (the data path of its dense keys, the same with compressed pulls)
_PATHS = {
    'slots': (DenseKeys, PullModelDense),
    'pull_keys': (PullKeyDense, PullKeyModelDense),
    'rows': (PayloadDense, PayloadModelDense),
}


def dense_keys(codec, native, slots, pull_codec=None, schedule=None):
    """The data path of `codec`'s dense keys (`native`: the worker's native store, `slots`:
    R), with compressed pulls of `pull_codec` at the rounds of `schedule` if given.

    Raises
    ------
    ValueError
        If `codec` names a wire this worker does not know.
    """
    try:
        plain, pulled = _PATHS[codec.wire]
    except KeyError:
        raise ValueError('codec %r travels by wire %r, which this worker does not know; '
                         'its Codec.wire must be one of %s'
                         % (codec.describe(), codec.wire, sorted(_PATHS))) from None
    if schedule is None:
        return plain(native, slots, codec)
    return pulled(native, slots, codec, pull_codec, schedule)
