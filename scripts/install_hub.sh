#!/usr/bin/env bash
# What a class on JupyterHub needs (`make class`, tests/test_hub.py; grading/README.md, "A class on JupyterHub"):
# Node.js and npm (Debian's, when missing), the hub's proxy configurable-http-proxy from npm (global), and
# JupyterHub from PyPI into the project's venv (the `hub` extra of pyproject.toml; no torch of its own).
# Idempotent: installs only what is missing. Never fails the caller: without root it says how to install,
# and the hub test skips. PYTHON (default .venv/bin/python) is the venv's interpreter.
set -u
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
# configurable-http-proxy 5 needs Node 20 (its argument parser wants 22); 4.6 runs on Debian 12's Node 18.
CHP_NODE22=5.3.0
CHP_OLDER=4.6.3
log=/tmp/install_hub.log

have_chp() { command -v configurable-http-proxy >/dev/null 2>&1 && configurable-http-proxy --version >/dev/null 2>&1; }
hub_requirements() {
    "$PYTHON" - <<'EOF'
import re
text = open("pyproject.toml", encoding="utf-8").read()
try:
    import tomllib
    print(" ".join(tomllib.loads(text)["project"]["optional-dependencies"]["hub"]))
except ImportError:  # Python 3.10: the extra's quoted lines
    print(" ".join(re.findall(r'"([^"]+)"', re.search(r"^hub = \[(.*?)^\]", text, re.M | re.S).group(1))))
EOF
}

if [ ! -x "$PYTHON" ]; then
    echo "install_hub: no venv at $PYTHON (run \`make setup\` first); nothing installed."
    exit 0
fi
requirements=$(hub_requirements)
if "$PYTHON" -c 'import jupyterhub' 2>/dev/null && have_chp; then
    echo "install_hub: JupyterHub $("$PYTHON" -c 'import jupyterhub; print(jupyterhub.__version__)') and" \
         "configurable-http-proxy $(configurable-http-proxy --version) already installed"
    exit 0
fi

# JupyterHub into the venv (pip as the venv's owner needs no root).
if ! "$PYTHON" -c 'import jupyterhub' 2>/dev/null; then
    echo "install_hub: installing $requirements into the venv ..."
    if "$PYTHON" -m pip install --quiet $requirements >"$log" 2>&1; then
        echo "install_hub: installed $requirements"
    else
        echo "install_hub: pip install $requirements failed (see $log)"
    fi
fi

if have_chp; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "install_hub: configurable-http-proxy not found and not running as root; to install it:"
    echo "    sudo apt-get update && sudo apt-get install -y nodejs npm        (when node is missing)"
    echo "    sudo npm install -g configurable-http-proxy@$CHP_OLDER         (Node 22 and later: @$CHP_NODE22)"
    echo "install_hub: until then tests/test_hub.py is skipped and \`make class\` cannot start."
    exit 0
fi
if ! command -v npm >/dev/null 2>&1; then
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "install_hub: no npm and no apt-get here; install Node.js and npm with your package manager."
        exit 0
    fi
    echo "install_hub: installing Debian's nodejs and npm with apt-get (once) ..."
    export DEBIAN_FRONTEND=noninteractive
    if ! { apt-get update -qq && apt-get install -y -qq nodejs npm; } >>"$log" 2>&1; then
        echo "install_hub: apt-get install nodejs npm failed (see $log)"
        exit 0
    fi
fi
node_major=$(node -p 'process.versions.node.split(".")[0]' 2>/dev/null || echo 0)
chp_version=$CHP_OLDER
[ "$node_major" -ge 22 ] && chp_version=$CHP_NODE22
echo "install_hub: installing configurable-http-proxy@$chp_version with npm (Node $(node --version 2>/dev/null)) ..."
if npm install -g --no-fund --no-audit "configurable-http-proxy@$chp_version" >>"$log" 2>&1 && have_chp; then
    echo "install_hub: installed configurable-http-proxy $(configurable-http-proxy --version)" \
         "at $(command -v configurable-http-proxy)"
else
    echo "install_hub: npm install -g configurable-http-proxy failed (see $log)"
fi
exit 0
