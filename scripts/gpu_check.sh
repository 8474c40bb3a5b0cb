#!/usr/bin/env bash
# trl_ext's first run on a GPU: one script, run from the repository root on a bare GPU machine with no network.
#
#   bash scripts/fetch_gpu_wheels.sh      # here, once: wheels + tokenizer into .gpu_wheels/ (gitignored)
#   bash scripts/gpu_check.sh             # there: device run with carry [".gpu_wheels"], timeout_s 420
#
# The machine's image already has CUDA torch 2.11, transformers 5.17, accelerate, peft, pytest and the rest of
# .library/device/KINDS.md's list; what it lacks travels in .gpu_wheels/ (see fetch_gpu_wheels.sh). The script
#   1. installs the carried wheels into a target folder ($SITE, on PYTHONPATH; --no-index --no-deps: nothing is
#      downloaded), checks every carried wheel's requirements against the image and installs a carried fallback
#      wheel (pyarrow) only where the image's own version does not satisfy them;
#   2. runs first the tests of what this project first ran for real on the CPU: QLoRA (tests/test_qlora.py: its
#      `gpu` test -- one 4-bit GRPO step on CUDA -- then its CPU tests with CUDA hidden: bitsandbytes' CPU backend
#      under the image's torch), then the vLLM tests (`pytest -m vllm`, once the suite declares that marker), all
#      in first_tests.xml; then the other tests marked `gpu` (tests/test_gpu.py: one bf16 step of each trl_ext
#      trainer, LoRA through the recipe's --use_peft with gradient checkpointing, checkpointing equality, trl_ext ==
#      upstream in fp32), with the embedded tokenizer's files from .gpu_wheels/tokenizer;
#   3. runs the memory/speed bench (scripts/gpu_bench.py: Qwen2.5-1.5B-shaped random model, LoRA r16 all-linear,
#      G=8, completions of 256 and 1024 tokens, trl_ext vs upstream TRL, QLoRA if bitsandbytes travelled) with the
#      time that is left.
# and writes, flat under $OUT (at most 8 files come back): gpu_check.log, environment.json, first_tests.xml,
# gpu_tests.xml, bench.json, bench.md, summary.json. Exit status: 0 when the tests passed (a run whose tests are
# all skipped, e.g. bitsandbytes did not travel, counts as passed) and the bench produced figures.
#
# Time budget (planned, not measured: no GPU has run this yet), BUDGET_S=360 in all:
#   install + requirement check    ~15 s   (pip unpacks ~50 MB of wheels; one python start for the check)
#   qlora + vllm tests             ~60 s   (hard limit QLORA_TIMEOUT_S=90 per pytest call, VLLM_TIMEOUT_S=90; no
#                                           vLLM travels today, so its tests skip; the CPU tests of test_qlora.py
#                                           took ~4 min on 2 loaded cores here, far less on the machine's 16: raise
#                                           QLORA_TIMEOUT_S for a GPU_CHECK_CPU=1 dry run)
#   gpu tests                      ~90 s   (hard limit TESTS_TIMEOUT_S=140; the recipe subprocess is ~30 s of it)
#   bench                          the rest, less 40 s of margin for its imports and the last run's overrun,
#                                  passed to gpu_bench.py --budget-s (it skips runs predicted not to fit); hard
#                                  limit: the rest of BUDGET_S
# so a device call with timeout_s 420 (7 min) ends with its files even if a stage hangs, and one rerun fits in a
# 15-minute device allowance together with two machine starts.
#
# Knobs: OUT (outputs/gpu_check when unset), WHEELS (.gpu_wheels), SITE (/tmp/trl_ext_site/site-packages),
# PYTHON (python3),
# BUDGET_S, TESTS_TIMEOUT_S, GPU_CHECK_CPU=1 (dry run on a machine without a GPU: the gpu tests on the CPU,
# the bench as `--device cpu --tiny`; checks the script itself, e.g. in an environment built like the image).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD

