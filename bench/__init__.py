"""Benchmark suite for shmbuffer: named scenarios run against peers and the copy limit.

Run ``python -m bench --list`` to see the scenarios, ``python -m bench core.transitions`` to run
one. The package ``shmbuffer`` never imports this one; peers (TorchRL, cpprb) are optional and
are skipped with a note when missing.
"""
