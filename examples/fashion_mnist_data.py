"""Fashion-MNIST from the four original idx files, with per-worker shards; no download.

The files are read from a directory (default :data:`DEFAULT_DATA_DIR`, where Debian's
package ``dataset-fashion-mnist`` installs them), gzip-compressed (``*.gz``) or not::

    train-images-idx3-ubyte  train-labels-idx1-ubyte
    t10k-images-idx3-ubyte   t10k-labels-idx1-ubyte

This module imports only numpy, so that a training script can import it after
``import mxdelay`` without importing MXNet first.

Examples
--------
>>> train = load_split('train')                # uint8 images (60000, 28, 28), int32 labels
>>> shard = WorkerShard(*train, batch_size=128, rank=0, num_workers=2, seed=1)
>>> for x, y in shard.batches(epoch=0):        # float32 (128, 1, 28, 28), float32 (128,)
...     pass
"""
import gzip
import os
import struct

import numpy as np

__all__ = ['DEFAULT_DATA_DIR', 'MEAN', 'STD', 'read_idx', 'load_split', 'normalize',
           'WorkerShard', 'iterate']

#: Where Debian's ``dataset-fashion-mnist`` puts the files.
DEFAULT_DATA_DIR = '/usr/share/datasets/fashion-mnist'

#: Mean and standard deviation of the training images' pixels scaled to [0, 1]
#: (computed from the 60000 training images).
MEAN, STD = 0.2860, 0.3530

# split -> (images file, labels file, number of examples)
_SPLITS = {
    'train': ('train-images-idx3-ubyte', 'train-labels-idx1-ubyte', 60000),
    'test': ('t10k-images-idx3-ubyte', 't10k-labels-idx1-ubyte', 10000),
}
_UBYTE = 0x08  # idx type code of unsigned bytes, the only one Fashion-MNIST uses


def _locate(data_dir, name):
    """Return the path of idx file `name` (compressed or not) in `data_dir`."""
    for candidate in (name + '.gz', name):
        path = os.path.join(data_dir, candidate)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        'Fashion-MNIST file %s(.gz) not found in %s. Install the four original idx files with '
        '`apt-get install dataset-fashion-mnist` (Debian/Ubuntu; they go to %s), or pass '
        '--data-dir DIR naming a folder that holds them (this example never downloads).'
        % (name, os.path.abspath(data_dir), DEFAULT_DATA_DIR))


def read_idx(path):
    """Read one idx file of unsigned bytes (optionally gzip-compressed) into a numpy array.

    Parameters
    ----------
    path : str
        The file; a name ending in ``.gz`` is decompressed.

    Returns
    -------
    numpy.ndarray of uint8
        Shaped as the dimensions in the file's header.

    Raises
    ------
    ValueError
        If the header is not an idx header of unsigned bytes, or the file's size does not
        match the header (a truncated download, say).
    """
    opener = gzip.open if path.endswith('.gz') else open
    try:
        with opener(path, 'rb') as src:
            data = src.read()
    except (OSError, EOFError) as err:  # a corrupt or truncated gzip stream
        raise ValueError('%s cannot be read as %s: %s' % (
            path, 'gzip' if opener is gzip.open else 'a file', err)) from None
    # Header: two zero bytes, the element type code, the number of dimensions, then one
    # big-endian uint32 per dimension.
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] != _UBYTE:
        raise ValueError('%s is not an idx file of unsigned bytes (magic %s)'
                         % (path, data[:4].hex() or 'missing'))
    ndim = data[3]
    header = 4 + 4 * ndim
    if len(data) < header:
        raise ValueError('%s: idx header of %d dimensions is truncated' % (path, ndim))
    shape = struct.unpack('>%dI' % ndim, data[4:header])
    expected = header + int(np.prod(shape, dtype=np.int64))
    if len(data) != expected:
        raise ValueError('%s: header says shape %s (%d bytes), the file has %d bytes; it is '
                         'truncated or corrupt' % (path, shape, expected, len(data)))
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(shape)


