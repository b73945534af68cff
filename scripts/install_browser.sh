#!/usr/bin/env bash
# Debian chromium for the browser smoke test (tests/test_browser.py). Playwright drives it via
# executable_path=/usr/bin/chromium; `playwright install` (a browser download) is never used.
# Idempotent: does nothing when chromium is already there. Never fails the caller: without
# root and without chromium it says how to install it, and the browser test skips.
set -u
CHROMIUM=/usr/bin/chromium

if [ -x "$CHROMIUM" ]; then
    echo "install_browser: chromium already installed ($("$CHROMIUM" --version 2>/dev/null || echo "$CHROMIUM"))"
    exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
    echo "install_browser: $CHROMIUM not found and not running as root; nothing installed."
    echo "install_browser: to run the browser test, install it with:"
    echo "    sudo apt-get update && sudo apt-get install -y chromium"
    echo "install_browser: until then tests/test_browser.py is skipped."
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_browser: $CHROMIUM not found and no apt-get here; install Chromium with your"
    echo "install_browser: package manager at $CHROMIUM to run tests/test_browser.py (skipped until then)."
    exit 0
fi

echo "install_browser: installing Debian chromium with apt-get (a few minutes, once) ..."
export DEBIAN_FRONTEND=noninteractive
if apt-get update -qq && apt-get install -y -qq chromium >/tmp/install_browser.log 2>&1; then
    echo "install_browser: installed $("$CHROMIUM" --version 2>/dev/null || echo chromium) (log: /tmp/install_browser.log)"
else
    echo "install_browser: apt-get install chromium failed (see /tmp/install_browser.log); tests/test_browser.py will skip."
fi
exit 0
