"""The scaling benchmark's arithmetic (benchmarks/scaling_report.py): ratios, scaling
efficiency, verdicts, the byte floor, the cores per role; the link counters and CPU times it
reads (benchmarks/monitor.py); the link rates it shapes and measures (benchmarks/netns.py)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                'benchmarks'))
import harness  # noqa: E402  pylint: disable=wrong-import-position
import monitor  # noqa: E402  pylint: disable=wrong-import-position
import netns  # noqa: E402  pylint: disable=wrong-import-position
import scaling  # noqa: E402  pylint: disable=wrong-import-position
import scaling_report  # noqa: E402  pylint: disable=wrong-import-position


def _row(model, workers, servers, method, rate, round_index=1, link='1gbit', **more):
    return dict(model=model, rate=link, workers=workers, servers=servers, method=method,
                round=round_index, samples_per_s=rate, cpu_workers=1.0, cpu_server=0.25,
                cpu_scheduler=0.0, cpu_launcher=0.125, cpu_other=0.5, **more)


def test_ratio_efficiency_and_verdicts():
    rows = [_row('resnet18', 2, 2, 'sync', 100.0), _row('resnet18', 2, 2, 'k4', 150.0),
            _row('resnet18', 4, 2, 'sync', 160.0), _row('resnet18', 4, 2, 'k4', 320.0),
            _row('resnet18', 4, 2, 'k4-fp16', 400.0),
            _row('resnet18', 8, 2, 'sync', 300.0), _row('resnet18', 8, 2, 'k4', 500.0),
            # a second round: the median of 80 and 120 is 100; a failed run is left out
            _row('mlp', 2, 1, 'sync', 80.0), _row('mlp', 2, 1, 'sync', 120.0, 2),
            dict(_row('mlp', 2, 1, 'sync', None, 3), error='exit [1]')]
    summary = scaling_report.summarize(rows)
    assert summary[('mlp', '1gbit', 2, 1, 'sync')]['samples_per_s'] == 100.0
    assert summary[('mlp', '1gbit', 2, 1, 'sync')]['runs'] == 2
    assert summary[('mlp', '1gbit', 2, 1, 'sync')]['busy_cores'] == 1.875
    assert summary[('resnet18', '1gbit', 2, 2, 'k4')]['x_sync'] == pytest.approx(1.5,
                                                                                abs=1e-12)
    assert summary[('resnet18', '1gbit', 2, 2, 'sync')]['efficiency'] == pytest.approx(
        1.0, abs=1e-12)
    # throughput(8) / (8/2 * throughput(2))
    assert summary[('resnet18', '1gbit', 8, 2, 'sync')]['efficiency'] == pytest.approx(
        0.75, abs=1e-12)
    assert summary[('resnet18', '1gbit', 8, 2, 'k4')]['efficiency'] == pytest.approx(
        500 / 600, abs=1e-12)
    assert summary[('resnet18', '1gbit', 4, 2, 'k4-fp16')]['efficiency'] is None  # no N=2
    assert scaling_report.verdicts(summary) == [
        ('resnet18 1gbit N=4 S=2: k=4 >= 1.6x dist_sync', '2.00x', 'met'),
        ('resnet18 1gbit N=4 S=2: k=4 + fp16 >= 2.5x dist_sync', '2.50x', 'met'),
        ("resnet18 1gbit S=2: scaling efficiency N=2 -> 8 of k=4 >= dist_sync's",
         '0.833 vs 0.750', 'met')]


def test_each_link_is_a_configuration_of_its_own_and_the_envelope_targets_use_steady_rates():
    # The same model, N, S and method at two rates: two summaries, each with its own sync;
    # issue 37's targets read the steady samples/s (a run too short for it has none).
    ternary = 'k4-ternary-pull-int8'
    rows = [_row('resnet50', 2, 1, 'sync', 40.0, link='10gbit', steady_samples_per_s=50.0),
            _row('resnet50', 2, 1, ternary, 30.0, link='10gbit', steady_samples_per_s=45.0),
            _row('resnet50', 2, 1, 'sync', 10.0, steady_samples_per_s=10.0),
            _row('resnet50', 2, 1, ternary, 36.0, steady_samples_per_s=32.0),
            _row('mlp', 2, 1, 'sync', 10.0, link='10gbit'),
            _row('mlp', 2, 1, 'k4', 20.0, link='10gbit')]
    summary = scaling_report.summarize(rows)
    assert summary[('resnet50', '10gbit', 2, 1, ternary)]['x_sync'] == 0.75
    assert summary[('resnet50', '10gbit', 2, 1, ternary)]['x_sync_steady'] == 0.9
    assert summary[('resnet50', '1gbit', 2, 1, ternary)]['x_sync'] == 3.6
    assert summary[('resnet50', '1gbit', 2, 1, ternary)]['x_sync_steady'] == 3.2
    assert summary[('mlp', '10gbit', 2, 1, 'k4')]['x_sync_steady'] is None
    assert scaling_report.model_rates(summary) == [('mlp', '10gbit'), ('resnet50', '10gbit'),
                                       ('resnet50', '1gbit')]
    assert scaling_report.verdicts(summary) == [
        ('resnet50 10gbit N=2 S=1: k=4 + ternary + pull int8 >= 1.0x dist_sync (steady '
         'samples/s)', '0.90x', 'missed'),
        ('resnet50 1gbit N=2 S=1: k=4 + ternary + pull int8 >= 3.0x dist_sync (steady '
         'samples/s)', '3.20x', 'met')]


def test_byte_floor():
    # ResNet-50's float32 gradient (94.2 MB) pushed by each of 2 workers, batch 8: the
    # server receives both, 188.4 MB a step; at 10 Gbit/s that is 150.72 ms, so at most
    # 2 x 8 samples per 150.72 ms. A worker's busiest direction is its send.
    row = dict(workers=2, servers=1, batch=8, worker_tx_mb=94.2, worker_rx_mb=23.55,
               server_tx_mb=47.1, server_rx_mb=188.4)
    floor = scaling_report.byte_floor(row, netns.rate_bits('10gbit'))
    assert floor == pytest.approx(dict(worker_floor_ms=75.36, server_floor_ms=150.72,
                                       floor_samples_per_s=16000 / 150.72), rel=1e-12)
    # a slower link: ten times the floor; no bytes at all: no floor
    slow = scaling_report.byte_floor(row, netns.rate_bits('1gbit'))
    assert slow['server_floor_ms'] == pytest.approx(1507.2, rel=1e-12)
    assert scaling_report.byte_floor(dict(row, worker_tx_mb=0.0, worker_rx_mb=0.0, server_tx_mb=0.0,
                                   server_rx_mb=0.0), 1e9)['floor_samples_per_s'] is None


def test_cores_per_role_from_the_cpu_monitors_samples():
    # Two workers and a server over a 2 s window: the CPU seconds each process gained, from
    # samples interpolated at the window's ends, per role and per process of the role; the
    # machine's busy time beyond the job's is 'other'.
    cpu = monitor.CpuMonitor({})
    cpu.samples = [(100.0, {'worker 0': 10.0, 'worker 1': 20.0, 'server 0': 5.0}, 1000.0),
                   (104.0, {'worker 0': 12.0, 'worker 1': 21.2, 'server 0': 6.6}, 1008.0)]
    results = [dict(steps=4, start=101.0, end=102.5, step_ends=[101.5, 102.0, 102.25, 102.5]),
               dict(steps=4, start=101.5, end=103.0, step_ends=[102.0, 102.5, 102.75, 103.0])]
    row = dict(harness.window(results, cpu, batch=8), workers=2, servers=1)
    # worker 0 gains 1.0 s, worker 1 0.6 s, the server 0.8 s in the 2 s window; the machine
    # 4.0 s of which 2.4 s the job's
    assert row['cpu_workers'] == pytest.approx(0.8, rel=1e-12)
    assert row['cpu_server'] == pytest.approx(0.4, rel=1e-12)
    assert row['cpu_other'] == pytest.approx(0.8, rel=1e-12)
    # 500 ms a step (the 2 s window over 4 steps): 0.4 cores x 500 ms each
    assert scaling_report.cpu_shares(row) == pytest.approx(dict(
        cores_per_worker=0.4, cores_per_server=0.4, worker_cpu_ms=200.0, server_cpu_ms=200.0),
        rel=1e-12)
    two = scaling_report.cpu_shares(dict(row, servers=2, cpu_server=1.0))
    assert two['cores_per_server'] == 0.5


def test_period_profile_shows_the_pull_step():
    # 9 steps, the 4th of every period slow (the pull): medians at each position; a run's
    # profiles then the median over rounds in the summary
    steps = '100 110 120 400 100 90 130 600 105'
    assert scaling_report.period_profile(steps) == [100.0, 100.0, 125.0, 500.0]
    assert scaling_report.period_profile('50 60') == [50.0, 60.0]
    rows = [_row('mlp', 2, 1, 'k4', 1.0, step_ms=steps),
            _row('mlp', 2, 1, 'k4', 1.0, 2, step_ms='100 100 100 100'),
            _row('mlp', 2, 1, 'k4', 1.0, 3, step_ms='300 300 300 300'),
            _row('mlp', 2, 1, 'sync', 1.0)]
    summary = scaling_report.summarize(rows)
    assert summary[('mlp', '1gbit', 2, 1, 'k4')]['period_ms'] == [100.0, 100.0, 125.0, 300.0]
    assert summary[('mlp', '1gbit', 2, 1, 'sync')]['period_ms'] is None


def test_rates_tbf_bursts_and_their_errors():
    assert [netns.rate_bits(r) for r in ('100mbit', '1gbit', '10gbit', '2.5gbit')] == [
        1e8, 1e9, 1e10, 2.5e9]
    # the bucket holds 2 ms at the rate (10 Gbit/s: 2.5 MB), never less than 64 KiB
    assert [netns._burst(r) for r in ('10gbit', '1gbit', '100mbit')] == [
        '2500000b', '250000b', '65536b']
    args = scaling.parse_args(['--rate', '10gbit,1gbit'])
    assert args.rate == ['10gbit', '1gbit']
    with pytest.raises(SystemExit):
        scaling.parse_args(['--rate', '10gbit,1gbps'])
    with pytest.raises(Exception, match="rate must look like '100mbit', '1gbit' or '10gbit', "
                                        "got '1gbps'"):
        scaling._rates('1gbps')


def test_method_order_rotates_and_reverses():
    methods = scaling.parse_args([]).methods
    assert methods == ['sync', 'k4', 'k4-fp16']
    assert scaling._order(methods, 0, 1) == ['sync', 'k4', 'k4-fp16']
    assert scaling._order(methods, 1, 1) == ['k4', 'k4-fp16', 'sync']
    assert scaling._order(methods, 4, 2) == ['sync', 'k4-fp16', 'k4']
    firsts = [scaling._order(methods, c, 1)[0] for c in range(9)]
    assert sorted(firsts) == sorted(methods * 3)


def test_port_counters_interpolate_between_samples():
    ports = monitor.PortCounters(net=None)
    ports.samples = [(10.0, {0: (0, 0), 1: (1000, 4000)}),
                     (11.0, {0: (100, 0), 1: (3000, 4000)}),
                     (12.0, {0: (100, 50), 1: (3000, 8000)})]
    assert ports.between(10.5, 11.5) == {0: (50.0, 25.0), 1: (1000.0, 2000.0)}
    assert ports.between(10.0, 12.0) == {0: (100.0, 50.0), 1: (2000.0, 4000.0)}


def test_a_shaped_link_carries_its_rate():
    # A real network of 3 namespaces at 100 Mbit/s: one TCP stream's payload gets what the
    # token buckets let through, less the headers (1448 of 1514 bytes a frame: 95.6 Mbit/s).
    reason = netns.netns_available()
    if reason:
        pytest.skip(reason)
    with netns.ShapedNetwork(3, '100mbit') as net:
        measured = netns.measure_rate(net, 1, 2, seconds=1.0)
    assert 0.85e8 < measured < 1.0e8
