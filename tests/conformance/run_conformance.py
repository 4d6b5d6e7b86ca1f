"""PyTorch's own distributed test suite against ``mpx``, with ``gloo`` as the control.

Runs ``DistributedTest._DistTestBase`` from the installed torch wheel
(``torch/testing/_internal/distributed/distributed_test.py``) under
``mpxrun -n RANKS`` once per backend, then prints how many of the tests that
gloo passes mpx passes too, and lists the rest::

    python tests/conformance/run_conformance.py --ranks 2
    python tests/conformance/run_conformance.py --ranks 3 --select subgroup
    python tests/conformance/run_conformance.py --ranks 2 -k all_reduce --backends mpx

The exit status is 1 when the tested backend fails a test the control
passes, other than those ``--expected-differ`` names (torch's gloo-only
``monitored_barrier``): a regression fails the run (and CI, whose
``nox -s tests`` runs the whole 2-rank suite). Then, unless ``--torch-files
none`` or ``--select subgroup``, ``run_torch_files.py``'s fixed sample of
torch's other test files runs (``test_functional_api.py`` ...; torch's sources
from ``MPX_TORCH_TESTS``, else a ``SKIPPED`` line), and fails the run alike.

The tests of one backend run in one job, one after another (a job start costs
torch's import); a test that hangs or kills a rank ends the job, and the job
restarts after it with that test counted as failed. Results go to
``--out`` (default ``conformance-results/``): ``<backend>-<ranks>.json``
and ``summary-<ranks>.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "EXPECTED_DIFFER",
    "SMOKE",
    "compare",
    "difference_lines",
    "error_line",
    "merge_ranks",
    "regressions",
    "select_tests",
    "suite_tests",
]

HERE = Path(__file__).resolve().parent
# A test that shows no progress for this long is stuck: its job is stopped.
STALL_S = 150.0
# What torch implements for gloo alone: it raises before reaching another backend.
EXPECTED_DIFFER = r"monitored_barrier"
# A cheap subset (--select smoke, ~20 s): one or two tests of each kind of
# operation, async work and DDP included, for a quick check while developing.
SMOKE = (
    "test_all_reduce_sum",
    "test_all_reduce_sum_async",
    "test_all_reduce_coalesced_sum",
    "test_all_reduce_complex_unsupported_ops",
    "test_broadcast",
    "test_reduce_sum",
    "test_all_gather",
    "test_all_gather_coalesced_simple",
    "test_gather",
    "test_scatter",
    "test_all_to_all_single_equal_split",
    "test_all_to_all_single_unequal_split",
    "test_send_recv",
    "test_send_recv_any_source",
    "test_isend",
    "test_irecv",
    "test_batch_isend_irecv_gloo",
    "test_barrier",
    "test_barrier_timeout_global",
    "test_all_gather_object_default_pg",
    "test_scatter_object_list",
    "test_get_future",
    "test_sparse_all_reduce_sum",
    "test_destroy_group",
    "test_grads_same_across_ranks_with_no_sync",
    "test_static_graph_api_cpu",
)


def suite_tests() -> list[str]:
    """The names of the suite's tests (importing it needs BACKEND and WORLD_SIZE set)."""
    env = dict(os.environ, BACKEND="gloo", WORLD_SIZE="2")
    code = (
        "import torch.testing._internal.distributed.distributed_test as m\n"
        "print('\\n'.join(sorted(n for n in dir(m.DistributedTest._DistTestBase)"
        " if n.startswith('test_'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True
    )
    return out.stdout.split()


def select_tests(names: Iterable[str], select: str, pattern: str | None) -> list[str]:
    """``all``; ``subgroup``: the tests on groups that need not span every rank; ``smoke``."""
    chosen = list(names)
    if select == "smoke":
        missing = sorted(set(SMOKE) - set(chosen))
        if missing:  # a torch upgrade renamed them: say so rather than test less
            raise SystemExit(f"the smoke tests {missing} are not in this torch's suite")
        chosen = [n for n in chosen if n in SMOKE]
    if select == "subgroup":
        chosen = [n for n in chosen if "group" in n and "full_group" not in n]
    if pattern:
        chosen = [n for n in chosen if re.search(pattern, n)]
    return chosen


