"""`python -m bench`: run every benchmark on this machine and write docs/benchmarks.md.

Not part of the test run. `--only NAME` runs one group and prints its figures (writing the file only
when `--out` is given too).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench import (
    api,
    archive,
    failover,
    ingestion,
    kubernetes,
    load,
    memory,
    overhead,
    remote,
    replication,
    report,
    scale,
    scaling,
    stack,
    timeline,
    tuners,
    versus_nni,
)
from bench.harness import REPO, Section, machine_description

GROUPS: dict[str, Callable[[Path, int], Section | list[Section]]] = {
    "overhead": overhead.run,
    "nni": versus_nni.run,
    "ingestion": ingestion.run,
    "scale": scale.run,
    "scaling": scaling.run,
    "tuners": tuners.run,
    "remote": remote.run,
    "api": api.run,
    "stack": stack.run,
    "kubernetes": kubernetes.run,
    "failover": failover.run,
    "replication": replication.run,
    "timeline": timeline.run,
    "load": load.run,
    "archive": archive.run,
    "memory": memory.run,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs per figure, whose median is reported (default 3)")
    parser.add_argument("--nni-runs", type=int, default=2, help="runs of the NNI comparison, ~75 s each (default 2)")
    parser.add_argument("--only", choices=sorted(GROUPS), help="run one group of benchmarks")
    parser.add_argument("--out", type=Path, help="where to write the report (default docs/benchmarks.md)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory (logs, Redis data)")
    args = parser.parse_args(argv)

    out = args.out or (None if args.only else REPO / "docs" / "benchmarks.md")
    root = Path(tempfile.mkdtemp(prefix="trialstream-bench-"))
    started = time.perf_counter()
    sections: list[Section] = []
    try:
        for name, run in GROUPS.items():
            if args.only and name != args.only:
                continue
            print(f"== {name}", flush=True)
            group_started = time.perf_counter()
            result = run(root / name, args.nni_runs if name == "nni" else args.runs)
            sections += result if isinstance(result, list) else [result]
            print(f"== {name}: {time.perf_counter() - group_started:.0f} s", flush=True)
    finally:
        if args.keep:
            print(f"scratch directory kept: {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    elapsed = time.perf_counter() - started
    command = "python -m bench" + "".join(f" {arg}" for arg in (argv if argv is not None else sys.argv[1:]))
    if out is not None:
        report.write(out, report.render(sections, machine_description(), args.runs, elapsed, command))
        print(f"wrote {out} ({elapsed / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
