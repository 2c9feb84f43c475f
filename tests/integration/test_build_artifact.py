"""What `sam build` ships: the controller and its runtime dependencies, nothing else.

The emulated AWS, the simulator, the benchmarks and the CLI live in `preemptor_tools`
beside the controller; a function's package must not carry them, nor anything that imports
moto, yaml or matplotlib. Each handler must import from the built folder alone: a
Python without site-packages, with only the build folder on its path.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from template_support import TEMPLATE_PATH, load_template

REPO = TEMPLATE_PATH.parent
FORBIDDEN_PACKAGES = ("preemptor_tools", "moto", "yaml", "matplotlib", "tqdm", "samcli", "cfnlint", "hypothesis")
FORBIDDEN_IMPORT = re.compile(r"^\s*(?:import|from)\s+(moto|yaml|matplotlib|preemptor_tools)\b", re.MULTILINE)

# One build for the module, on one xdist worker (two concurrent `sam build`s of one
# project trip over each other's dependency folders).
pytestmark = pytest.mark.xdist_group("sam-build")


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory) -> Path:
    sam = shutil.which("sam", path=str(Path(sys.executable).parent)) or shutil.which("sam")
    if sam is None:
        pytest.fail("sam (aws-sam-cli) is not installed in the project's environment")
    out = tmp_path_factory.mktemp("sam-build")
    env = dict(os.environ, SAM_CLI_TELEMETRY="0", PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    # Given the template as a user builds it
    result = subprocess.run(
        [sam, "build", "--template-file", str(TEMPLATE_PATH), "--base-dir", str(REPO), "--build-dir", str(out),
         "--cache-dir", str(out.parent / "sam-cache")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


def _functions() -> dict[str, str]:
    resources = load_template()["Resources"]
    return {
        name: r["Properties"]["Handler"]
        for name, r in resources.items()
        if r["Type"] == "AWS::Serverless::Function"
    }


FUNCTIONS = _functions()


@pytest.mark.parametrize("function", sorted(FUNCTIONS))
def test_a_function_ships_the_controller_and_no_tools(build_dir, function):
    # When sam build has packaged the function
    folder = build_dir / function
    top = {p.name for p in folder.iterdir()}
    # Then the controller is there and none of the tools or their dependencies are
    assert "preemptor" in top
    assert not [name for name in FORBIDDEN_PACKAGES if name in top], sorted(top)
    offenders = [
        str(path.relative_to(folder))
        for path in (folder / "preemptor").rglob("*.py")
        if FORBIDDEN_IMPORT.search(path.read_text())
    ]
    assert offenders == []


@pytest.mark.parametrize("function", sorted(FUNCTIONS))
def test_a_handler_imports_from_the_built_folder_alone(build_dir, function):
    # Given a Python that sees only the standard library and the build folder
    module, attr = FUNCTIONS[function].rsplit(".", 1)
    probe = (
        "import sys; sys.path[:] = [p for p in sys.path if 'site-packages' not in p and 'functions' not in p];"
        f"sys.path.insert(0, {str(build_dir / function)!r});"
        f"import importlib; m = importlib.import_module({module!r});"
        f"assert callable(getattr(m, {attr!r}));"
        "bad = sorted(n for n in sys.modules if n.split('.')[0] in "
        f"{FORBIDDEN_PACKAGES!r});"
        "assert not bad, bad; print(m.__file__)"
    )
    env = {"PATH": os.environ["PATH"], "AWS_DEFAULT_REGION": "us-east-1", "POWERTOOLS_SERVICE_NAME": "preemptor"}
    # When the handler module is imported, Then it loads from the build folder, with nothing else
    result = subprocess.run([sys.executable, "-S", "-I", "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().startswith(str(build_dir / function))
