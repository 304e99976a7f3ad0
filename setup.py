"""The optional part of the build: the int4 matmul library (specrt/engines/kernels, docs/kernel.md), an
onnxruntime custom operator compiled from the project's own C++ with the system compiler. Everything else
is declared in pyproject.toml. Without a working C++17 compiler specrt still installs and runs
onnxruntime's own kernel; the reason is kept beside the package for `specrt info`."""
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

KERNELS = "specrt/engines/kernels"
NOTE = "_int4.build-error.txt"  # beside the library; read by specrt/engines/int4.py


class OptionalBuild(build_ext):
    def build_extension(self, ext):
        note = Path(self.get_ext_fullpath(ext.name)).parent / NOTE
        note.parent.mkdir(parents=True, exist_ok=True)
        try:
            super().build_extension(ext)
        except Exception as e:  # no compiler, or one too old: install anyway, and say why where info looks
            why = " ".join(str(e).split()) or type(e).__name__
            note.write_text(f"{type(e).__name__}: {why}\n")
            print(f"warning: specrt's int4 kernel library was not built ({why}); specrt runs onnxruntime's own "
                  f"int4 kernel instead. `specrt info PAIR` says how to build it.")
        else:
            note.unlink(missing_ok=True)


setup(
    ext_modules=[Extension(
        "specrt.engines._int4",
        sources=[f"{KERNELS}/{f}" for f in ("int4.cc", "int4_x86.cc", "int4_arm.cc", "int4_none.cc", "attention.cc",
                                            "ort_op.cc")],
        depends=[f"{KERNELS}/{f}" for f in ("int4.h", "int4_tile.inc", "int4_kernel.inc", "attention.h", "attention_core.inc", "ort_api.h")],
        language="c++",
        # no contraction of a*b+c into FMAs the source does not write: every path must round the same way
        extra_compile_args=["-std=c++17", "-O3", "-ffp-contract=off", "-fvisibility=hidden"],
    )],
    cmdclass={"build_ext": OptionalBuild},
)
