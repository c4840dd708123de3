#!/usr/bin/env bash
# Debian's headless-capable Chromium (+ chromedriver) for tests/bench/test_bench.py (it loads report.html and
# screenshots it) and tests/serve/test_serve.py (selenium drives the service's web page).
# CI: add `bash bench/install_chromium.sh || echo "chromium not installed; the report-rendering test will skip"`
# to .ci/run before `make test`.
set -euo pipefail
if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
  echo "chromium already installed: $(/usr/bin/chromium --version 2>/dev/null || true)"
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends chromium chromium-driver fonts-dejavu-core >/dev/null
/usr/bin/chromium --version
