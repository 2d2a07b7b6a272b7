"""Byte accounting: the store's ``traffic`` part (``DistDelay.delayed.traffic``).

What one push and one pull of a key carry, as configured or with another codec
(:mod:`mxdelay.traffic` compares them), and how many native keys (chunks) a round of a key
pushes. ps-lite's headers (keys, lengths) are not counted.
"""
import numpy as np

from kvstore_ext.codecs import pulls

__all__ = ['ByteCount', 'chunk_bytes']


class ByteCount(object):
    """The bytes of the keys of `session` (:class:`kvstore_ext.worker.session.Session`)."""

    def __init__(self, session):
        self._session = session

    def num_chunks(self, key):
        """Number of native keys (chunks) of `key`: push operations per round."""
        return len(self._session.tensor(key).chunks)

    def payload_bytes(self, key, codec=None, pull_codec=None):
        """``(push, pull)``: bytes of the values one push and one pull of `key` carry.

        Parameters
        ----------
        key : int or str
        codec : kvstore_ext.codecs.Codec, optional
            The push codec to count with (default: this store's; ``codecs.NONE``: the
            tensor's dtype). Another codec than this store's is counted on the chunks it
            would have (``Codec.chunk_limit``: a blockwise codec's may be smaller), and so
            is `pull_codec` with it.
        pull_codec : kvstore_ext.codecs.pulls.PullCodec or False, optional
            The pull codec to count with (default: this store's; False: exact pulls, the
            tensor's dtype).

        Returns
        -------
        tuple of int, or None
            None for a row_sparse key, whose pushes and pulls carry the rows of the step.
            ps-lite's headers (keys, lengths) are not counted.
        """
        session = self._session
        tensor = session.tensor(key)
        if tensor.kind is session.rows:
            return None
        mine = session.settings.codec
        codec = mine if codec is None else codec
        pull_codec = session.settings.pull_compression if pull_codec is None \
            else (pull_codec or None)
        if codec is mine:
            sizes = [chunk.stop - chunk.start for chunk in tensor.chunks]
        else:   # the chunks `codec` would have: a blockwise codec's may be smaller
            sizes = [stop - start for start, stop in session.placement.spans(
                tensor.size, codec.chunk_limit(session.num_workers))]
        return chunk_bytes(codec, pull_codec, sizes, tensor.dtype)


def chunk_bytes(codec, pull_codec, sizes, dtype):
    """``(push, pull)``: bytes of one push with `codec` and one pull with `pull_codec` (None:
    exact, `dtype`) of chunks of `sizes` elements."""
    return (sum(codec.push_bytes(n, dtype) for n in sizes),
            np.dtype(dtype).itemsize * sum(sizes) if pull_codec is None
            else pulls.bytes_per_pull(pull_codec, sizes))
