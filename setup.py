"""The optional part of the build: the int4 matmul library (specrt/engines/kernels, docs/kernel.md), an
onnxruntime custom operator compiled from the project's own C++ with the system compiler (GCC or clang).
Everything else is declared in pyproject.toml. Without a working C++17 compiler specrt still installs and
runs onnxruntime's own kernels; the reason is kept beside the package for `specrt info`."""
import os
import platform
import runpy
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

KERNELS = "specrt/engines/kernels"
NOTE = "_int4.build-error.txt"  # beside the library; read by specrt/engines/int4.py
SRC = runpy.run_path(f"{KERNELS}/sources.py")


def ort_header_flags() -> list[str]:
    """Where onnxruntime's C API header is installed (a system or Homebrew package; SPECRT_ORT_INCLUDE names
    a folder), the flags that check ort_api.h's function indices against it at compile time."""
    roots = [os.environ.get("SPECRT_ORT_INCLUDE", ""), "/usr/include/onnxruntime", "/usr/local/include/onnxruntime",
             "/opt/homebrew/include/onnxruntime", "/usr/include/onnxruntime/core/session"]
    found = next((r for r in roots if r and Path(r, "onnxruntime_c_api.h").is_file()), None)
    return ["-DSPECRT_ORT_HEADER", f"-I{found}"] if found else []



class OptionalBuild(build_ext):
    def build_extension(self, ext):
        note = Path(self.get_ext_fullpath(ext.name)).parent / NOTE
        note.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._build_with_file_flags(ext)
        except Exception as e:  # no compiler, or one too old: install anyway, and say why where info looks
            why = " ".join(str(e).split()) or type(e).__name__
            note.write_text(f"{type(e).__name__}: {why}\n")
            print(f"warning: specrt's int4 kernel library was not built ({why}); specrt runs onnxruntime's own "
                  f"kernels instead (slower wide passes, rows not exact). `specrt info PAIR` says how to build it.")
        else:
            note.unlink(missing_ok=True)

    def _build_with_file_flags(self, ext):
        """The files that need an instruction set's flag are compiled alone with it (or, when the compiler
        refuses it, without it: that path is then null) and linked in with the rest."""
        from setuptools.errors import CompileError

        plain, objects = [], []
        for source in ext.sources:
            extra = SRC["flags_for"](Path(source).name, platform.machine())
            if not extra:
                plain.append(source)
                continue
            for flags in (extra, []):
                try:
                    objects += self.compiler.compile([source], output_dir=self.build_temp, depends=ext.depends,
                                                     extra_postargs=ext.extra_compile_args + flags)
                    break
                except CompileError:
                    if not flags:
                        raise
                    print(f"warning: the compiler refused {' '.join(flags)} for {source}; that kernel path is left out")
        ext.sources, ext.extra_objects = plain, list(ext.extra_objects or []) + objects
        super().build_extension(ext)


setup(
    ext_modules=[Extension(
        "specrt.engines._int4",
        sources=[f"{KERNELS}/{f}" for f in SRC["SOURCES"]],
        depends=[f"{KERNELS}/{f}" for f in SRC["HEADERS"] + ["sources.py"]],
        language="c++",
        # SPECRT_CXXFLAGS: flags of the builder's own, after the project's
        extra_compile_args=SRC["FLAGS"] + ort_header_flags() + os.environ.get("SPECRT_CXXFLAGS", "").split(),
    )],
    cmdclass={"build_ext": OptionalBuild},
)
