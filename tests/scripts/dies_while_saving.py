"""Imported by the servers of tests/test_autosave.py (``MXDELAY_SERVER_IMPORTS``): the server
that writes the file ``SERVER_DIES_AT`` (a name ending) in the background SIGKILLs itself
halfway through the write, once: it first creates ``SERVER_DIES_MARKER``, and a server that
finds the marker writes normally.
"""
import os
import signal

from kvstore_ext.checkpoint import files

_WRITE = files.write_encoded


def _die_halfway(out):
    out.write(b'PK\x03\x04 the first bytes of an archive')
    out.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def write_encoded(path, kind, tree, arrays, save_id):
    """``files.write_encoded``, or the half of a write and the end of this process."""
    marker = os.environ['SERVER_DIES_MARKER']
    if kind == files.SERVER and path.endswith(os.environ['SERVER_DIES_AT']) \
            and not os.path.exists(marker):
        open(marker, 'w').close()
        files.atomic_write(path, _die_halfway)
    return _WRITE(path, kind, tree, arrays, save_id)


files.write_encoded = write_encoded
