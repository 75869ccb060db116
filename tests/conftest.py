"""Shared by every test directory.

hypothesis is imported here, at collection, on purpose: its pytest plugin imports it lazily at the
terminal summary otherwise, and CPython 3.11.7's ``ast.parse`` (pytest's assertion rewriting of
that import) can then fail with "SystemError: AST constructor recursion depth mismatch" when the
garbage collector runs finalizers of leftover coroutines during the parse (fixed in 3.11.8,
gh-106905). Seen after runs of a single test file that never imported hypothesis itself.
"""

import hypothesis  # noqa: F401
