"""The GPU suite and the scripts that run it on a bare GPU machine."""
