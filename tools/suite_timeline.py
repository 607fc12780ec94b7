"""Where the suite's wall time went, per xdist worker: in tests, before the first test, between
tests, and after the last one; the longest gaps and the slowest test files.

Usage: ``python -m tools.suite_timeline build/test-timeline`` (``make test`` writes that folder).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path


def _events(folder: Path) -> dict[str, list[dict]]:
    workers: dict[str, list[dict]] = {}
    for path in sorted(folder.glob("*.jsonl")):
        lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        workers[path.stem] = sorted(lines, key=lambda e: e["at"])
    return workers


def _short(test: str, width: int = 120) -> str:
    """A parametrized id can be kilobytes long (a fuzzed input); a gap's line names it, not shows it."""
    return test if len(test) <= width else test[: width - 3] + "..."


def report(folder: Path, gaps: int = 10) -> str:
    workers = _events(folder)
    if not workers:
        return f"no timeline in {folder} (make test writes one)"
    begin = min(e["at"] for events in workers.values() for e in events)
    end = max(e["at"] for events in workers.values() for e in events)
    out = [f"suite wall {end - begin:.0f} s, {len(workers)} timelines"]
    by_file: dict[str, float] = defaultdict(float)
    cpu_by_file: dict[str, float] = defaultdict(float)
    cpu_by_test: list[tuple[float, float, str]] = []
    all_gaps: list[tuple[float, str, str, str]] = []
    for name, events in workers.items():
        starts = [e for e in events if e["kind"] == "start"]
        if not starts:
            continue
        in_tests, open_at, last_end, last_test = 0.0, None, None, "(session start)"
        opened: dict[str, object] = {}
        for event in events:
            if event["kind"] == "start":
                if last_end is not None:
                    all_gaps.append((event["at"] - last_end, name, last_test, event["test"]))
                open_at, opened = event["at"], event
            elif event["kind"] == "end" and open_at is not None:
                took = event["at"] - open_at
                in_tests += took
                by_file[event["test"].split("::")[0]] += took
                if "cpu_s" in event and "cpu_s" in opened:
                    cpu = event["cpu_s"] - opened["cpu_s"]
                    cpu_by_file[event["test"].split("::")[0]] += cpu
                    cpu_by_test.append((cpu, took, event["test"]))
                open_at, last_end, last_test = None, event["at"], event["test"]
        first, last = starts[0]["at"], last_end or starts[-1]["at"]
        out.append(
            f"{name}: before its first test {first - begin:.0f} s, in tests {in_tests:.0f} s, "
            f"between tests {last - first - in_tests:.0f} s, idle after its last {end - last:.0f} s"
        )
    out.append(f"longest gaps between tests ({gaps}):")
    for seconds, name, before, after in sorted(all_gaps, reverse=True)[:gaps]:
        out.append(f"  {seconds:6.1f} s  {name}  after {_short(before)}  before {_short(after)}")
    out.append("test files by time in tests (20):")
    for path, seconds in sorted(by_file.items(), key=lambda item: -item[1])[:20]:
        out.append(f"  {seconds:7.1f} s  {path}")
    if cpu_by_test:
        out.append(f"CPU in tests {sum(c for c, _, _ in cpu_by_test):.0f} CPU-s; test files by CPU (20):")
        for path, seconds in sorted(cpu_by_file.items(), key=lambda item: -item[1])[:20]:
            out.append(f"  {seconds:7.1f} CPU-s  {path}")
        out.append("tests by CPU (25): CPU-s, wall s")
        for cpu, took, test in sorted(cpu_by_test, reverse=True)[:25]:
            out.append(f"  {cpu:7.1f} {took:7.1f}  {_short(test)}")
    return "\n".join(out)


if __name__ == "__main__":
    sys.stdout.write(report(Path(sys.argv[1] if len(sys.argv) > 1 else "build/test-timeline")) + "\n")
