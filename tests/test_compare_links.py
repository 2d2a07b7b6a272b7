"""``./dev demo --link``'s comparison (examples/compare_links.py) without its jobs (fast).

What is tested: the settings per link and their checks; the summary's figures from two
curves, exactly (time to stock's final accuracy, speed-up, time per step) and "not reached";
the clear refusal where shaped links cannot be built; the PNG, and its absence said when
matplotlib is missing. The jobs themselves need root and two minutes: ``./dev demo --link
100mbit`` (its output is in the report of the change that added it).
"""
import os
import sys
import types

import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'examples')
sys.path.insert(0, EXAMPLES)
import compare_links  # noqa: E402  pylint: disable=wrong-import-position
sys.path.remove(EXAMPLES)

STOCK = (70.0, [(5, 12.5, 0.70), (10, 23.0, 0.76), (20, 44.0, 0.79)])
MXDELAY = (60.0, [(12, 16.0, 0.71), (24, 21.0, 0.79), (72, 40.0, 0.84)])


def test_defaults_per_link_and_checks(capsys):
    args = compare_links.parse_args(['--link', '100mbit'])
    assert (args.stock_steps, args.mxdelay_steps, args.warmup_steps) == (20, 72, 50)
    args = compare_links.parse_args(['--link', '1gbit', '--warmup-steps', '0', '--out', 'x'])
    assert (args.stock_steps, args.mxdelay_steps, args.warmup_steps, args.out) == (
        120, 234, 0, os.path.abspath('x'))
    with pytest.raises(SystemExit):
        compare_links.parse_args(['--link', '100mbit', '--stock-steps', '0'])
    assert '--stock-steps must be at least 1, got 0' in capsys.readouterr().err
    with pytest.raises(SystemExit):
        compare_links.parse_args(['--link', '100mbit', '--mxdelay-steps', '235'])
    assert '--mxdelay-steps must be at most 234 (one epoch), got 235' in capsys.readouterr().err
    with pytest.raises(SystemExit):
        compare_links.parse_args(['--link', '10gbit'])


def test_summary_gives_time_to_stocks_final_accuracy():
    lines = compare_links.summary({'stock': STOCK, 'mxdelay': MXDELAY})
    assert lines == [
        'stock dist_sync: 20 steps in 44.0 s of training (2.20 s a step), test accuracy 0.7900; '
        'the whole job 70.0 s (start-up and evaluation included)',
        'mxdelay:         72 steps in 40.0 s of training (0.56 s a step), test accuracy 0.8400; '
        'the whole job 60.0 s (start-up and evaluation included)',
        "time to 0.7900 (stock's final test accuracy): stock 44.0 s, mxdelay 21.0 s: 2.10x "
        'faster']


def test_summary_says_not_reached():
    short = (60.0, [(12, 16.0, 0.71), (24, 21.0, 0.78)])
    assert compare_links.summary({'stock': STOCK, 'mxdelay': short})[-1] == (
        "time to 0.7900 (stock's final test accuracy): stock 44.0 s, mxdelay did not reach it "
        'in 24 steps')
    assert compare_links.time_to(STOCK[1], 0.76) == 23.0


def test_refuses_clearly_without_network_namespaces(monkeypatch):
    fake = types.SimpleNamespace(netns_available=lambda: 'network namespaces and tc need root '
                                                         '(this process runs as uid 1000)')
    monkeypatch.setattr(compare_links, 'shaped_network_module', lambda: fake)
    with pytest.raises(SystemExit) as info:
        compare_links.main(['--link', '100mbit'])
    assert str(info.value) == (
        './dev demo --link 100mbit needs root, network namespaces and tc (ip netns, tc tbf) to '
        'emulate the links: network namespaces and tc need root (this process runs as uid '
        '1000). Run it as root on Linux, or run ./dev demo without --link for the loopback '
        'demo.')


def test_plot_writes_a_png_or_says_why_not(tmp_path, monkeypatch):
    runs = {'stock': STOCK, 'mxdelay': MXDELAY}
    path = str(tmp_path / 'accuracy.png')
    assert compare_links.plot(runs, '100mbit', path) == ('accuracy against training time: %s'
                                                         % path)
    with open(path, 'rb') as png:
        assert png.read(8) == b'\x89PNG\r\n\x1a\n'
    monkeypatch.setitem(sys.modules, 'matplotlib', None)   # import matplotlib raises
    assert compare_links.plot(runs, '100mbit', str(tmp_path / 'b.png')).startswith(
        'no picture: matplotlib is not installed')
    assert not os.path.exists(tmp_path / 'b.png')
