"""Mutation testing of the core modules with mutmut 3 (not part of CI; see docs/mutation.md).

Each target runs in its own scratch copy of the repository (jsgl/, tests/, pyproject.toml plus a generated
setup.cfg), so the working tree is never touched: mutmut writes its mutants under <copy>/mutants/.

    pip install 'mutmut>=3.8'
    python experiments/mutation.py                       # every target, 2 workers
    python experiments/mutation.py radix sampler -j 2    # some targets
    python experiments/mutation.py radix --show          # also print the diff of each survivor
"""

from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name: (module to mutate, fast test files); the tests run with -m "not slow".
TARGETS = {
    "radix": ("jsgl/radix/radix_cache.py", ["tests/test_radix_tree.py"]),
    "sampler": ("jsgl/engine/sampler.py", ["tests/test_sampler.py"]),
    "output_processor": ("jsgl/engine/output_processor.py", ["tests/test_output_processor.py"]),
    "scheduler": ("jsgl/engine/scheduler.py",
                  ["tests/test_scheduler_unit.py", "tests/test_scheduler_state_machine.py"]),
    "jump_forward": ("jsgl/fsm/jump_forward.py",
                     ["tests/test_fsm_index_unit.py", "tests/test_fsm.py", "tests/test_fsm_json.py"]),
    "token_index": ("jsgl/fsm/token_index.py",
                    ["tests/test_fsm_index_unit.py", "tests/test_fsm.py", "tests/test_fsm_json.py"]),
    "json_schema": ("jsgl/fsm/json_schema.py", ["tests/test_json_schema_unit.py"]),
    "streaming": ("jsgl/server/streaming.py", ["tests/test_streaming.py"]),
}

SETUP_CFG = """[mutmut]
source_paths=jsgl
only_mutate={module}
pytest_add_cli_args_test_selection={tests}
pytest_add_cli_args=-m
\tnot slow
\t-p
\tno:cacheprovider
\t-x
\t-q
# JAX caches traced functions per function object: a worker forked after the clean run would reuse the
# unmutated trace (mutmut's forced-fail check catches this), so fork from a server that never ran a test.
process_isolation=forkserver
forkserver_warmup=collect
timeout_multiplier=5
"""


def run_target(name: str, jobs: int, show: bool, workdir: Path,
               tests_override: list[str] | None = None) -> collections.Counter:
    module, tests = TARGETS[name]
    tests = tests_override or tests
    copy = workdir / name
    shutil.rmtree(copy, ignore_errors=True)
    copy.mkdir(parents=True)
    for part in ("jsgl", "tests", "pyproject.toml"):
        src = ROOT / part
        (shutil.copytree if src.is_dir() else shutil.copy)(src, copy / part)
    (copy / "setup.cfg").write_text(SETUP_CFG.format(module=module, tests="\n\t".join(tests)))
    subprocess.run(["mutmut", "run", "--max-children", str(jobs)], cwd=copy, check=False)
    out = subprocess.run(["mutmut", "results", "--all", "true"], cwd=copy, capture_output=True, text=True).stdout
    status = {}
    for line in out.splitlines():
        if ": " in line:
            mutant, state = line.strip().rsplit(": ", 1)
            status[mutant] = state
    counts = collections.Counter(status.values())
    print(f"\n== {name} ({module}): {len(status)} mutants, {dict(counts)}")
    for mutant, state in status.items():
        if state not in ("killed", "timeout"):
            print(f"   {state}: {mutant}")
            if show:
                diff = subprocess.run(["mutmut", "show", mutant], cwd=copy, capture_output=True, text=True).stdout
                print("".join(f"      {x}\n" for x in diff.splitlines() if x[:1] in "+-" and x[:3] not in
                              ("+++", "---")))
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("targets", nargs="*", metavar="TARGET", help=f"some of {', '.join(TARGETS)} (default: all)")
    parser.add_argument("-j", "--jobs", type=int, default=2, help="mutmut worker processes")
    parser.add_argument("--show", action="store_true", help="print each survivor's diff")
    parser.add_argument("--tests", nargs="+", metavar="FILE",
                        help="test files to run instead of the target's own (while writing new tests)")
    parser.add_argument("--workdir", type=Path, help="where the copies go (default: a temporary folder, kept)")
    args = parser.parse_args(argv)
    unknown = set(args.targets) - set(TARGETS)
    if unknown:
        parser.error(f"unknown targets {sorted(unknown)}; choose from {', '.join(TARGETS)}")
    if shutil.which("mutmut") is None:
        print("mutmut is not installed: pip install 'mutmut>=3.8'", file=sys.stderr)
        return 1
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="jsgl-mutation-"))
    print(f"copies under {workdir}")
    table = {name: run_target(name, args.jobs, args.show, workdir, args.tests) for name in (args.targets or TARGETS)}
    print("\n| module | total | killed | timeout | survived | other |")
    print("|---|---|---|---|---|---|")
    for name, c in table.items():
        other = sum(v for k, v in c.items() if k not in ("killed", "timeout", "survived"))
        print(f"| {TARGETS[name][0]} | {sum(c.values())} | {c['killed']} | {c['timeout']} | {c['survived']} "
              f"| {other} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
