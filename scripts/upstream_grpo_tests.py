"""Run TRL's own tests/test_grpo_trainer.py as upstream and with trl_ext swapped in; print the tests whose outcome
differs (issue 39 item 2; docs/upstream_tests.md).

TRL's test file and its tests/testing_utils.py are not part of this repository (and not of TRL's wheel or sdist): the
script copies them from a TRL checkout into tests/upstream_trl/ (git-ignored), from ``--trl-source DIR`` (a TRL
checkout, or its tests/ folder) or else by cloning TRL's ``v1.16.0`` tag with git. tests/upstream_trl/conftest.py
makes the file's Hub models and datasets local stand-ins and, for the second run, binds the module's
``GRPOTrainer``/``GRPOConfig`` to trl_ext's. Both runs are single pytest processes run one after the other.

    uv run python scripts/upstream_grpo_tests.py [--trl-source DIR] [-k EXPR] [--out report.json]

Exit status: 0 when no test's outcome differs, 1 when some do, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "tests" / "upstream_trl"
FILES = ("test_grpo_trainer.py", "testing_utils.py")
TRL_REPO = "https://github.com/huggingface/trl"
TRL_TAG = "v1.16.0"


def vendor(source: Path | None) -> str:
    """Copy TRL's test files into tests/upstream_trl/; return where they came from."""
    if source is None:
        if all((TARGET / name).exists() for name in FILES):
            return f"{TARGET} (already there)"
        clone = Path(tempfile.mkdtemp(prefix="trl_clone_"))
        subprocess.run(
            ["git", "clone", "--quiet", "--depth", "1", "--branch", TRL_TAG, TRL_REPO, str(clone)], check=True
        )
        source = clone
    tests = source / "tests" if (source / "tests" / FILES[0]).exists() else source
    missing = [name for name in FILES if not (tests / name).exists()]
    if missing:
        raise SystemExit(f"error: --trl-source {source}: no {', '.join(missing)} there (nor under tests/)")
    for name in FILES:
        shutil.copyfile(tests / name, TARGET / name)
    return str(tests)


def outcomes(junit: Path) -> dict[str, str]:
    """test id -> passed / failed / error / skipped / xfailed, from pytest's JUnit XML."""
    result = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        test_id = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" else "error"
            elif child.tag == "skipped":
                outcome = "xfailed" if child.get("type") == "pytest.xfail" else "skipped"
        result[test_id] = outcome
    return result


def run(swap: bool, select: list[str], junit: Path) -> float:
    """One pytest run of the vendored file; returns its wall time in seconds."""
    env = dict(os.environ, TRL_EXT_UPSTREAM_TESTS="1", TRL_EXT_UPSTREAM_SWAP="1" if swap else "0")
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    command = [sys.executable, "-m", "pytest", str(TARGET / FILES[0]), "-q", "-p", "no:cacheprovider"]
    command += ["--junitxml", str(junit), "-o", "junit_family=xunit2", *select]
    start = time.monotonic()
    subprocess.run(command, cwd=ROOT, env=env)
    return time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trl-source", type=Path, help="a TRL checkout (or its tests/ folder) to copy the files from")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression: run only these tests (both runs)")
    parser.add_argument("--out", type=Path, help="write both runs' outcomes and the differences here (JSON)")
    args = parser.parse_args(argv)
    print(f"TRL test files from: {vendor(args.trl_source)}", flush=True)
    select = ["-k", args.keyword] if args.keyword else []
    with tempfile.TemporaryDirectory() as tmp:
        runs, seconds = {}, {}
        for name, swap in (("upstream", False), ("trl_ext", True)):
            junit = Path(tmp) / f"{name}.xml"
            seconds[name] = run(swap, select, junit)
            runs[name] = outcomes(junit)
    ids = sorted(set(runs["upstream"]) | set(runs["trl_ext"]))
    differ = {i: (runs["upstream"].get(i, "absent"), runs["trl_ext"].get(i, "absent")) for i in ids}
    differ = {i: pair for i, pair in differ.items() if pair[0] != pair[1]}
    for name in runs:
        counts = {}
        for outcome in runs[name].values():
            counts[outcome] = counts.get(outcome, 0) + 1
        print(f"{name}: {len(runs[name])} tests in {seconds[name]:.0f} s: {dict(sorted(counts.items()))}")
    print(f"{len(differ)} tests differ (upstream -> trl_ext):")
    for test_id, (upstream, ours) in differ.items():
        print(f"  {test_id}: {upstream} -> {ours}")
    if args.out:
        args.out.write_text(json.dumps({"seconds": seconds, "outcomes": runs, "differ": differ}, indent=1))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