OUT=${OUT:-$ROOT/outputs/gpu_check}
WHEELS=$(cd "${WHEELS:-.gpu_wheels}" 2>/dev/null && pwd) || { echo "gpu_check.sh: no ${WHEELS:-.gpu_wheels}/ (run scripts/fetch_gpu_wheels.sh and carry it)" >&2; exit 2; }
# The folder's path must contain "site-packages": dill (which datasets uses to fingerprint tables) pickles a module
# by reference only when its file lies under sys.prefix or in a "site-packages" folder, and by value otherwise,
# which fails on pyarrow's types ("Can't pickle <class 'MonthDayNano'>"), so every Dataset.from_dict would.
SITE=${SITE:-/tmp/trl_ext_site/site-packages}
case "$SITE" in *site-packages*) ;; *) echo "gpu_check.sh: SITE=$SITE must contain 'site-packages' (see above)" >&2; exit 2 ;; esac
PYTHON=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-360}
TESTS_TIMEOUT_S=${TESTS_TIMEOUT_S:-140}
QLORA_TIMEOUT_S=${QLORA_TIMEOUT_S:-90}
VLLM_TIMEOUT_S=${VLLM_TIMEOUT_S:-90}
CPU_DRY_RUN=${GPU_CHECK_CPU:-0}

mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
t0=$(date +%s)
elapsed() { echo $(($(date +%s) - t0)); }
declare -A status seconds

export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export HF_HOME=${HF_HOME:-/tmp/trl_ext_hf} TRL_EXT_CACHE=${TRL_EXT_CACHE:-/tmp/trl_ext_cache}
export TRL_EXT_TEST_TOKENIZER_DIR="$WHEELS/tokenizer"

echo "== gpu_check.sh $(date -u +%FT%TZ), budget ${BUDGET_S} s, commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
if [ "$CPU_DRY_RUN" = 1 ]; then
    echo "GPU_CHECK_CPU=1: dry run on the CPU"
    export TRL_EXT_GPU_TESTS_ON_CPU=1
    bench_args=(--device cpu --tiny)
else
    if ! nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; then
        echo "gpu_check.sh: nvidia-smi failed: no NVIDIA GPU here (GPU_CHECK_CPU=1 for a CPU dry run)" >&2
        exit 2
    fi
    bench_args=(--device cuda)
fi

