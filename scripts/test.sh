#!/usr/bin/env bash
# Install what the tests need, then run them (tiny models built at test time; nothing downloaded).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec "${PYTHON:-python3}" -m pytest -q "$@"
