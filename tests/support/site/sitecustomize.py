"""Python imports ``sitecustomize`` at start-up: in a test job's roles (support.jobs.job_env
puts this folder on ``PYTHONPATH``), memoise ``import mxnet``'s generated functions
(mxnet_code_cache.py) and import ``requests``, which MXNet imports, when first used
(lazy_modules.py)."""
import lazy_modules
import mxnet_code_cache

mxnet_code_cache.install()
lazy_modules.install()
