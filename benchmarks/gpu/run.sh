#!/bin/bash
# The GPU checks of docs/gpu.md, in one go, on a machine with a CUDA GPU and a CUDA
# torch (python3, or $PYTHON): builds multipy's C in place, then runs each step, its
# output in $OUT (default: gpu-results/).  STEPS picks steps (default: all of them, in
# this order):
#   info      multipy info, the machine and the build          -> machine.txt
#   gpu       tests/test_gpu.py                                 -> gpu-tests.txt
#   probe     benchmarks/gpu/probe.py, interpreters (hardware queues 8, then 32), then
#             processes                                         -> probe.json, probe.err
#   bench     multipy bench --device cuda: the Python-heavy model and ResNet-18 at batch
#             1 (n = 1, 8), ResNet-18 at batch 8 ($BATCHES) -> bench.txt, bench1/, bench8/
#   tests     the whole test suite (pytest-xdist, $TESTS_WORKERS processes, one a core by
#             default, a file's tests in one, as `make test` runs it)  -> tests.txt
#   serve     benchmarks/serve_load.py --device cuda: multipy serve beside the floor (and
#             KServe, where its python is given as $KSERVE_PYTHON), JSON clients, the
#             Python-heavy model and ResNet-18 ($SERVE_MODELS) at N = 2, 4, 8
#             ($SERVE_COUNTS)   -> serve.txt, serve.json (written after each N), serve.png
# Wheels in .whl/ (benchmarks/gpu/wheels.sh, carried along) are installed first: the
# serving stack and the tests' client into /tmp/site, KServe into /tmp/kserve-site (with
# $KSERVE_PYTHON, a python that finds it first).
#     OUT=/tmp/gpu STEPS="info probe" benchmarks/gpu/run.sh
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu-results}
STEPS=${STEPS:-info gpu probe bench tests serve}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
install() {  # the wheels in folder $1 into target $2
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$2" "$1"/*.whl
}
if ls .whl/serve/*.whl >/dev/null 2>&1 && install .whl/serve /tmp/site; then
    export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
if [ -z "${KSERVE_PYTHON:-}" ] && ls .whl/kserve/*.whl >/dev/null 2>&1 \
        && install .whl/kserve /tmp/kserve-site; then  # KServe's python: its own first
    printf '#!/bin/sh\nPYTHONPATH=/tmp/kserve-site:$PYTHONPATH exec %s "$@"\n' "$(command -v $PY)" \
        >/tmp/kserve-python && chmod +x /tmp/kserve-python && KSERVE_PYTHON=/tmp/kserve-python
fi
step() { case " $STEPS " in *" $1 "*) return 0;; esac; return 1; }
{
    git log -1 --format='commit %h %s' 2>/dev/null
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    $PY -c 'import sys, torch; print(sys.version); print("torch", torch.__version__, "CUDA", torch.version.cuda)'
    $PY setup.py build_ext --inplace -q 2>&1 | grep -iE "error|warning" || true
} >"$OUT/machine.txt" 2>&1
if step info; then
    $PY -m multipy info >>"$OUT/machine.txt" 2>&1
    tail -3 "$OUT/machine.txt"
fi
if step gpu; then
    timeout 200 $PY -m multipy run -m pytest -q -p no:cacheprovider tests/test_gpu.py >"$OUT/gpu-tests.txt" 2>&1
    echo "gpu tests: exit $?"; tail -15 "$OUT/gpu-tests.txt"
fi
if step probe; then
    { timeout 150 $PY -m multipy run benchmarks/gpu/probe.py --interpreters 8
      echo "probe, interpreters: exit $?"
      # 9 streams (8 interpreters' and the default) over the driver's 8 hardware queues by
      # default: with 32, does one context launch more? (docs/gpu.md, the 1.8x)
      CUDA_DEVICE_MAX_CONNECTIONS=32 timeout 150 $PY -m multipy run benchmarks/gpu/probe.py --interpreters 8
      echo "probe, interpreters, CUDA_DEVICE_MAX_CONNECTIONS=32: exit $?"
      timeout 150 $PY benchmarks/gpu/probe.py --processes 8
      echo "probe, processes: exit $?"; } >"$OUT/probe.json" 2>"$OUT/probe.err"
    grep -v '^   ' "$OUT/probe.json" | tail -25; tail -5 "$OUT/probe.err"
fi
if step bench; then
    common="--device cuda --strategies one_python,multi_python,threads,processes --threads 1,8 --duration 2 --warm-up 0.5 --no-plot"
    for batch in ${BATCHES:-1 8}; do
        models=python_heavy,resnet; [ "$batch" = 1 ] || models=resnet
        timeout 200 $PY -m multipy bench $common --models $models --batch $batch --out "$OUT/bench$batch"
        echo "bench batch $batch: exit $?"
    done >"$OUT/bench.txt" 2>&1
    grep -v "━\|─" "$OUT/bench.txt" | tail -60
fi
if step tests; then
    timeout ${TESTS_TIMEOUT:-300} $PY -m multipy run -m pytest -v -rfE -n ${TESTS_WORKERS:-$(nproc)} \
        --dist loadfile -p no:cacheprovider tests >"$OUT/tests.txt" 2>&1
    echo "tests: exit $?"; grep -E "FAILED|ERROR" "$OUT/tests.txt" | head -20; tail -3 "$OUT/tests.txt"
fi
if step serve; then
    peers=floor; [ -n "${KSERVE_PYTHON:-}" ] && peers=floor,kserve
    timeout ${SERVE_TIMEOUT:-420} $PY -m multipy run benchmarks/serve_load.py --device cuda \
        --models ${SERVE_MODELS:-python_heavy,resnet} --counts ${SERVE_COUNTS:-2,4,8} \
        --transports json --peers $peers ${KSERVE_PYTHON:+--peer-python $KSERVE_PYTHON} \
        --seconds ${SERVE_SECONDS:-5} --warm-up 2 --rounds 1 --json "$OUT/serve.json" \
        --plot "$OUT/serve.png" >"$OUT/serve.txt" 2>&1
    echo "serve: exit $?"; tail -40 "$OUT/serve.txt"
fi
