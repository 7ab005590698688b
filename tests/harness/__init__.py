"""Harnesses for the tests and the benchmark scripts, kept out of the installed package.

``harness.postgres.LocalPostgres``: a throwaway PostgreSQL cluster on 127.0.0.1 (the shared store's tests,
``scripts/scale_bench.py``, ``scripts/index_sync_bench.py``). ``harness.server.ServerProcess``: ``carnator serve`` in a
child process (the service's tests, ``scripts/load_test.py``).

The tests import it as ``harness`` (pytest puts ``tests/`` on ``sys.path``); a script under ``scripts/`` puts
``tests/`` on ``sys.path`` itself before importing it.
"""
