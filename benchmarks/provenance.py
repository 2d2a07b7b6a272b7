"""What each process of a benchmark job imported and saw: proof that a baseline is stock.

Import this module and call :func:`record` *before* importing MXNet (and mxdelay). It writes
``role-<role>-<rank>.json`` into a folder: a record at the call and another at exit (a
scheduler or server process leaves MXNet's import only to exit), each with whether
``mxdelay`` or ``kvstore_ext`` were imported and the ``MXNET_*``, ``OMP_*`` and
``MXDELAY_*`` variables of the process. With ``stock=True`` a process that already has
mxdelay imported exits at once with code 3. This module imports only the standard library.
"""
import atexit
import json
import os
import sys

__all__ = ['record', 'read_records', 'STOCK_VIOLATION']

STOCK_VIOLATION = 3


def _snapshot(stage, mode, rank):
    return dict(stage=stage, role=os.environ.get('DMLC_ROLE', 'worker'), rank=rank,
                pid=os.getpid(), mode=mode, mxdelay_imported='mxdelay' in sys.modules,
                kvstore_ext_imported='kvstore_ext' in sys.modules,
                env={k: v for k, v in sorted(os.environ.items())
                     if k.startswith(('MXNET_', 'OMP_', 'MXDELAY_'))})


def record(folder, mode, stock, rank='0'):
    """Write this process's records into `folder`; exit(3) if `stock` and mxdelay is loaded."""
    rank = os.environ.get('MXDELAY_RANK', rank)
    path = os.path.join(folder, 'role-%s-%s.json' % (os.environ.get('DMLC_ROLE', 'worker'), rank))
    records = [_snapshot('start', mode, rank)]

    def write():
        with open(path, 'w', encoding='utf-8') as dst:
            json.dump(records, dst, indent=1)

    def at_exit():
        records.append(_snapshot('exit', mode, rank))
        write()
    write()
    atexit.register(at_exit)
    if stock and (records[0]['mxdelay_imported'] or records[0]['kvstore_ext_imported']):
        sys.stderr.write('a stock process found mxdelay imported\n')
        sys.stderr.flush()
        os._exit(STOCK_VIOLATION)


def read_records(folder):
    """The records of a job's processes in `folder`: ``({role-rank: [records]}, [the
    role-ranks that had mxdelay or kvstore_ext imported])``."""
    roles = {}
    for name in sorted(os.listdir(folder)):
        if name.startswith('role-'):
            with open(os.path.join(folder, name), encoding='utf-8') as src:
                roles[name[5:-5]] = json.load(src)
    imported = sorted(name for name, records in roles.items()
                      if any(r['mxdelay_imported'] or r['kvstore_ext_imported'] for r in records))
    return roles, imported
