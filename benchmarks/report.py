"""The benchmarks' shared report code.

The results files (:func:`write_csv`, :func:`read_csv`, :func:`write_json`, :func:`read_json`,
:func:`write_lines`), Markdown tables (:func:`table`, :func:`fmt`, :func:`seconds`), plots
(:func:`pyplot`, :func:`save`), the link to the rules from a results folder (:func:`rules_link`),
the successful runs of each configuration (:func:`groups`),
what a *noisy* run is (:data:`NOISE_CORES`, :func:`is_noisy`) and the steady rate of a window
run (:func:`steady_ms_per_step`). Each benchmark's own tables are in its script.
"""
import csv
import json
import os

__all__ = ['write_csv', 'read_csv', 'write_json', 'read_json', 'write_lines', 'table', 'fmt',
           'pyplot', 'save', 'seconds', 'groups', 'is_noisy', 'steady_ms_per_step',
           'rules_link', 'NOISE_CORES']

#: A run during which processes outside the job used more than this many cores on average
#: (the machine is shared) is *noisy*: flagged in the tables, never dropped
#: (docs/benchmarks/README.md, rule 6).
NOISE_CORES = 0.25


#: docs/benchmarks/README.md: the rules every results folder follows.
RULES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'docs',
                     'benchmarks', 'README.md')


def rules_link(out):
    """A Markdown link to the benchmarks' rules from a results folder `out` (at any depth)."""
    path = os.path.relpath(RULES, os.path.abspath(out)).replace(os.sep, '/')
    return '[%s](%s)' % (path, path)


def write_csv(path, rows):
    """Write `rows` (dicts) to `path`, columns in first-seen order."""
    columns = []
    for row in rows:
        columns += [key for key in row if key not in columns]
    with open(path, 'w', newline='', encoding='utf-8') as dst:
        writer = csv.DictWriter(dst, columns)
        writer.writeheader()
        writer.writerows(rows)


def read_csv(path):
    """Read rows written by :func:`write_csv`, numbers as numbers (for ``--report-only``)."""
    def convert(value):
        for kind in (int, float):
            try:
                return kind(value)
            except ValueError:
                pass
        return value
    with open(path, newline='', encoding='utf-8') as src:
        return [{key: convert(value) for key, value in row.items() if value != ''}
                for row in csv.DictReader(src)]


def write_json(path, data, indent=1):
    """Write `data` to `path` as JSON (`indent` None: one line)."""
    with open(path, 'w', encoding='utf-8') as dst:
        json.dump(data, dst, indent=indent)


def read_json(path):
    with open(path, encoding='utf-8') as src:
        return json.load(src)


def write_lines(path, lines):
    """Write `lines` to `path`, one a line (a Markdown file)."""
    with open(path, 'w', encoding='utf-8') as dst:
        dst.write('\n'.join(lines) + '\n')


def seconds(value):
    """`value` seconds as ``'42 s'``, from 10 minutes ``'12.5 min'``; ``'-'`` for None."""
    if value is None:
        return '-'
    return '%.0f s' % value if value < 600 else '%.1f min' % (value / 60)


def fmt(value, pattern='%.2f'):
    """`value` formatted by `pattern`; '' for None."""
    return '' if value is None else pattern % value


def table(header, rows, align=None):
    """The lines of a Markdown table: `header` (a list, or a string of cells separated by
    ``' | '``), its rule (`align`: one ``l`` or ``r`` a column; default: the first column
    left, the others right) and `rows` (lists of cells)."""
    if isinstance(header, str):
        header = header.split(' | ')
    align = align or 'l' + 'r' * (len(header) - 1)
    return ['| %s |' % ' | '.join(header),
            '|%s|' % '|'.join('---:' if a == 'r' else '---' for a in align)] + [
                '| %s |' % ' | '.join(str(cell) for cell in row) for row in rows]


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display)."""
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
    return plt


def save(fig, path, dpi):
    """Lay out `fig`, write it to `path` and close it."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)


def steady_ms_per_step(folder, period, num_workers=2):
    """Steady-state ms/step of a run, from its workers' step ends; None if too short.

    The job-level measure (from the first window start to the last worker's end, after
    ``nd.waitall()``) counts the start-up of the delayed phase and the drain of the pushes
    still queued at the end, up to ``slack`` rounds: a bias against the delayed runs on slow
    links, where a short window holds few steps. This one takes each worker's time between
    two ends of a pull period's last step (the same point of the cycle, so the same queue),
    leaving out the first period; the slower worker's rate is the job's.
    """
    worst = None
    for rank in range(num_workers):
        path = os.path.join(folder, 'worker-%d.json' % rank)
        if not os.path.exists(path):
            return None
        ends = read_json(path)['step_ends']
        first = 2 * period - 1
        last = first + (len(ends) - 1 - first) // period * period
        if last - first < 2 * period:
            return None
        value = 1000 * (ends[last] - ends[first]) / (last - first)
        worst = value if worst is None else max(worst, value)
    return worst


def groups(rows, fields):
    """``{(values of `fields`): [rows]}`` of the `rows` that have no ``error`` (a failed run)."""
    found = {}
    for row in rows:
        if 'error' not in row:
            found.setdefault(tuple(row[field] for field in fields), []).append(row)
    return found


def is_noisy(row):
    """Whether other processes used more than :data:`NOISE_CORES` during the run."""
    return row.get('cpu_other', 0.0) > NOISE_CORES
