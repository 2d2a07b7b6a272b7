"""What the tests share, one module per concern: :mod:`support.jobs` (real multi-process
jobs), :mod:`support.reference_jobs` (mlp_job and stock MXNet's job against the numpy
reference), :mod:`support.model` (one worker's parameters and gradients in this process),
:mod:`support.native` (a stand-in for MXNet's native store with mxdelay's real servers in
this process), :mod:`support.stores` (stores that stop above the servers). pytest puts
tests/ on ``sys.path`` (the rootdir conftest.py), so test files and scripts import
``support.<module>``."""
