"""What ``compression_params='auto'`` needs from the trainer (docs/design.md §2.16): the trained
tensors' sizes and what rules codecs out, as the store's
:class:`kvstore_ext.worker.autocodec.Request`, which rank 0's hand-shake reads."""
import numpy as np

from kvstore_ext.worker import autocodec

__all__ = ['request']


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
