"""Layers of the Llama-family forward pass, each dispatching to a backend where it has one."""
