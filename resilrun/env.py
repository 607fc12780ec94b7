"""The agent-to-worker environment contract.

These are exactly the variables torchrun gives its workers (same names, same meanings), plus
``RESILRUN_*`` ones for resilrun's own worker library. Nothing else in the package builds worker
environments, so a diff of this module is a diff of the contract.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

# --snapshot-every auto, as Config and the worker contract hold it (RESILRUN_SNAPSHOT_EVERY=auto).
SNAPSHOT_AUTO = 0

# A worker exits with this code when its state is in no tier (StateLostError): retrying cannot help,
# so the agent stops the job at once instead of spending restarts on it.
STATE_LOST_EXIT_CODE = 76
# ... and this one when the only copy of it was refused (StateRefusedError: checksums or MACs fail).
STATE_REFUSED_EXIT_CODE = 77
STOP_EXIT_CODES = (STATE_LOST_EXIT_CODE, STATE_REFUSED_EXIT_CODE)
# ... and this one when its device failed the check before it took its rank (worker/health.py):
# the process, not the rank, is at fault, so the next spare may take the rank at once.
UNHEALTHY_EXIT_CODE = 78
# The median multiply rate (GFLOP/s) the node's processes measured, given to a spare with its rank.
EXPECTED_GFLOPS_ENV = "RESILRUN_EXPECTED_GFLOPS"
# Seconds a promoted spare's first collective with the others may take (worker/health.py's
# PEER_BUDGET_S when unset): a tuning knob for very large jobs, and how the tests keep it short.
PEER_CHECK_ENV = "RESILRUN_PEER_CHECK_S"

# Secrets the agent reads from its own environment and no worker needs: job_secret.SECRET_ENV and
# rendezvous.factory.ETCD_PASSWORD_ENV (named here, not imported: this module is a leaf).
WITHHELD_FROM_WORKERS = ("RESILRUN_JOB_SECRET", "RESILRUN_ETCD_PASSWORD")


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerEnv:
    """The identity and bootstrap data of one worker process."""

    global_rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    role_name: str
    role_rank: int
    role_world_size: int
    master_addr: str
    master_port: int
    run_id: str
    restart_count: int
    max_restarts: int
    error_file: str
    round: int
    agent_socket: str = ""
    attempt: int = 0
    recovery_wait_s: float = 10.0
    heartbeat_interval_s: float = 1.0
    snapshot_dedup: bool = True
    snapshot_every: int = 1  # SNAPSHOT_AUTO: auto
    max_overhead_pct: float = 3.0
    # --replicate-every auto with peer replicas: the workers' schedule picks the replicated snapshots
    replicate_auto: bool = False

    def to_env(self, base: Mapping[str, str]) -> dict[str, str]:
        """The full environment of the worker: ``base`` (the agent's) plus the contract."""
        env = dict(base)
        env.update(
            {
                "RANK": str(self.global_rank),
                "LOCAL_RANK": str(self.local_rank),
                "WORLD_SIZE": str(self.world_size),
                "LOCAL_WORLD_SIZE": str(self.local_world_size),
                "GROUP_RANK": str(self.node_rank),
                "GROUP_WORLD_SIZE": str(self.num_nodes),
                "ROLE_RANK": str(self.role_rank),
                "ROLE_NAME": self.role_name,
                "ROLE_WORLD_SIZE": str(self.role_world_size),
                "MASTER_ADDR": self.master_addr,
                "MASTER_PORT": str(self.master_port),
                "TORCHELASTIC_RUN_ID": self.run_id,
                "TORCHELASTIC_RESTART_COUNT": str(self.restart_count),
                "TORCHELASTIC_MAX_RESTARTS": str(self.max_restarts),
                "TORCHELASTIC_ERROR_FILE": self.error_file,
                # Each round has a fresh store hosted by the round leader's agent: workers connect
                # as clients, and no key of an earlier attempt can be read (the stale-address trap).
                "TORCHELASTIC_USE_AGENT_STORE": "True",
                "TORCH_NCCL_ASYNC_ERROR_HANDLING": base.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
                # torchrun exports the signals it forwards; scripts (and SLURM wrappers) read it.
                "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
                "RESILRUN_RUN_ID": self.run_id,
                "RESILRUN_ROUND": str(self.round),
                # Restarts plus in-process recoveries so far: which incarnation of the job this is.
                "RESILRUN_ATTEMPT": str(self.attempt),
                "RESILRUN_RECOVERY_WAIT_S": str(self.recovery_wait_s),
                "RESILRUN_HEARTBEAT_INTERVAL_S": str(self.heartbeat_interval_s),
                "RESILRUN_SNAPSHOT_DEDUP": "1" if self.snapshot_dedup else "0",
                "RESILRUN_SNAPSHOT_EVERY": "auto" if self.snapshot_every == SNAPSHOT_AUTO else str(self.snapshot_every),
                "RESILRUN_MAX_OVERHEAD": f"{self.max_overhead_pct:g}",
                "RESILRUN_SPARE": "0",
            }
        )
        # Set only when the workers choose the replicated snapshots; otherwise the agent does.
        env.pop("RESILRUN_REPLICATE_EVERY", None)
        if self.replicate_auto:
            env["RESILRUN_REPLICATE_EVERY"] = "auto"
        if self.agent_socket:
            env["RESILRUN_AGENT_SOCKET"] = self.agent_socket
        return env


# What resilrun tells each process it starts (WorkerEnv.to_env, spare_environ): read by the script
# and by resilrun at call time, never by the interpreter or torch as they start, so a worker may be
# forked from the node's template (started without them) and given them afterwards.
PER_PROCESS_KEYS = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_RANK",
        "ROLE_NAME",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",  # read when an NCCL group is made
    }
)
# resilrun's own (read at call time) and the node's network interface for gloo and NCCL (read
# when a process group is made).
_READ_AFTER_START_PREFIXES = ("TORCHELASTIC_", "RESILRUN_")
_READ_AFTER_START_SUFFIXES = ("_SOCKET_IFNAME",)


