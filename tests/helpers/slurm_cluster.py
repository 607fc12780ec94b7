"""A real SLURM on the netns cluster: slurmctld on the first host, a slurmd on every host, munge.

Debian's ``slurmctld``, ``slurmd``, ``slurm-client`` and ``munge`` (``make test-tools`` installs
them as root). Everything lives under one directory: the munge key and socket (one munged on the
machine serves every host: its socket is a file, reached from every network namespace), the
slurm.conf (``AuthInfo`` names that socket), spool, state and logs. Each daemon runs in its host's
network namespace with the host's name and /etc/hosts (``Cluster.daemon_command``), so a job step
that slurmd starts is on that host as a user's would be: its address, its hostname. Nodes use
``proctrack/linuxproc`` and ``task/none`` (no cgroup confinement), ``SlurmdTimeout`` is short so
that a lost node is seen in seconds, and jobs may be requeued.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from tests.helpers.netns_cluster import Cluster

TOOLS = ("slurmctld", "slurmd", "sbatch", "srun", "scontrol", "munged")
SLURMD_TIMEOUT_S = 6


def available() -> str | None:
    """None when SLURM and munge are installed, else what is missing."""
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    return f"not installed: {', '.join(missing)} (Debian: slurmctld slurmd slurm-client munge)" if missing else None


class SlurmCluster:
    """``SlurmCluster(cluster, root).start()``; ``close()`` stops it (and whatever its jobs left)."""

    def __init__(self, cluster: Cluster, root: Path) -> None:
        self.cluster = cluster
        self.root = root
        self.conf = root / "slurm.conf"
        self._daemons: dict[str, subprocess.Popen[bytes]] = {}
        self._munged_pid: int | None = None

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def start(self, timeout_s: float = 60.0) -> SlurmCluster:
        self.root.mkdir(parents=True, exist_ok=True)
        key, sock = self.root / "munge.key", self.root / "munge.socket"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        munged = [
            "munged", "--force", f"--socket={sock}", f"--key-file={key}", f"--pid-file={self.root / 'munged.pid'}",
            f"--log-file={self.root / 'munged.log'}", f"--seed-file={self.root / 'munged.seed'}",
        ]  # fmt: skip
        done = subprocess.run(munged, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"munged did not start: {done.stderr.strip()}")
        self._munged_pid = int((self.root / "munged.pid").read_text().strip())
        (self.root / "state").mkdir(exist_ok=True)
        for host in self.cluster.hosts:
            (self.root / f"slurmd-{host.name}").mkdir(exist_ok=True)
        self.conf.write_text(self._config(sock))
        try:
            self._spawn(self.cluster.hosts[0].name, ["slurmctld", "-D", "-i", "-f", str(self.conf)], "slurmctld")
            for host in self.cluster.hosts:
                self._spawn(host.name, ["slurmd", "-D", "-N", host.name, "-f", str(self.conf)], f"slurmd-{host.name}")
            deadline = time.monotonic() + timeout_s
            while self.idle_nodes() != len(self.cluster.hosts):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"SLURM nodes not idle within {timeout_s} s:\n{self.logs()}")
                time.sleep(0.5)
        except BaseException:
            self.close()
            raise
        return self

    def _config(self, sock: Path) -> str:
        first = self.cluster.hosts[0]
        nodes = "".join(
            f"NodeName={h.name} NodeAddr={h.addr} CPUs=2 RealMemory=2000 State=UNKNOWN\n" for h in self.cluster.hosts
        )
        return (
            f"ClusterName=resilrun\nSlurmctldHost={first.name}({first.addr})\n"
            "SlurmUser=root\nSlurmdUser=root\n"
            f"AuthType=auth/munge\nAuthInfo=socket={sock}\nCredType=cred/munge\n"
            "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nMpiDefault=none\n"
            "SelectType=select/cons_tres\nSelectTypeParameters=CR_CPU\nSchedulerType=sched/backfill\n"
            "JobAcctGatherType=jobacct_gather/none\nAccountingStorageType=accounting_storage/none\n"
            f"StateSaveLocation={self.root / 'state'}\nSlurmdSpoolDir={self.root}/slurmd-%n\n"
            f"SlurmctldPidFile={self.root / 'slurmctld.pid'}\nSlurmdPidFile={self.root}/slurmd-%n.pid\n"
            f"SlurmctldLogFile={self.root / 'slurmctld.log'}\nSlurmdLogFile={self.root}/slurmd-%n.log\n"
            # A node's hardware differs from what is declared here: use the declaration.
            "SlurmdParameters=config_overrides\nReturnToService=2\n"
            # Short timeouts: a lost node is seen in seconds, and a job step told to stop is killed soon.
            f"SlurmdTimeout={SLURMD_TIMEOUT_S}\nMessageTimeout=4\nKillWait=5\nMinJobAge=300\nJobRequeue=1\n"
            f"{nodes}PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n"
        )

    def _spawn(self, host: str, argv: list[str], name: str) -> None:
        with open(self.root / f"{name}.out", "wb") as out:
            popen = subprocess.Popen(
                self.cluster.daemon_command(host, argv), env=self.env, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        self._daemons[name] = popen

    # -- clients -------------------------------------------------------------------------------------
    def run(self, argv: Sequence[str], *, env: dict[str, str] | None = None, cwd: Path | None = None,
            timeout: float = 60.0) -> subprocess.CompletedProcess[str]:  # fmt: skip
        """A SLURM client command (sbatch, scontrol, ...) as a user on the first host runs it."""
        return subprocess.run(
            self.cluster.daemon_command(self.cluster.hosts[0].name, list(argv)),
            env={**self.env, **(env or {})}, cwd=cwd, capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip

    def sbatch(self, argv: Sequence[str], *, env: dict[str, str] | None = None, cwd: Path | None = None) -> int:
        done = self.run(["sbatch", "--parsable", *argv], env=env, cwd=cwd)
        if done.returncode != 0:
            raise RuntimeError(f"sbatch failed: {done.stderr.strip()}")
        return int(done.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, NodeList, Restarts, ...); {} once forgotten."""
        done = self.run(["scontrol", "show", "job", "-o", str(job_id)])
        return dict(re.findall(r"(\w+)=(\S*)", done.stdout)) if done.returncode == 0 else {}

    def idle_nodes(self) -> int:
        done = self.run(["sinfo", "-h", "-N", "-o", "%T"])
        return sum(state.strip() == "idle" for state in done.stdout.splitlines()) if done.returncode == 0 else 0

    def node_state(self, name: str) -> str:
        done = self.run(["sinfo", "-h", "-n", name, "-N", "-o", "%T"])
        return done.stdout.strip()

    def kill_slurmd(self, name: str) -> None:
        """SIGKILL ``name``'s slurmd (with the host's link cut too, the node is lost to SLURM)."""
        popen = self._daemons.get(f"slurmd-{name}")
        if popen is not None:
            popen.kill()

    def logs(self) -> str:
        parts = []
        for log in sorted(self.root.glob("*.log")) + sorted(self.root.glob("*.out")):
            parts.append(f"--- {log.name}\n{log.read_text(errors='replace')[-1500:]}")
        return "\n".join(parts)

    def close(self) -> None:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            self.run(["scancel", "--full", "--quiet", "--user", "root"], timeout=20)
        for popen in self._daemons.values():
            popen.kill()
        for popen in self._daemons.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(10)
        self.cluster.kill_all()  # job steps slurmd left behind (slurmstepd reparents itself)
        if self._munged_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._munged_pid, 9)
        self._daemons = {}
