"""mxdelay: k-step delayed updates and layer-wise pipelining for MXNet's parameter server."""
import os
import re

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def read(*parts):
    with open(os.path.join(HERE, *parts), encoding='utf-8') as src:
        return src.read()


def version():
    """``mxdelay.__version__``, read from the source: importing mxdelay here would need MXNet
    at build time, and the version has one source."""
    found = re.findall(r"^__version__ = '([^']+)'$", read('mxdelay', '__init__.py'), re.MULTILINE)
    if len(found) != 1:
        raise RuntimeError("mxdelay/__init__.py must set __version__ = '...' exactly once")
    return found[0]


setup(
    name='mxdelay',
    version=version(),
    description=("k-step delayed updates, layer-wise pushes and compressed pushes and pulls "
                 "for Apache MXNet 1.9.1's parameter server"),
    long_description=read('README.md'),
    long_description_content_type='text/markdown',
    license='Apache-2.0',
    license_files=['LICENSE', 'NOTICE'],
    python_requires='>=3.8',
    classifiers=[
        'License :: OSI Approved :: Apache Software License',
        'Operating System :: POSIX :: Linux',
        'Programming Language :: Python :: 3',
        'Topic :: Scientific/Engineering :: Artificial Intelligence',
    ],
    # Subpackages too (tests/test_wheel.py installs the wheel and runs a job from it).
    packages=find_packages(include=['mxdelay', 'mxdelay.*', 'kvstore_ext', 'kvstore_ext.*']),
    package_data={'kvstore_ext': ['autoload/sitecustomize.py'],
                  'kvstore_ext.codecs.kernels': ['codec_kernels.c']},
    # MXNet is not a requirement: its builds are separate distributions (mxnet, mxnet-cu112,
    # ...) of the same module, and pip would install the CPU wheel over a CUDA build.
    # `import mxnet` checks the release (kvstore_ext.bootstrap); '[cpu]' installs the CPU wheel.
    install_requires=['numpy<1.24'],
    extras_require={
        'cpu': ['mxnet==1.9.1'],
        'test': ['pytest>=7', 'pytest-timeout', 'pytest-xdist'],
        'examples': ['tqdm', 'matplotlib'],
    },
    entry_points={
        'console_scripts': [
            'mxdelay-launch=mxdelay.launcher:main',
            'mxdelay-run=mxdelay.run:main',
        ],
    },
)
