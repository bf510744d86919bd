#!/usr/bin/env bash
# Every GPU check in one call: bench/gpu_checks/run.sh [--cpu-dry-run [--jobs N]] [--out DIR] [--time-limit S] [--only a,b]
#
# Runs the checks one after another (each in its own process, each with a time cap), keeps
# going past a failure, and writes summary.json, summary.md and logs/ to DIR (default: $OUT
# if set, else bench/results/gpu_<date>/). The total stays under --time-limit (default 540 s,
# at most 600). --cpu-dry-run runs the same scripts on the CPU with the device assertions
# skipped and listed as skipped (CI runs this, so the scripts cannot rot). Exit status 0 when
# every check passed or was skipped for a stated reason. See bench/gpu_checks/README.md.
set -uo pipefail
cd "$(dirname "$0")/../.."
limit=540
prev=""
for arg in "$@"; do
  case "$arg" in
    --time-limit=*) limit="${arg#--time-limit=}" ;;
  esac
  [[ "$prev" == "--time-limit" ]] && limit="$arg"
  prev="$arg"
done
python="${PYTHON:-$(command -v python || command -v python3)}"
# Backstop only: driver.py stops every check at its own deadline and writes the summary.
exec timeout --kill-after=15 "$(( ${limit%.*} + 60 ))" "$python" bench/gpu_checks/driver.py --python "$python" "$@"
