"""``benchmarks/tta.py`` with the compressed-pull methods of ``benchmarks/harness.py`` (issue 20).

tta.py's method table holds its own methods only; this adds the registry's three
compressed-pull methods to it and runs ``tta.main`` with the same arguments. Usage::

    python docs/benchmarks/tta-pull/run.py --part full --methods ... --out docs/benchmarks/tta-pull
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir,
                                os.pardir, 'benchmarks'))
import harness  # noqa: E402  pylint: disable=wrong-import-position
import tta  # noqa: E402  pylint: disable=wrong-import-position

tta.METHODS.update(harness.methods('k4-pull-fp16', 'k4-pull-int8', 'k4-2bit-pull-int8'))

if __name__ == '__main__':
    sys.exit(tta.main(command='python docs/benchmarks/tta-pull/run.py'))
