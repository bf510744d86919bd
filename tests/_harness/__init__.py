"""The test suite's helpers (not tests): processes run together, the zygote that forks fresh
programs, the examples loaded from their files, fault injection and the CPU profile.

Imported as ``_harness.<module>``: the suite's root conftest puts ``tests/`` on ``sys.path``
(pytest's rootdir-relative import), and ranks and pool workers inherit that path."""
