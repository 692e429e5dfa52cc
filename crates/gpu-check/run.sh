#!/usr/bin/env bash
# metrale's GPU check (docs/GPU-CHECK.md). Run it from anywhere:
#
#   tar xzf gpu-check.tar.gz -C /tmp && /tmp/gpu-check/run.sh
#
# Finds the CUDA libraries (the driver's libcuda.so.1, and cuBLASLt and the
# rest from the NVIDIA pip wheels inside a Python environment), puts them on
# LD_LIBRARY_PATH (cudarc dlopens them by name), runs bin/metrale-gpu-check
# (which also runs `metrale bench`) under a time limit, and exits non-zero
# when anything failed. Everything in under 5 minutes.
#
#   run.sh --find-libs   only find and print the libraries (exit 3 if some
#                        are missing)
#   run.sh ARGS...       extra ARGS go to metrale-gpu-check (e.g. --only parity/llama)
#
# Environment (mostly for testing this script):
#   GPU_CHECK_PYTHON          the python whose site-packages to search (default:
#                             python3 on PATH, then /opt/torch/.venv/bin/python3, python)
#   GPU_CHECK_SITE_PACKAGES   colon-separated site-packages dirs to search instead
#   GPU_CHECK_DRIVER_DIRS     colon-separated dirs to look for libcuda.so.1 in first
#   GPU_CHECK_NO_LDCONFIG=1   don't consult `ldconfig -p`
#   GPU_CHECK_TIMEOUT_S       the check program's hard limit (default 285)
#   GPU_CHECK_LOG             where to keep a copy of the output
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
START=$(date +%s)
say() { printf '%s\n' "$*"; }

# ---------------------------------------------------------------------------
# The libraries.

# Libraries cudarc (cuda-13000) loads by name: the driver and cuBLASLt are
# needed; the rest are reported for information.
REQUIRED_LIBS="libcuda.so.1 libcublasLt.so.13"
OPTIONAL_LIBS="libcublas.so.13 libnvrtc.so.13 libcudart.so.13"

site_dirs() {
    if [ -n "${GPU_CHECK_SITE_PACKAGES:-}" ]; then
        tr ':' '\n' <<<"$GPU_CHECK_SITE_PACKAGES"
        return
    fi
    local candidates=()
    if [ -n "${GPU_CHECK_PYTHON:-}" ]; then
        candidates=("$GPU_CHECK_PYTHON")
    else
        candidates=(python3 /opt/torch/.venv/bin/python3 python)
    fi
    local py
    for py in "${candidates[@]}"; do
        command -v "$py" >/dev/null 2>&1 || continue
        # site-packages, the user site and sys.path: wherever nvidia/ may be.
        "$py" - <<'EOF' 2>/dev/null
import site, sys
dirs = []
try:
    dirs += site.getsitepackages()
except Exception:
    pass
try:
    dirs.append(site.getusersitepackages())
except Exception:
    pass
dirs += [p for p in sys.path if p]
seen = set()
for d in dirs:
    if d not in seen:
        seen.add(d)
        print(d)
EOF
    done
    # In case no python runs: the usual virtual environment's folders.
    if [ -z "${GPU_CHECK_PYTHON:-}" ]; then
        compgen -G "/opt/torch/.venv/lib/python3*/site-packages" || true
    fi
}

# Every lib/ or lib64/ folder under <site>/nvidia/ holding a shared library:
# nvidia/cu13/lib (the CUDA 13 wheels), nvidia/cublas/lib, nvidia/cuda_nvrtc/lib...
nvidia_lib_dirs() {
    local sp
    while IFS= read -r sp; do
        [ -d "$sp/nvidia" ] || continue
        find "$sp/nvidia" -maxdepth 3 -type d \( -name lib -o -name lib64 \) 2>/dev/null | sort |
            while IFS= read -r d; do
                if compgen -G "$d/*.so*" >/dev/null; then printf '%s\n' "$d"; fi
            done
    done < <(site_dirs)
}

# Where libcuda.so.1 is: the driver dirs first (containers mount the host's
# driver at /usr/local/nvidia), then the loader's cache.
driver_dirs() {
    if [ -n "${GPU_CHECK_DRIVER_DIRS:-}" ]; then
        tr ':' '\n' <<<"$GPU_CHECK_DRIVER_DIRS"
        return
    fi
    printf '%s\n' /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/x86_64-linux-gnu \
        /usr/lib64 /usr/lib/wsl/lib /run/opengl-driver/lib
}

