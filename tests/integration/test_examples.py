"""Every example works: each Python script under resilrun (2 workers, tiny sizes), the SLURM
script's host list at a size no test cluster has (a real SLURM runs it: test_slurm.py), the S3
script end to end with a moto S3, and the Kubernetes manifest checked against the CLI. Sizes keep
each run well under a minute on 2 cores."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import resumed_from

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"

# Tiny arguments for each Python example; a new example must be added here (a test checks it).
TINY = {
    "train_checkpointless.py": ["--steps", "6", "--hidden", "16"],
    "train_ddp_torchrun.py": ["--steps", "6", "--hidden", "16"],
    "train_fsdp2.py": ["--steps", "6", "--hidden", "16", "--layers", "2"],
    "train_gpt.py": [
        "--steps",
        "8",
        "--layers",
        "2",
        "--width",
        "32",
        "--heads",
        "2",
        "--vocab",
        "64",
        "--context",
        "16",
    ],  # fmt: skip
    "train_scheduler_dataloader.py": [
        "--steps",
        "8",
        "--warmup",
        "3",
        "--samples",
        "64",
        "--batch",
        "4",
        "--hidden",
        "16",
    ],
}


def _has_fsdp2() -> bool:
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return True


def _skip_unless_runnable(name: str) -> None:
    if name == "train_fsdp2.py" and not _has_fsdp2():
        pytest.skip("this torch has no torch.distributed.fsdp.fully_shard (FSDP2 needs torch >= 2.6)")


def _run_example(launcher, tmp_path: Path, name: str, *extra: str, env: dict[str, str] | None = None) -> tuple:
    target = tmp_path / f"{name}.{len(list(tmp_path.iterdir()))}.sha"
    run = launcher(
        "resilrun",
        "--standalone",
        "--nproc-per-node",
        "2",
        *extra,
        str(EXAMPLES / name),
        *TINY[name],
        "--checksum-file",
        str(target),
        env=env,
    )
    code = run.wait(90)
    assert code == 0, f"{name} exited {code}\n{run.stdout()[-2000:]}\n{run.stderr()[-3000:]}"
    checksum = target.read_text()
    assert re.fullmatch(r"[0-9a-f]{64}", checksum)
    return checksum, run


# Examples run (with a fault, against a failure-free run) by a test file of their own.
OWN_TESTS = {
    "train_hf_trainer.py": ROOT / "tests" / "integration" / "test_framework_transformers.py",
    "train_accelerate.py": ROOT / "tests" / "integration" / "test_framework_accelerate.py",
    "train_lightning.py": ROOT / "tests" / "integration" / "test_framework_lightning.py",
    "train_snapshot_torchrun.py": ROOT / "tests" / "integration" / "test_captured_checkpoints.py",
    "train_dcp.py": ROOT / "tests" / "integration" / "test_captured_checkpoints.py",
}


def test_every_python_example_is_run_by_this_file_or_its_own() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted([*TINY, *OWN_TESTS])
    for name, test_file in OWN_TESTS.items():
        assert f'"{name}"' in test_file.read_text(), (name, test_file)


@pytest.mark.parametrize("name", sorted(TINY))
def test_python_example_runs_under_resilrun(launcher, tmp_path: Path, name: str) -> None:
    _skip_unless_runnable(name)
    # Given an example with tiny sizes, When resilrun runs it on 2 workers, Then it finishes cleanly
    _, run = _run_example(launcher, tmp_path, name)
    assert "done:" in run.stdout()


@pytest.mark.parametrize(
    ("name", "fault_step"), [("train_fsdp2.py", 4), ("train_scheduler_dataloader.py", 5), ("train_gpt.py", 5)]
)
def test_three_call_example_resumes_after_a_kill_bitwise_equal(
    launcher, tmp_path: Path, name: str, fault_step: int
) -> None:
    _skip_unless_runnable(name)
    # Given the example's failure-free result
    clean, _ = _run_example(launcher, tmp_path, name)
    # When rank 1 is SIGKILLed as step `fault_step` starts (no spare: a new process takes its place)
    faulty, run = _run_example(
        launcher, tmp_path, name, "--max-restarts", "1", env={"RESILRUN_FAULTS": f"kill:rank=1,step={fault_step}"}
    )
    # Then every rank resumed from the last finished step and the parameters equal the clean run's
    for rank in (0, 1):
        assert resumed_from(run.stderr())[rank] == (fault_step - 1, "memory")
    assert faulty == clean


# -- the job scripts -------------------------------------------------------------------------------
def _run_script(argv: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run a shell example in its own session; everything it started is killed if it overruns."""
    proc = subprocess.Popen(
        argv,
        cwd=ROOT,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{argv[0]} ran past {timeout} s\n{out[-2000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


@pytest.mark.parametrize("script", ["slurm/train.sbatch", "s3_checkpoints.sh"])
def test_shell_examples_are_valid_bash(script: str) -> None:
    result = subprocess.run(["bash", "-n", str(EXAMPLES / script)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr


def test_slurm_script_survives_an_allocation_of_thousands_of_hosts(tmp_path: Path) -> None:
    # A real SLURM runs the script in tests/integration/test_slurm.py; this covers what it cannot:
    # thousands of hosts, where a script piping them into `head` under pipefail dies of SIGPIPE.
    # Given a stand-in scontrol listing 5000 hosts (the first one local) and an srun that records
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(
        '#!/usr/bin/env bash\n[ "$1 $2" = "show hostnames" ] && { echo localhost; seq -f "node-%g" 5000; }\n'
    )
    (bin_dir / "srun").write_text('#!/usr/bin/env bash\necho "$*" > "$SRUN_RECORD"\n')
    for tool in ("scontrol", "srun"):
        (bin_dir / tool).chmod(0o755)
    record = tmp_path / "srun.args"
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}", "SRUN_RECORD": str(record),
        "SLURM_JOB_NODELIST": "localhost,node-[1-5000]", "SLURM_JOB_NUM_NODES": "5001", "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "resilrun-test", "NPROC_PER_NODE": "2", "CHECKPOINT_URI": str(tmp_path / "ckpt"),
        "SECRET_FILE": str(tmp_path / "secrets" / "job.secret"),
    }  # fmt: skip
    # When the batch script runs
    result = _run_script(["bash", str(EXAMPLES / "slurm" / "train.sbatch"), "--steps", "3"], env)
    # Then it reaches srun with the first host as the rendezvous endpoint
    assert result.returncode == 0, result.stderr[-3000:]
    srun_args = record.read_text()
    assert "--rdzv-endpoint localhost:29400" in srun_args and "--nnodes 5001" in srun_args
    assert "--rdzv-id 4242" in srun_args and srun_args.rstrip().endswith("--steps 3")
    # with a job secret of its own, readable by this user only, given to every agent
    secret = tmp_path / "secrets" / "job.secret"
    assert f"--job-secret-file {secret} --require-auth" in srun_args
    assert secret.stat().st_mode & 0o777 == 0o600 and len(secret.read_text().strip()) == 64


@pytest.mark.s3
def test_s3_script_persists_verifies_and_a_second_job_resumes(s3_server, s3_bucket: str) -> None:
    env = {
        "BUCKET": s3_bucket,
        "PREFIX": "jobs/example",
        "S3_ENDPOINT_URL": s3_server.endpoint_url,
        "RESILRUN": f"{shlex.quote(sys.executable)} -m resilrun",
        "STEPS": "6",
        "PERSIST_EVERY": "2",
        "KEEP_LAST": "2",
    }
    # Given the S3 example pointed at a bucket (moto), When it runs
    first = _run_script(["bash", str(EXAMPLES / "s3_checkpoints.sh")], env)
    # Then it trains, persists, and inspect-checkpoint verifies every checksum of the newest step
    assert first.returncode == 0, first.stderr[-3000:]
    assert "step 5: complete, world size 2, every checksum verified" in first.stdout
    keys = [o["Key"] for o in s3_server.client().list_objects_v2(Bucket=s3_bucket)["Contents"]]
    assert "jobs/example/step_000000000005/COMPLETE.json" in keys
    assert not any(k.startswith("jobs/example/step_000000000001/") for k in keys)  # --keep-last 2
    # When it runs again, Then the new job resumes from the persisted step
    second = _run_script(["bash", str(EXAMPLES / "s3_checkpoints.sh")], env)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from step 5 (persistent storage)" in second.stderr


# -- the Kubernetes manifest -----------------------------------------------------------------------
def test_kubernetes_manifest_is_an_indexed_job_behind_a_headless_service() -> None:
    yaml = pytest.importorskip("yaml")
    service, job = yaml.safe_load_all((EXAMPLES / "kubernetes" / "indexed-job.yaml").read_text())
    assert service["kind"] == "Service" and service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    name = job["metadata"]["name"]
    assert service["spec"]["selector"] == {"job-name": name}
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]
    assert pod["subdomain"] == service["metadata"]["name"]
    assert pod["restartPolicy"] == "Never"  # required by podFailurePolicy

    script = pod["containers"][0]["args"][0]
    words = shlex.split(script[script.index("exec resilrun") :].replace("\\\n", " "))
    argv = words[2 : words.index("examples/train_checkpointless.py")]
    flags = dict(zip(argv[::2], argv[1::2], strict=True))
    # The endpoint is pod 0's stable name; the spare pods are the ones beyond --nnodes
    assert flags["--rdzv-endpoint"] == f"{name}-0.{service['metadata']['name']}:{service['spec']['ports'][0]['port']}"
    nodes = int(flags["--nnodes"])
    assert spec["successPolicy"]["rules"][0]["succeededCount"] == nodes < spec["parallelism"]
    # Every flag the manifest uses is a flag of `resilrun run`, and the exit codes it names exist
    import typer

    from resilrun.cli import app
    from resilrun.errors import ExitCode

    run = typer.main.get_command(app).commands["run"]  # type: ignore[attr-defined]  # a click Group
    known = {opt for param in run.params for opt in param.opts}
    assert set(flags) <= known, set(flags) - known
    env_names = {e["name"] for e in pod["containers"][0]["env"]}
    assert {"RESILRUN_LOCAL_ADDR", "RESILRUN_S3_EXPECTED_OWNER"} <= env_names
    fail_codes = spec["podFailurePolicy"]["rules"][1]["onExitCodes"]["values"]
    assert {ExitCode(code).name for code in fail_codes} == {"WORKERS_FAILED", "USAGE", "CHECKPOINT", "STORAGE"}


def test_examples_readme_describes_every_example() -> None:
    readme = (EXAMPLES / "README.md").read_text()
    for path in sorted(EXAMPLES.rglob("*")):
        if path.is_file() and path.name != "README.md" and "__pycache__" not in path.parts:
            assert str(path.relative_to(EXAMPLES)) in readme, path


def test_the_demo_shows_a_recovery_and_its_verdict() -> None:
    # Given `make demo`'s driver, When it runs, Then the job lost a worker, recovered without a restart
    # and ended with the failure-free run's parameters
    demo = EXAMPLES / "demo" / "resilient_demo.py"
    result = subprocess.run([sys.executable, str(demo)], capture_output=True, text=True, timeout=150, check=False)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert "hot spare takes over" in out
    assert "steps redone: 0; whole-job restarts: 0" in out
    assert "verdict: final parameters identical to a failure-free run" in out
