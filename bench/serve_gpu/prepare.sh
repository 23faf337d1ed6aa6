#!/usr/bin/env bash
# Here, before a device run: copy SmolLM2's config and tokenizer (not its weights) into
# .device_model/, and download the wheels of what the GPU image lacks (pydantic, fastapi, uvicorn,
# compressed-tensors and their needs) into .whl/; both are git-ignored and the device call carries
# them. The versions are this venv's, for the image's Python 3.12.
set -euo pipefail
cd "$(dirname "$0")/../.."
src=${1:-.cache/test/smollm2-135m-fp32}
[ -f "$src/config.json" ] || { echo "no checkpoint at $src: run 'make test' once (it converts SmolLM2) or pass one" >&2; exit 1; }
rm -rf .device_model && mkdir .device_model
cp "$src"/config.json "$src"/generation_config.json "$src"/tokenizer.json "$src"/tokenizer_config.json .device_model/
[ -f "$src/chat_template.jinja" ] && cp "$src/chat_template.jinja" .device_model/
grep -qx '/.whl/' .git/info/exclude 2> /dev/null || echo '/.whl/' >> .git/info/exclude
pins=$(.venv/bin/python -m pip list --format=freeze 2> /dev/null | grep -iE \
  '^(compressed-tensors|pydantic|pydantic_core|annotated-types|typing-inspection|loguru|typing_extensions|fastapi|starlette|uvicorn|annotated-doc|opentelemetry-api)==')
rm -rf .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $pins
du -sh .device_model .whl
size=$(git ls-files -z | xargs -0 stat -c %s | awk '{s += $1} END {print int(s / 1048576)}')
echo "tracked files: $size MiB; with the two folders the call must stay under 64 MiB"