def merge_ranks(per_rank: Sequence[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """One outcome per test from every rank's: fail if any failed, else skip if any skipped."""
    merged: dict[str, dict[str, Any]] = {}
    tests = {t for outcomes in per_rank for t in outcomes}
    for test in tests:
        seen = [outcomes[test] for outcomes in per_rank if test in outcomes]
        fails = [o for o in seen if o["event"] != "pass" and o["event"] != "skip"]
        if fails or len(seen) < len(per_rank):
            detail = fails[0]["detail"] if fails else "a rank recorded no outcome"
            merged[test] = {"event": "fail", "detail": detail}
        elif any(o["event"] == "skip" for o in seen):
            merged[test] = {"event": "skip", "detail": seen[0]["detail"]}
        else:
            merged[test] = {"event": "pass", "detail": ""}
    return merged


def compare(
    control: dict[str, dict[str, Any]], tested: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """How many of the tests the control passes the tested backend passes, and which not."""
    baseline = sorted(t for t, o in control.items() if o["event"] == "pass")
    passed = [t for t in baseline if tested.get(t, {}).get("event") == "pass"]
    failed = {t: tested.get(t, {"event": "missing", "detail": ""}) for t in baseline}
    return {
        "control_passes": len(baseline),
        "passes": len(passed),
        "differ": {t: o for t, o in failed.items() if t not in passed},
    }


def regressions(result: dict[str, Any], expected: str) -> list[str]:
    """The tests the control passes and the tested backend does not, but for ``expected``."""
    return sorted(t for t in result["differ"] if not re.search(expected, t))


def _read_events(out: Path) -> list[dict[str, dict[str, Any]]]:
    per_rank = []
    for path in sorted(out.glob("rank*.jsonl")):
        outcomes: dict[str, dict[str, Any]] = {}
        for line in path.read_text().splitlines():
            event = json.loads(line)
            if event["event"] != "stuck-peer":
                outcomes[event["test"]] = event
        per_rank.append(outcomes)
    return per_rank


def _progress_mark(out: Path) -> int:
    return sum(p.stat().st_size for p in out.glob("rank*.jsonl"))


def run_backend(
    backend: str,
    tests: list[str],
    ranks: int,
    out: Path,
    driver_args: Sequence[str] = (),
    driver: Path = HERE / "driver.py",
) -> dict[str, Any]:
    """Runs ``tests`` on ``backend``; restarts the job after a test that ends it."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    remaining = list(tests)
    jobs = 0
    while remaining:
        jobs += 1
        list_file = out / f"tests-{jobs}.txt"
        list_file.write_text("\n".join(remaining) + "\n")
        log = (out / f"job-{jobs}.log").open("w")
        command = ["mpxrun", "-n", str(ranks), "--", sys.executable, str(driver)]
        command += ["--backend", backend, "--tests", str(list_file), "--out", str(out)]
        command += driver_args
        job = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        mark, last_change = _progress_mark(out), time.monotonic()
        while job.poll() is None:
            time.sleep(1.0)
            now_mark = _progress_mark(out)
            if now_mark != mark:
                mark, last_change = now_mark, time.monotonic()
            elif time.monotonic() - last_change > STALL_S:
                os.killpg(job.pid, signal.SIGTERM)
                try:
                    job.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(job.pid, signal.SIGKILL)
                    job.wait()
        log.close()
        per_rank = _read_events(out)
        finished = [t for t in remaining if all(_finished(o, t) for o in per_rank)]
        started = [t for t in remaining if any(t in o for o in per_rank)]
        # The first test some rank started but not every rank finished ended the job.
        unfinished = [t for t in started if t not in finished]
        if unfinished:
            culprit = unfinished[0]
            index = remaining.index(culprit)
            remaining = remaining[index + 1 :]
            _mark_failed(out, culprit, f"the job ended in this test (exit {job.returncode})")
        elif started:
            remaining = remaining[remaining.index(started[-1]) + 1 :]
        elif job.returncode != 0:
            raise SystemExit(f"{backend}: the job failed before any test; see {log.name}")
    return merge_ranks(_read_events(out))


def _finished(outcomes: dict[str, dict[str, Any]], test: str) -> bool:
    return test in outcomes and outcomes[test]["event"] != "start"


def _mark_failed(out: Path, test: str, why: str) -> None:
    with (out / "rank0.jsonl").open("a") as f:
        f.write(json.dumps({"test": test, "event": "fail", "detail": why}) + "\n")


def error_line(detail: str) -> str:
    """The exception's own line of a traceback (the last line naming an error)."""
    lines = [line.strip() for line in detail.strip().splitlines() if line.strip()]
    named = [line for line in lines if re.match(r"^[\w.]+(Error|Exception|Exit|Timeout)\b", line)]
    return named[-1] if named else (lines[-1] if lines else "")


def difference_lines(result: dict[str, Any], expected: str, control: str) -> list[str]:
    """One line per test the control passes and the tested backend does not.

    A test that ``expected`` names (torch's gloo-only ``monitored_barrier``)
    is reported as that, not as a failure: it is not one.
    """
    lines = []
    for test, outcome in sorted(result["differ"].items()):
        why = error_line(outcome.get("detail", ""))[:160]
        if re.search(expected, test):
            lines.append(f"  {control}-only {test}: torch implements it for {control} alone")
        else:
            lines.append(f"  {outcome['event']:5} {test}: {why}")
    return lines


def _summary_line(ranks: int, result: dict[str, Any], tested: str, control: str) -> str:
    return (
        f"{ranks} ranks: {tested} passes {result['passes']} of the "
        f"{result['control_passes']} tests that {control} passes"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--select", choices=["all", "subgroup", "smoke"], default="all")
    parser.add_argument("-k", dest="pattern", help="only tests whose name matches this regex")
    parser.add_argument("--backends", default="gloo,mpx", help="control first (default gloo,mpx)")
    parser.add_argument("--out", type=Path, default=Path("conformance-results"))
    parser.add_argument(
        "--expected-differ",
        default=EXPECTED_DIFFER,
        help=f"regex of tests that may differ from the control (default {EXPECTED_DIFFER!r})",
    )
    parser.add_argument(
        "--torch-files",
        choices=["sample", "none"],
        default="sample",
        help="after distributed_test.py, run_torch_files.py's fixed sample of torch's other "
        "test files (read from MPX_TORCH_TESTS; reported SKIPPED without it); not with "
        "--select subgroup",
    )
    args = parser.parse_args(argv)
    # Absolute: torch's suite makes file:// URLs of it, and a relative path there
    # reads as a host name (file://conformance-results/...): every rank waits forever.
    args.out = args.out.resolve()

    tests = select_tests(suite_tests(), args.select, args.pattern)
    backends = args.backends.split(",")
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for backend in backends:
        start = time.monotonic()
        # The subgroup tests need the suite's size gate lifted (see driver.py).
        extra = ["--lift-size-gate"] if args.select == "subgroup" else []
        results[backend] = run_backend(
            backend, tests, args.ranks, args.out / f"{backend}-{args.ranks}", extra
        )
        counts = {
            e: sum(o["event"] == e for o in results[backend].values())
            for e in ("pass", "skip", "fail")
        }
        seconds = time.monotonic() - start
        print(f"{backend}, {args.ranks} ranks, {len(tests)} tests: {counts} in {seconds:.0f} s")
        (args.out / f"{backend}-{args.ranks}.json").write_text(
            json.dumps(results[backend], indent=1, sort_keys=True)
        )
    if len(backends) < 2:
        return 0
    control, tested = backends[0], backends[1]
    result = compare(results[control], results[tested])
    (args.out / f"summary-{args.ranks}.json").write_text(
        json.dumps(result, indent=1, sort_keys=True)
    )
    print(_summary_line(args.ranks, result, tested, control))
    for line in difference_lines(result, args.expected_differ, control):
        print(line)
    regressed = regressions(result, args.expected_differ)
    if regressed:
        print(f"{tested} fails {len(regressed)} test(s) that {control} passes: {regressed}")
    files_status = 0
    if args.torch_files == "sample" and args.select != "subgroup":
        files_status = _torch_files().run_sample(args.ranks, args.out / "files")
    return 1 if regressed or files_status else 0


def _torch_files() -> Any:
    """run_torch_files.py, this folder's (a script, not an installed module)."""
    sys.path.insert(0, str(HERE))
    spec = importlib.util.spec_from_file_location("run_torch_files", HERE / "run_torch_files.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    sys.exit(main())
