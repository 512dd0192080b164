"""The GPU suite and the broad-heads run, with the scripts that run them on a bare GPU machine."""
