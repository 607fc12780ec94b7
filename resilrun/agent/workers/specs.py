"""Pure construction of worker and spare process specs for one round on one node."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from resilrun.agent.workers.procs import WorkerSpec
from resilrun.config import Config
from resilrun.env import (
    SNAPSHOT_AUTO,
    WorkerEnv,
    python_exec,
    spare_environ,
    worker_base_env,
)
from resilrun.option_values import Std, resolve_std
from resilrun.rendezvous.protocol import RdzvState


@dataclass(frozen=True, slots=True)
class NodeSetup:
    """Facts resolved once per agent before the first round."""

    nproc: int
    addr: str
    log_root: Path
    base_env: dict[str, str]
    agent_socket: str = ""


def process_env(setup: NodeSetup) -> dict[str, str]:
    """What every process this node starts inherits (the secrets dropped whoever built
    ``setup.base_env``)."""
    return worker_base_env(setup.base_env, setup.nproc)


def command(config: Config) -> tuple[str, ...]:
    if config.no_python:
        return (config.script, *config.script_args)
    module = ("-m",) if config.module else ()
    return (python_exec(), "-u", "-m", "resilrun.worker_main", *module, config.script, *config.script_args)


def _streams(config: Config, local_rank: int) -> tuple[Std, Std]:
    redirect = resolve_std(config.redirects_spec, local_rank)
    tee = resolve_std(config.tee_spec, local_rank)
    ranks_filter = config.ranks_filter
    if ranks_filter is not None and local_rank not in ranks_filter:
        return Std.ALL, Std.NONE  # hidden from the console, kept in files
    return Std(redirect | tee), Std(Std.ALL & ~redirect)


def worker_specs(
    config: Config, setup: NodeSetup, run_id: str, state: RdzvState, node_rank: int, master: str
) -> list[WorkerSpec]:
    """The workers of ``node_rank`` in the round ``state`` describes, with torchrun's environment."""
    master_addr, _, master_port = master.rpartition(":")
    base_rank = sum(p.local_world_size for p in state.participants[:node_rank])
    world = sum(p.local_world_size for p in state.participants)
    base_env = process_env(setup)
    specs = []
    for local_rank in range(setup.nproc):
        global_rank = base_rank + local_rank
        log_dir = setup.log_root / f"round_{state.round}" / f"rank_{global_rank}"
        to_file, to_console = _streams(config, local_rank)
        env = WorkerEnv(
            global_rank=global_rank,
            local_rank=local_rank,
            world_size=world,
            local_world_size=setup.nproc,
            node_rank=node_rank,
            num_nodes=len(state.participants),
            role_name=config.role,
            role_rank=global_rank,
            role_world_size=world,
            master_addr=master_addr,
            master_port=int(master_port),
            run_id=run_id,
            restart_count=state.restarts,
            max_restarts=config.max_restarts,
            error_file=str(log_dir / "error.json"),
            round=state.round,
            agent_socket=setup.agent_socket,
            attempt=state.restarts + state.recoveries,
            # Long enough for another node's agent to notice its failure (or a node loss) and for
            # a warming spare to become ready (spare_pool.SPARE_READY_TIMEOUT_S).
            recovery_wait_s=config.heartbeat_timeout_s + 40.0,
            heartbeat_interval_s=config.heartbeat_interval_s,
            snapshot_dedup=not config.no_snapshot_dedup,
            snapshot_every=config.snapshot_every,
            max_overhead_pct=config.max_overhead_pct,
            replicate_auto=config.replicate_every == SNAPSHOT_AUTO and config.replicas > 0,
        ).to_env(base_env)
        specs.append(
            WorkerSpec(
                local_rank=local_rank,
                global_rank=global_rank,
                argv=command(config),
                env=env,
                log_dir=log_dir,
                to_file=to_file,
                to_console=to_console,
            )
        )
    return specs


def spare_spec(config: Config, setup: NodeSetup, round: int, index: int) -> WorkerSpec:
    """A hot spare: the same command, no rank; it waits in ``resilrun.init()`` to be given one."""
    log_dir = setup.log_root / f"round_{round}" / f"spare_{index}"
    base_env = process_env(setup)
    to_file, to_console = _streams(config, 0)
    return WorkerSpec(
        local_rank=-1,
        global_rank=-1,
        argv=command(config),
        env=spare_environ(base_env, setup.agent_socket, str(log_dir)),
        log_dir=log_dir,
        to_file=to_file,
        to_console=to_console,
    )
