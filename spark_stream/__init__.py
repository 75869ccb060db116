"""PySpark data source for Scroll streams (not built yet: see issue 6)."""
