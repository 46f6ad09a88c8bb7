#!/usr/bin/env bash
# The prepared accelerator check (`fullband bench gpu --size full`) as one device call: exactness of every decode mode
# and of --exact-states on CUDA, training tokens/s and MFU at d768 L12 T = 1024 and the paper's shape, decode tokens/s.
#
# The device machines have an older PyTorch and transformers and reach no package registry; the package needs
# transformers >= 5.24, so its wheel travels with the call in .whl/ (ignored by git, carried). Here, once:
#     pip download --no-deps -d .whl "transformers==$(python -c 'import transformers; print(transformers.__version__)')"
# Then the device call: command `bash benchmarks/gpu_check.sh`, carry [".whl"], timeout_s 600. The report lands in
# $OUT/gpu.json, rewritten after each section, so a run cut short keeps what it measured; nothing is installed into
# the image but the carried transformers wheel, and the package runs from src/.
set -euo pipefail
OUT="${OUT:-/tmp}"
if ! python -c "import sys, transformers as t; sys.exit(tuple(map(int, t.__version__.split('.')[:2])) < (5, 24))"; then
    pip install --quiet --no-index --no-deps .whl/transformers-*.whl
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/nvidia-smi.txt"
python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
PYTHONPATH=src timeout 540 python -c "import sys; from fullband.cli import main; sys.exit(main(sys.argv[1:]))" \
    bench gpu --device cuda --size full --out "$OUT/gpu.json"
