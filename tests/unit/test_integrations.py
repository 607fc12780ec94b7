"""Framework integrations: the import hook that adapts a framework when the script imports it, and
the transformers integration's refusal of what it does not know (issue 18)."""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from resilrun import integrations
from resilrun.integrations import _support as support
from resilrun.integrations import import_hooks
from resilrun.integrations import transformers as hf
from tests.unit import fake_frameworks as fake


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A throwaway importable package ``fw_<n>`` with a module ``core`` defining ``Thing``."""
    name = f"fw_{abs(hash(tmp_path)) % 10**8}"
    root = tmp_path / name
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "core.py").write_text("class Thing:\n    value = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = list(sys.meta_path)
    yield name
    sys.meta_path[:] = before
    for module in [m for m in sys.modules if m == name or m.startswith(f"{name}.")]:
        del sys.modules[module]


def test_the_hook_runs_once_the_module_has_executed(package: str) -> None:
    # Given a hook on the package's module, installed before anything imports it
    seen: list[int] = []
    import_hooks.install({f"{package}.core": lambda module: seen.append(module.Thing.value)})
    # When the script imports it (as a lazy package would: importlib by name)
    module = importlib.import_module(f"{package}.core")
    # Then the hook saw the executed module, once, and the module is the real one
    assert seen == [1]
    assert module.Thing.value == 1
    importlib.import_module(f"{package}.core")
    assert seen == [1]


def test_a_module_imported_already_is_adapted_at_once(package: str) -> None:
    importlib.import_module(f"{package}.core")
    seen: list[str] = []
    import_hooks.install({f"{package}.core": lambda module: seen.append(module.__name__)})
    assert seen == [f"{package}.core"]


def test_a_failing_hook_leaves_the_import_working(package: str, caplog: pytest.LogCaptureFixture) -> None:
    def broken(module: ModuleType) -> None:
        raise AttributeError("Trainer has no attribute train")

    import_hooks.install({f"{package}.core": broken})
    with caplog.at_level(logging.WARNING):
        module = importlib.import_module(f"{package}.core")
    assert module.Thing.value == 1
    assert f"resilrun could not adapt {package}.core; training runs without its integration" in caplog.text


@pytest.mark.parametrize(
    ("environ", "wanted"),
    [
        ({"RESILRUN_AGENT_SOCKET": "/run/agent.sock"}, True),
        ({"RESILRUN_AGENT_SOCKET": "/run/agent.sock", "RESILRUN_NO_INTEGRATIONS": "1"}, False),
        ({"RESILRUN_AGENT_SOCKET": "/run/agent.sock", "RESILRUN_NO_INTEGRATIONS": "true"}, False),
        ({"RESILRUN_AGENT_SOCKET": "/run/agent.sock", "RESILRUN_NO_INTEGRATIONS": "0"}, True),
        ({}, False),  # plain python or torchrun: frameworks are never touched
    ],
)
def test_integrations_are_only_installed_in_a_resilrun_worker_that_wants_them(
    environ: dict[str, str], wanted: bool
) -> None:
    before = list(sys.meta_path)
    try:
        assert integrations.install_import_hooks(environ) is wanted
        assert (len(sys.meta_path) > len(before)) is wanted
    finally:
        sys.meta_path[:] = before


_Trainer = fake.Trainer


def _framework(monkeypatch: pytest.MonkeyPatch, version: str, trainer: type) -> ModuleType:
    return fake.transformers(monkeypatch, version, trainer)


def test_a_transformers_version_outside_the_tested_range_is_left_alone(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    trainer = type("Trainer", (_Trainer,), {})
    module = _framework(monkeypatch, "4.40.2", trainer)
    with caplog.at_level(logging.WARNING):
        hf.adapt_trainer(module)
    assert trainer.train is _Trainer.train
    assert "transformers 4.40.2 is outside the versions resilrun integrates (>=5.0, <6.0)" in caplog.text
    assert "a failure restarts the job" in caplog.text


def test_a_trainer_without_the_loaders_it_needs_is_left_alone(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    trainer = type("Trainer", (_Trainer,), {"_load_scaler": None})
    module = _framework(monkeypatch, "5.23.0", trainer)
    with caplog.at_level(logging.WARNING):
        hf.adapt_trainer(module)
    assert trainer.train is _Trainer.train
    assert "transformers 5.23.0 lacks Trainer._load_scaler as resilrun uses it" in caplog.text


def test_outside_a_resilrun_worker_the_adapted_trainer_is_the_frameworks(monkeypatch: pytest.MonkeyPatch) -> None:
    # Given an adapted Trainer (explicit install() in a script run under plain torchrun)
    trainer = type("Trainer", (_Trainer,), {})
    module = _framework(monkeypatch, "5.23.0", trainer)
    monkeypatch.setattr(hf, "_forget_accelerate_state_on_reentry", lambda: None)
    hf.adapt_trainer(module)
    assert trainer.train is not _Trainer.train
    # Then without resilrun's agent it runs the framework's own train
    instance = fake.trainer_instance(trainer)
    assert instance.train() == "the framework's own train"


def test_a_second_train_in_the_same_run_is_not_snapshotted(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Given an adapted Trainer in a resilrun worker whose first train() already ran in this generation
    trainer = type("Trainer", (_Trainer,), {})
    monkeypatch.setattr(hf, "_forget_accelerate_state_on_reentry", lambda: None)
    hf.adapt_trainer(_framework(monkeypatch, "5.23.0", trainer))
    monkeypatch.setenv("RESILRUN_AGENT_SOCKET", "/run/agent.sock")
    monkeypatch.setattr(support, "GENERATION", support.Generation())
    monkeypatch.setattr(hf, "GENERATION", support.GENERATION)
    support.GENERATION.claim("an earlier training")
    instance = fake.trainer_instance(trainer)
    # When the script trains again (a second stage), Then it runs as the framework's own, and says so:
    # the job's snapshots are the first training's steps, which this one must never restore
    with caplog.at_level(logging.WARNING):
        assert instance.train() == "the framework's own train"
    assert "first training of a run only (an earlier training); this Trainer.train() is not" in caplog.text
    # and running the script again in a new generation integrates its first train() again
    support.GENERATION.forget()
    assert support.GENERATION.claim("Trainer.train()")


def test_a_lightning_version_outside_the_tested_range_is_left_alone(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from resilrun.integrations import lightning as lit

    class Trainer:
        def fit(self, model: object, ckpt_path: object = None) -> str:
            return "the framework's own fit"

    package = ModuleType("lightning")
    package.__version__ = "1.9.5"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "lightning", package)
    module = ModuleType("lightning.pytorch.trainer.trainer")
    module.Trainer = Trainer  # type: ignore[attr-defined]
    original = Trainer.fit
    with caplog.at_level(logging.WARNING):
        lit.adapt_trainer(module)
    assert Trainer.fit is original
    assert "lightning 1.9.5 is outside the versions resilrun integrates (>=2.5, <3.0)" in caplog.text


@pytest.mark.parametrize(
    ("strategy", "integrated"),
    [("DDPStrategy", True), ("SingleDeviceStrategy", True), ("FSDPStrategy", False), ("DeepSpeedStrategy", False)],
)
def test_lightning_strategies_other_than_ddp_and_single_device_are_not_integrated(
    monkeypatch: pytest.MonkeyPatch, strategy: str, integrated: bool
) -> None:
    from resilrun.integrations import lightning as lit

    monkeypatch.setenv("RESILRUN_AGENT_SOCKET", "/run/agent.sock")
    monkeypatch.delenv("RESILRUN_NO_INTEGRATIONS", raising=False)
    bases = (type("DDPStrategy", (), {}),) if strategy == "DeepSpeedStrategy" else ()
    trainer = fake.lightning_instance(fake.LightningTrainer, strategy, bases)
    reason = lit._not_integrated(trainer, "lightning.pytorch")
    assert (reason is None) is integrated, reason
    if not integrated:
        assert f"the {strategy} is not integrated (DDP and single-device are)" == reason


def test_lightning_is_left_alone_outside_a_resilrun_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    from resilrun.integrations import lightning as lit

    monkeypatch.delenv("RESILRUN_AGENT_SOCKET", raising=False)
    assert lit._not_integrated(object(), "lightning.pytorch") == ""  # not a resilrun worker: nothing to say


def test_the_first_training_of_a_generation_is_the_snapshotted_one_whichever_framework_runs_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    generation = support.Generation()
    assert generation.claim("Trainer.fit()")
    with caplog.at_level(logging.WARNING):
        assert not generation.claim("Accelerate loop")
    assert "first training of a run only (Trainer.fit()); this Accelerate loop is not snapshotted" in caplog.text
    generation.forget()
    assert generation.claim("Accelerate loop")


@pytest.mark.parametrize(
    ("text", "expected"), [("2.6.0", (2, 6)), ("5.1.dev0", (5, 1)), ("2.10rc1", (2, 10)), ("main", None), ("3", None)]
)
def test_versions_are_read_as_major_and_minor(text: str, expected: tuple[int, int] | None) -> None:
    assert support.version_of(text) == expected


# -- Accelerate ---------------------------------------------------------------------------------------
def test_an_accelerate_version_outside_the_tested_range_is_left_alone(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("accelerate")
    from resilrun.integrations import accelerate as acc

    package = ModuleType("accelerate")
    package.__version__ = "0.34.2"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "accelerate", package)
    accelerator = type("Accelerator", (), {"prepare": lambda self, *objects: objects})
    module = ModuleType("accelerate.accelerator")
    module.Accelerator = accelerator  # type: ignore[attr-defined]
    prepare = accelerator.prepare
    with caplog.at_level(logging.WARNING):
        acc.adapt_accelerator(module)
    assert accelerator.prepare is prepare
    assert "accelerate 0.34.2 is outside the versions resilrun integrates (>=1.0, <2.0)" in caplog.text


def test_accelerate_joins_the_job_unless_a_sharded_engine_or_a_framework_sets_it_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from resilrun.integrations import accelerate as acc

    monkeypatch.setenv("RESILRUN_AGENT_SOCKET", "/run/agent.sock")
    monkeypatch.delenv("RESILRUN_NO_INTEGRATIONS", raising=False)
    for name in acc._NOT_INTEGRATED_ENV:
        monkeypatch.delenv(name, raising=False)
    assert acc._joins()  # a script's own Accelerator
    # An Accelerator the Transformers Trainer creates (it has its own integration) is the framework's
    framework_code: dict[str, object] = {"__name__": "transformers.trainer", "joins": acc._joins}
    exec("def create_accelerator():\n    return joins()\n", framework_code)  # noqa: S102 - a module's frame
    assert not framework_code["create_accelerator"]()  # type: ignore[operator]
    # and FSDP or DeepSpeed set up their own process state
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    assert not acc._joins()
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    monkeypatch.setenv("RESILRUN_NO_INTEGRATIONS", "1")
    assert not acc._joins()


def test_a_prepared_loaders_own_generators_are_found_once_each() -> None:
    import torch

    from resilrun.integrations import _accelerate_loop as acc

    generator = torch.Generator().manual_seed(7)
    sampler = torch.utils.data.RandomSampler(range(8), generator=generator)
    inner = torch.utils.data.BatchSampler(sampler, 2, drop_last=False)
    shard = type("BatchSamplerShard", (), {"batch_sampler": inner, "sampler": None})()
    loader = type("Loader", (), {"synchronized_generator": generator, "batch_sampler": shard, "generator": None})()
    assert acc._generators(loader) == [generator]
    states = acc._generator_states(loader)
    torch.randperm(8, generator=generator)
    acc._set_generator_states(loader, states)
    assert torch.equal(generator.get_state(), states[0])


def test_a_skipped_pass_drops_the_iterator_a_stateful_loader_made_at_prepare() -> None:
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    from resilrun.integrations import _accelerate_loop as acc

    base = stateful.StatefulDataLoader(list(range(8)), batch_size=2, shuffle=True)
    base.state_dict()  # what Accelerate does when it wraps the loader: the first iterator is made
    assert base._iterator is not None
    loader = type("DataLoaderShard", (), {"base_dataloader": base})()
    acc._drop_premade_iterator(loader)
    assert base._iterator is None
