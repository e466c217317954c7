#!/usr/bin/env bash
# Debian's Chromium for the browser tests (Playwright drives it; no browser download).
# Fails, with the reason, when it is missing and cannot be installed: `make test` runs this (`make browser`) and the browser
# tests and must not pass without them (`make test-fast` leaves them out).
set -uo pipefail
CHROMIUM=/usr/bin/chromium
if [ -x "$CHROMIUM" ]; then exit 0; fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "setup: $CHROMIUM is missing and apt-get is unavailable: install Chromium there to run the browser tests" >&2
  exit 1
fi
if [ "$(id -u)" != 0 ]; then
  echo "setup: $CHROMIUM is missing; as root: apt-get install chromium (the browser tests need it)" >&2
  exit 1
fi
if ! (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null); then
  echo "setup: apt-get install chromium failed; the browser tests need $CHROMIUM" >&2
  exit 1
fi
if [ ! -x "$CHROMIUM" ]; then
  echo "setup: apt-get installed chromium but $CHROMIUM is not there" >&2
  exit 1
fi
"$CHROMIUM" --version
