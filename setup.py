"""The metadata is pyproject.toml's; this adds one step to the build: the CPU decode backend's C
library (``src/gptkiln/cpu/csrc``) compiled at install into the package's ``cpu/_built/``, where
`gptkiln.cpu.library` looks first, so that the first ``gptkiln generate`` after ``pip install``
waits for no compiler (2-3 s of it on two cores). Where there is no C compiler, or the build
fails, the package installs all the same and builds the library at its first use (or runs
torch's own kernels). ``GPTKILN_NATIVE=0`` or ``GPTKILN_CPU_INSTALL_BUILD=0`` skips it."""

import importlib.util
import os
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


class BuildPyWithLibrary(build_py):
    def run(self):
        super().run()
        if "0" in (os.environ.get("GPTKILN_NATIVE"), os.environ.get("GPTKILN_CPU_INSTALL_BUILD")):
            return
        editable = getattr(self, "editable_mode", False)  # pip install -e: the source tree
        package = HERE / "src" / "gptkiln" if editable else Path(self.build_lib) / "gptkiln"
        try:
            # the module alone (no gptkiln package, so no torch in the build's environment)
            spec = importlib.util.spec_from_file_location(
                "gptkiln_cpu_library", HERE / "src" / "gptkiln" / "cpu" / "library.py"
            )
            library = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(library)
            where = package / "cpu" / "_built"
            where.mkdir(mode=0o700, parents=True, exist_ok=True)
            built = library.build_into(where)
        except Exception as e:  # noqa: BLE001 (an option, never a failed install)
            built, why = None, f"{type(e).__name__}: {e}"
        else:
            why = "no C compiler, or it failed"
        if built is None:
            print(f"gptkiln: the CPU library was not built at install ({why}); built at first use")
        else:
            print(f"gptkiln: built the CPU library {built.name}")


setup(cmdclass={"build_py": BuildPyWithLibrary})
