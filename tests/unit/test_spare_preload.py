"""What a hot spare imports before it has a rank (``worker_main.script_imports``): the installed
packages the script imports before it runs any code of its own, and no others. An import after a
statement of the script may depend on it (an environment variable set, a library patched, a path
added), so importing it first would run the package against a world the script has not made yet.
Seen with torchtitan: a script patching torch's device lookup before ``from torchtitan.train import
main`` had its spare import torchtitan first, which then trained on the wrong device.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from resilrun.worker_main import TopImport, script_imports


def _imports(tmp_path: Path, source: str) -> list[str]:
    """The modules preloaded (the names taken from them: see the tests of ``TopImport``)."""
    script = tmp_path / "train.py"
    script.write_text(source)
    return list(dict.fromkeys(each.module for each in script_imports(str(script), as_module=False)))


def test_the_leading_imports_are_preloaded_in_order(tmp_path: Path) -> None:
    source = '''"""A training script."""
from __future__ import annotations
import json
import torch.nn as nn
from torch.utils.data import DataLoader
try:
    import safetensors
except ImportError:
    safetensors = None
__all__ = ["main"]
STEPS = 10
def main() -> None:
    import tokenizers
if __name__ == "__main__":
    import psutil
    main()
'''
    assert _imports(tmp_path, source) == ["json", "torch.nn", "torch.utils.data", "safetensors", "psutil"]


def test_imports_after_the_scripts_own_code_are_left_to_the_script(tmp_path: Path) -> None:
    source = """import os
os.environ["TOKENIZERS_PARALLELISM"] = "false"
import tokenizers
"""
    assert _imports(tmp_path, source) == ["os"]


def test_an_import_after_a_call_in_the_main_block_is_left_to_the_script(tmp_path: Path) -> None:
    source = """import sys
def apply() -> None:
    pass
if __name__ == "__main__":
    import os
    apply()
    from torchtitan.train import main
    main()
"""
    assert _imports(tmp_path, source) == ["sys", "os"]


def test_a_decorated_function_or_a_class_ends_the_preload(tmp_path: Path) -> None:
    for definition in ("@staticmethod\ndef f() -> None:\n    pass\n", "class Config:\n    steps = 3\n"):
        assert _imports(tmp_path, f"import json\n{definition}import psutil\n") == ["json"]


def test_the_scripts_own_module_ends_the_preload(tmp_path: Path) -> None:
    (tmp_path / "cpu_patch.py").write_text("import os\n")
    assert _imports(tmp_path, "import json\nimport cpu_patch\nfrom torchtitan.train import main\n") == ["json"]
    assert _imports(tmp_path, "import json\nfrom cpu_patch import apply\nimport psutil\n") == ["json"]
    assert _imports(tmp_path, "import json\nfrom . import patch\nimport psutil\n") == ["json"]


def test_a_condition_that_calls_or_a_block_that_runs_code_ends_the_preload(tmp_path: Path) -> None:
    calls = "import json\nimport torch\nif torch.cuda.is_available():\n    import psutil\nimport tokenizers\n"
    assert _imports(tmp_path, calls) == ["json", "torch"]
    finally_runs = "import json\ntry:\n    import psutil\nfinally:\n    print('x')\nimport tokenizers\n"
    assert _imports(tmp_path, finally_runs) == ["json", "psutil"]
    handled = "try:\n    import psutil\nexcept ImportError:\n    psutil = None\nimport tokenizers\n"
    assert _imports(tmp_path, handled) == ["psutil", "tokenizers"]


def _package(root: Path, name: str, *, record: bool) -> None:
    """A package in ``root`` whose import leaves a mark; with a record as pip's install writes one."""
    (root / name).mkdir(parents=True)
    (root / name / "__init__.py").write_text("import os\nos.environ['RESILRUN_TEST_PACKAGE_RAN'] = '1'\n")
    (root / name / "train.py").write_text("import json\n")
    if record:
        info = root / f"{name}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        (info / "RECORD").write_text(f"{name}/__init__.py,,\n{name}/train.py,,\n")


