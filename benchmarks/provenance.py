"""Provenance: what each process of a benchmark job imported and saw (proof that a baseline
is stock), and the commit, machine and dates of a run.

Import this module and call :func:`record` *before* importing MXNet (and mxdelay). It writes
``role-<role>-<rank>.json`` into a folder: a record at the call and another at exit (a
scheduler or server process leaves MXNet's import only to exit), each with whether
``mxdelay``, ``kvstore_ext`` or ``mxnet`` were imported and the ``MXNET_*``, ``OMP_*`` and
``MXDELAY_*`` variables of the process. With ``stock=True`` a process that already has
mxdelay imported exits at once with code 3. This module imports only the standard library.
"""
import atexit
import contextlib
import datetime
import json
import os
import platform
import subprocess
import sys

__all__ = ['record', 'read_records', 'STOCK_VIOLATION', 'now', 'git', 'code_version',
           'cpu_model', 'machine', 'meta_line']

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

STOCK_VIOLATION = 3


def _snapshot(stage, mode, rank):
    return dict(stage=stage, role=os.environ.get('DMLC_ROLE', 'worker'), rank=rank,
                pid=os.getpid(), mode=mode, mxdelay_imported='mxdelay' in sys.modules,
                kvstore_ext_imported='kvstore_ext' in sys.modules,
                mxnet_imported='mxnet' in sys.modules,
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


# -- a run's provenance ---------------------------------------------------------------------
def now():
    """The UTC time, ISO 8601 to the second: the results' start and end stamps."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')


def git(*args):
    return subprocess.run(['git', '-C', REPO] + list(args), capture_output=True, text=True,
                          check=False).stdout.strip()


def code_version():
    """``{'commit': HEAD, 'dirty': bool, 'dirty_files': [...]}`` of the repository."""
    status = subprocess.run(['git', '-C', REPO, 'status', '--porcelain', '--untracked-files=no'],
                            capture_output=True, text=True, check=False).stdout
    dirty = [line[3:] for line in status.splitlines() if line.strip()]  # 'XY path'
    return {'commit': git('rev-parse', 'HEAD'), 'dirty': bool(dirty), 'dirty_files': dirty}


def cpu_model():
    with contextlib.suppress(OSError):
        with open('/proc/cpuinfo', encoding='utf-8') as src:
            for line in src:
                if line.startswith('model name'):
                    return line.split(':', 1)[1].strip()
    return 'unknown'


def machine():
    return {'cores': os.cpu_count(), 'cpu': cpu_model(), 'kernel': platform.release(),
            'python': platform.python_version()}


def _changed(start, end):
    """Files changed between two commits (what changed under a run that spans them)."""
    if not start or not end or start == end:
        return []
    return git('diff', '--name-only', start, end).split()


def meta_line(meta):
    """One Markdown line of a part's provenance (command, dates, commits, machine, load)."""
    code = meta.get('code_start', {})
    end = meta.get('code_end', {})
    changed = _changed(code.get('commit'), end.get('commit'))
    return ('`%s`: %s to %s, commit `%s`%s%s; %s cores (%s); load average (1 min) %.2f before, '
            '%.2f after' % (
                meta['command'], meta['started'], meta.get('finished', '?'),
                code.get('commit', '?')[:10],
                ' (dirty: %s)' % ', '.join(code['dirty_files']) if code.get('dirty') else '',
                '' if end.get('commit') == code.get('commit') else
                ', `%s` at the end (files changed in between: %s)' % (
                    end.get('commit', '?')[:10], ', '.join(changed) or 'none'),
                meta['machine']['cores'], meta['machine']['cpu'], meta['load_before'][0],
                meta.get('load_after', [float('nan')])[0]))
