"""``resilrun status``: a live view of a running job, read from its rendezvous store.

Connects as a read-only client (it never hosts a store, never joins), with a short timeout, from any
machine that can reach the endpoint. Tables with health colours on a terminal, plain text otherwise,
``--json`` one document (schema: docs/status.md; fields are only ever added), ``--watch [SECONDS]``
refreshes in place (one JSON document per line with ``--json``). An unreachable endpoint, or one
without the job, ends as one ``resilrun: error:`` line and exit code 3 within ``--timeout``.
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from typing import Annotated, Any

import typer

from resilrun.cli import _status_render as view
from resilrun.cli._errors import render
from resilrun.cli._output import Output
from resilrun.cli._secret import secret_file_option
from resilrun.errors import RendezvousError, ResilrunError

# Seconds: the store answers a live job in milliseconds; a few seconds covers a slow network
# without leaving a script (or a person) waiting on a dead endpoint.
DEFAULT_TIMEOUT_S = 3.0
DEFAULT_WATCH_S = 2.0


def normalize_argv(args: list[str]) -> list[str]:
    """Let ``--watch`` stand without a value (typer options need one): it then means every 2 s."""
    if args[:1] != ["status"]:
        return args
    out = list(args)
    for i, word in enumerate(out):
        if word == "--watch" and (i + 1 == len(out) or out[i + 1].startswith("-")):
            out.insert(i + 1, f"{DEFAULT_WATCH_S:g}")
            break
    return out


def status(
    rdzv_endpoint: Annotated[
        str,
        typer.Option(
            "--rdzv-endpoint",
            "--rdzv_endpoint",
            envvar=["RESILRUN_RDZV_ENDPOINT", "PET_RDZV_ENDPOINT"],
            help="The job's rendezvous host:port (default port 29400; etcd: host:2379[,host:2379...]).",
        ),
    ] = "localhost:29400",
    rdzv_id: Annotated[
        str | None,
        typer.Option(
            "--rdzv-id",
            "--rdzv_id",
            envvar=["RESILRUN_RDZV_ID", "PET_RDZV_ID"],
            help="Job id (default: the newest job registered at the endpoint).",
        ),
    ] = None,
    rdzv_backend: Annotated[
        str,
        typer.Option(
            "--rdzv-backend",
            "--rdzv_backend",
            envvar=["RESILRUN_RDZV_BACKEND", "PET_RDZV_BACKEND"],
            help="c10d, static (give --master-addr:--master-port as the endpoint) or etcd.",
        ),
    ] = "c10d",
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")] = False,
    watch: Annotated[
        float | None,
        typer.Option("--watch", metavar="[SECONDS]", min=0.1, help="Refresh every SECONDS (default 2) until Ctrl-C."),
    ] = None,
    timeout: Annotated[
        float, typer.Option("--timeout", min=0.1, help="Seconds to wait for the endpoint before giving up.")
    ] = DEFAULT_TIMEOUT_S,
    history: Annotated[int, typer.Option("--history", min=0, max=64, help="Failures and recoveries shown.")] = 10,
    rdzv_conf: Annotated[
        str,
        typer.Option(
            "--rdzv-conf",
            "--rdzv_conf",
            envvar=["RESILRUN_RDZV_CONF", "PET_RDZV_CONF"],
            metavar="K=V,...",
            help="etcd's TLS and user, as the job gives them: ca_file, cert_file, key_file, user, password_file.",
        ),
    ] = "",
    job_secret_file: Annotated[
        str | None,
        secret_file_option("The job's secret file (or RESILRUN_JOB_SECRET): the store's documents are then verified."),
    ] = None,
) -> None:
    """Show a running job: nodes, ranks, spares, snapshot progress, failures and recoveries."""
    from resilrun.env import agent_secrets
    from resilrun.job_secret import external_secret
    from resilrun.option_values import parse_rdzv_conf
    from resilrun.rendezvous.factory import etcd_security

    out = Output(json_mode=json_output)
    try:
        secrets = agent_secrets()
        secret = external_secret(job_secret_file, secrets)
        security = etcd_security(parse_rdzv_conf(rdzv_conf), secrets)
        reader = _Reader(rdzv_backend.strip().lower(), rdzv_endpoint, rdzv_id, timeout, history, secret, security)
        if watch is None:
            _show(out, reader.read(), json_output, tty=sys.stdout.isatty())
            return
        _watch(out, reader, watch, json_output)
    except ResilrunError as exc:
        if not json_output:
            raise  # main() renders it as one line + hint
        raise typer.Exit(render(exc, out)) from None


class _Reader:
    """Opens the backend once and reads the job's document on demand."""

    def __init__(
        self,
        kind: str,
        endpoint: str,
        run_id: str | None,
        timeout_s: float,
        history: int,
        secret: bytes | None,
        security: Any = None,
    ) -> None:
        self.kind = kind
        self.endpoint = endpoint
        self.requested_id = run_id
        self.timeout = timedelta(seconds=timeout_s)
        self.history = history
        self.secret = secret
        self.security = security  # etcd's TLS and user (rendezvous/etcd.py EtcdSecurity), or None
        self.backend: Any = None
        self.refused: list[str] = []  # keys whose documents did not verify (shown, never trusted)
        self.versions: Any = None  # status/view.py DocumentVersions: refuses replays across reads

    def read(self) -> dict[str, Any]:
        """The composed document (see docs/status.md).

        Raises:
            StoreConnectionError: the endpoint is not reachable within the timeout.
            RendezvousError: the endpoint answers but holds no such job.
        """
        from resilrun.rendezvous.readonly import open_readonly
        from resilrun.status import records as history
        from resilrun.status import view as status_view

        if self.backend is None:
            from resilrun.rendezvous.sealed import SealedBackend, store_key

            opened, self.endpoint = open_readonly(self.kind, self.endpoint, self.timeout, self.security)
            # Without the secret, documents are shown unverified (and the view says so).
            key = store_key(self.secret) if self.secret is not None else None
            self.backend = SealedBackend(opened, key, on_forged=self.refused.append)
            self.versions = status_view.DocumentVersions()
        run_id = self.requested_id or history.latest_run(self.backend) or "none"
        raw = status_view.read_raw(self.backend, run_id, self.history)
        # verified documents only: without the secret anyone could write a "newer" one
        replayed = self.versions.admit(raw) if self.secret is not None else []
        if raw["rdzv"] is None and not raw["nodes"]:
            raise RendezvousError(
                f"no job '{run_id}' at {self.endpoint}",
                hint="pass the job's --rdzv-id" if self.requested_id else "is the job running at this endpoint?",
            )
        store = {"verified": self.backend.verified, "refused": sorted(set(self.refused)), "replayed": replayed}
        return status_view.compose(raw, endpoint=self.endpoint, backend=self.kind, store=store, now=time.time())


def _show(out: Output, doc: dict[str, Any], json_output: bool, *, tty: bool) -> None:
    if json_output:
        out.json(doc)
    elif tty:
        out.rich(view.rich_view(doc))
    else:
        for line in view.text_lines(doc):
            out.data(line)


def _watch(out: Output, reader: _Reader, every_s: float, json_output: bool) -> None:
    """Refresh until Ctrl-C. After the job ended and its store went away, say so and exit 0."""
    tty = sys.stdout.isatty() and not json_output
    last: dict[str, Any] | None = None
    live = out.live() if tty else None
    try:
        while True:
            try:
                doc = reader.read()
            except ResilrunError:
                if last is not None and last["job"]["state"] in ("succeeded", "failed", "stopped"):
                    out.info(f"the job ended ({last['job']['state']}) and its rendezvous store is gone")
                    return
                raise
            last = doc
            if live is not None:
                live.update(view.rich_view(doc))
            elif json_output:
                out.json_line(doc)
            else:
                for line in view.text_lines(doc):
                    out.data(line)
                out.data("")
            time.sleep(every_s)
    except KeyboardInterrupt:
        return
    finally:
        if live is not None:
            live.stop()
