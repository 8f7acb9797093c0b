#!/usr/bin/env bash
# Claude Code's first turn on a ~27k-token cold prompt, nothing configured on the client but the address, a
# dummy key and the model: all its tools plus a project CLAUDE.md of 529 convention lines, against
# `kvsession serve -m qwen2.5-coder-0.5b`. Prints the client's exit status and time, the server's trace line
# (prompt tokens, prefill rate, first-token time) and its request lines (one POST: no retry).
#
#   tools/claude_code_long_prompt.sh [DIR]      # needs `make setup`, Node.js, and Claude Code installed by
#                                               # `make test-agents` (~/.cache/kvsession/agents); ~5 minutes
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-$(mktemp -d)}"
claude="${KVSESSION_AGENTS_DIR:-$HOME/.cache/kvsession/agents}/node_modules/.bin/claude"
[ -x "$claude" ] || { echo "no Claude Code at $claude: run make test-agents first" >&2; exit 1; }
rm -rf "$dir/kv" "$dir/home" "$dir/project" "$dir/trace.jsonl"
mkdir -p "$dir/home" "$dir/project"
python3 - "$dir/project/CLAUDE.md" <<'PY'
import sys
lines = [f"- Rule {i}: files in module_{i % 37} keep their functions under {20 + i % 50} lines and name tests "
         f"test_{i}." for i in range(1, 530)]
open(sys.argv[1], "w").write("# Project conventions\n\n" + "\n".join(lines) + "\n")
PY
port=8027
.venv/bin/kvsession serve -m qwen2.5-coder-0.5b --kv-disk-dir "$dir/kv" --trace "$dir/trace.jsonl" --port $port \
    > "$dir/server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
for _ in $(seq 300); do curl -sf localhost:$port/health > /dev/null && break; sleep 1; done
start=$(date +%s)
set +e
(cd "$dir/project" && HOME="$dir/home" ANTHROPIC_BASE_URL=http://127.0.0.1:$port ANTHROPIC_API_KEY=dummy \
    timeout 1500 "$claude" --model qwen2.5-coder-0.5b -p "Say hello." --output-format json --max-turns 1 \
    < /dev/null > "$dir/out.json" 2> "$dir/err.txt")
echo "claude: exit status $?, $(( $(date +%s) - start )) s"
set -e
kill $server; wait $server || true
python3 - "$dir" <<'PY'
import json, sys
for line in open(f"{sys.argv[1]}/trace.jsonl"):
    d = json.loads(line)
    print({k: d.get(k) for k in ("source", "prompt_tokens", "prefill_tps", "first_token_ms", "finish_reason")})
print("reply:", json.load(open(f"{sys.argv[1]}/out.json")).get("result"))
PY
grep -E '"(POST|HEAD) ' "$dir/server.log"
