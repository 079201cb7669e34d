"""The one thing pyproject.toml cannot say to every setuptools: the optional C extension.

The connection path in C (issue 26, lbproxy/net/_cpump.c) is optional, so a machine
without a compiler or the Python headers still installs lbproxy, on the pure-Python path
(lbproxy/net/compiled.py; `lbproxy --version` says which runs). It is declared here and
not as `[tool.setuptools.ext-modules]` because the setuptools of a fresh venv (65)
rejects that table, and a wheel built with it (tests/integration/test_dashboard.py
`test_the_page_is_package_data`) would fail to build at all.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "lbproxy.net._cpump",
            sources=["lbproxy/net/_cpump.c"],
            depends=["lbproxy/net/_cpump_udp.h"],  # included by _cpump.c: one translation unit
            optional=True,
            extra_compile_args=["-O2"],
        )
    ]
)
