"""A class on JupyterHub on one machine: :mod:`grading.hub.classroom` sets it up and starts the hub with
``jupyterhub_config.py`` beside it (`make class`; grading/README.md, "A class on JupyterHub")."""