find_libs() {
    LIB_DIRS=()
    local d
    while IFS= read -r d; do
        [ -n "$d" ] && LIB_DIRS+=("$d")
    done < <(nvidia_lib_dirs)
    while IFS= read -r d; do
        if [ -n "$d" ] && [ -e "$d/libcuda.so.1" ]; then
            LIB_DIRS+=("$d")
            break
        fi
    done < <(driver_dirs)
    local joined=""
    for d in "${LIB_DIRS[@]}"; do
        case ":$joined:" in *":$d:"*) ;; *) joined="${joined:+$joined:}$d" ;; esac
    done
    export LD_LIBRARY_PATH="${joined}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

    say "== CUDA libraries"
    say "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    MISSING=0
    local lib where kind
    for lib in $REQUIRED_LIBS $OPTIONAL_LIBS; do
        where=""
        for d in "${LIB_DIRS[@]}"; do
            if [ -e "$d/$lib" ]; then where="$d/$lib"; break; fi
        done
        if [ -z "$where" ] && [ "${GPU_CHECK_NO_LDCONFIG:-0}" != 1 ] && command -v ldconfig >/dev/null 2>&1; then
            where="$(ldconfig -p 2>/dev/null | awk -v l="$lib" '$1 == l { print $NF; exit }')"
            [ -n "$where" ] && where="$where (loader cache)"
        fi
        case " $REQUIRED_LIBS " in *" $lib "*) kind=required ;; *) kind=optional ;; esac
        if [ -n "$where" ]; then
            say "found   $lib: $where"
        else
            say "MISSING $lib ($kind)"
            [ "$kind" = required ] && MISSING=1
        fi
    done
}

if [ "${1:-}" = "--find-libs" ]; then
    find_libs
    [ "$MISSING" = 0 ] || exit 3
    exit 0
fi

# ---------------------------------------------------------------------------
# The machine.

main() {
say "== metrale gpu-check bundle: $HERE"
[ -f "$HERE/BUILD-INFO" ] && sed 's/^/  /' "$HERE/BUILD-INFO"
say "host: $(uname -srm), $(nproc 2>/dev/null || echo '?') cores, $(. /etc/os-release 2>/dev/null && echo "$PRETTY_NAME")"
if command -v nvidia-smi >/dev/null 2>&1; then
    timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,compute_cap --format=csv 2>&1 | sed 's/^/  /'
else
    say "  (no nvidia-smi on PATH)"
fi
find_libs
if [ "$MISSING" != 0 ]; then
    say "WARNING: a required CUDA library is missing (see above); the device check will say why it cannot open the device"
fi

# ---------------------------------------------------------------------------
# The checks (the program runs `metrale bench` as its last check).

LIMIT="${GPU_CHECK_TIMEOUT_S:-285}"
BUDGET=$((LIMIT - 15))
say "== checks (time limit ${LIMIT} s)"
timeout -k 10 "$LIMIT" "$HERE/bin/metrale-gpu-check" \
    --fixtures "$HERE/fixtures" \
    --bench-config "$HERE/bench/llama-370m.json" \
    --bench-hybrid-config "$HERE/bench/granite-4.0-h-350m.json" \
    --metrale "$HERE/bin/metrale" \
    --budget-s "$BUDGET" "$@"
RC=$?
case "$RC" in
    0) ;;
    1) ;;
    124|137) say "FAIL gpu-check: the check program ran past ${LIMIT} s and was stopped (status $RC)" ;;
    *)
        say "FAIL gpu-check: the check program ended with status $RC (a crash?)"
        if [ "$RC" -gt 128 ]; then
            # It died before its own bench check: run the bench here.
            say "== metrale bench (after the crash)"
            timeout -k 5 90 "$HERE/bin/metrale" bench --config "$HERE/bench/llama-370m.json" \
                --device cuda --prompt-len 128 --gen-len 32
            say "(metrale bench: status $?)"
        fi
        ;;
esac
say "== done in $(( $(date +%s) - START )) s, status $RC; log: $LOG"
[ "$RC" = 0 ]
}

LOG="${GPU_CHECK_LOG:-/tmp/metrale-gpu-check-$(date +%Y%m%d-%H%M%S).log}"
main "$@" 2>&1 | tee -a "$LOG"
[ "${PIPESTATUS[0]}" = 0 ] || exit 1
exit 0
