"""The scaling benchmark's arithmetic: ratios, scaling efficiency, verdicts, and the link
counters it reads (benchmarks/monitor.py)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                'benchmarks'))
import monitor  # noqa: E402  pylint: disable=wrong-import-position
import scaling  # noqa: E402  pylint: disable=wrong-import-position


def _row(model, workers, servers, method, rate, round_index=1):
    return dict(model=model, workers=workers, servers=servers, method=method,
                round=round_index, samples_per_s=rate, cpu_workers=1.0, cpu_server=0.25,
                cpu_scheduler=0.0, cpu_launcher=0.125, cpu_other=0.5)


def test_ratio_efficiency_and_verdicts():
    rows = [_row('resnet18', 2, 2, 'sync', 100.0), _row('resnet18', 2, 2, 'k4', 150.0),
            _row('resnet18', 4, 2, 'sync', 160.0), _row('resnet18', 4, 2, 'k4', 320.0),
            _row('resnet18', 4, 2, 'k4-fp16', 400.0),
            _row('resnet18', 8, 2, 'sync', 300.0), _row('resnet18', 8, 2, 'k4', 500.0),
            # a second round: the median of 80 and 120 is 100; a failed run is left out
            _row('mlp', 2, 1, 'sync', 80.0), _row('mlp', 2, 1, 'sync', 120.0, 2),
            dict(_row('mlp', 2, 1, 'sync', None, 3), error='exit [1]')]
    summary = scaling.summarize(rows)
    assert summary[('mlp', 2, 1, 'sync')]['samples_per_s'] == 100.0
    assert summary[('mlp', 2, 1, 'sync')]['runs'] == 2
    assert summary[('mlp', 2, 1, 'sync')]['busy_cores'] == 1.875
    assert summary[('resnet18', 2, 2, 'k4')]['x_sync'] == pytest.approx(1.5, abs=1e-12)
    assert summary[('resnet18', 2, 2, 'sync')]['efficiency'] == pytest.approx(1.0, abs=1e-12)
    # throughput(8) / (8/2 * throughput(2))
    assert summary[('resnet18', 8, 2, 'sync')]['efficiency'] == pytest.approx(0.75, abs=1e-12)
    assert summary[('resnet18', 8, 2, 'k4')]['efficiency'] == pytest.approx(500 / 600,
                                                                           abs=1e-12)
    assert summary[('resnet18', 4, 2, 'k4-fp16')]['efficiency'] is None  # no N=2 run
    assert scaling.verdicts(summary) == [
        ('resnet18 N=4 S=2: k=4 >= 1.6x dist_sync', '2.00x', 'met'),
        ('resnet18 N=4 S=2: k=4 + fp16 >= 2.5x dist_sync', '2.50x', 'met'),
        ("resnet18 S=2: scaling efficiency N=2 -> 8 of k=4 >= dist_sync's", '0.833 vs 0.750',
         'met')]


def test_method_order_rotates_and_reverses():
    methods = scaling.parse_args([]).methods
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