def load_split(split, data_dir=DEFAULT_DATA_DIR):
    """Load the 'train' or 'test' split of Fashion-MNIST.

    Parameters
    ----------
    split : {'train', 'test'}
    data_dir : str, default DEFAULT_DATA_DIR
        Folder with the four idx files.

    Returns
    -------
    images : numpy.ndarray of uint8, shape (n, 28, 28)
    labels : numpy.ndarray of int32, shape (n,), values 0..9

    Raises
    ------
    FileNotFoundError
        If a file is missing (the message says how to install it).
    ValueError
        If a file is malformed or the two files disagree.
    """
    if split not in _SPLITS:
        raise ValueError("split must be 'train' or 'test', got %r" % (split,))
    images_name, labels_name, count = _SPLITS[split]
    images_path = _locate(data_dir, images_name)
    labels_path = _locate(data_dir, labels_name)
    images = read_idx(images_path)
    labels = read_idx(labels_path)
    if images.shape != (count, 28, 28):
        raise ValueError('%s has shape %s, Fashion-MNIST %s images are (%d, 28, 28)'
                         % (images_path, images.shape, split, count))
    if labels.shape != (count,) or labels.max() > 9:
        raise ValueError('%s has shape %s and largest label %d; Fashion-MNIST %s labels are '
                         '(%d,) in 0..9' % (labels_path, labels.shape, labels.max(), split, count))
    return images, labels.astype(np.int32)


def normalize(images):
    """Scale uint8 images (n, 28, 28) to float32 (n, 1, 28, 28) with zero mean, unit std."""
    x = images.astype(np.float32)[:, None, :, :]
    x *= 1.0 / 255.0
    x -= MEAN
    x *= 1.0 / STD
    return x


class WorkerShard(object):
    """The training examples of worker `rank` of `num_workers`, in batches.

    The examples are dealt once into `num_workers` disjoint shards of equal size (a
    permutation seeded by `seed`, so that every shard has all classes); the remainder of
    the division is dropped, and so is each epoch's last partial batch: every worker then
    runs exactly :attr:`num_batches` steps per epoch, all of the same size. Both matter
    with a parameter server: a worker that pushes one round more than the others waits
    forever for that round to complete (MXNet's parameter server then hangs), and stock
    ``gluon.Trainer`` on ``dist_sync`` refuses a change of batch size once it trains.

    Parameters
    ----------
    images : numpy.ndarray of uint8, shape (n, 28, 28)
    labels : numpy.ndarray of int, shape (n,)
    batch_size : int
        Examples per batch on this worker.
    rank, num_workers : int
        This worker and the number of workers.
    seed : int
        Seed of the shard assignment and of each epoch's order.
    max_batches : int, optional
        Cap on the batches per epoch (the same on every worker).

    Raises
    ------
    ValueError
        If an argument is out of range, or the shard holds less than one batch.
    """

    def __init__(self, images, labels, batch_size, rank, num_workers, seed, max_batches=None):
        if not 0 <= rank < num_workers:
            raise ValueError('rank must be in [0, num_workers=%d), got %r' % (num_workers, rank))
        if batch_size < 1:
            raise ValueError('batch_size must be >= 1, got %r' % (batch_size,))
        shard_size = len(images) // num_workers  # the remainder is dropped (equal shards)
        order = np.random.RandomState(seed).permutation(len(images))
        self._indices = np.sort(order[rank * shard_size:(rank + 1) * shard_size])
        self._images, self._labels = images, labels
        self.batch_size, self.rank, self.seed = batch_size, rank, seed
        self.num_batches = shard_size // batch_size  # the last partial batch is dropped
        if max_batches is not None:
            self.num_batches = min(self.num_batches, max_batches)
        if self.num_batches < 1:
            raise ValueError('each of %d workers gets %d examples, less than one batch of %d; '
                             'lower --batch-size' % (num_workers, shard_size, batch_size))

    def __len__(self):
        return self.num_batches

    def batches(self, epoch):
        """Yield this epoch's batches ``(x, y)``: float32 (b, 1, 28, 28) and float32 (b,).

        The order is a permutation of the shard seeded by (seed, epoch, rank): different on
        every worker and in every epoch, and the same when an epoch is run again (resume).
        """
        rng = np.random.default_rng([self.seed, epoch, self.rank])
        order = self._indices[rng.permutation(len(self._indices))]
        for b in range(self.num_batches):
            chosen = order[b * self.batch_size:(b + 1) * self.batch_size]
            yield normalize(self._images[chosen]), self._labels[chosen].astype(np.float32)


def iterate(images, labels, batch_size):
    """Yield ``(x, y)`` batches of a whole split in order (the last batch may be smaller)."""
    for start in range(0, len(images), batch_size):
        yield (normalize(images[start:start + batch_size]),
               labels[start:start + batch_size].astype(np.float32))
