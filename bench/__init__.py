"""draftstore benchmarks: ratios against baselines measured in the same run.

Run ``python -m bench`` from the repository root (``--quick`` for a < 60 s
pass). Every scenario runs on the real stack — PostgreSQL, SeaweedFS (S3) and
Redis — and prints ``NAME ratio=R ours_ms=X baseline_ms=Y``. See README.md.
"""
