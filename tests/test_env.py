"""The one place that reads environment variables (``kvstore_ext.env``).

What is tested: a name that is not in ``env.VARIABLES`` is refused (so every variable read
is in the documented table); unset variables give their documented defaults, as strings
from ``get`` and converted by ``get_int``/``get_float``; set values win; malformed numbers
raise ``ValueError`` naming the variable and the value; ``get_bool`` and ``role``.
Environment changes go through ``monkeypatch`` and are undone after each test.

Tolerance: none; values are exact.
"""
import os
import re

import pytest

from kvstore_ext import env

# The documented defaults (docs/env.md's table), written out independently of env.VARIABLES.
DOCUMENTED_DEFAULTS = {
    'DMLC_ROLE': None,
    'DMLC_NUM_WORKER': None,
    'DMLC_NUM_SERVER': None,
    'MXDELAY_CHUNK_SIZE': 524288,
    'MXDELAY_SLACK': 1,
    'MXDELAY_RANK': None,
    'MXDELAY_LOCAL_RANK': None,
    'MXDELAY_LOCAL_SIZE': None,
    'MXDELAY_TIMELINE': None,
    'MXDELAY_TIMELINE_STEPS': 20,
    'MXDELAY_LOG_EVERY': 0,
}


@pytest.fixture
def clean_env(monkeypatch):
    for name in env.VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize('name', ['MXDELAY_NOPE', 'DMLC_PS_ROOT_URI', 'mxdelay_slack', ''])
def test_unknown_name_is_refused(clean_env, name):
    clean_env.setenv('MXDELAY_NOPE', '1')    # even when it is set
    for getter in (env.get, env.get_int, env.get_float, env.get_bool):
        with pytest.raises(KeyError, match='%s is not an mxdelay environment variable' % name):
            getter(name)


def test_every_variable_has_a_default_and_a_meaning():
    assert set(DOCUMENTED_DEFAULTS) <= set(env.VARIABLES)
    for name, entry in env.VARIABLES.items():
        default, meaning = entry
        assert default is None or isinstance(default, str), name
        assert isinstance(meaning, str) and len(meaning) > 10, name


def test_defaults_when_unset(clean_env):
    for name, (default, _) in env.VARIABLES.items():
        assert env.get(name) == default, name
    for name, value in DOCUMENTED_DEFAULTS.items():
        assert env.get_int(name) == value, name
    assert env.get('MXDELAY_LOG_LEVEL') == 'INFO'
    assert env.get_float('MXDELAY_SLACK') == 1.0
    assert env.role() is None
    assert env.get_bool('DMLC_ROLE') is False


def test_set_values_win(clean_env):
    clean_env.setenv('MXDELAY_CHUNK_SIZE', '1000')
    clean_env.setenv('MXDELAY_SLACK', ' 7 ')
    clean_env.setenv('DMLC_NUM_WORKER', '3')
    assert env.get('MXDELAY_CHUNK_SIZE') == '1000'
    assert env.get_int('MXDELAY_CHUNK_SIZE') == 1000
    assert env.get_int('MXDELAY_SLACK') == 7
    assert env.get_int('DMLC_NUM_WORKER') == 3
    assert env.get_float('MXDELAY_CHUNK_SIZE') == 1000.0
    # read at call time, not cached at import
    clean_env.setenv('MXDELAY_CHUNK_SIZE', '2000')
    assert env.get_int('MXDELAY_CHUNK_SIZE') == 2000


@pytest.mark.parametrize('name', ['MXDELAY_CHUNK_SIZE', 'MXDELAY_SLACK', 'DMLC_NUM_WORKER',
                                  'DMLC_NUM_SERVER', 'MXDELAY_RANK'])
@pytest.mark.parametrize('raw', ['abc', '1.5', '4k', '0x10', '', '1 2'])
def test_malformed_integer(clean_env, name, raw):
    clean_env.setenv(name, raw)
    with pytest.raises(ValueError) as info:
        env.get_int(name)
    message = str(info.value)
    assert name in message and repr(raw) in message and 'integer' in message


@pytest.mark.parametrize('raw', ['fast', '1,5', ''])
def test_malformed_number(clean_env, raw):
    clean_env.setenv('MXDELAY_SLACK', raw)
    with pytest.raises(ValueError, match=r"MXDELAY_SLACK=%r is not a valid number" % raw):
        env.get_float('MXDELAY_SLACK')


def test_malformed_message_says_the_fix(clean_env):
    clean_env.setenv('MXDELAY_CHUNK_SIZE', 'big')
    with pytest.raises(ValueError, match=r'unset it or set e\.g\. MXDELAY_CHUNK_SIZE=524288'):
        env.get_int('MXDELAY_CHUNK_SIZE')


@pytest.mark.parametrize('raw,expected', [('1', True), ('true', True), (' Yes ', True),
                                          ('ON', True), ('0', False), ('false', False),
                                          ('no', False), ('', False)])
def test_get_bool(clean_env, raw, expected):
    clean_env.setenv('MXDELAY_RANK', raw)
    assert env.get_bool('MXDELAY_RANK') is expected


@pytest.mark.parametrize('raw,expected', [('server', 'server'), (' Worker\n', 'worker'),
                                          ('SCHEDULER', 'scheduler'), ('', None)])
def test_role(clean_env, raw, expected):
    clean_env.setenv('DMLC_ROLE', raw)
    assert env.role() == expected


def test_markdown_table_lists_every_variable_with_its_default():
    table = env.markdown_table()
    assert re.findall(r'^\| `([A-Z_]+)` \|', table, re.MULTILINE) == list(env.VARIABLES)
    assert '| `MXDELAY_CHUNK_SIZE` | `524288` | Largest number of elements' in table
    assert '| `DMLC_ROLE` | - | Role of this process' in table


def test_docs_env_md_holds_the_current_table():
    # docs/env.md is the page users read (the README links it); its table must be exactly
    # what env.VARIABLES generates. To update it, replace the table with the output of
    # python -c 'from kvstore_ext import env; print(env.markdown_table())'.
    page = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                             'docs', 'env.md'), encoding='utf-8').read()
    table = page.split('<!-- env-table', 1)[1].split('-->\n', 1)[1]
    assert table.rstrip('\n') == env.markdown_table()
