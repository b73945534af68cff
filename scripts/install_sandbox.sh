#!/usr/bin/env bash
# bubblewrap (`bwrap`), the sandbox every graded submission runs in (grading/sandbox.py). Idempotent:
# does nothing when bwrap is already there. Without root it says how to install it; the grading tests
# then fail with that reason (autograde refuses to grade without a sandbox, unless --unsafe-no-sandbox).
set -u
if command -v bwrap >/dev/null 2>&1; then
    echo "install_sandbox: bubblewrap already installed ($(bwrap --version 2>/dev/null || echo bwrap))"
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "install_sandbox: bwrap not found and not running as root; nothing installed. Install it with:"
    echo "    sudo apt-get install -y bubblewrap        (Debian / Ubuntu; Fedora: sudo dnf install bubblewrap)"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_sandbox: bwrap not found and no apt-get here; install bubblewrap with your package manager."
    exit 0
fi
echo "install_sandbox: installing bubblewrap with apt-get ..."
export DEBIAN_FRONTEND=noninteractive
if apt-get install -y -qq bubblewrap >/tmp/install_sandbox.log 2>&1 \
        || (apt-get update -qq && apt-get install -y -qq bubblewrap >>/tmp/install_sandbox.log 2>&1); then
    echo "install_sandbox: installed $(bwrap --version 2>/dev/null || echo bubblewrap) (log: /tmp/install_sandbox.log)"
else
    echo "install_sandbox: apt-get install bubblewrap failed (see /tmp/install_sandbox.log)"
fi
exit 0
