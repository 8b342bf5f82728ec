"""Builds the one native part, `sink._vector_scan` (see sink/vector_scan.py).

It compiles against simdjson as pysimdjson ships it (its wheel carries the amalgamated
``simdjson.h`` and ``simdjson.cpp``; the build pins the same release the sink runs with),
so the JSON parser is simdjson's own, not a copy kept here.
"""

from pathlib import Path

import simdjson
from setuptools import Extension, setup

_SIMDJSON = Path(simdjson.__file__).parent

setup(
    ext_modules=[
        Extension(
            "sink._vector_scan",
            sources=["sink/_vector_scan.cpp", str(_SIMDJSON / "simdjson.cpp")],
            include_dirs=[str(_SIMDJSON)],
            language="c++",
            extra_compile_args=["-std=c++17", "-O3", "-DNDEBUG"],
        )
    ]
)
