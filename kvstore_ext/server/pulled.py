"""What the workers' pulls read when it is not a slot key: pull keys and model keys.

- With float16 or blockwise pushes a chunk's slot keys hold what the workers push; each slot
  has a float32 *pull key*, and a round's weights W are written there (docs/design.md §2.11):
  :class:`PullStores`.
- With compressed pulls each chunk has a *model key*: at every round that all workers pull,
  the server writes the payload ``C(W - x̂)`` there and advances its copy of the pulled
  model ``x̂`` (docs/design.md §2.12): :class:`PulledModels`, :class:`ServerModel`.

The stored arrays of both come from the workers' round of zeros at init.
"""
import numpy as np

from kvstore_ext.codecs import host, kernels
from kvstore_ext.protocol.commands import field

__all__ = ['PullStores', 'PulledModels', 'ServerModel']


class PullStores(object):
    """The stored arrays of the chunks' pull keys, by (chunk, pull key). A chunk has P pull
    keys (the hand-shake's, :meth:`set_count`): slot s's rounds write pull key ``s mod P``."""

    def __init__(self):
        self._stores = {}
        self._count = None   # P; None: one pull key per slot

    def set_count(self, count):
        """P, the pull keys per chunk (R, or 1 with compressed pulls; 0: none)."""
        self._count = count or None

    def _index(self, slot):
        return slot if self._count is None else slot % self._count

    def set_store(self, chunk, index, stored):
        """`stored` is the stored array of `chunk`'s pull key `index`: W is written there
        from now on (its value, W_0, is kept)."""
        self._stores[(chunk, index)] = stored

    def has_store(self, chunk, slot):
        """Whether :meth:`set_store` was called for the pull key of `chunk`'s `slot`."""
        return (chunk, self._index(slot)) in self._stores

    def target(self, chunk, slot, stored):
        """Where the W of `chunk`'s round in `slot` goes: its pull key's stored array, else
        `stored` (the slot's own). With one pull key every round writes it, in place."""
        return self._stores.get((chunk, self._index(slot)), stored)


class PulledModels(object):
    """The compressed pulls' codec and schedule, and per chunk its :class:`ServerModel`."""

    def __init__(self):
        self._codec = self._schedule = None
        self._models = {}              # chunk id -> ServerModel
        self._stores = {}              # chunk id -> the model key's stored array

    def set_codec(self, codec, schedule):
        """At every round `schedule` pulls, write `codec`'s payload into each chunk's model
        key (the hand-shake's ``pull_compression``)."""
        self._codec, self._schedule = codec, schedule

    def amend_schedule(self, body):
        """The SCHEDULE command: ``delay='auto'``'s decisions (``body``: ``delay``,
        ``synchronous_from``, each an int or None) amend the pulled rounds
        (:meth:`PullSchedule.amend <kvstore_ext.protocol.schedule.PullSchedule.amend>`);
        without compressed pulls the servers need no schedule. Worker 0 sends it before its
        push of the first round it changes: the round cannot be applied before."""
        delay = field(body, 'delay', int, minimum=2, optional=True)
        synchronous_from = field(body, 'synchronous_from', int, minimum=1, optional=True)
        if self._schedule is not None:
            self._schedule.amend(delay, synchronous_from)
        return {}

    def set_store(self, chunk, stored):
        """`stored` is the stored array of `chunk`'s model key: the payloads go there."""
        self._stores[chunk] = stored
        if chunk in self._models:
            self._models[chunk].store = stored

    def start(self, chunk, weight):
        """`chunk`'s first round: W_0 is `weight` (an NDArray), where its x̂ starts."""
        if chunk in self._stores and chunk not in self._models:
            self._start(chunk, weight.asnumpy())

    def restore(self, chunk, model):
        """A checkpoint's x̂ of `chunk` (numpy, or None: saved without)."""
        if model is not None and chunk in self._stores:
            self._start(chunk, model)

    def _start(self, chunk, initial):
        model = ServerModel(self._codec, initial)
        model.store = self._stores[chunk]
        self._models[chunk] = model

    def broadcast(self, chunk, rnd, weight):
        """`chunk`'s round `rnd` was applied with weights `weight`: if every worker pulls
        it, its payload must be in the model key before the round is acknowledged (the
        native server answers pulls from it in C++)."""
        model = self._models.get(chunk)
        if model is not None and self._schedule.pulled(rnd):
            model.broadcast(weight)

    def model(self, chunk):
        """`chunk`'s pulled model x̂ (numpy, to read; None without compressed pulls or
        before its first round)."""
        model = self._models.get(chunk)
        return None if model is None else model.model


class ServerModel(object):
    """A server's ``x̂`` of one chunk and the stored array of its model key.

    Parameters
    ----------
    codec : PullCodec
    initial : numpy.ndarray
        W_0 (flat float32): the workers start from it too.
    """

    def __init__(self, codec, initial):
        self.codec = codec
        self.model = np.array(initial, dtype=np.float32).reshape(-1)
        self.store = None   # the model key's stored NDArray, from the workers' zero round
        self._threads = kernels.cores()

    def broadcast(self, weight):
        """Round applied, pulled by every worker: write ``C(W - x̂)`` into the model key and
        advance ``x̂`` by what it carries, in place (:meth:`PullCodec.broadcast
        <kvstore_ext.codecs.pulls.PullCodec.broadcast>`: one fused kernel on every core of
        this process). `weight` is W (an NDArray). The payload goes straight into the key's
        memory, before the round is acknowledged: the native server answers pulls from it
        in C++, on the thread that runs this one."""
        self.codec.broadcast(host.view(weight), self.model, host.view(self.store, write=True),
                             threads=self._threads)
