"""How a codec's pushes travel: the data path (*wire*) of its dense keys, chosen by
``Codec.wire``, once, at the hand-shake.

- ``'slots'``: :class:`~kvstore_ext.worker.wires.slots.SlotWire` (pushes and pulls on the
  slot keys; without a codec :class:`~kvstore_ext.worker.wires.slots.ExchangeWire`, which can
  send a round and its pull in one pushpull);
- ``'pull_keys'``: :class:`~kvstore_ext.worker.wires.pull_keys.PullKeyWire` (slot keys of the
  codec's wire dtype, float32 pull keys);
- ``'rows'``: :class:`~kvstore_ext.worker.wires.rows.RowWire` (one row per worker);

each holding its pull strategy (:mod:`kvstore_ext.worker.wires.pulls`): compressed pulls
where ``pull_compression`` is set, else exact ones. What they share is
:mod:`~kvstore_ext.worker.wires.base`.
"""
from kvstore_ext.worker.wires.pulls import EXACT, CompressedPulls
from kvstore_ext.worker.wires.pull_keys import PullKeyWire
from kvstore_ext.worker.wires.rows import RowWire
from kvstore_ext.worker.wires.slots import ExchangeWire, SlotWire

__all__ = ['dense_keys', 'finite_flag']

#: Codec.wire -> the wire of its dense keys
_WIRES = {'slots': SlotWire, 'pull_keys': PullKeyWire, 'rows': RowWire}


def _wire(codec):
    try:
        return _WIRES[codec.wire]
    except KeyError:
        raise ValueError('codec %r travels by wire %r, which this worker does not know; '
                         'its Codec.wire must be one of %s'
                         % (codec.describe(), codec.wire, sorted(_WIRES))) from None


def dense_keys(codec, native, slots, pull_codec=None, schedule=None):
    """The data path of `codec`'s dense keys (`native`: the worker's native store, `slots`:
    R), with compressed pulls of `pull_codec` at the rounds of `schedule` if given.

    Raises
    ------
    ValueError
        If `codec` names a wire this worker does not know.
    """
    wire = _wire(codec)
    if wire is SlotWire and codec.type_name is None:
        # Without a codec a round can go as one pushpull per chunk (MXNet refuses pushpull
        # with its compression; the other wires pull from other keys than they push to).
        wire = ExchangeWire
    pulls = EXACT if schedule is None else CompressedPulls(native, pull_codec, schedule)
    return wire(native, slots, codec, pulls)


def finite_flag(codec, flag):
    """What carries AMP's all-finite `flag` (a one-element NDArray) in the pushes of
    `codec`'s dense keys (:mod:`kvstore_ext.worker.finite`).

    Raises
    ------
    ValueError
        If those pushes cannot carry it (one row per worker), or the wire is unknown.
    """
    return _wire(codec).finite_flag(codec, flag)
