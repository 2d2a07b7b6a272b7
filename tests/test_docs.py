"""The user's pages agree with the code and with the results files (fast; no jobs).

What is tested:

- every error message that docs/troubleshooting.md quotes (the backtick spans of its tables'
  first column) is a message of the library (a string literal of ``kvstore_ext/`` or
  ``mxdelay/``, format fields and the page's ``...`` matching any text), except the few it
  quotes from MXNet or dmlc-core and the names beside them, listed below;
- every figure of README.md and docs/tuning.md that sits in a paragraph, list item or table
  row linking a results file (``docs/benchmarks/...``) appears in one of the files it links;
  at least :data:`MIN_FIGURES` figures are checked, so that the check cannot pass by finding
  none;
- every relative link of those pages (and of every results page under docs/) resolves; the README has at most 200 lines, and its
  diff's script defines every name it uses.

Tolerance: none; a figure must appear digit for digit (``9.63x`` as ``9.63``, ``-0.87`` as
``0.87``), bounded by non-digits.
"""
import ast
import builtins
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIBRARY = ('kvstore_ext', 'mxdelay')
CHECKED_PAGES = ('README.md', os.path.join('docs', 'tuning.md'))
MIN_FIGURES = {'README.md': 40, os.path.join('docs', 'tuning.md'): 160}

#: Spans of troubleshooting.md's error column that are not mxdelay's messages, and why.
NOT_MXDELAY = {
    "AttributeError: 'Thread' object has no attribute 'isAlive'": "dmlc-core's old tracker",
    "We can't generate TBlob for MKLDNN data": "MXNet's CPU build",
    'init 4 first': "MXNet's stock server",
    'worker speaks protocol P, this server Q': 'the log of a server older than protocol 4',
}
#: Spans that name a call, option or command beside a message.
NAMES = {'tools/launch.py', 'set_pull_compression', 'configure()', 'warmup_steps',
         "warmup_strategy='lars'", 'dist_sync', 'python -m mxdelay.trace --merge', 'update()',
         'load_states', 'ValueError', 'mxdelay-launch'}

_WILD = '\0'   # one format field of a library string: any text
_FIELD = re.compile(r'%(?:\([^)]*\))?[-+ #0]*\d*(?:\.\d+)?[sdrfgixXe]|\{[^{}]*\}')


def _read(*parts):
    with open(os.path.join(REPO, *parts), encoding='utf-8') as src:
        return src.read()


# -- (a) troubleshooting.md's messages --------------------------------------------------------
def _string_value(node):
    """The text of a str constant, f-string or '+' of them, fields as _WILD; else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return ''.join(_string_value(v) if isinstance(v, ast.Constant) else _WILD
                       for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _string_value(node.left), _string_value(node.right)
        if left is not None or right is not None:
            return (left if left is not None else _WILD) + (right if right is not None
                                                            else _WILD)
    return None


@pytest.fixture(scope='module')
def library_messages():
    """Every string of the library, %-fields and {}-fields as _WILD, '%%' as '%'."""
    found = set()
    for package in LIBRARY:
        for folder, _, files in os.walk(os.path.join(REPO, package)):
            for name in files:
                if not name.endswith('.py'):
                    continue
                path = os.path.join(folder, name)
                with open(path, encoding='utf-8') as src:
                    tree = ast.parse(src.read(), path)
                for node in ast.walk(tree):
                    text = _string_value(node)
                    if text and len(text) > 8:
                        found.add(_FIELD.sub(_WILD, text).replace('%%', '%'))
    assert len(found) > 1000, 'the library has too few strings: is %s right?' % (LIBRARY,)
    return found


#: The share of a quoted piece's characters, quoted values, numbers and one-letter
#: placeholders left out, that must match the library's literal text (the rest: values that
#: format fields render, such as a parameter's name).
LITERAL_SHARE = 0.75
_VALUE = re.compile(r"'[^']*'|\b[A-Z]\b|\d")


def _occurs(fragment, template):
    """Whether `fragment` is a substring of some text that `template` (literal characters and
    _WILD fields) can become, with at least LITERAL_SHARE of it (values left out) from literal
    characters."""
    none = -1
    # best[j]: the most literal characters of a match of fragment[:j] ending here.
    best = [0] + [none] * len(fragment)
    found = 0
    for char in template:
        if char == _WILD:
            for j in range(1, len(best)):      # a field renders any text
                best[j] = max(best[j], best[j - 1])
        else:
            for j in range(len(best) - 1, 0, -1):
                best[j] = best[j - 1] + 1 if best[j - 1] != none and fragment[j - 1] == char \
                    else none
        found = max(found, best[-1])
        best[0] = 0                             # the fragment may start anywhere
    values = sum(len(m) for m in _VALUE.findall(fragment))
    return found >= LITERAL_SHARE * (len(fragment) - values)


def troubleshooting_messages():
    """The backtick spans of the error column of docs/troubleshooting.md's tables."""
    spans = []
    for line in _read('docs', 'troubleshooting.md').splitlines():
        if line.startswith('| ') and not line.startswith(('| error', '|---')):
            spans += re.findall(r'`([^`]+)`', line.split('|')[1])
    return spans


