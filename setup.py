"""Packaging hook: a wheel carries the C++ kernel sources (csrc/ at the repository root) as
fleetllm/_csrc, since the kernels are compiled at first use on the machine that runs them
(fleetllm/kernels/build.py says why). Everything else is in pyproject.toml. An editable
install reads csrc/ where it is."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

CSRC = Path(__file__).resolve().parent / "csrc"


class BuildPyWithKernelSources(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        target = Path(self.build_lib) / "fleetllm" / "_csrc"
        target.mkdir(parents=True, exist_ok=True)
        for source in sorted(CSRC.iterdir()):
            if source.suffix in (".cpp", ".h"):
                self.copy_file(str(source), str(target / source.name))


setup(cmdclass={"build_py": BuildPyWithKernelSources})
