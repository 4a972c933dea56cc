#!/usr/bin/env bash
# Set up .venv (the first time, and again whenever pyproject.toml changes), then run a task:
#   bash scripts/bootstrap.sh demo          # the main job: 2-rank comparison -> reports/latest/report.html
#   bash scripts/bootstrap.sh test [args]   # the test suite (what CI runs)
set -euo pipefail
cd "$(dirname "$0")/.."

usage="usage: bash scripts/bootstrap.sh {demo|test [pytest args...]}"
case "${1:-}" in demo|test) ;; *) echo "$usage" >&2; exit 2 ;; esac  # (before a minute of setup)

python=${PYTHON:-python3}
stamp=.venv/.portddp-setup
want=$(sha256sum pyproject.toml scripts/bootstrap.sh | sha256sum | cut -c1-16)
if [ ! -x .venv/bin/python ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "== setting up .venv: CPU PyTorch 2.13.0, JAX, MPICH + mpi4py, portddp (a minute or two) =="
  "$python" -m venv .venv
  # The pinned CPU build first: a bare torch requirement can resolve a CUDA build of several GB. Where pip
  # offers no CPU wheel of it (plain PyPI on Linux x86-64 serves the CUDA one), name PyTorch's CPU index:
  # PORTDDP_TORCH_INDEX=https://download.pytorch.org/whl/cpu bash scripts/bootstrap.sh ...
  .venv/bin/python -m pip install --quiet --disable-pip-version-check \
    ${PORTDDP_TORCH_INDEX:+--index-url "$PORTDDP_TORCH_INDEX"} torch==2.13.0
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[dev]'
  echo "$want" > "$stamp"
fi
export PATH="$PWD/.venv/bin:$PATH"

task=${1:-}
[ $# -gt 0 ] && shift
case "$task" in
  demo) portddp compare -n 2 --model gpt --steps 10 --dtype float64 --optimizer adamw
        portddp mixed -n 2
        # The overlap study on a 2-host emulated cluster, at the link rate where the gradients' wire time
        # equals the backward compute time (measured and printed first); on loopback where no cluster can be made.
        portddp run overlap -n 2 --hosts 2 --link matched --or-loopback -- --batch 2048
        portddp run bucket_sweep -n 2 --rounds 2 --steps-per-round 3
        exec portddp report --results results --out reports/latest ;;
  test) exec python -m pytest "$@" ;;
  *) echo "$usage" >&2; exit 2 ;;
esac
