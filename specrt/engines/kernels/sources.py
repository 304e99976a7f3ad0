"""The kernel library's sources and the flags some of them need, read by setup.py and by the tests that build
the library by hand (runpy.run_path: this file imports nothing). Every file compiles on every machine; a path
the machine or the compiler lacks compiles to a null kernel that int4.cc never offers."""

SOURCES = ["int4.cc", "int4_x86.cc", "int4_amx.cc", "int4_arm_dot.cc", "int4_arm_i8mm.cc", "int4_none.cc", "attention.cc", "ort_op.cc"]
HEADERS = ["int4.h", "int4_neon.h", "int4_tile.inc", "int4_kernel.inc", "attention.h", "attention_core.inc",
           "ort_api.h", "target.h"]
# no contraction of a*b+c into FMAs the source does not write: every path must round the same way
FLAGS = ["-std=c++17", "-O3", "-ffp-contract=off", "-fvisibility=hidden"]
# Files compiled alone with an instruction set's flag, on Arm only (x86's paths are target regions, target.h).
# A compiler that refuses the flag builds the file without it: that path is then missing, the rest works.
ARM_FLAGS = {"int4_arm_dot.cc": ["-march=armv8.2-a+dotprod"], "int4_arm_i8mm.cc": ["-march=armv8.2-a+dotprod+i8mm"]}


def flags_for(source: str, machine: str) -> list[str]:
    """The extra flags `source` takes on `machine` (platform.machine()'s name)."""
    return ARM_FLAGS.get(source, []) if machine.lower() in ("aarch64", "arm64") else []