MESSAGES = [span for span in troubleshooting_messages()
            if span not in NOT_MXDELAY and span not in NAMES]


def test_troubleshooting_quotes_enough_messages():
    assert len(MESSAGES) >= 30, MESSAGES
    # The exceptions above are still quoted by the page (else they should go from the lists).
    assert set(NOT_MXDELAY) | NAMES <= set(troubleshooting_messages())


@pytest.mark.parametrize('message', MESSAGES)
def test_troubleshooting_message_is_in_the_code(message, library_messages):
    text = re.sub(r'^[A-Z]\w*Error: ', '', message)   # the exception's class
    fragments = [part.strip() for part in text.split('...')]
    # A short fragment between two '...' is a value (e.g. 'LAMB...: ...'), not the message.
    fragments = [part for part in fragments if len(part) >= 8] or [max(fragments, key=len)]
    # Candidates: the strings holding half its words of 4 letters or more (values left out).
    words = set(re.findall(r'[A-Za-z_]{4,}', _VALUE.sub(' ', text)))
    candidates = [t for t in library_messages if 2 * sum(w in t for w in words) >= len(words)]
    assert any(all(_occurs(f, t) for f in fragments) for t in candidates), (
        'docs/troubleshooting.md quotes %r, which no one string of %s can give (quote a '
        "message made of several strings as several spans)" % (message, ' or '.join(LIBRARY)))


def test_occurs_is_strict():
    template = _FIELD.sub(_WILD, 'workers disagree on %s: worker %d has %r, worker %d has %r')
    assert _occurs('workers disagree on delay: worker 0 has 4, worker 1 has 8', template)
    assert _occurs('disagree on delay: worker 0', template)
    assert not _occurs('workers disagree about delay', template)
    assert not _occurs('worker 0 has 4, worker 1 differs from worker 0', template)
    assert _occurs("type 'dist_dealy' is unknown", _FIELD.sub(_WILD, 'type %r is unknown'))
    assert not _occurs('cannot be combined with fp16 pushes',
                       _FIELD.sub(_WILD, 'cannot be combined with AMP (%s) yet'))


# -- (b) figures beside links to results files ----------------------------------------------
_LINK = re.compile(r'\[([^\]]*)\]\(([^)\s]+)\)')
#: A figure: a decimal number, or a number with x, % or a unit of time; versions excluded.
_FIGURE = re.compile(r'(?<![\w.])[+-]?(\d+\.\d+|\d+(?=x\b|%| s\b| ms\b| min\b))(?![\d.]?\d)')


def units(text):
    """The page's table rows, list items and paragraphs (code blocks left out)."""
    result, current, fenced = [], [], False
    for line in text.splitlines() + ['']:
        if line.startswith('```'):
            fenced = not fenced
            line = ''
        if fenced:
            continue
        starts = line.startswith(('|', '- ', '#')) or re.match(r'\d+\. ', line)
        if not line.strip() or starts or current[:1] and current[0].startswith('|'):
            if current:
                result.append(' '.join(current))
            current = []
        if line.strip():
            current.append(line.strip())
    return result


def results_links(unit, page):
    """The existing results files (under docs/benchmarks/) that `unit` links."""
    here = os.path.dirname(os.path.join(REPO, page))
    paths = []
    for _, target in _LINK.findall(unit):
        path = os.path.normpath(os.path.join(here, target.split('#')[0]))
        if path.startswith(os.path.join(REPO, 'docs', 'benchmarks') + os.sep) and \
                os.path.isfile(path) and not path.endswith('.png'):  # a picture holds no text
            paths.append(path)
    return paths


def figures(unit):
    """The figures of `unit` outside code spans, link targets and section numbers."""
    text = re.sub(r'`[^`]*`', ' ', unit)
    text = _LINK.sub(lambda m: ' %s ' % m.group(1), text)
    text = re.sub(r'§\s*[\d.]+', ' ', text)
    return _FIGURE.findall(text)


