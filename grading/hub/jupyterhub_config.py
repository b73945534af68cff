"""JupyterHub for a minillm class on one machine (`make class`; grading/README.md, "A class on JupyterHub").

Each account logs in with its Unix password (PAM) and gets its own Jupyter server, started as that Unix user
(LocalProcessSpawner), from the course's venv (the interpreter that runs this hub). The class itself, written by
``python -m grading.hub.classroom`` (accounts, exchange, the instructor's course), is read from the JSON file
``$MINILLM_CLASS`` (default /srv/minillm/hub/class.json):

    {"state": folder of the class-wide Jupyter config (jupyter/, every account reads it) and of the hub's
               database and cookie secret (hub/, root's alone),
     "instructor": "...", "students": [...], "port": 8000, "hub_port": 8081, "proxy_api_port": 8001}

The hub listens on 127.0.0.1 only: put a TLS-terminating reverse proxy (or JupyterHub's own ssl_key/ssl_cert
and a public bind_url) in front of it for a real class. ``$MINILLM_HUB_API_TOKEN``, when set, is the token of a
service that may start, stop and use every account's server (for scripts and tests/test_hub.py).
"""

import json
import os
import pwd
import shutil
import sys
from pathlib import Path

c = get_config()  # noqa: F821 (injected by traitlets when JupyterHub loads this file)

CLASS = json.loads(Path(os.environ.get("MINILLM_CLASS", "/srv/minillm/hub/class.json")).read_text())
STATE = Path(CLASS["state"])
PRIVATE = STATE / "hub"  # root's alone: database, cookie secret, proxy pid file
PRIVATE.mkdir(mode=0o700, parents=True, exist_ok=True)
VENV_BIN = Path(sys.executable).parent  # the course's venv: jupyterhub-singleuser, nbgrader, python

# --- the hub and its proxy, on the loopback only
c.JupyterHub.bind_url = f"http://127.0.0.1:{int(CLASS['port'])}"
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.hub_port = int(CLASS.get("hub_port", 8081))
c.ConfigurableHTTPProxy.api_url = f"http://127.0.0.1:{int(CLASS.get('proxy_api_port', 8001))}"
c.ConfigurableHTTPProxy.command = [shutil.which("configurable-http-proxy") or "configurable-http-proxy"]
c.ConfigurableHTTPProxy.pid_file = str(PRIVATE / "jupyterhub-proxy.pid")
c.JupyterHub.db_url = "sqlite:///" + str(PRIVATE / "jupyterhub.sqlite")
c.JupyterHub.cookie_secret_file = str(PRIVATE / "jupyterhub_cookie_secret")
c.JupyterHub.cleanup_servers = True  # stopping the hub stops every account's server

# --- who logs in: the class's Unix accounts, with their passwords. The instructor is no hub admin (an admin
# could open the students' servers); the formgrader runs in the instructor's own server.
c.JupyterHub.authenticator_class = "pam"
c.Authenticator.allowed_users = {CLASS["instructor"], *CLASS["students"]}
c.PAMAuthenticator.open_sessions = False

# --- each account's server: its own Unix user, its home as the root, JupyterLab, the course's venv first on PATH
# (nbgrader creates a gradebook through the `alembic` script), and the class-wide Jupyter config: nbgrader's
# exchange and course id, the formgrader off (the instructor turns it on in ~/.jupyter).
c.JupyterHub.spawner_class = "jupyterhub.spawner.LocalProcessSpawner"
c.Spawner.cmd = [str(VENV_BIN / "jupyterhub-singleuser")]
c.Spawner.notebook_dir = "~"
c.Spawner.default_url = "/lab"


def jupyter_config_path(spawner) -> str:
    """The class-wide Jupyter config for every server. JUPYTER_CONFIG_PATH outranks ~/.jupyter, so the
    instructor's own ~/.jupyter (the formgrader on, the course's nbgrader config) goes first on theirs."""
    folders = [str(STATE / "jupyter")]
    if spawner.user.name == CLASS["instructor"]:
        folders.insert(0, os.path.join(pwd.getpwnam(spawner.user.name).pw_dir, ".jupyter"))
    return os.pathsep.join(folders)


c.Spawner.environment = {
    "PATH": os.pathsep.join([str(VENV_BIN), "/usr/local/bin", "/usr/bin", "/bin"]),
    "JUPYTER_CONFIG_PATH": jupyter_config_path,  # JupyterHub calls it with each account's spawner
}
c.Spawner.start_timeout = 300  # a server imports JupyterLab and nbgrader: slow on a busy 2-core machine
c.Spawner.http_timeout = 300

# --- an API token for scripts (tests/test_hub.py): start and use every account's server.
token = os.environ.get("MINILLM_HUB_API_TOKEN")
if token:
    c.JupyterHub.services = [{"name": "minillm-class-admin", "api_token": token}]
    c.JupyterHub.load_roles = [{
        "name": "minillm-class-admin",
        "scopes": ["admin:users", "admin:servers", "access:servers", "list:users", "read:users"],
        "services": ["minillm-class-admin"],
    }]
