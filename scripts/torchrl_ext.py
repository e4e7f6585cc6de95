"""Make TorchRL's compiled part (``torchrl._torchrl``: its segment trees, so its
``PrioritizedSampler`` and ``PrioritizedReplayBuffer``) load with the torch installed here.

A TorchRL wheel's ``_torchrl`` links against the torch it was built with, and the C++ ABI of
torch changes between minor releases: torchrl 0.14.x is built against torch 2.14, whose CPU
build is not on PyPI (PyPI's Linux torch is the CUDA build), while the CPU torch pinned here
is 2.13. The wheel ships the extension's sources (``torchrl/csrc``), so this compiles them
against the installed torch (g++ and the Python headers; a minute on two cores) and puts the
result where the wheel's copy was. It does nothing when ``_torchrl`` loads already, and exits
non-zero, saying why, when it cannot make it load.

    .venv/bin/python scripts/torchrl_ext.py
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

CHECK = "from torchrl._torchrl import SumSegmentTreeFp32; SumSegmentTreeFp32(4)"


def loads() -> str | None:
    """None if ``torchrl._torchrl`` loads in a fresh interpreter, else its error's last line."""
    done = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, check=False
    )
    if done.returncode == 0:
        return None
    lines = done.stderr.strip().splitlines()
    return lines[-1] if lines else f"exit status {done.returncode}"


def build(package: Path, out: Path) -> Path:
    """Compile ``package/csrc/*.cpp`` into ``out`` as TorchRL's setup.py does (no CUDA)."""
    from setuptools import Extension, setup
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    sources = sorted(str(p) for p in (package / "csrc").glob("*.cpp"))
    if not sources:
        raise SystemExit(f"{package}/csrc holds no C++ sources: this torchrl wheel has none")
    extension: Extension = CppExtension(
        "_torchrl",
        sources,
        include_dirs=[str(package.parent)],  # the sources include "torchrl/csrc/..." too
        extra_compile_args={"cxx": ["-O3"]},
        extra_link_args=["-Wl,-s"],
    )
    setup(
        name="torchrl-extension",
        ext_modules=[extension],
        cmdclass={"build_ext": BuildExtension.with_options(use_ninja=False)},
        script_args=["-q", "build_ext", "--build-lib", str(out), "--build-temp", str(out / "tmp")],
    )
    built = sorted(out.glob("_torchrl*.so"))
    if not built:
        raise SystemExit(f"the build left no _torchrl*.so in {out}")
    return built[0]


def main() -> int:
    spec = importlib.util.find_spec("torchrl")
    if spec is None or spec.origin is None:
        print("torchrl is not installed: nothing to do", file=sys.stderr)
        return 0
    error = loads()
    if error is None:
        print("torchrl._torchrl loads with this torch: nothing to do")
        return 0
    import torch

    package = Path(spec.origin).parent
    target = package / f"_torchrl{sysconfig.get_config_var('EXT_SUFFIX')}"
    print(
        f"torchrl._torchrl does not load ({error[:160]}); compiling it against torch "
        f"{torch.__version__}"
    )
    with tempfile.TemporaryDirectory(prefix="torchrl-ext-") as tmp:
        # In a child, so the compiler's pages of warnings are shown only when it fails.
        done = subprocess.run(
            [sys.executable, __file__, "--build", str(package), tmp],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            print((done.stdout + done.stderr)[-6000:], file=sys.stderr)
            print("compiling torchrl's extension failed (is g++ installed?)", file=sys.stderr)
            return 1
        built = Path(done.stdout.strip().splitlines()[-1])
        staged = target.with_suffix(".so.new")
        shutil.copyfile(built, staged)
        staged.replace(target)  # atomic: no process ever loads half a file
    error = loads()
    if error is not None:
        print(f"the rebuilt {target.name} still does not load: {error}", file=sys.stderr)
        return 1
    print(f"rebuilt {target}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--build"]:
        print(build(Path(sys.argv[2]), Path(sys.argv[3])))
        sys.exit(0)
    sys.exit(main())