# The room the agent leaves in the worker template's command line (one argument of this many
# spaces) and environment (this variable, eight times as long) for each forked worker to show its
# own there (resilrun/worker_template.py, StartAreas).
TEMPLATE_ROOM_ENV = "RESILRUN_TEMPLATE_ROOM"
TEMPLATE_ROOM_BYTES = 4096


def read_after_start(key: str) -> bool:
    """Whether ``key`` is one resilrun sets per process or per node that nothing reads while a
    Python process starts and imports torch (so a forked worker may get it afterwards)."""
    return (
        key in PER_PROCESS_KEYS
        or key.startswith(_READ_AFTER_START_PREFIXES)
        or key.endswith(_READ_AFTER_START_SUFFIXES)
    )


def worker_base_env(environ: Mapping[str, str], nproc_per_node: int) -> dict[str, str]:
    """What every process a node starts inherits: ``environ`` with torchrun's OMP default, without
    the agent's secrets (the last gate before a process exists)."""
    return without_secrets({**environ, **omp_threads_default(environ, nproc_per_node)})


def omp_threads_default(base: Mapping[str, str], nproc_per_node: int) -> dict[str, str]:
    """torchrun sets OMP_NUM_THREADS=1 when unset and more than one worker shares a node."""
    if "OMP_NUM_THREADS" in base or nproc_per_node <= 1:
        return {}
    return {"OMP_NUM_THREADS": "1"}


def agent_environ() -> dict[str, str]:
    """A copy of the agent's own environment, the base of every worker's, without the secrets the
    agent alone uses (``WITHHELD_FROM_WORKERS``)."""
    return without_secrets(os.environ)


