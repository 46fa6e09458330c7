#!/usr/bin/env bash
# The Debian package the browser tests use: chromium (tests/demo/test_demo_browser.py drives /usr/bin/chromium
# headless). Nothing else in the suite needs a Debian package: PyAV, decord and OpenCV carry their own FFmpeg.
# Needs root; skipped otherwise. Only chromium's dependencies, not its recommendations (fonts come with
# fontconfig's dependencies); the package lists are refreshed only when the install fails without a refresh.
set -uo pipefail
if command -v chromium >/dev/null 2>&1; then exit 0; fi
if [ "$(id -u)" != "0" ]; then
  echo "[system-deps] not root: cannot install chromium; the browser tests will be skipped" >&2
  exit 0
fi
install() {
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends -o Dpkg::Options::=--force-unsafe-io \
    -o Acquire::Retries=3 chromium
}
echo "[system-deps] installing chromium (apt, without recommended packages)"
if ! install >/dev/null 2>&1; then
  apt-get update -qq -o Acquire::Retries=3 >/dev/null 2>&1 && install >/dev/null 2>&1 \
    || { echo "[system-deps] apt-get failed: the browser tests will be skipped" >&2; exit 0; }
fi
echo "[system-deps] chromium installed: $(chromium --version 2>/dev/null || echo '?')"
exit 0
