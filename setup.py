"""mxdelay: k-step delayed updates and layer-wise pipelining for MXNet's parameter server."""
from setuptools import setup

setup(
    name='mxdelay',
    version='0.1.0',
    description=('k-step delayed update with sparse communication and layer-wise pushes '
                 "for Apache MXNet's parameter server"),
    long_description=open('README.md', encoding='utf-8').read(),
    long_description_content_type='text/markdown',
    python_requires='>=3.8',
    packages=['mxdelay', 'mxdelay.launching', 'kvstore_ext'],
    package_data={'kvstore_ext': ['autoload/sitecustomize.py']},
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