# ---- 1. install the carried wheels, check requirements, add fallbacks where the image falls short -------------
stage_start=$(date +%s)
rm -rf "$SITE"
mkdir -p "$SITE"
wheels=("$WHEELS"/required/*.whl)
[ -d "$WHEELS/optional" ] && wheels+=("$WHEELS"/optional/*.whl)
"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "${wheels[@]}"
install_rc=$?
"$PYTHON" - "$WHEELS" "$SITE" "$OUT/environment.json" <<'EOF'
"""Check the carried wheels' requirements against the image + $SITE; install fallback wheels that fix a shortfall;
write environment.json (versions, GPU, unmet requirements)."""
import glob, importlib.metadata as md, json, os, platform, subprocess, sys, zipfile
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

wheels_dir, site, out = sys.argv[1:4]

def installed():
    """name -> version of the distribution Python imports: the first on sys.path ($SITE comes before the image's)."""
    found = {}
    for d in md.distributions():
        if d.metadata["Name"]:
            found.setdefault(canonicalize_name(d.metadata["Name"]), d.version)
    return found

def requirements(wheel):
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    env = dict(default_environment(), extra="")
    reqs = [Requirement(l.split(":", 1)[1].strip()) for l in lines if l.startswith("Requires-Dist:")]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(env)]

def unmet(have):
    problems = []
    for wheel in sorted(glob.glob(f"{wheels_dir}/required/*.whl") + glob.glob(f"{wheels_dir}/optional/*.whl")):
        for req in requirements(wheel):
            version = have.get(canonicalize_name(req.name))
            if version is None or not req.specifier.contains(Version(version), prereleases=True):
                problems.append({"wheel": os.path.basename(wheel), "name": canonicalize_name(req.name), "requires": str(req), "found": version})
    return problems

have = installed()
problems = unmet(have)
fallbacks = {canonicalize_name(os.path.basename(w).split("-")[0]): w for w in glob.glob(f"{wheels_dir}/fallback/*.whl")}
used = sorted({p["name"] for p in problems} & set(fallbacks))
if used:
    print(f"installing fallback wheels for {used}", flush=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
                    "--target", site, *[fallbacks[n] for n in used]], check=True)
    have = installed()
    problems = unmet(have)
names = ["torch", "transformers", "accelerate", "peft", "trl", "datasets", "huggingface-hub", "tokenizers",
         "safetensors", "pyarrow", "pandas", "numpy", "fsspec", "dill", "multiprocess", "math-verify",
         "latex2sympy2-extended", "sympy", "gguf", "bitsandbytes", "liger-kernel", "triton", "pytest"]
env = {"python": platform.python_version(), "versions": {n: have.get(canonicalize_name(n)) for n in names},
       "fallback_wheels_installed": used, "unmet_requirements": problems}
try:
    import torch
    env["cuda_available"] = torch.cuda.is_available()
    env["torch_cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 1024**3, 1)
    env["flash_attn"] = __import__("importlib").util.find_spec("flash_attn") is not None
    env["vllm"] = __import__("importlib").util.find_spec("vllm") is not None
except Exception as error:
    env["torch_error"] = repr(error)
for module in ("trl", "datasets", "math_verify", "trl_ext", "bitsandbytes", "liger_kernel"):
    try:
        __import__(module)
        env.setdefault("imports", {})[module] = "ok"
    except Exception as error:
        env.setdefault("imports", {})[module] = f"{type(error).__name__}: {error}"
json.dump(env, open(out, "w"), indent=2)
print(json.dumps({k: env[k] for k in ("versions", "fallback_wheels_installed", "imports")}, indent=1))
for p in problems:
    print(f"UNMET: {p['wheel']} requires {p['requires']}, found {p['found']}")
EOF
check_rc=$?
status[install]=$(( install_rc || check_rc ))
seconds[install]=$(($(date +%s) - stage_start))
echo "== install + check: rc ${status[install]}, ${seconds[install]} s"

# ---- 2. QLoRA, then vLLM, then the other gpu-marked tests --------------------------------------------------------
# pytest exits 5 when every selected test was deselected or none exists: nothing failed.
passed() { [ "$1" = 0 ] || [ "$1" = 5 ]; }
JUNIT=$(mktemp -d)  # merged into $OUT/first_tests.xml below: at most 8 files come back from $OUT
stage_start=$(date +%s)
# the 4-bit step on CUDA, then bitsandbytes' CPU backend (CUDA hidden: those tests place the model on the CPU)
timeout --kill-after=10 "$QLORA_TIMEOUT_S" "$PYTHON" -m pytest tests/test_qlora.py -m gpu -p no:cacheprovider -q -rA \
    --junitxml="$JUNIT/qlora_gpu.xml" -W ignore::FutureWarning
qlora_rc=$?
if passed "$qlora_rc"; then
    CUDA_VISIBLE_DEVICES="" timeout --kill-after=10 "$QLORA_TIMEOUT_S" "$PYTHON" -m pytest tests/test_qlora.py \
        -m "not slow and not gpu" -p no:cacheprovider -q -rA --junitxml="$JUNIT/qlora_cpu.xml" \
        -W ignore::FutureWarning
    qlora_rc=$?
fi
passed "$qlora_rc" && status[qlora]=0 || status[qlora]=$qlora_rc
seconds[qlora]=$(($(date +%s) - stage_start))
echo "== qlora tests: rc ${status[qlora]}, ${seconds[qlora]} s"
stage_start=$(date +%s)
# the vLLM tests (marker `vllm`, written with vLLM's CPU build): run here once the suite declares the marker
if "$PYTHON" -m pytest --markers -p no:cacheprovider 2>/dev/null | grep -q "^@pytest.mark.vllm"; then
    timeout --kill-after=10 "$VLLM_TIMEOUT_S" "$PYTHON" -m pytest -m vllm -p no:cacheprovider -q -rA \
        --junitxml="$JUNIT/vllm.xml" -W ignore::FutureWarning
    vllm_rc=$?
    passed "$vllm_rc" && status[vllm]=0 || status[vllm]=$vllm_rc
else
    echo "== vllm tests: no 'vllm' marker declared in pyproject.toml; skipped"
    status[vllm]=0
fi
seconds[vllm]=$(($(date +%s) - stage_start))
echo "== vllm tests: rc ${status[vllm]}, ${seconds[vllm]} s"
"$PYTHON" - "$JUNIT" "$OUT/first_tests.xml" <<'EOF'
"""One JUnit file of the QLoRA (CUDA, CPU backend) and vLLM runs: their <testsuite> elements under one root."""
import glob, sys, xml.etree.ElementTree as ET
root = ET.Element("testsuites")
for path in sorted(glob.glob(f"{sys.argv[1]}/*.xml")):
    tree = ET.parse(path).getroot()
    for suite in ([tree] if tree.tag == "testsuite" else list(tree)):
        suite.set("name", path.rsplit("/", 1)[-1][:-4])
        root.append(suite)
ET.ElementTree(root).write(sys.argv[2], encoding="utf-8", xml_declaration=True)
EOF
stage_start=$(date +%s)
timeout --kill-after=10 "$TESTS_TIMEOUT_S" "$PYTHON" -m pytest tests/test_gpu.py -m gpu -p no:cacheprovider -q -rA \
    --junitxml="$OUT/gpu_tests.xml" -W ignore::FutureWarning
status[tests]=$?
seconds[tests]=$(($(date +%s) - stage_start))
echo "== gpu tests: rc ${status[tests]}, ${seconds[tests]} s"

# ---- 3. the bench, with what is left of the budget ----------------------------------------------------------------
stage_start=$(date +%s)
left=$((BUDGET_S - $(elapsed)))
bench_budget=$((left - 40))
if [ "$bench_budget" -lt 30 ]; then
    echo "== bench skipped: ${left} s left of ${BUDGET_S}"
    status[bench]=124
else
    timeout --kill-after=10 "$left" "$PYTHON" scripts/gpu_bench.py "${bench_args[@]}" --budget-s "$bench_budget" \
        --out "$OUT/bench.json"
    status[bench]=$?
fi
seconds[bench]=$(($(date +%s) - stage_start))
echo "== bench: rc ${status[bench]}, ${seconds[bench]} s"

total=$(elapsed)
cat >"$OUT/summary.json" <<EOF
{"install": {"rc": ${status[install]}, "s": ${seconds[install]}},
 "qlora": {"rc": ${status[qlora]}, "s": ${seconds[qlora]}},
 "vllm": {"rc": ${status[vllm]}, "s": ${seconds[vllm]}},
 "tests": {"rc": ${status[tests]}, "s": ${seconds[tests]}},
 "bench": {"rc": ${status[bench]}, "s": ${seconds[bench]}},
 "total_s": $total, "budget_s": $BUDGET_S, "cpu_dry_run": $([ "$CPU_DRY_RUN" = 1 ] && echo true || echo false)}
EOF
echo "== done in ${total} s of ${BUDGET_S}: install ${status[install]}, qlora ${status[qlora]}, vllm ${status[vllm]}," \
    "tests ${status[tests]}, bench ${status[bench]}"
[ "${status[qlora]}" = 0 ] && [ "${status[vllm]}" = 0 ] && [ "${status[tests]}" = 0 ] && [ "${status[bench]}" = 0 ]
