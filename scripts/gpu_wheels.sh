# Sourced by scripts/gpu_check.sh and scripts/run_gpu_tests.sh: puts the wheels of .gpu_wheels/ (git-ignored) on
# PYTHONPATH where their package is not importable yet. A device call reaches no package registry, so torchao
# (--fp8-backend torchao; docs/fp8.md) travels as its wheel: put it there once, where a registry is reachable,
#
#     pip download --no-deps --dest .gpu_wheels torchao==0.18.0
#
# and name `.gpu_wheels` in the device call's carry. Each wheel is installed without its dependencies (torchao has
# none) and without an index into a temporary folder; nothing is downloaded on the device.
for wheel in .gpu_wheels/*.whl; do
  [ -e "$wheel" ] || continue
  package=$(basename "$wheel" | cut -d- -f1)
  if ! "${PYTHON:-python3}" -c "import $package" 2>/dev/null; then
    GPU_WHEELS_DIR=${GPU_WHEELS_DIR:-$(mktemp -d)}
    PIP_ROOT_USER_ACTION=ignore "${PYTHON:-python3}" -m pip install --quiet --disable-pip-version-check --no-deps \
      --no-index --target "$GPU_WHEELS_DIR" "$wheel"
    export PYTHONPATH="$GPU_WHEELS_DIR${PYTHONPATH:+:$PYTHONPATH}"
    echo "gpu_wheels: $(basename "$wheel") installed into $GPU_WHEELS_DIR (on PYTHONPATH)"
  fi
done
