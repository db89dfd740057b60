"""Hydra configs, installed as the package longstride.configs so that the installed `longstride` command finds them."""
