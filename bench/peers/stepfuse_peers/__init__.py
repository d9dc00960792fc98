"""stepfuse_peers: the modules of bench/peers/peers.py, which is the entry point (command line, exit codes)."""
