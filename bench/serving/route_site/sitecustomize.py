"""Bench only (``bench.serving.route_replay``): in an engine process started with ``MOEPAGE_BENCH_ROUTE``, replay a
trace's routing. Anything else: nothing."""

import os

if os.environ.get("MOEPAGE_BENCH_ROUTE"):
    from bench.serving.route_replay import install_from_env

    install_from_env()
