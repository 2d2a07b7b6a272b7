"""Ordering in MXNet's engine: small writes that make a later operation wait for an earlier one.

MXNet's engine orders operations by the arrays they read and write: an operation that writes
an array runs after every operation queued before it that reads or writes that array. The
native store's push reads its send buffer until the server acknowledges the push (its round
complete, docs/design.md §2.4), and a pull writes its receive buffer. The worker's data paths
(:mod:`kvstore_ext.worker.wires`) order their pulls and pushes with one-element writes on the
*heads* of those buffers (their first element, a view): each function here says what it
orders after what. The elements written hold data that is no longer needed, or are
overwritten right after (by the pull they order, or the next copy into the buffer).
"""
from mxnet import nd

__all__ = ['touch', 'wait_for_pushes', 'add_after_pushes', 'add_after_writes',
           'copy_after_pushes', 'follow', 'empty_row_pull']


def touch(head):
    """A one-element write on `head`, in place: it runs after every operation queued on its
    array before (a push that sends the array: until the push is acknowledged)."""
    nd._internal._plus_scalar(head, scalar=0.0, out=head)  # pylint: disable=protected-access


def wait_for_pushes(heads):
    """Wait, in this thread, for the pushes that send the arrays of `heads` to be
    acknowledged."""
    for head in heads:
        touch(head)
        head.wait_to_read()


def add_after_pushes(target, heads):
    """Make the next write on `target`'s array wait for the pushes that send the arrays of
    `heads`: each head is touched, then added into `target`."""
    for head in heads:
        touch(head)
    add_after_writes(target, heads)


def add_after_writes(target, heads):
    """Make the next write on `target`'s array wait for the writes queued on the arrays of
    `heads` (a pushpull writes its send buffer until its answer arrives, a pull its receive
    buffer): each head is added into `target`, a read, which waits for writes only."""
    for head in heads:
        nd.elemwise_add(target, head, out=target)


def copy_after_pushes(targets, heads):
    """Make the next write on each of `targets`' arrays wait for the pushes that send the
    arrays of `heads`: each head is touched, then copied into every target."""
    for head in heads:
        touch(head)
        for target in targets:
            head.copyto(target)


def follow(target, source):
    """Make the next operation on `target`'s array wait for what is queued on `source`'s
    (e.g. a pull into it): a one-element copy of `source` into `target` (a cast if their
    dtypes differ)."""
    source.copyto(target)


def empty_row_pull(native, key, scratch, no_rows, priority=0):
    """Pull no rows of the row_sparse `key` into `scratch` (`no_rows`: empty int64 ids).
    MXNet's row_sparse pull writes the buffer the key's last push was sent from, so it runs
    after that push is acknowledged; what reads `scratch` next follows it."""
    native.row_sparse_pull(key, out=scratch, row_ids=no_rows, priority=priority)
