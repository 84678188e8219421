"""The optional C probe datapath (linkpass/adapters/_probe_io.c); everything else is in
pyproject.toml.  ``optional=True``: where no compiler, Python headers or OpenSSL headers are
found the package still installs and the prober runs its Python datapath (the README says
so); ``make install`` installs what the build needs."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "linkpass.adapters._probe_io",
            ["linkpass/adapters/_probe_io.c"],
            libraries=["crypto"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            optional=True,
        )
    ]
)
