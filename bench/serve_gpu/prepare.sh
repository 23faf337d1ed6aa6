#!/usr/bin/env bash
# Here, before a device run: copy SmolLM2's config and tokenizer (not its weights) into
# .device_model/, a git-ignored folder that the device call carries.
set -euo pipefail
cd "$(dirname "$0")/../.."
src=${1:-.cache/test/smollm2-135m-fp32}
[ -f "$src/config.json" ] || { echo "no checkpoint at $src: run 'make test' once (it converts SmolLM2) or pass one" >&2; exit 1; }
rm -rf .device_model && mkdir .device_model
cp "$src"/config.json "$src"/generation_config.json "$src"/tokenizer.json "$src"/tokenizer_config.json .device_model/
[ -f "$src/chat_template.jinja" ] && cp "$src/chat_template.jinja" .device_model/
du -sh .device_model
