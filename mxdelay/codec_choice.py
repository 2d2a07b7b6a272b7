"""What ``compression_params='auto'`` needs from the trainer (docs/design.md §2.16): the trained
tensors' sizes, what rules codecs out and the codecs a resume keeps, as the store's
:class:`kvstore_ext.worker.autocodec.Request`, which rank 0's hand-shake reads."""
import contextlib

import numpy as np

from kvstore_ext.worker import autocodec

from . import worker_state

__all__ = ['request', 'KeptCodecs', 'loading']


class KeptCodecs(object):
    """``kept()``: the codecs 'auto' keeps rather than choosing, or None (choose): those of
    the checkpoint that ``load_states`` reads (:func:`loading`), else ``newest()``'s (the
    newest periodic checkpoint's). The resume finds the state of those codecs (residuals,
    pulled models); another choice would make its load refuse the checkpoint."""

    def __init__(self, newest):
        self.newest = newest
        self.fname = None

    def __call__(self):
        if self.fname is not None:
            return worker_state.index_codecs(self.fname)
        return self.newest()


@contextlib.contextmanager
def loading(kept, fname):
    """Within it, `kept` (a :class:`KeptCodecs`, or None: no 'auto') keeps the codecs of the
    checkpoint `fname`: a hand-shake inside a ``load_states`` before the first step."""
    if kept is not None:
        kept.fname = fname
    try:
        yield
    finally:
        if kept is not None:
            kept.fname = None


def request(states, amp, delay, resumed):
    """The :class:`~kvstore_ext.worker.autocodec.Request` of a trainer's parameters.

    Parameters
    ----------
    states : list of ParamState
        The trainer's parameters.
    amp : NoAmp or LossScaledAmp
        Its AMP policy.
    delay : int or None
        k (None: ``delay='auto'``, not decided before the switch).
    resumed : callable
        ``resumed()``: the codecs of the checkpoint the job resumes from, or None.
    """
    trained = [s for s in states if s.trained]

    def sizes():
        # At the hand-shake: after the first forward has fixed deferred shapes.
        return [s.param.list_data()[0].size for s in trained]

    def restriction():
        """Why only no codec may be chosen, or None."""
        if amp.enabled:
            return 'AMP: the codecs need float32 gradients, compressed pulls refuse AMP'
        if any(s.gradient.sparse for s in states):
            return 'row_sparse gradients: the codecs push dense gradients only'
        if any(np.dtype(s.param.dtype) != np.float32 for s in trained):
            return 'a parameter is not float32: the codecs compress float32 only'
        return None

    return autocodec.Request(sizes, delay, restriction, resumed)