def test_only_packages_an_installer_put_there_are_preloaded_not_a_projects_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a project's package on the path (PYTHONPATH, an editable install's folder) and an installed
    # one beside it (as pip --target lays it out), outside the script's folder
    site, project = tmp_path / "site", tmp_path / "project"
    _package(site, "wheel_pkg", record=True)
    _package(project, "project_pkg", record=False)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.syspath_prepend(str(project))
    importlib.invalidate_caches()
    folder = tmp_path / "scripts"
    folder.mkdir()
    # Then the installed one is preloaded and the project's is the user's code, imported by the script
    assert _imports(folder, "import json\nimport wheel_pkg\nimport project_pkg\n") == ["json", "wheel_pkg"]
    # and a script run as a module of the project's package is not looked into: finding it would run
    # the package's __init__ without a rank
    monkeypatch.setenv("RESILRUN_TEST_PACKAGE_RAN", "0")  # (recorded: undone after the test)
    monkeypatch.delenv("RESILRUN_TEST_PACKAGE_RAN")
    assert script_imports("project_pkg.train", as_module=True) == []
    assert "RESILRUN_TEST_PACKAGE_RAN" not in os.environ
    assert script_imports("wheel_pkg.train", as_module=True) == [TopImport("json")]
    for name in ("wheel_pkg", "wheel_pkg.train"):
        monkeypatch.delitem(sys.modules, name, raising=False)


def test_the_names_a_script_takes_from_a_module_are_preloaded_with_it(tmp_path: Path) -> None:
    source = """import json
from torch.utils.data import DataLoader, Dataset
from json import dumps, loads as parse
from torch.utils.data import DataLoader, Sampler
from os.path import *
from json import dumps, loads
"""
    script = tmp_path / "train.py"
    script.write_text(source)
    # one per statement, in order, the same statement once: a name that fails fails its own only
    assert script_imports(str(script), as_module=False) == [
        TopImport("json"),
        TopImport("torch.utils.data", ("DataLoader", "Dataset")),
        TopImport("json", ("dumps", "loads")),
        TopImport("torch.utils.data", ("DataLoader", "Sampler")),
        TopImport("os.path"),
    ]


def _lazy_package(root: Path) -> None:
    """A package that imports its contents on first access (PEP 562), as transformers does."""
    (root / "lazy_pkg").mkdir(parents=True)
    (root / "lazy_pkg" / "__init__.py").write_text(
        "import importlib\n"
        "def __getattr__(name):\n"
        "    if name == 'Trainer':\n"
        "        value = importlib.import_module('lazy_pkg.trainer').Trainer\n"
        "        globals()[name] = value\n"
        "        return value\n"
        "    raise AttributeError(name)\n"
    )
    (root / "lazy_pkg" / "trainer.py").write_text("class Trainer:\n    pass\n")
    (root / "lazy_pkg" / "models.py").write_text("")
    (root / "lazy_pkg-1.0.dist-info").mkdir()  # installed, as pip --target lays it out


@pytest.fixture
def lazy_pkg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``lazy_pkg`` importable for the test, and gone from ``sys.modules`` after it."""
    _lazy_package(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    names = ("lazy_pkg", "lazy_pkg.trainer", "lazy_pkg.models")
    try:
        yield
    finally:
        for name in names:
            sys.modules.pop(name, None)


@pytest.mark.usefixtures("lazy_pkg")
def test_preloading_a_from_import_does_the_lazy_imports_the_statement_would() -> None:
    # Given a package that loads its classes on first access and a submodule taken by name
    wanted = TopImport("lazy_pkg", ("Trainer", "models"))
    assert not wanted.done()
    # When it is preloaded (``from lazy_pkg import Trainer, models``)
    wanted.run()
    # Then what the statement imports is imported: the lazily loaded class's module and the submodule
    assert "lazy_pkg.trainer" in sys.modules
    assert "lazy_pkg.models" in sys.modules
    assert wanted.done()
    assert not TopImport("lazy_pkg", ("Missing",)).done()
    # and a name the package does not have fails as the statement would
    with pytest.raises(ImportError, match="Missing"):
        TopImport("lazy_pkg", ("Missing",)).run()


@pytest.mark.usefixtures("lazy_pkg")
def test_a_statement_whose_name_fails_leaves_the_other_statements_preloaded(tmp_path: Path) -> None:
    # Given a script that takes a class a newer version has, in a try, then the one it needs
    folder = tmp_path / "scripts"
    folder.mkdir()
    script = folder / "train.py"
    script.write_text(
        "try:\n    from lazy_pkg import NewerClass\nexcept ImportError:\n    NewerClass = None\n"
        "from lazy_pkg import Trainer\n"
    )
    statements = script_imports(str(script), as_module=False)
    assert [str(each) for each in statements] == ["from lazy_pkg import NewerClass", "from lazy_pkg import Trainer"]
    # When each is preloaded as a spare does: the first fails, the second still loads its class
    with pytest.raises(ImportError, match="NewerClass"):
        statements[0].run()
    statements[1].run()
    assert "lazy_pkg.trainer" in sys.modules
