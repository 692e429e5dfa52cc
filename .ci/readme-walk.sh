#!/usr/bin/env bash
# A newcomer's walk through the README: every command line of its ```sh
# blocks, run with the test build's binaries (target/debug) on the bundled
# default model, in a temporary directory, so that a README line that stops
# working fails CI. Placeholders are filled in (<dir> and <model-dir>: the
# bundled model; <shape>: the smallest bench shape; "prompt" as written;
# hub ids: the bundled model in a Hugging Face cache of the walk's own);
# `metrale serve` is started, queried by the README's curl line on a free
# port, and stopped. Lines that need what CI does not have are listed as
# skipped, each with its reason.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin="$root/target/debug"
[ -x "$bin/metrale" ] && [ -x "$bin/metrale-serve" ] || {
    echo "readme-walk: build first (cargo test --workspace --no-run)" >&2
    exit 1
}
work=$(mktemp -d)
server_pid=""
cleanup() {
    [ -n "$server_pid" ] && kill "$server_pid" 2>/dev/null && wait "$server_pid" 2>/dev/null
    rm -rf "$work"
}
trap cleanup EXIT
export PATH="$bin:$PATH" METRALE_CACHE_DIR="$work/cache" NO_COLOR=1
model="$root/models/default"
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
cd "$work"
echo "Once upon a time" > prompt.txt
echo '{"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}' > schema.json
# The hub ids the README names, in a Hugging Face cache of this walk's own
# (HF_HUB_CACHE), each a snapshot of the bundled model: the lookup runs as
# it does on a user's machine, without the network.
export HF_HUB_CACHE="$work/hub"
fake_hub() { # REPO REF
    local repo="$HF_HUB_CACHE/models--${1//\//--}" hash
    hash=$(printf '%s' "$1" | sha1sum | cut -c1-40)
    mkdir -p "$repo/refs" "$repo/snapshots/$hash"
    cp "$model"/*.json "$model"/*.safetensors "$repo/snapshots/$hash/"
    printf '%s' "$hash" > "$repo/refs/$2"
}
fake_hub Qwen/Qwen3-0.6B main
fake_hub org/name v1.0

# The README's command lines: continuation lines joined, comments dropped.
commands=$(awk '/^```sh/ { f = 1; next } /^```/ { f = 0 } f' "$root/README.md" |
    sed -e 's/[[:space:]]#[[:space:]].*$//' -e '/^[[:space:]]*#/d' |
    awk '{ if (sub(/\\$/, "")) { acc = acc $0; next } print acc $0; acc = "" }' |
    sed -e 's/[[:space:]]*$//' -e '/^$/d')

# skip_reason LINE: why CI does not run LINE (empty: it runs).
skip_reason() {
    case "$1" in
    "cargo test --workspace") echo "CI's own test step, just before this walk" ;;
    METRALE_CPU_KERNEL=dot*)
        grep -qw avx512_bf16 /proc/cpuinfo || echo "this CPU has no AVX512-BF16 (the dot kernel is refused)" ;;
    esac
}

failures=0
ran=0
run_line() {
    local line=$1 shown=$1 stdin=/dev/null
    line=${line//<model-dir>/$model}
    line=${line//<dir|org\/name>/$model}
    line=${line//<dir>/$model}
    line=${line//<shape>/tiny-hybrid}
    line=${line//benches\/configs/$root/benches/configs}
    line=${line//localhost:8000/127.0.0.1:$port}
    line=${line//cargo xtask/cargo --quiet xtask}
    line=${line/#curl /curl -sSf }
    # cargo runs in the repository; everything else here, so that what a
    # line writes (logits.safetensors, out.gguf) lands in the scratch dir.
    local dir=$work
    [[ "$line" == cargo* ]] && dir=$root
    case "$line" in
    # The run build has no cuda feature, the test build has: cargo run
    # would build the metrale crates again; the test build's binary runs
    # the same subcommand.
    "cargo run -p metrale -- generate"*) line="metrale generate${line#cargo run -p metrale -- generate}" ;;
    *"metrale chat"*) stdin="$work/chat-input" && printf 'Hello there\n/exit\n' > "$stdin" ;;
    esac
    if [[ "$line" == "metrale serve "* ]]; then
        # Its optional [..] groups dropped; started on a free port.
        line=$(echo "$line" | sed -e 's/ \[[^]]*\]//g')
        echo "--- $shown"
        echo "    (as: $line --port $port)"
        # exec: the job is the server itself, which SIGTERM stops gracefully.
        eval "exec $line --port $port" > "$work/serve.log" 2>&1 &
        server_pid=$!
        for _ in $(seq 1 300); do
            curl -sf "127.0.0.1:$port/health" > /dev/null 2>&1 && break
            sleep 0.1
        done
        return
    fi
    echo "--- $shown"
    [[ "$line" == "$shown" ]] || echo "    (as: $line)"
    local start=$SECONDS
    if (cd "$dir" && timeout 120 bash -c "$line") < "$stdin" > "$work/out" 2>&1; then
        echo "    ok ($((SECONDS - start)) s)"
    else
        echo "    FAILED ($((SECONDS - start)) s): $line"
        tail -n 15 "$work/out" | sed 's/^/    | /'
        failures=$((failures + 1))
    fi
    ran=$((ran + 1))
}

skipped=()
while IFS= read -r line; do
    reason=$(skip_reason "$line")
    if [ -n "$reason" ]; then
        skipped+=("$line  -- $reason")
        continue
    fi
    run_line "$line"
done <<< "$commands"

if [ -n "$server_pid" ]; then
    kill -TERM "$server_pid"
    if wait "$server_pid"; then echo "--- metrale serve: stopped cleanly"; else
        echo "--- metrale serve: FAILED to stop cleanly"
        tail -n 15 "$work/serve.log" | sed 's/^/    | /'
        failures=$((failures + 1))
    fi
    server_pid=""
fi
echo "=== README walk: $ran lines run, $failures failed, ${#skipped[@]} skipped:"
for s in "${skipped[@]}"; do echo "    skipped: $s"; done
[ "$failures" -eq 0 ]