def without_secrets(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` less ``WITHHELD_FROM_WORKERS``. Why: a worker's environment is inherited by its
    DataLoader workers and every subprocess it starts (user code, shells, crash reporters that dump
    it), so a secret there reaches whatever runs in the job; workers never need either one."""
    return {k: v for k, v in env.items() if k not in WITHHELD_FROM_WORKERS}


def agent_secrets(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The ``WITHHELD_FROM_WORKERS`` secrets that are set in ``environ`` (default: this process's).

    Why: they are all that ``job_secret.external_secret`` and ``rendezvous.factory.etcd_security``
    read, so the agent and the commands hand those two this, not the whole environment.
    """
    env = os.environ if environ is None else environ
    return {k: env[k] for k in WITHHELD_FROM_WORKERS if k in env}


def resilrun_debug() -> bool:
    return os.environ.get("RESILRUN_DEBUG", "") not in ("", "0", "false")


def python_exec() -> str:
    """The interpreter for Python workers; torchrun honours PYTHON_EXEC too."""
    import sys

    return os.environ.get("PYTHON_EXEC") or sys.executable


def agent_token(environ: Mapping[str, str] | None = None) -> str:
    """The token a worker shows its agent's channel (``RESILRUN_AGENT_TOKEN``); "" when unset.

    The agent puts it only in the environment of the workers it spawns, so an empty one is refused
    by the agent: that is how a process the launcher did not start is kept off the channel.
    """
    env = os.environ if environ is None else environ
    return env.get("RESILRUN_AGENT_TOKEN", "")


def fault_hook_setting(name: str, environ: Mapping[str, str] | None = None) -> str:
    """The value of the agent's fault hook ``name`` (``RESILRUN_FAULT_*``), stripped; "" when unset.

    Parsed by ``agent/workers/fault_hooks.py``: a value that is not a number is refused there, with
    an error that this leaf module cannot raise.
    """
    env = os.environ if environ is None else environ
    return env.get(name, "").strip()


# typer answers shell completion when this variable is set (its name: _<PROG>_COMPLETE); the
# scripts in completions/ set it to complete_<shell>.
SHELL_COMPLETE_ENV = "_RESILRUN_COMPLETE"


def shell_completion_request(environ: Mapping[str, str] | None = None) -> str:
    """What the shell asks ``resilrun`` for (``complete_<shell>``, ``source_<shell>``); "" on a run."""
    env = os.environ if environ is None else environ
    return env.get(SHELL_COMPLETE_ENV, "")


@dataclass(frozen=True, slots=True)
class WorkerVariables:
    """What a worker reads of its environment (torchrun's contract plus resilrun's)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    run_id: str
    restart_count: int
    agent_socket: str | None
    faults: str
    spare: bool = False
    round: int = 0
    attempt: int = 0
    recovery_wait_s: float = 10.0
    heartbeat_interval_s: float = 1.0
    dedup: bool = True  # local ranks split the copy of DDP-replicated state (snapshot/dedup.py)
    snapshot_every: int = 1  # --snapshot-every: which steps Job.commit snapshots (SNAPSHOT_AUTO: auto)
    max_overhead: float = 0.03  # --max-overhead, as a fraction of step time
    replicate_auto: bool = False  # --replicate-every auto: Job.commit says which snapshots go to peers
    expected_gflops: float | None = None  # the node's device rate, for a spare's check (worker/health.py)
    peer_check_s: float | None = None  # a promoted spare's first-collective budget (None: health.PEER_BUDGET_S)


def read_worker_variables(environ: Mapping[str, str] | None = None) -> WorkerVariables:
    """Read the worker contract; a plain ``python train.py`` is a world of one."""
    env = os.environ if environ is None else environ
    return WorkerVariables(
        rank=int(env.get("RANK", "0")),
        world_size=int(env.get("WORLD_SIZE", "1")),
        local_rank=int(env.get("LOCAL_RANK", "0")),
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", "1")),
        run_id=env.get("RESILRUN_RUN_ID") or env.get("TORCHELASTIC_RUN_ID", "none"),
        restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
        agent_socket=env.get("RESILRUN_AGENT_SOCKET") or None,
        faults=env.get("RESILRUN_FAULTS", ""),
        spare=env.get("RESILRUN_SPARE") == "1",
        round=int(env.get("RESILRUN_ROUND", "0")),
        attempt=int(env.get("RESILRUN_ATTEMPT", env.get("TORCHELASTIC_RESTART_COUNT", "0"))),
        recovery_wait_s=float(env.get("RESILRUN_RECOVERY_WAIT_S", "10")),
        heartbeat_interval_s=float(env.get("RESILRUN_HEARTBEAT_INTERVAL_S", "1")),
        dedup=env.get("RESILRUN_SNAPSHOT_DEDUP", "1") != "0",
        snapshot_every=_snapshot_every(env.get("RESILRUN_SNAPSHOT_EVERY", "1")),
        max_overhead=float(env.get("RESILRUN_MAX_OVERHEAD", "3")) / 100,
        replicate_auto=env.get("RESILRUN_REPLICATE_EVERY") == "auto",
        expected_gflops=float(env[EXPECTED_GFLOPS_ENV]) if env.get(EXPECTED_GFLOPS_ENV) else None,
        peer_check_s=float(env[PEER_CHECK_ENV]) if env.get(PEER_CHECK_ENV) else None,
    )


def _snapshot_every(value: str) -> int:
    return SNAPSHOT_AUTO if value.strip().lower() == "auto" else max(1, int(value))


# What runs after each assignment is adopted (``on_assignment``).
_ON_ASSIGNMENT: list[Callable[[], None]] = []


def on_assignment(callback: Callable[[], None]) -> None:
    """Run ``callback`` each time this process adopts an assignment: for what a library computed
    from the environment as it was imported (the process may have imported it with no rank yet:
    a spare, or the node's worker template it was forked from)."""
    if callback not in _ON_ASSIGNMENT:
        _ON_ASSIGNMENT.append(callback)


def apply_assignment(env: Mapping[str, str]) -> None:
    """Adopt the environment the agent gave this process (a promoted spare, a new generation)."""
    os.environ.update(env)
    for callback in list(_ON_ASSIGNMENT):
        callback()


# Single values of the contract a worker process reads (the entry point, resilrun/worker_main.py,
# among others), each read afresh: a process that moves to a new generation adopts a new
# environment (``apply_assignment``).
def error_file() -> str | None:
    """Where an uncaught exception is recorded (torchrun's error file); None without one."""
    return os.environ.get("TORCHELASTIC_ERROR_FILE") or None


# --no-spare-head-start as the workers inherit it: a spare waits before the script's first line.
NO_HEAD_START_ENV = "RESILRUN_NO_HEAD_START"


def head_start_wanted() -> bool:
    """Whether a hot spare runs its script ahead until it reads its rank (``worker/pending.py``)."""
    return os.environ.get(NO_HEAD_START_ENV) != "1"


def is_spare() -> bool:
    """Whether this process is a hot spare, with no rank yet (``spare_environ``)."""
    return os.environ.get("RESILRUN_SPARE") == "1"


def agent_socket_path() -> str | None:
    """The local socket of this worker's agent; None outside a resilrun worker (python, torchrun)."""
    return os.environ.get("RESILRUN_AGENT_SOCKET") or None


def recovery_wait_s() -> float:
    """How long a rank whose collective broke waits for the agent's verdict (``WorkerEnv``)."""
    return float(os.environ.get("RESILRUN_RECOVERY_WAIT_S", "10"))


def current_round() -> int:
    """The rendezvous round (generation) whose environment this process has."""
    return int(os.environ.get("RESILRUN_ROUND", "0"))


# --no-integrations as the workers inherit it; config.py parses the flag's value with the same words.
NO_INTEGRATIONS_ENV = "RESILRUN_NO_INTEGRATIONS"
_TRUE_WORDS = frozenset({"1", "true", "yes", "on"})


def integrations_wanted(environ: Mapping[str, str] | None = None) -> bool:
    """Whether frameworks are to be adapted: only in a worker resilrun started (a plain python or
    torchrun run must find every framework untouched), unless ``--no-integrations`` was given."""
    env = os.environ if environ is None else environ
    return bool(env.get("RESILRUN_AGENT_SOCKET")) and not integrations_turned_off(env)


def integrations_turned_off(environ: Mapping[str, str]) -> bool:
    """Whether ``environ`` turns the framework integrations off (``RESILRUN_NO_INTEGRATIONS``)."""
    return environ.get(NO_INTEGRATIONS_ENV, "").lower() in _TRUE_WORDS


def any_set_true(*names: str) -> bool:
    """Whether any of ``names`` is "true" (any case): how a launcher such as ``accelerate launch``
    tells its workers to set up a sharded engine (``ACCELERATE_USE_FSDP``), read the same way here."""
    return any(os.environ.get(name, "").lower() == "true" for name in names)


def spare_environ(base: Mapping[str, str], agent_socket: str, log_dir: str) -> dict[str, str]:
    """A hot spare's environment: no rank yet, only the way to its agent."""
    env = {k: v for k, v in base.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update({"RESILRUN_SPARE": "1", "RESILRUN_AGENT_SOCKET": agent_socket})
    env["TORCHELASTIC_ERROR_FILE"] = f"{log_dir}/error.json"
    return env


def quiet_torch_native_logs() -> None:
    """Keep torch's C++ warnings (store connect retries, with stack traces) off a CLI's stderr.

    Read by torch when it is first imported, so this only has an effect before that; an explicit
    ``TORCH_CPP_LOG_LEVEL`` from the user wins.
    """
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")


def ensure_rendezvous_defaults() -> None:
    """Let ``resilrun.init()`` run without a launcher (a single process, for quick experiments)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")


# --capture-dir as the workers see it (absolute): where resilrun.checkpoint.StorageWriter writes.
CAPTURE_DIR_ENV = "RESILRUN_CAPTURE_DIR"


def capture_dir(environ: Mapping[str, str] | None = None) -> str | None:
    """The job's captured folder, when the agent captures one (``--capture-dir``)."""
    env = os.environ if environ is None else environ
    return env.get(CAPTURE_DIR_ENV) or None


# --rerun-in-process as the workers inherit it: a plain script's survivors re-run it in-process.
RERUN_ENV = "RESILRUN_RERUN"


def rerun_wanted(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this worker's agent re-runs a plain script in-process after a failure (opt-in: a
    script that never calls ``resilrun.init()`` is otherwise restarted the torchrun way)."""
    env = os.environ if environ is None else environ
    return bool(env.get("RESILRUN_AGENT_SOCKET")) and env.get(RERUN_ENV) == "1"
