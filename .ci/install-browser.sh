#!/usr/bin/env bash
# Debian's Chromium for the browser tests (Playwright drives it; no browser download).
# Skips with a clear message where apt is unavailable; the browser tests then skip too.
if [ -x /usr/bin/chromium ]; then exit 0; fi
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
    || echo "setup: could not install Debian's chromium; browser tests will be skipped"
else
  echo "setup: apt-get unavailable (or not root); install chromium at /usr/bin/chromium to run the browser tests"
fi
exit 0