def _in_file(figure, contents):
    return re.search(r'(?<![\d.])%s(?!\d)' % re.escape(figure), contents) is not None


@pytest.mark.parametrize('page', CHECKED_PAGES)
def test_figures_appear_in_the_results_files_they_sit_beside(page):
    checked, missing = 0, []
    for unit in units(_read(page)):
        paths = results_links(unit, page)
        if not paths:
            continue
        contents = ''.join(_read(path) for path in paths)
        for figure in figures(unit):
            checked += 1
            if not _in_file(figure, contents):
                missing.append('%s (beside %s)' % (figure, ', '.join(
                    os.path.relpath(p, REPO) for p in paths)))
    assert not missing, '%s: figures not in the files they link:\n%s' % (page,
                                                                         '\n'.join(missing))
    assert checked >= MIN_FIGURES[page], (page, checked)


def test_figure_extraction():
    unit = ('**9.63x at 100 Mbit/s** (250 s against 40.0 min), -0.87 points, 98%, MXNet 1.9.1, '
            '`0.5`, [design §2.14](docs/design.md#214-x), k=4, 3 seeds, 1.86M parameters')
    assert figures(unit) == ['9.63', '250', '40.0', '0.87', '98', '1.86']
    assert _in_file('0.87', '| lowest | -0.87 |') and not _in_file('0.87', '0.8702')
    assert not _in_file('9.6', '9.63x') and not _in_file('250', '1250 s')


# -- links, length, the first screen's diff -------------------------------------------------
def _markdown_pages():
    """The README and every Markdown page under docs/, results folders included, except the
    ``readme-rows.md`` that benchmarks/accuracy_cnn.py writes for benchmarks/results_page.py
    (rows whose links are relative to the repository's root, where that page puts them)."""
    pages = ['README.md']
    for folder, _, names in sorted(os.walk(os.path.join(REPO, 'docs'))):
        pages += sorted(os.path.relpath(os.path.join(folder, name), REPO) for name in names
                        if name.endswith('.md') and name != 'readme-rows.md')
    return pages


@pytest.mark.parametrize('page', _markdown_pages())
def test_relative_links_resolve(page):
    here = os.path.dirname(os.path.join(REPO, page))
    broken = [target for _, target in _LINK.findall(_read(page))
              if not re.match(r'[a-z]+:', target) and not target.startswith('#')
              and not os.path.exists(os.path.join(here, target.split('#')[0]))]
    assert not broken, (page, broken)


def test_readme_is_at_most_200_lines():
    assert len(_read('README.md').splitlines()) <= 200


def readme_diff_script():
    """The script after the README's first diff (its ' ' and '+' lines)."""
    diff = _read('README.md').split('```diff\n', 1)[1].split('```', 1)[0]
    return '\n'.join(line[1:] for line in diff.splitlines() if line[:1] in (' ', '+', ''))


def test_readme_diff_defines_every_name():
    tree = ast.parse(readme_diff_script())
    defined = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            defined.update((a.asname or a.name).split('.')[0] for a in node.names)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    assert used - defined == set()


def test_readme_diff_has_the_headline_settings():
    # The first screen's figures are k=4 + ternary pushes + int8 pulls, warm-up 200
    # (docs/benchmarks/tta-payload/combined-2777c42/results.md); the diff's 'auto' settings
    # (the default warm-up, 200) chose exactly those in the real runs of tta/auto.
    script = readme_diff_script()
    for setting in ("delay='auto'", "compression_params='auto'", "'dist_delay'"):
        assert setting in script, setting
    assert 'warmup_steps' not in script and 'pull_compression' not in script
    assert 'Delayed methods: rule `mirror`, warm-up 200 steps' in _read(
        'docs', 'benchmarks', 'tta-payload', 'combined-2777c42', 'results.md')
    for link in ('1gbit', '100mbit'):
        notes = _read('docs', 'benchmarks', 'tta', 'auto', link, 'notes.md')
        assert 'ternary pushes + int8 pulls at the hand-shake (probed' in notes, link
        assert 'k=4 at the switch, no' in notes, link
        assert 'warm-up 200' in notes, link


def test_ci_runs_the_readmes_test_command():
    # .ci/run must be exactly what the README tells a developer to run (the wheel check
    # and these docs checks are tests of that suite).
    readme = _read('README.md')
    assert re.search(r'^\./dev test +# the whole test suite$', readme, re.MULTILINE)
    commands = [line for line in _read('.ci', 'run').splitlines()
                if line.strip() and not line.startswith(('#', 'set ', 'cd '))]
    assert commands == ['exec ./dev test'], commands
