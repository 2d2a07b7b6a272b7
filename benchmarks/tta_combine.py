"""One ``tta.py`` folder made of the runs of several, for one report.

A derived time to accuracy needs a method's accuracy runs (``full``) and its step times
(``phases``) in one folder, and the check of the derivation the real runs (``real``) too.
When they were made by separate invocations (the baseline's accuracy long before, a method's
step times later), this script writes that folder: each part's CSV rows from the folders
given for it, in the order given (``FOLDER:METHOD,...``: those methods only), and the part's
meta file, which records every source (its folder, methods and provenance line; the report
lists them). A run found in two sources (the same part, method, seed, network or round) and
sources whose jobs differ (workers, servers, optimizer) are refused. Then::

    python benchmarks/tta.py --part report --methods ... --out OUT

Usage::

    python benchmarks/tta_combine.py --out docs/benchmarks/codecs-tta/combined \\
        --full docs/benchmarks/tta:sync --full docs/benchmarks/mlp-codecs \\
        --phases docs/benchmarks/codecs-tta
"""
import argparse
import logging
import os
import sys

import provenance
import report as report_lib
from accuracy_gaps import split_spec
from tta import job_of

__all__ = ['PARTS', 'combine', 'main']

_LOG = logging.getLogger('tta_combine')

#: part -> (its CSV files, the columns that name one run)
PARTS = {
    'full': (('full-evals.csv', 'full-runs.csv'), ('method', 'seed')),
    'phases': (('phases-runs.csv',), ('network', 'method', 'round')),
    'real': (('real-evals.csv', 'real-runs.csv'), ('network', 'method', 'seed')),
}
#: what every source of a folder must share (tta.job_of; the report reads it from any part)
SHARED = ('workers', 'servers', 'optimizer')


def combine(out, sources):
    """Write `out` from `sources`: {part: [FOLDER or FOLDER:METHOD,...]}; returns the
    number of runs per part."""
    os.makedirs(out, exist_ok=True)
    counts, shared = {}, {}
    for part, specs in sources.items():
        files, key_columns = PARTS[part]
        rows = {name: [] for name in files}
        seen, records, meta = {}, [], None
        for spec in specs:
            folder, methods = split_spec(spec)
            source_meta = report_lib.read_json(os.path.join(folder, 'meta-%s.json' % part))
            for name, value in zip(SHARED, job_of(source_meta)):
                if shared.setdefault(name, (value, folder))[0] != value:
                    raise ValueError('%s: %s %r, but %s has %r; combine the runs of one job '
                                     'only' % (folder, name, value, shared[name][1],
                                               shared[name][0]))
            taken = {name: [] for name in files}
            for name in files:
                path = os.path.join(folder, name)
                if os.path.exists(path):  # no real-evals.csv when no real run succeeded
                    taken[name] = [row for row in report_lib.read_csv(path)
                                   if methods is None or row['method'] in methods]
                rows[name] += taken[name]
            for row in taken[files[-1]]:  # the runs file: one row per run
                run = tuple(row[c] for c in key_columns)
                if seen.setdefault(run, folder) != folder:
                    raise ValueError('%s run %s is in %s and in %s; give one of them with '
                                     'FOLDER:METHOD,...' % (part, dict(zip(key_columns, run)),
                                                             seen[run], folder))
            records.append(dict(folder=_relative(folder),
                                methods=sorted(methods) if methods else None,
                                line=provenance.meta_line(source_meta)))
            meta = meta or dict(source_meta)
        meta['sources'] = records
        report_lib.write_json(os.path.join(out, 'meta-%s.json' % part), meta)
        for name, part_rows in rows.items():
            if part_rows:
                report_lib.write_csv(os.path.join(out, name), part_rows)
        counts[part] = len(seen)
    return counts


def _relative(folder):
    """`folder` as the results record it: relative to the repository when inside it."""
    inside = os.path.relpath(folder, provenance.REPO) if os.path.isabs(folder) else folder
    return folder if inside.startswith(os.pardir) else inside


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n', 1)[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--out', required=True, help='the folder to write')
    for part in PARTS:
        parser.add_argument('--' + part, action='append', default=[], metavar='FOLDER[:M,...]',
                            help="a folder with tta.py's %s part (repeatable)" % part)
    args = parser.parse_args(argv)
    sources = {part: getattr(args, part) for part in PARTS if getattr(args, part)}
    if 'full' not in sources:
        parser.error('give at least one --full FOLDER (the report needs accuracy runs)')
    try:
        counts = combine(args.out, sources)
    except (OSError, ValueError) as err:
        parser.error(str(err))
    logging.basicConfig(level=logging.INFO, format='%(message)s')
    _LOG.info('wrote %s: %s', args.out, ', '.join('%d %s runs' % (n, p)
                                                  for p, n in counts.items()))
    return 0


if __name__ == '__main__':
    sys.exit(main())
