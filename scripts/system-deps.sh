#!/usr/bin/env bash
# Debian packages for the video (ffmpeg) and browser (chromium) tests. Needs root; skipped otherwise.
set -uo pipefail
if command -v chromium >/dev/null 2>&1 && command -v ffmpeg >/dev/null 2>&1; then exit 0; fi
if [ "$(id -u)" != "0" ]; then
  echo "[system-deps] not root: cannot install chromium/ffmpeg; browser and ffmpeg tests will be skipped" >&2
  exit 0
fi
echo "[system-deps] installing chromium and ffmpeg (apt)"
apt-get update -qq >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium ffmpeg >/dev/null 2>&1 \
  || echo "[system-deps] apt-get failed: browser and ffmpeg tests will be skipped" >&2
exit 0
