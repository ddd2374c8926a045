#!/usr/bin/env bash
# The install round trip (docs/install.md), as a user gets moe-comm: each step in fresh venvs under WORKDIR
# (default: a new temporary folder, removed after a run that passed), from a clean copy of this checkout
# (the files git tracks or would track, uncommitted changes included; no build outputs, no .venv):
#
#   a  pip install .            build isolation on, the venv's own pip: _C, _cuda_host and, where nvcc
#                               is, _cuda; _cuda_nvshmem missing, and build_info() says why; the 2-rank check
#   b  pip wheel .              (newest pip), then that wheel into another fresh venv: the build as in a,
#                               and a 2-rank low-latency dispatch/combine (tools/install_check_ll.py)
#   c  python -m build --sdist  then the sdist into a fresh venv, the same checks; where nvcc is, built
#                               with the NVSHMEM switch (MOE_COMM_NVSHMEM_WHEEL=cu13, extra [cu13]):
#                               _cuda_nvshmem built in the isolated build, and it loads
#   d  no nvcc                  pip install . with nvcc out of reach (PATH without it, CUDACXX unset,
#                               CMAKE_IGNORE_PATH over the folders that hold it): a CPU-only build whose
#                               build_info() says "nvcc not found", and the 2-rank check
#
# One PASS/FAIL line per step with its time; exits 1 if any step failed (its log is then kept and its end
# printed). torch is pinned (TORCH_SPEC) in every venv, and a constraints file pins it for pip and for
# isolated builds, so nothing fetches another torch.
#   tools/install_check.sh [WORKDIR]        (PYTHON=python3, TORCH_SPEC=torch==2.13.0, STEPS="a b c d")
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
STEPS=${STEPS:-a b c d}
if [ $# -ge 1 ]; then
  WORK=$(mkdir -p "$1" && cd "$1" && pwd)
  KEEP=1
else
  WORK=$(mktemp -d -t moe-comm-install-check.XXXXXX)
  KEEP=${KEEP:-0}
fi
LOGS=$WORK/logs
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1

# torch for every pip here (PIP_CONSTRAINT) and for isolated build environments: pip 23-25 pass
# PIP_CONSTRAINT on to them, pip 26 only build constraints (PIP_BUILD_CONSTRAINT). moe-comm's build
# requirements name no torch; this keeps it so if one ever pulls torch in.
printf '%s\n' "$TORCH_SPEC" >"$WORK/constraints.txt"
export PIP_CONSTRAINT=$WORK/constraints.txt PIP_BUILD_CONSTRAINT=$WORK/constraints.txt

# Where nvcc is: the folders a build would find it in (PATH, the toolkit's default place, CUDA_PATH),
# and the real folders behind them.
NVCC_DIRS=()
add_dir() { [[ " ${NVCC_DIRS[*]:-} " == *" $1 "* ]] || NVCC_DIRS+=("$1"); }
add_nvcc_dir() { if [ -x "$1/nvcc" ]; then add_dir "$1"; add_dir "$(dirname "$(readlink -f "$1/nvcc")")"; fi; }
IFS=: read -r -a PATH_DIRS <<<"$PATH"
for d in "${PATH_DIRS[@]}" /usr/local/cuda/bin ${CUDA_PATH:+"$CUDA_PATH/bin"}; do add_nvcc_dir "$d"; done
if [ -n "${CUDACXX:-}" ] || [ ${#NVCC_DIRS[@]} -gt 0 ]; then HAVE_NVCC=1; else HAVE_NVCC=0; fi
# what each install must hold, and what it must say is missing
if [ $HAVE_NVCC = 1 ]; then BUILT=cuda_host,cuda; else BUILT=cuda_host; fi
if [ $HAVE_NVCC = 1 ]; then NVSHMEM_BUILT=cuda_host,cuda,cuda_nvshmem; else NVSHMEM_BUILT=$BUILT; fi
MISSING=cuda_nvshmem
[ $HAVE_NVCC = 1 ] || MISSING=cuda,cuda_nvshmem

CHECK=$WORK/install_check_ll.py
cp "$ROOT/tools/install_check_ll.py" "$CHECK"

# copy_source DEST: the checkout's files as git sees them (tracked, and untracked but not ignored; not
# those deleted in the work tree)
copy_source() {
  mkdir -p "$1"
  (cd "$ROOT" && git ls-files -z -co --exclude-standard |
     while IFS= read -r -d '' f; do if [ -e "$f" ] || [ -L "$f" ]; then printf '%s\0' "$f"; fi; done |
     tar --null -T - -cf -) | tar -xf - -C "$1"
}

# new_venv DIR [latest]: a venv with the pip it comes with (or the newest pip) and torch
new_venv() {
  "$PYTHON" -m venv "$1"
  if [ "${2:-}" = latest ]; then "$1/bin/python" -m pip install -q --upgrade pip; fi
  "$1/bin/python" -m pip install -q "$TORCH_SPEC"
}

# check VENV ARGS...: tools/install_check_ll.py in VENV, from outside any source tree
check() {
  local venv=$1
  shift
  (cd "$WORK" && "$venv/bin/python" "$CHECK" "$@")
}

step_a() {
  new_venv "$WORK/venv-a"
  copy_source "$WORK/src-a"
  (cd "$WORK/src-a" && "$WORK/venv-a/bin/python" -m pip install -v .)
  check "$WORK/venv-a" --built "$BUILT" --missing "$MISSING"
}

step_b() {
  "$PYTHON" -m venv "$WORK/venv-b-build"
  "$WORK/venv-b-build/bin/python" -m pip install -q --upgrade pip
  copy_source "$WORK/src-b"
  (cd "$WORK/src-b" && "$WORK/venv-b-build/bin/python" -m pip wheel -v --no-deps -w "$WORK/wheelhouse" .)
  local wheels=("$WORK"/wheelhouse/moe_comm-*.whl)
  [ ${#wheels[@]} = 1 ] && [ -f "${wheels[0]}" ] || { echo "expected one moe_comm wheel, got: ${wheels[*]}"; return 1; }
  echo "wheel: ${wheels[0]} ($(du -h "${wheels[0]}" | cut -f1))"
  new_venv "$WORK/venv-b" latest
  "$WORK/venv-b/bin/python" -m pip install "${wheels[0]}"
  check "$WORK/venv-b" --built "$BUILT" --missing "$MISSING"
}

step_c() {
  "$PYTHON" -m venv "$WORK/venv-c-build"
  "$WORK/venv-c-build/bin/python" -m pip install -q --upgrade pip build
  copy_source "$WORK/src-c"
  "$WORK/venv-c-build/bin/python" -m build --sdist --outdir "$WORK/sdist" "$WORK/src-c"
  local sdists=("$WORK"/sdist/moe_comm-*.tar.gz)
  [ ${#sdists[@]} = 1 ] && [ -f "${sdists[0]}" ] || { echo "expected one moe_comm sdist, got: ${sdists[*]}"; return 1; }
  echo "sdist: ${sdists[0]} ($(du -h "${sdists[0]}" | cut -f1))"
  new_venv "$WORK/venv-c" latest
  if [ $HAVE_NVCC = 1 ]; then
    (cd "$WORK" && MOE_COMM_NVSHMEM_WHEEL=cu13 "$WORK/venv-c/bin/python" -m pip install -v "${sdists[0]}[cu13]")
    check "$WORK/venv-c" --built "$NVSHMEM_BUILT"
  else
    (cd "$WORK" && "$WORK/venv-c/bin/python" -m pip install -v "${sdists[0]}")
    check "$WORK/venv-c" --built "$BUILT" --missing "$MISSING"
  fi
}

step_d() {
  new_venv "$WORK/venv-d"
  copy_source "$WORK/src-d"
  local path="" d ignore
  for d in "${PATH_DIRS[@]}"; do [ -x "$d/nvcc" ] || path=${path:+$path:}$d; done
  ignore=$(IFS=';'; echo "${NVCC_DIRS[*]:-}")
  echo "PATH=$path"
  echo "CMAKE_IGNORE_PATH=$ignore"
  (cd "$WORK/src-d" && env -u CUDACXX -u CUDA_PATH -u CUDA_HOME PATH="$path" \
     "$WORK/venv-d/bin/python" -m pip install -v . -C "cmake.define.CMAKE_IGNORE_PATH=$ignore")
  check "$WORK/venv-d" --built cuda_host --missing cuda,cuda_nvshmem --reason-has "nvcc not found"
}

describe() {
  case $1 in
    a) echo "a: pip install . (build isolation) builds _C, _cuda_host$([ $HAVE_NVCC = 1 ] && echo ', _cuda'), 2-rank check" ;;
    b) echo "b: pip wheel . -> wheel in a fresh venv, 2-rank low-latency dispatch/combine" ;;
    c) echo "c: python -m build --sdist -> sdist in a fresh venv$([ $HAVE_NVCC = 1 ] && echo ' with MOE_COMM_NVSHMEM_WHEEL=cu13'), 2-rank check" ;;
    d) echo "d: no nvcc: CPU-only build, build_info says why, 2-rank check" ;;
  esac
}

echo "install check: $ROOT -> $WORK ($("$PYTHON" --version), $TORCH_SPEC, nvcc: $([ $HAVE_NVCC = 1 ] && echo "${NVCC_DIRS[*]:-$CUDACXX}" || echo none))"
failed=0
total_start=$SECONDS
for s in $STEPS; do
  start=$SECONDS
  # a plain command, not an if's condition, so that set -e inside the step stops it at its first failure
  set +e
  ( set -euo pipefail; "step_$s" ) >"$LOGS/$s.log" 2>&1
  rc=$?
  set -e
  if [ $rc = 0 ]; then
    printf 'PASS %-95s %4d s\n' "$(describe "$s")" $((SECONDS - start))
    grep -E "^(build_info|[a-z_]+ not built|portable|cuda_host|wheel|sdist):" "$LOGS/$s.log" | cut -c1-400 | sed 's/^/     /'
  else
    failed=1
    printf 'FAIL %-95s %4d s (log: %s)\n' "$(describe "$s")" $((SECONDS - start)) "$LOGS/$s.log"
    tail -n 40 "$LOGS/$s.log" | sed 's/^/     /'
  fi
done
echo "install check: $([ $failed = 0 ] && echo passed || echo FAILED) in $((SECONDS - total_start)) s"
if [ $failed = 0 ] && [ "$KEEP" = 0 ]; then rm -rf "$WORK"; fi
exit $failed
