"""Python imports ``sitecustomize`` at start-up: in a test job's roles (support.jobs.job_env
puts this folder on ``PYTHONPATH``), memoise ``import mxnet``'s generated code
(mxnet_code_cache.py)."""
import mxnet_code_cache

mxnet_code_cache.install()
