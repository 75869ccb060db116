"""Shared by every test directory.

hypothesis is imported here, at collection, on purpose: its pytest plugin imports it lazily at the
terminal summary otherwise, and pytest's assertion rewriting of that import runs ``ast.parse``,
which in this CPython (3.11.7) can fail with "SystemError: AST constructor recursion depth
mismatch" in a process with other threads running (gRPC's here; python/cpython#106905, fixed in
later releases). Seen after runs of a single test file that never imported hypothesis itself.
"""

import hypothesis  # noqa: F401
