"""Child of ``control_plane_scale.py``: simulated agents that join with torchrun's own rendezvous.

    python benchmarks/_torchrun_rdzv_agents.py PORT RUN_ID N FIRST COUNT DEADLINE_S

Each of COUNT threads plays one agent of an N-agent job exactly as ``torchrun --rdzv-backend c10d``
sets it up: a TCPStore client, ``C10dRendezvousBackend`` and ``DynamicRendezvousHandler`` (torch's
code, unchanged), then ``next_rendezvous()``. Threads wait for the parent's ``go`` key so that
every agent starts at once, and print one JSON line each: its node index, the wall-clock time its
rendezvous completed, and its rank (or the error). Process start and imports are not timed.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from datetime import timedelta

os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # no store of its own for rank 0

from torch.distributed import TCPStore  # noqa: E402
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend  # noqa: E402
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (  # noqa: E402
    DynamicRendezvousHandler,
    RendezvousTimeout,
)


def agent(port: int, run_id: str, n: int, index: int, deadline_s: float, out: list[str]) -> None:
    try:
        store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=deadline_s + 30))
        backend = C10dRendezvousBackend(store, run_id)
        timeout = RendezvousTimeout(join=timedelta(seconds=deadline_s), last_call=timedelta(seconds=1))
        handler = DynamicRendezvousHandler.from_backend(
            run_id, store, backend, min_nodes=n, max_nodes=n, local_addr=f"node-{index:05d}", timeout=timeout
        )
        store.add(f"{run_id}/ready", 1)
        store.wait([f"{run_id}/go"])
        info = handler.next_rendezvous()
        out.append(json.dumps({"node": index, "t": time.time(), "rank": info.rank}))
    except Exception as exc:  # reported, not raised: the parent counts who finished
        out.append(json.dumps({"node": index, "error": f"{type(exc).__name__}: {exc}"[:300]}))


def main() -> None:
    port, run_id, n, first, count, deadline_s = sys.argv[1:7]
    out: list[str] = []
    threads = [
        threading.Thread(
            target=agent, args=(int(port), run_id, int(n), int(first) + i, float(deadline_s), out), daemon=True
        )
        for i in range(int(count))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    sys.stdout.write("\n".join(out) + "\n")
    sys.stdout.flush()
    os._exit(0)  # the handlers' keep-alive timers would keep the process alive


if __name__ == "__main__":
    main()
