"""Only for the optional C extension; all metadata is in pyproject.toml.

``logjam_relay.io._zmqfast`` (batch receive/publish on pyzmq sockets) is built when a C
compiler and the Python headers are there; if the build fails, the install goes on and
the relay uses pyzmq alone (``logjam-relay --version`` says which).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("logjam_relay.io._zmqfast", ["src/logjam_relay/io/_zmqfast.c"],
                             optional=True, extra_compile_args=["-O2", "-std=c11"])])
